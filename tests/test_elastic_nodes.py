"""Elastic membership across two namespace nodes (``tests/hosts.py``): ``axolotl-dist --nnodes
1:2`` admits a node that joins a later round, and goes on without a node that is lost; each
time every rank restarts clean, and the launcher says why (docs/launching.md, "Restarts")."""

from __future__ import annotations

import shlex
import sys
import textwrap
import time
from typing import List

import pytest

import hosts
from fixtures import free_port, subprocess_env

_NO_NETWORK = hosts.network_available()
pytestmark = [pytest.mark.skipif(_NO_NETWORK is not None, reason=str(_NO_NETWORK)),
              pytest.mark.timeout(300)]

HEAD = """
import os, sys, time
import axolotl_dist as ad
DIR = os.environ["NODE_DIR"]
def mark(name):
    path = os.path.join(DIR, name)
    with open(path + ".tmp", "w") as fh:
        fh.write(repr(time.time()))
    os.rename(path + ".tmp", path)
ad.init_distributed()
rank, world = ad.get_rank(), ad.get_world_size()
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
mark(f"seen-r{rank}-w{world}-a{restart}")
"""

#: The kit's calls a clean round runs across every node, checked for exact values.
AFTER = """
with ad.zero_first():
    pass
total = ad.reduce_and_broadcast(lambda: rank + 1, sum)
assert total == world * (world + 1) // 2, total
assert ad.compute_and_broadcast(lambda: 42) == 42
ad.barrier()
mark(f"end-r{rank}-w{world}")
"""


@pytest.fixture
def two_nodes(tmp_path):
    nodes = [hosts.Node(hostname="node-a", private=["/tmp"]),
             hosts.Node(hostname="node-b", private=["/tmp"])]
    with hosts.private_network(nodes, str(tmp_path)):
        yield nodes


def _command(node0: hosts.Node, port: int, script: str) -> List[str]:
    return [sys.executable, "-m", "axolotl_dist.launch", "-n", "2", "--nnodes", "1:2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{node0.address}:{port}",
            "--rdzv-id", "elastic", "--rdzv-conf", "last_call_timeout=1,join_timeout=60",
            "--monitor-interval", "0.2", "--max-restarts", "1", script]


def _wait_for(tmp_path, names: List[str], launched, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not all((tmp_path / n).exists() for n in names):
        assert time.monotonic() < deadline, "\n".join(l.describe() for l in launched)
        time.sleep(0.1)


def _script(tmp_path, body: str) -> str:
    path = tmp_path / "elastic.py"
    path.write_text(HEAD + textwrap.dedent(body) + AFTER)
    return str(path)


def test_a_node_joining_a_later_round_restarts_every_rank_clean(tmp_path, two_nodes):
    script = _script(tmp_path, """
        if world == 2:
            with ad.zero_first():
                pass
            time.sleep(150)  # until node-b joins and the agent restarts this node's ranks
    """)
    port = free_port()
    env = subprocess_env(tmp_path, NODE_DIR=str(tmp_path))
    command = _command(two_nodes[0], port, script)
    # node-b's launcher starts once node-a's two ranks run alone (a round of one node)
    later = ["sh", "-c", f"until [ -e {shlex.quote(str(tmp_path))}/seen-r1-w2-a0 ]; do sleep 0.1; "
             f"done; sleep 1; exec {' '.join(shlex.quote(c) for c in command)}"]
    launched = hosts.start_commands(two_nodes, [command, later], str(tmp_path), env,
                                    cwd=str(tmp_path))
    assert hosts.wait_nodes(two_nodes, timeout=180), "\n".join(l.describe() for l in launched)
    both = "\n".join(l.describe() for l in launched)
    assert [l.code for l in launched] == [0, 0], both
    assert all((tmp_path / f"seen-r{r}-w2-a0").exists() for r in range(2)), both
    assert all((tmp_path / f"end-r{r}-w4").exists() for r in range(4)), both
    first = launched
    assert "axolotl-dist: the membership changed (now 2 node(s), 4 rank(s)): restarted every " \
           "rank in a new round" in first[0].stderr, both


def test_a_lost_node_restarts_the_others_clean_and_the_restart_line_names_its_rank(tmp_path,
                                                                                   two_nodes):
    script = _script(tmp_path, """
        if world == 4 and restart == "0":
            ad.barrier()
            mark(f"ready-r{rank}")
            if rank >= 2:
                time.sleep(150)  # node-b is killed here
            ad.barrier()
    """)
    port = free_port()
    env = subprocess_env(tmp_path, NODE_DIR=str(tmp_path), AXOLOTL_DIST_HEARTBEAT_TIMEOUT="8")
    launched = hosts.start_commands(two_nodes, [_command(two_nodes[0], port, script)] * 2,
                                    str(tmp_path), env, cwd=str(tmp_path))
    _wait_for(tmp_path, [f"ready-r{r}" for r in range(4)], launched)
    time.sleep(1.0)
    hosts.kill_nodes(two_nodes[1:])
    assert hosts.wait_nodes(two_nodes[:1], timeout=200), launched[0].describe()
    survivor = launched[0]
    assert survivor.code == 0, survivor.describe()
    assert all((tmp_path / f"end-r{r}-w2").exists() for r in range(2)), survivor.describe()
    lines = [l for l in survivor.stderr.splitlines() if l.startswith("axolotl-dist: attempt 1")]
    assert len(lines) == 1, survivor.describe()
    print(lines[0])
    assert "failed: rank 2 " in lines[0] or "failed: rank 3 " in lines[0], lines
    assert "node-b" in lines[0], lines
