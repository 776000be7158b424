"""Runs across host boundaries: ranks on "nodes" built from Linux namespaces (tests/hosts.py),
each with its own PID namespace and hostname, started with bare env vars (rank 0 hosts the
store, as under srun or mpirun)."""

import os
import re
import signal
import textwrap
import time

import pytest

from fixtures import free_port
import hosts

pytestmark = pytest.mark.skipif(hosts.available() is not None, reason=str(hosts.available()))

#: A script every rank runs: init, a zero_first block rank 0 holds for a while (the others wait
#: and judge it), a barrier, then a line saying it ended well.
_PREAMBLE = """
import os, sys, time
import axolotl_dist as ad
rank = int(os.environ["RANK"])
open(os.path.join(os.environ["NODE_DIR"], f"pid-{rank}"), "w").write(str(os.getpid()))
ad.init_distributed()
"""


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "rank.py"
    path.write_text(_PREAMBLE + textwrap.dedent(body))
    return str(path)


def test_nodes_with_one_hostname_run_clean(tmp_path):
    # Two nodes both named "node": a rank's pid means nothing in the other node's /proc (pids
    # burnt on node 0 so that its ranks' pids are not live processes on node 1 by chance).
    # Judged by hostname, each node would find the other's ranks "gone" and fail a healthy run.
    script = _script(tmp_path, """
        with ad.zero_first():
            if rank == 0:
                time.sleep(2.5)  # the others wait, judging rank 0 every liveness interval
        ad.barrier()
        value = ad.compute_and_broadcast(lambda: {"from": rank})
        print("ok", rank, value["from"], flush=True)
    """)
    nodes = [hosts.Node([0, 1], "node", burn_pids=60), hosts.Node([2, 3], "node")]
    ranks = hosts.start_nodes(nodes, script, str(tmp_path), free_port())
    assert hosts.wait_nodes(nodes, timeout=120), ranks.describe()
    for rank in range(4):
        assert ranks.code(rank) == 0, ranks.describe()
        assert f"ok {rank} 0" in ranks.output(rank), ranks.describe()


def test_a_killed_node_is_named_by_the_survivors(tmp_path):
    # node 1 (ranks 2, 3) is SIGKILLed while node 0's ranks wait in a barrier: its pids cannot
    # be judged from node 0, so its heartbeats decide (AXOLOTL_DIST_HEARTBEAT_TIMEOUT, 15 s)
    script = _script(tmp_path, """
        ad.barrier()
        open(os.path.join(os.environ["NODE_DIR"], f"ready-{rank}"), "w").close()
        if rank >= 2:
            time.sleep(60)  # node 1: killed here
        try:
            ad.barrier()  # ranks 2 and 3 never arrive: their node is killed
        except ad.RankFailedError as exc:
            print(f"named {exc.rank} at {time.time():.2f}: {exc}", flush=True)
            sys.exit(3)
    """)
    nodes = [hosts.Node([0, 1], "node-a", burn_pids=60), hosts.Node([2, 3], "node-b")]
    ranks = hosts.start_nodes(nodes, script, str(tmp_path), free_port())
    try:
        deadline = time.monotonic() + 90
        while not all(os.path.exists(tmp_path / f"ready-{r}") for r in range(4)):
            assert time.monotonic() < deadline, ranks.describe()
            time.sleep(0.1)
        time.sleep(3.0)  # node 0's ranks wait in their second barrier (the judge judges)
        killed = time.time()
        hosts.kill_nodes(nodes[1:])
        assert hosts.wait_nodes(nodes[:1], timeout=60), ranks.describe()
    finally:
        hosts.kill_nodes(nodes)
    for rank in (0, 1):
        out = ranks.output(rank)
        found = re.search(r"named (\d) at ([\d.]+): (.*)", out)
        assert found, ranks.describe()
        assert int(found.group(1)) in (2, 3), out
        delay = float(found.group(2)) - killed
        print(f"rank {rank} named rank {found.group(1)} {delay:.1f} s after the kill")
        assert delay < 20.0, (delay, out)
        assert "no heartbeat" in found.group(3) and "node-b" in found.group(3), out
        assert ranks.code(rank) == 3, ranks.describe()


def _parent_store(port: int):
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=120))


def _rank_0_alone(tmp_path, script: str):
    """Rank 0 alone on node-a, ranks 1-3 on node-b, the store in this process (a launcher's
    agent, outliving rank 0): ``(store, nodes, ranks)``; keep ``store`` referenced."""
    port = free_port()
    store = _parent_store(port)
    nodes = [hosts.Node([0], "node-a", burn_pids=60), hosts.Node([1, 2, 3], "node-b")]
    return store, nodes, hosts.start_nodes(nodes, script, str(tmp_path), port, store=store)


def _wait_ready(tmp_path, ranks, count: int) -> None:
    deadline = time.monotonic() + 90
    while not all(os.path.exists(tmp_path / f"ready-{r}") for r in range(count)):
        assert time.monotonic() < deadline, ranks.describe()
        time.sleep(0.1)


@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGSTOP"])
def test_rank_0_lost_on_another_node_is_named(tmp_path, signal_name):
    # The store lives in a launcher's agent (here: this process), so it outlives rank 0. Rank 0,
    # alone on node 0, is killed or stopped while node 1's ranks wait in a barrier: rank 0's
    # heartbeat thread was the judge of every heartbeat, so node 1's waiters, seeing its rounds
    # stop, read the heartbeats themselves (nobody can judge rank 0 by its pid).
    script = _script(tmp_path, """
        ad.barrier()
        open(os.path.join(os.environ["NODE_DIR"], f"ready-{rank}"), "w").close()
        if rank == 0:
            time.sleep(120)  # killed or stopped here
        start = time.monotonic()
        try:
            ad.barrier()
        except ad.RankFailedError as exc:
            print(f"named {exc.rank} after {time.monotonic() - start:.1f} s: {exc}", flush=True)
            sys.exit(3)
    """)
    store, nodes, ranks = _rank_0_alone(tmp_path, script)
    try:
        _wait_ready(tmp_path, ranks, 4)
        time.sleep(1.0)  # the others are in their second barrier
        pid = ranks.pid_in_node(0)
        os.kill(hosts.outer_pid(nodes[0], pid), getattr(signal, signal_name))
        deadline = time.monotonic() + 60
        while any(ranks.code(r) is None for r in (1, 2, 3)) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        hosts.kill_nodes(nodes)
    for rank in (1, 2, 3):
        out = ranks.output(rank)
        found = re.search(r"named (\d) after ([\d.]+) s: (.*)", out)
        assert found, ranks.describe()
        assert int(found.group(1)) == 0, out
        assert float(found.group(2)) < 20.0, out
        assert "no heartbeat" in found.group(3) and "node-a" in found.group(3), out


def test_a_remote_rank_stopped_for_a_while_is_warned_about_not_failed(tmp_path):
    # rank 0, alone on node 0 (and the judge), is SIGSTOPped for 12 s, below the heartbeat
    # timeout (15 s), while node 1's ranks wait in a barrier: with the judge silent they read
    # its heartbeat themselves, warn that it is silent, and the barrier completes once it runs
    # again; nobody is declared dead
    script = _script(tmp_path, """
        ad.barrier()
        open(os.path.join(os.environ["NODE_DIR"], f"ready-{rank}"), "w").close()
        if rank == 0:
            time.sleep(3.0)  # stopped in here for 12 s
        start = time.monotonic()
        ad.barrier()
        print(f"through after {time.monotonic() - start:.1f} s", flush=True)
    """)
    store, nodes, ranks = _rank_0_alone(tmp_path, script)
    try:
        _wait_ready(tmp_path, ranks, 4)
        pid = hosts.outer_pid(nodes[0], ranks.pid_in_node(0))
        os.kill(pid, signal.SIGSTOP)
        time.sleep(12.0)
        os.kill(pid, signal.SIGCONT)
        assert hosts.wait_nodes(nodes, timeout=60), ranks.describe()
    finally:
        hosts.kill_nodes(nodes)
    for rank in range(4):
        assert ranks.code(rank) == 0, ranks.describe()
        assert "through after" in ranks.output(rank), ranks.describe()
    for rank in (1, 2, 3):
        assert "no heartbeat from rank 0" in ranks.output(rank), ranks.describe()
