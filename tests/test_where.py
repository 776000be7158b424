"""Where every rank is: on demand (``kill -USR1`` to the launcher, ``axolotl-dist where``
against any launcher's store) and by itself (the first warning of a long wait)."""

import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import axolotl_dist as ad
from axolotl_dist import launch
from axolotl_dist.testing import run_distributed
from fixtures import ROOT, finish, free_port, start, subprocess_env, unfold

#: Rank 1 sleeps in a function of its own while rank 0 waits for it in a barrier.
SLOW_RANK = """
import os, sys, time
import axolotl_dist as ad
END = time.monotonic() + float(sys.argv[1])  # at most; a file "go" in the cwd ends it sooner
def tokenize(seconds):
    time.sleep(seconds)

ad.init_distributed()
sys.stdout.write(f"started {ad.get_rank()} {os.getpid()}\\n"); sys.stdout.flush()  # one write
if ad.get_rank() == 1:
    while not os.path.exists("go") and time.monotonic() < END: tokenize(0.05)
ad.barrier()
sys.stdout.write(f"done {ad.get_rank()}\\n"); sys.stdout.flush()
"""


# The ranks write their lines in one call each: they share the launcher's stdout, and with
# PYTHONUNBUFFERED (set in CI) print() writes every argument and separator on its own, so two
# ranks' pieces could mix and a "started" line be lost.


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "prep.py"
    path.write_text(SLOW_RANK)
    return path


def _started(proc, count, deadline=60.0):
    """Read ``started <rank> <pid>`` lines from the launcher's stdout."""
    pids = {}
    end = time.monotonic() + deadline
    while len(pids) < count and time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            break
        line = unfold(line)
        if line.startswith("started"):
            _, rank, pid = line.split()
            pids[int(rank)] = int(pid)
    return pids


def _where(port: int, env) -> str:
    done = subprocess.run([sys.executable, "-m", "axolotl_dist.launch", "where", "--master-port",
                           str(port), "--timeout", "60"], env=env, capture_output=True, text=True,
                          timeout=120, cwd=str(ROOT))  # --timeout: a loaded machine is slow to accept
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_sigusr1_to_the_launcher_prints_where_every_rank_is(tmp_path):
    env = subprocess_env(tmp_path)
    proc = start([sys.executable, "-m", "axolotl_dist.launch", "-n", "2", str(_script(tmp_path)),
                  "8"], env, cwd=tmp_path)
    pids = _started(proc, 2)
    assert len(pids) == 2, pids
    time.sleep(1.0)  # both in place: rank 0 in the barrier, rank 1 in tokenize
    asked = time.monotonic()
    os.kill(proc.pid, signal.SIGUSR1)
    code, out, err = finish(proc, 90)
    assert code == 0, err  # the run went on
    assert out.count("done") == 2, out
    assert "where every rank is (SIGUSR1; the run goes on)" in err, err
    assert re.search(r"rank 1: in tokenize at prep\.py:6 ← tokenize at prep\.py:11", err), err
    assert re.search(r"rank 0: barrier at prep\.py:12", err), err
    assert time.monotonic() - asked < 30


def test_sigusr1_to_the_launcher_of_node_1_reports_every_rank(tmp_path):
    # two launchers (--nnodes 2 on loopback): node 1's launcher has no global rank 0, whose
    # note of the store's address it used to wait for ("no rank has joined ... yet")
    env = subprocess_env(tmp_path)
    script = str(_script(tmp_path))
    port = str(free_port())
    procs = [start([sys.executable, "-m", "axolotl_dist.launch", "-n", "1", "--nnodes", "2",
                    "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port",
                    port, script, "60"], env, cwd=tmp_path) for node in (0, 1)]
    try:
        started = {r: pid for p in procs for r, pid in _started(p, 1).items()}
        assert len(started) == 2, started
        time.sleep(1.0)  # both in place: rank 0 in the barrier, rank 1 in tokenize
        os.kill(procs[1].pid, signal.SIGUSR1)
        time.sleep(8.0)  # the report takes a beat (2.5 s) and the answers' wait (4 s)
    finally:
        (tmp_path / "go").write_text("")
        results = [finish(p, 90) for p in procs]
    assert all(code == 0 for code, _, _ in results), results
    err = results[1][2]
    assert "where every rank is (SIGUSR1; the run goes on)" in err, err
    assert "rank 1: in tokenize at prep.py:6" in err, err
    assert "rank 0: barrier at prep.py:12" in err, err


@pytest.mark.parametrize("launcher", ["torchrun", "torchrun-rdzv", "env"])
def test_axolotl_dist_where_asks_a_run_started_by_another_launcher(tmp_path, launcher):
    # torchrun-rdzv: asked at torchrun's --rdzv-endpoint, the address a torchrun user knows;
    # the ranks' store is another one (the agent's), which the rendezvous store names
    port = free_port()
    env = subprocess_env(tmp_path)
    script = str(_script(tmp_path))
    if launcher == "torchrun":
        procs = [start([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                        "--master-addr", "127.0.0.1", "--master-port", str(port), script, "60"],
                       env, cwd=tmp_path)]
    elif launcher == "torchrun-rdzv":
        procs = [start([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                        "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                        f"127.0.0.1:{port}", script, "60"], env, cwd=tmp_path)]
    else:  # bare env vars: rank 0's own process hosts the store
        procs = [start([sys.executable, script, "60"],
                       dict(env, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port)), cwd=tmp_path) for r in range(2)]
    try:
        # every rank in place (a fixed sleep raced the start-up on a loaded machine): rank 1 in
        # tokenize for 6 s, rank 0 in the barrier
        started = (_started(procs[0], 2) if launcher.startswith("torchrun") else
                   {r: pid for p in procs for r, pid in _started(p, 1).items()})
        assert len(started) == 2, started
        time.sleep(1.0)
        out = _where(port, env)
    finally:
        (tmp_path / "go").write_text("")  # the run may end now (a loaded machine: not sooner)
        results = [finish(p, 90) for p in procs]
    assert all(code == 0 for code, _, _ in results), results
    assert "rank 1: in tokenize at prep.py:6" in out, out
    assert "rank 0: barrier at prep.py:12" in out, out
    if launcher == "torchrun-rdzv":
        assert re.search(rf"127\.0\.0\.1:{port} is torchrun's rendezvous; the ranks' store is at "
                         r"\S+:\d+", out), out
    # no secret here, and torch's store listens on every interface: both said (issue #60)
    assert "note: this run has no secret (AXOLOTL_DIST_SECRET)" in out, out
    assert "listens on every interface of this host: other hosts can reach it" in out, out


def _bare_where(env, timeout: float = 120):
    """``axolotl-dist where`` with no address: ``(exit code, stdout, stderr, seconds)``."""
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "axolotl_dist.launch", "where", "--timeout",
                           "60"], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=str(ROOT))
    return done.returncode, done.stdout, done.stderr, time.monotonic() - began


def test_bare_where_reports_the_run_this_host_recorded(tmp_path):
    # no address: the launcher recorded its run in the run directory; the rank's first wait
    # warning says the command that shows every rank
    runs = tmp_path / "runs"
    env = subprocess_env(tmp_path, AXOLOTL_DIST_RUN_DIR=str(runs),
                         AXOLOTL_DIST_WAIT_LOG_INTERVAL="1")
    proc = start([sys.executable, "-m", "axolotl_dist.launch", "-n", "2", str(_script(tmp_path)),
                  "60"], env, cwd=tmp_path)
    try:
        assert len(_started(proc, 2)) == 2
        time.sleep(1.0)  # both in place: rank 0 in the barrier, rank 1 in tokenize
        code, out, err, _ = _bare_where(env)
    finally:
        (tmp_path / "go").write_text("")
        result = finish(proc, 90)
    assert code == 0, (out, err)
    assert re.match(r"where every rank of the run at 127\.0\.0\.1:(\d+) \(prep\.py, 2 rank\(s\)\) "
                    r"is:\n", out), out
    port = re.match(r".*:(\d+) ", out).group(1)
    assert "rank 1: in tokenize at prep.py:6" in out, out
    assert "rank 0: barrier at prep.py:12" in out, out
    assert "runs are recorded" not in out, out
    assert "no secret" not in out and "every interface" not in out, out  # axolotl-dist's own
    assert result[0] == 0, result
    logged = result[2]  # the barrier's first warning (loaded, init's own may come first)
    assert re.search(r"rank 0 has waited \d+ s in barrier for rank\(s\) \[1\]; where they are:\n"
                     r"  rank 1: in tokenize at prep\.py:6 .*\n"
                     rf"  \(every rank: axolotl-dist where --master-port {port}\)\n", logged), logged
    assert logged.count("(every rank:") == 1, logged  # the first warning only
    assert list(runs.iterdir()) == []  # the launcher took its entry back


def test_bare_where_lists_and_reports_every_run_of_this_host(tmp_path):
    # runs of other launchers record themselves (their local rank 0, at init)
    runs = tmp_path / "runs"
    env = subprocess_env(tmp_path, AXOLOTL_DIST_RUN_DIR=str(runs))
    script = str(_script(tmp_path))
    ports = [free_port(), free_port()]
    procs = [start([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "--master-addr", "127.0.0.1", "--master-port", str(ports[0]), script, "60"],
                   env, cwd=tmp_path)]
    procs += [start([sys.executable, script, "60"],
                    dict(env, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[1])), cwd=tmp_path)
              for r in range(2)]
    try:
        started = [_started(procs[0], 2)] + [_started(p, 1) for p in procs[1:]]
        assert [len(s) for s in started] == [2, 1, 1], started
        time.sleep(1.0)
        code, out, err, _ = _bare_where(env)
    finally:
        (tmp_path / "go").write_text("")
        results = [finish(p, 90) for p in procs]
    assert code == 0, (out, err)
    assert all(c == 0 for c, _, _ in results), results
    listed = out.split("\n\n")[0]
    assert listed.startswith("2 runs are recorded on this host (pick one with --master-port):"), out
    assert re.search(rf"port {ports[0]} on 127\.0\.0\.1: 2 rank\(s\), \S*/prep\.py, pid \d+ "
                     r"\(torchrun\), started \d+ s ago", listed), out
    assert re.search(rf"port {ports[1]} on 127\.0\.0\.1: 2 rank\(s\), \S*/prep\.py, pid "
                     rf"{started[1][0]} \(env vars\), started \d+ s ago", listed), out
    for port in ports:
        report = out.split(f"where every rank of the run at 127.0.0.1:{port} ")[1]
        assert re.match(r"\(prep\.py, 2 rank\(s\)\) is:\n  rank 0: barrier at prep\.py:12 .*\n"
                        r"  rank 1: in tokenize at prep\.py:6", report), out


def test_bare_where_without_a_recorded_run_says_how_to_point_it_at_one(tmp_path):
    # a run whose ranks were killed leaves its entry (rank 0 recorded it at init): the
    # recording process is gone, so the entry is stale, skipped and removed
    runs = tmp_path / "runs"
    env = subprocess_env(tmp_path, AXOLOTL_DIST_RUN_DIR=str(runs))
    script = tmp_path / "dies.py"
    script.write_text("import os\nimport axolotl_dist as ad\nad.init_distributed()\nad.barrier()\n"
                      "os._exit(0)  # no exit hook: as if killed\n")
    port = str(free_port())
    results = [finish(p, 60) for p in [
        start([sys.executable, str(script)], dict(env, RANK=str(r), WORLD_SIZE="2",
              LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=port), cwd=tmp_path)
        for r in range(2)]]
    assert all(code == 0 for code, _, _ in results), results
    entries = list(runs.iterdir())
    assert [e.name.endswith(".json") for e in entries] == [True], entries
    assert f'"port": {port},' in entries[0].read_text()
    code, out, err, _ = _bare_where(env)
    assert code == 1 and out == "", (out, err)
    assert err == (f"axolotl-dist where: no run of this user is recorded on this host (run "
                   f"directory {runs}); point it at one with --master-addr A --master-port P (or "
                   f"MASTER_ADDR / MASTER_PORT): the run's c10d store\n"), err
    assert list(runs.iterdir()) == []


def test_a_stopped_rank_is_reported_with_its_process_state(tmp_path):
    port = free_port()
    env = subprocess_env(tmp_path)
    script = str(_script(tmp_path))
    procs = [start([sys.executable, script, "6"],
                   dict(env, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port)), cwd=tmp_path) for r in range(2)]
    try:
        pids = {}
        for r, p in enumerate(procs):
            pids.update(_started(p, 1))
        assert len(pids) == 2, pids
        time.sleep(1.5)  # rank 1's heartbeat has registered it
        os.kill(pids[1], signal.SIGSTOP)
        out = _where(port, env)
    finally:
        os.kill(pids[1], signal.SIGCONT)
        results = [finish(p, 60) for p in procs]
    assert re.search(rf"rank 1: did not answer within [\d.]+ s \(process {pids[1]} on \S+, stopped "
                     r"\(SIGSTOP or a debugger\); it made no heartbeat meanwhile\)", out), out
    assert all(code == 0 for code, _, _ in results), results


def test_the_first_wait_warning_says_where_the_awaited_ranks_are(store):
    def body():
        records = []

        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())

        logging.getLogger("axolotl_dist").addHandler(Keep())

        def tokenize():
            time.sleep(3)

        with ad.zero_first():
            if ad.get_rank() == 0:
                tokenize()
        return records

    out = run_distributed(body, 2, store=store, timeout=60,
                          env={"AXOLOTL_DIST_WAIT_LOG_INTERVAL": "1"})
    warnings = [m for m in out[1] if "has waited" in m]
    assert warnings, out[1]
    first = warnings[0]
    assert "where they are:" in first, first
    assert re.search(r"rank 0: in tokenize at tests/test_where\.py:\d+ ← tokenize at "
                     r"tests/test_where\.py:\d+; inside zero_first block #1 at tests/test_where.py:"
                     r"\d+ in body, which it runs first", first), first
    assert all("where they are" not in m for m in warnings[1:]), warnings
    # its last line: the command that shows every rank (the harness's store is on loopback)
    assert re.search(r"\n  \(every rank: axolotl-dist where --master-port \d+\)$", first), first
    assert all("every rank:" not in m for m in warnings[1:]), warnings


# ---------------------------------------------------------------- deadlocks the kit can see


def _collective_in_first_run(helper):
    def body():
        start = time.monotonic()
        try:
            with ad.zero_first():
                if ad.get_rank() == 0:
                    if helper == "barrier":
                        ad.barrier()  # a newcomer's mistake: the others wait for this block
                    else:
                        ad.gather_from_all_ranks(lambda: 1)
        except (ad.CollectiveMismatchError, ad.RankFailedError) as exc:
            return type(exc).__name__, str(exc), time.monotonic() - start
        return None, "", time.monotonic() - start
    return body


@pytest.mark.parametrize("ws", [2, 3, 4])
@pytest.mark.parametrize("helper", ["barrier", "gather_from_all_ranks"])
def test_a_collective_inside_a_first_run_block_is_an_error_on_every_rank(ws, helper, store):
    out = run_distributed(_collective_in_first_run(helper), ws, store=store, timeout=60)
    kind, message, elapsed = out[0]
    assert kind == "CollectiveMismatchError", out[0]
    assert re.search(rf"{helper}\(\) at tests/test_where\.py:\d+ in body can never complete: it "
                     r"is called inside zero_first block #1 at tests/test_where\.py:\d+ in body, "
                     r"which this rank runs first", message), message
    assert "Move the call out of the block" in message, message
    for kind, message, elapsed in out[1:]:
        assert kind == "RankFailedError", message
        assert "rank 0 failed in zero_first block #1" in message, message
        assert f"{helper}() at tests/test_where.py:" in message, message
    assert all(elapsed < 5.0 for _, _, elapsed in out), out


def test_a_collective_inside_zero_only_code_is_an_error(store):
    @ad.zero_only
    def log_total():
        return ad.all_reduce_value(1)  # the other ranks never call it

    def body():
        with ad.zero_only():
            try:
                ad.barrier()
            except ad.CollectiveMismatchError as exc:
                block = str(exc)
        try:
            log_total()
        except ad.CollectiveMismatchError as exc:
            function = str(exc)
        total = ad.all_reduce_value(1)  # the ranks still agree afterwards: nothing half-done
        return (block, function, total) if ad.get_rank() == 0 else total

    out = run_distributed(body, 2, store=store, timeout=60)
    block, function, total = out[0]
    assert re.search(r"barrier\(\) at tests/test_where\.py:\d+ in body can never complete: it is "
                     r"called inside the `with zero_only\(\):` block at tests/test_where\.py:\d+ in "
                     r"body, which runs on the main rank only", block), block
    assert re.search(r"all_reduce_value\(\) at tests/test_where\.py:\d+ in log_total can never "
                     r"complete: it is called inside the @zero_only function .*log_total \(defined "
                     r"at tests/test_where\.py:\d+\)", function), function
    assert "Call it on every rank" in function, function
    assert total == out[1] == 2


# ---------------------------------------------------------------- one clean account of a failure

FAILS = """
import os, signal, sys
import axolotl_dist as ad

def tokenize():
    raise ValueError("bad shard 17")

ad.init_distributed()
if sys.argv[1] == "raise":
    with ad.zero_first():
        if ad.get_rank() == 0:
            tokenize()
else:
    ad.barrier()
    if ad.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    ad.reduce_and_broadcast(lambda: 1, sum)
"""


@pytest.mark.parametrize("fault", ["raise", "killed"])
def test_a_failure_reads_once_per_rank_with_the_users_frames_only(tmp_path, fault):
    script = tmp_path / "fails.py"
    script.write_text(FAILS)
    code, out, err = finish(start([sys.executable, "-m", "axolotl_dist.launch", "-n", "3",
                                   str(script), fault], subprocess_env(tmp_path), cwd=tmp_path), 90)
    err = unfold(err, labelled=True)  # each rank's line, folded or not
    assert code != 0, err
    assert "axolotl_dist/" not in err and "axolotl_dist" + os.sep not in err, err  # no kit frames
    assert "The above exception was the direct cause" not in err, err  # no socket error chained
    assert "Exception raised from" not in err and "frame #" not in err, err  # no C++ traces
    if fault == "raise":
        # rank 0's own traceback, once; rank 1's and rank 2's one-line account of it; the
        # launcher's summary points to it
        assert err.count('raise ValueError("bad shard 17")') == 1, err
        for rank in (1, 2):
            assert re.search(rf"\[rank {rank}\] axolotl_dist.errors.RankFailedError at "
                             r"\S*fails\.py:10 in <module>: rank 0 failed in zero_first block #1 "
                             r"at \S*fails\.py:10 in <module>: ValueError: bad shard 17 \(its "
                             r"traceback is in rank 0's output\)$", err, re.M), err
    else:
        assert "rank 1 (local rank 1, pid " in err and "killed by signal 9 (SIGKILL)" in err, err
        # The launcher stops the survivors as soon as it sees rank 1 gone (as torchrun does), so
        # whether they print their own account first is a race; when they do, it is this one.
        accounts = re.findall(r"\[rank (\d)\] axolotl_dist.errors.RankFailedError(.*)", err)
        assert len({rank for rank, _ in accounts}) == len(accounts), err  # once per rank
        for _, message in accounts:  # at the user's line
            assert re.match(r" at \S*fails\.py:17 in <module>: rank 1 failed in "
                            r"reduce_and_broadcast: died: process \d+ on \S+, started by "
                            r"axolotl-dist", message), err


def test_a_run_that_succeeds_says_nothing_about_stopping_processes(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("import axolotl_dist as ad\nad.init_distributed()\n"
                      "for i in range(300):\n    print('rank', ad.get_rank(), 'line', i, 'of 300')\n"
                      "print(ad.reduce_and_broadcast(lambda: 1, sum))\nad.cleanup_distributed()\n")
    code, out, err = finish(start([sys.executable, "-m", "axolotl_dist.launch", "-n", "2",
                                   str(script)], subprocess_env(tmp_path), cwd=tmp_path), 90)
    assert code == 0, err
    lines = unfold(out).splitlines()  # each line whole: the ranks' output never interleaves mid-line
    assert sorted(lines) == sorted(["2", "2"] + [f"rank {r} line {i} of 300" for r in (0, 1)
                                                 for i in range(300)]), out
    assert "stopped" not in err, err


# ---------------------------------------------------------------- the root cause reaches every rank


def _lost_peer_chain(late):
    ad.barrier()
    if ad.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2 if ad.get_rank() == 0 else late)
    return ad.all_reduce_value(1)


@pytest.mark.parametrize("late", [0.5, 6.5])  # rank 2 in the collective, or after rank 0 left
def test_a_lost_peer_is_named_on_every_rank_past_a_dead_store_host(late):
    from axolotl_dist.testing import run_distributed_outcomes

    outcomes = run_distributed_outcomes(_lost_peer_chain, 3, args=(late,), store="rank0",
                                        timeout=60)
    for o in (outcomes[0], outcomes[2]):
        assert not o.timed_out and o.exitcode == 1, o.describe()
        assert o.error.startswith("RankFailedError: rank 1 failed in all_reduce_value: died"), o.error
    assert outcomes[2].elapsed < late + 5.0, outcomes[2].elapsed


#: Bare env launch, rank 0 hosts the store; rank 1 is SIGKILLed; rank 2 reaches the collective
#: after rank 0 (which names rank 1) has left, taking the store with it.
CHAIN = """
import os, signal, sys, time
import axolotl_dist as ad

ad.init_distributed()
ad.barrier()
if ad.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(0.2 if ad.get_rank() == 0 else float(sys.argv[1]))
ad.all_reduce_value(1)
"""


@pytest.mark.parametrize("late", [0.5, 6.5])
def test_every_rank_of_a_bare_env_run_names_the_lost_peer_and_prints_no_cpp_trace(tmp_path, late):
    script = tmp_path / "chain.py"
    script.write_text(CHAIN)
    port = free_port()
    env = subprocess_env(tmp_path)
    procs = [start([sys.executable, str(script), str(late)],
                   dict(env, RANK=str(r), WORLD_SIZE="3", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port)), cwd=tmp_path) for r in range(3)]
    results = [finish(p, 60) for p in procs]
    assert results[1][0] == -signal.SIGKILL, results[1]
    for rank in (0, 2):
        code, _, err = results[rank]
        assert code == 1, err
        assert re.search(r"RankFailedError at \S*chain\.py:10 in <module>: rank 1 failed in "
                         r"all_reduce_value: died", err), err
        assert "Exception raised from" not in err and "frame #" not in err, err  # no C++ traces
        assert "The above exception was the direct cause" not in err, err
        assert "Traceback (most recent call last)" not in err, err  # its account: one line
        assert "axolotl_dist/" not in err, err


def test_where_at_a_port_nothing_listens_on_fails_at_once(tmp_path, capfd):
    # at once: measured in this process, whose interpreter and torch are already up (a new
    # process spends 1.5-4.5 s on those alone on a loaded 2-core machine); it retried for its
    # whole --timeout before
    port = free_port()
    line = (f"axolotl-dist where: nothing listens at 127.0.0.1:{port} (connection refused): no "
            "run's c10d store is there (the run ended, or the address is not its "
            "MASTER_ADDR:MASTER_PORT)\n")
    began = time.monotonic()
    code = launch.main(["where", "--master-port", str(port), "--timeout", "60"])
    elapsed = time.monotonic() - began
    out, err = capfd.readouterr()  # the file descriptors: torch's C++ warnings too
    assert (code, out, err) == (1, "", line), (code, out, err)
    assert elapsed < 1.0, elapsed
    # the command itself: the same one line, exit 1, far sooner than its --timeout
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "axolotl_dist.launch", "where", "--master-port",
                           str(port), "--timeout", "60"], env=subprocess_env(tmp_path),
                          capture_output=True, text=True, timeout=60, cwd=str(ROOT))
    assert (done.returncode, done.stdout, done.stderr) == (1, "", line), done
    assert time.monotonic() - began < 30, done


# ---------------------------------------------------------------- the harness's timeout


def _one_rank_sleeps():
    if ad.get_rank() == 0:
        time.sleep(600)
    ad.barrier()


def test_the_harness_says_where_each_rank_was_before_it_killed_them(store):
    # run_distributed's timeout asks every rank still running where it is (the kit's where
    # report, a few seconds at most), then kills them
    from axolotl_dist.testing import DistributedTestError, run_distributed_outcomes

    start = time.monotonic()
    outcomes = run_distributed_outcomes(_one_rank_sleeps, 2, store=store, timeout=5)
    assert time.monotonic() - start < 5 + 8
    assert [o.timed_out for o in outcomes] == [True, True]
    first = _one_rank_sleeps.__code__.co_firstlineno
    # with each rank's place in torch's collectives: init's barrier #1, the kit's barrier #2
    assert outcomes[0].where == (f"in _one_rank_sleeps at tests/test_where.py:{first + 2}; "
                                 "torch's last: barrier #1 on the default group, finished"), \
        outcomes[0].where
    assert re.fullmatch(rf"barrier at tests/test_where.py:{first + 3} "
                        r"\(waiting \d+ s for rank\(s\) \[0\]\); in torch's barrier #2 on the "
                        r"default group, not finished", outcomes[1].where), outcomes[1]
    assert outcomes[1].describe() == f"rank 1: did not finish in time (killed): {outcomes[1].where}"
    with pytest.raises(DistributedTestError, match="rank 0: did not finish in time .killed.: in "
                                                   "_one_rank_sleeps"):
        from axolotl_dist.testing import run_distributed

        run_distributed(_one_rank_sleeps, 2, store=store, timeout=3)


HELD = """
import os, time
import axolotl_dist as ad
ad.init_distributed()
with ad.zero_first():
    if ad.get_rank() == 0:
        open("in-block", "w").close()
        time.sleep(120)
"""


def test_where_says_in_one_line_that_the_store_went_away_while_it_asked(tmp_path):
    # bare env vars: rank 0 hosts the store; rank 1 is stopped (it cannot answer), so where
    # still waits for it when rank 0 is killed: no traceback, no C++ frames, one line
    (tmp_path / "held.py").write_text(HELD)
    port = free_port()
    env = subprocess_env(tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                         WORLD_SIZE="2")
    procs = [start([sys.executable, "held.py"], dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                   cwd=tmp_path) for r in range(2)]
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "in-block").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # rank 1 waits in the block, its heartbeat running
        os.kill(procs[1].pid, signal.SIGSTOP)
        where = subprocess.Popen([sys.executable, "-m", "axolotl_dist.launch", "where",
                                  "--master-addr", "127.0.0.1", "--master-port", str(port),
                                  "--timeout", "30"], env=env, cwd=tmp_path,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        head = where.stdout.readline()  # connected: it asks the ranks next
        assert head.startswith("where every rank of the run at"), head + where.stderr.read()
        time.sleep(1.0)  # it has asked, and waits for rank 1's answer
        os.kill(procs[0].pid, signal.SIGKILL)
        out, err = where.communicate(timeout=60)
        out = head + out
    finally:
        for p in procs:
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(30)
    assert where.returncode == 1, out + err
    assert "where: the run's store at 127.0.0.1:" in err and "went away while its ranks were " \
        "asked" in err, out + err
    assert "Traceback" not in out + err and "frame #" not in out + err, out + err
