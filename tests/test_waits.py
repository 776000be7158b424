"""Waits outside the helpers say what they wait for, and stop when asked: a rank waiting in
``init_distributed`` for a store that never comes, the launcher waiting for other nodes."""

import os
import re
import select
import signal
import socket
import sys
import time

import pytest

from fixtures import finish, free_port, start, subprocess_env, unfold

INIT = "import axolotl_dist as ad\nad.init_distributed()\nprint('init done', ad.get_rank())\n"


def test_a_taken_master_port_is_named_by_rank_0_and_by_the_waiting_rank(tmp_path):
    squatter = socket.socket()  # another program listens on the port, and never answers
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(16)
    port = squatter.getsockname()[1]
    env = subprocess_env(tmp_path, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                         AXOLOTL_DIST_WAIT_LOG_INTERVAL="1")
    procs = [start([sys.executable, "-c", INIT], dict(env, RANK=str(r)), cwd=tmp_path)
             for r in range(2)]
    try:
        code0, _, err0 = finish(procs[0], 60)
        time.sleep(2.5)  # rank 1 waits on: one wait interval (1 s) and then some
    finally:
        procs[1].kill()
        _, _, err1 = finish(procs[1], 30)
        squatter.close()
    assert code0 == 1
    assert f"DistributedEnvError: MASTER_PORT={port} is taken on this host (EADDRINUSE)" in err0
    assert "set MASTER_PORT to a free port" in err0
    assert re.search(rf"\d\d:\d\d:\d\d WARNING axolotl_dist: \[rank 1/2\] rank 1 has waited 1 s in "
                     rf"init_distributed for the c10d store at 127\.0\.0\.1:{port}, hosted by rank 0"
                     r".*is rank 0 running, and is the port free\?", err1), err1


def _read_until(proc, text, deadline):
    """``proc``'s stderr up to the first time it holds ``text`` (read from the pipe itself, so
    :func:`finish` gets the rest)."""
    seen, fd, end = b"", proc.stderr.fileno(), time.monotonic() + deadline
    while time.monotonic() < end and text.encode() not in seen:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            seen += chunk
    if text.encode() not in seen:
        pytest.fail(f"{text!r} not seen within {deadline} s:\n{seen.decode(errors='replace')}")
    return seen.decode(errors="replace")


@pytest.mark.parametrize("node_rank", [0, 1])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_the_launcher_waiting_for_other_nodes_stops_at_once(tmp_path, node_rank, sig):
    script = tmp_path / "train.py"
    script.write_text(INIT)
    env = subprocess_env(tmp_path, AXOLOTL_DIST_WAIT_LOG_INTERVAL="1")
    proc = start([sys.executable, "-m", "axolotl_dist.launch", "-n", "1", "--nnodes", "2",
                  "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port",
                  str(free_port()), "--rdzv-timeout", "120", str(script)], env, cwd=tmp_path)
    # in the rendezvous (the other node never comes) once the launcher says what it waits for;
    # a fixed sleep raced the launcher's imports on a loaded machine
    first = _read_until(proc, "is waiting for the other node", 60.0)
    sent = time.monotonic()
    os.kill(proc.pid, sig)
    code, _, err = finish(proc, 30)
    err = first + err
    assert time.monotonic() - sent < 2.0, err
    assert code == 128 + sig, (code, err)
    assert f"got {signal.Signals(sig).name} before any rank started; stopping" in err, err
    assert re.search(rf"node {node_rank} of 2 is waiting for the other node\(s\) to join the "
                     r"rendezvous at 127\.0\.0\.1:\d+", err), err


@pytest.mark.parametrize("endpoint", ["given", "torch's default"])
def test_an_elastic_rendezvous_wait_names_the_endpoint_and_run_id_torch_uses(tmp_path, endpoint):
    # "--nnodes 1:2 --rdzv-backend c10d" said "waiting ... at ? (id none)"
    script = tmp_path / "train.py"
    script.write_text(INIT)
    env = subprocess_env(tmp_path, AXOLOTL_DIST_WAIT_LOG_INTERVAL="1")
    port = free_port()
    where = ["--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "job7"] \
        if endpoint == "given" else []
    proc = start([sys.executable, "-m", "axolotl_dist.launch", "-n", "1", "--nnodes", "1:2",
                  "--rdzv-backend", "c10d", *where, str(script)], env, cwd=tmp_path)
    err = _read_until(proc, "is waiting for the other node", 60.0)
    os.kill(proc.pid, signal.SIGINT)
    finish(proc, 30)
    said = (f"at 127.0.0.1:{port}, run id 'job7'" if endpoint == "given" else
            "at localhost:29400 (torch's default: no --rdzv-endpoint given), run id 'none'")
    assert ("axolotl-dist: this node is waiting for the other node(s) to join the c10d "
            f"rendezvous {said} (1 to 2 nodes: it starts once 1 joined and no other joined for "
            "the rendezvous's last-call time)") in err, err


# ---------------------------------------------------------------- Ctrl-C stops a rank in barrier()

#: Every rank but the straggler waits in ad.barrier(); the straggler arrives after argv[2] s.
IN_BARRIER = """
import os, sys, time
import axolotl_dist as ad

ad.init_distributed()
rank = ad.get_rank()
sys.stdout.write(f"started {rank} {os.getpid()}\\n"); sys.stdout.flush()  # one write
if rank == int(sys.argv[1]):
    time.sleep(float(sys.argv[2]))
ad.barrier()
"""


# Ranks write their "started" line in one call: they share the launcher's stdout, and with
# PYTHONUNBUFFERED (set in CI) print() writes every argument and separator on its own, so two
# ranks' pieces could mix ("startedstarted 0 12472" then " 1 12473": rank 1 lost; seen in CI).


def _pids(procs, count, deadline=60.0):
    pids, end = {}, time.monotonic() + deadline
    for proc in procs:
        while len(pids) < count and time.monotonic() < end:
            line = proc.stdout.readline()
            if not line:
                break
            line = unfold(line)
            if line.startswith("started"):
                _, rank, pid = line.split()
                pids[int(rank)] = int(pid)
            if proc is not procs[-1] and len(procs) > 1:
                break  # one rank per process
    return pids


def _gone_within(pid, seconds):
    """Whether process ``pid`` ended (gone or a zombie) within ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.02)
    return False


# rank 0 hosts the store under a bare env launch; the last rank is the straggler
@pytest.mark.parametrize("ws, target", [(2, 0), (3, 0), (3, 1)])
def test_ctrl_c_stops_a_rank_blocked_in_barrier_and_the_others_name_it(tmp_path, ws, target):
    script = tmp_path / "train.py"
    script.write_text(IN_BARRIER)
    port = free_port()
    env = subprocess_env(tmp_path)
    procs = [start([sys.executable, str(script), str(ws - 1), "6"],
                   dict(env, RANK=str(r), WORLD_SIZE=str(ws), LOCAL_RANK=str(r),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)), cwd=tmp_path)
             for r in range(ws)]
    try:
        pids = _pids(procs, ws)
        assert len(pids) == ws, pids
        time.sleep(1.5)  # the others in the barrier, the straggler not there yet
        os.kill(pids[target], signal.SIGINT)
        assert _gone_within(pids[target], 2.0), \
            f"the interrupted rank did not stop within 2 s (SIGINT here: {signal.getsignal(signal.SIGINT)})"
    finally:
        results = [finish(p, 60) for p in procs]
    code, _, err = results[target]
    assert code != 0 and "KeyboardInterrupt" in err, (code, err)
    for rank in set(range(ws)) - {target}:
        code, _, err = results[rank]
        assert code == 1, err
        assert re.search(rf"RankFailedError at train\.py:\d+ in <module>: rank {target} failed "
                         r"at train\.py:\d+: .*KeyboardInterrupt", err), err


def test_ctrl_c_stops_a_rank_blocked_in_barrier_under_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(IN_BARRIER)
    proc = start([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
                  "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script),
                  "2", "30"], subprocess_env(tmp_path), cwd=tmp_path)
    try:
        pids = _pids([proc], 3)
        if len(pids) == 3:
            time.sleep(1.5)
            started = time.monotonic()
            os.kill(pids[1], signal.SIGINT)  # a rank, not the launcher
            assert _gone_within(pids[1], 2.0), "the interrupted rank did not stop within 2 s"
    finally:
        code, _, err = finish(proc, 60)
    assert len(pids) == 3, f"ranks {sorted(pids)} started, not 3; the run said:\n{err[-4000:]}"
    assert code != 0, err
    assert time.monotonic() - started < 25, "the run did not end before the straggler arrived"
    assert "[rank1]: KeyboardInterrupt" in err, err
    # rank 0 waits in the barrier: it names rank 1 before torchrun's agent stops it (rank 1's
    # exit gives its peers FAILED_EXIT_GRACE to read its record)
    assert re.search(r"\[rank0\]: axolotl_dist\.errors\.RankFailedError at train\.py:\d+ in "
                     r"<module>: rank 1 failed at train\.py:\d+: KeyboardInterrupt", err), err
