"""A straggler named while the run goes (#78): DDP on 3 real gloo ranks where one rank sleeps
200 ms more than the others each step. Rank 0 logs it on its own, once, naming the rank, its
host and how far behind it is; ``ad.straggler_report()`` returns it on every rank; a traced run
marks it on the timeline. Under torchrun (after a healthy stretch that must not be reported),
``axolotl-dist``, bare env vars (the store in rank 0) and on two namespace nodes. The rules
(thresholds, rate limit, records) are unit-tested in tests/runtime/liveness/test_stragglers.py."""

import json
import re
import socket
import time
from typing import Tuple

import pytest
import torch

import axolotl_dist as ad
from axolotl_dist.testing import run_distributed
from fixtures import (KIT_WARNING, await_output, free_port, kill_tree, start_logged,
                      subprocess_env)
import hosts

HOST = socket.gethostname()  # the host the kit names a rank on, as it names it

SLOW = """\
import sys, time
import torch
import axolotl_dist as ad

def say(line):  # one write: torchrun's ranks share a pipe (print writes the newline apart)
    sys.stdout.write(line + "\\n"); sys.stdout.flush()

slow, healthy = int(sys.argv[1]), float(sys.argv[2])
ad.init_distributed()
rank = ad.get_rank()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
start, step, since = time.monotonic(), 0, None
while True:
    behind = rank == slow and time.monotonic() - start >= healthy
    if behind and since is None:
        since = time.time()
        say(f"slow since {since:.3f}")
    time.sleep(0.25 if behind else 0.05)  # rank `slow`: 200 ms behind the others a step
    model(torch.randn(2, 8)).sum().backward()
    step += 1
    if step % 10 == 0 and ad.broadcast_object(
            ad.straggler_report() is not None or time.monotonic() - start > 150, src=0):
        break
say(f"report {rank}: {ad.straggler_report()!r}")
"""

#: The straggler's line on rank 0: its rank and host, how many of how many collectives, how far.
_SAID = re.compile(r"^a straggler: rank (\d) \(([\w.-]+)\) arrived last at (\d+) of the last "
                   r"(\d+) collectives, (\d+) ms after the other ranks' median \(a collective "
                   r"every (\d+) ms\): every other rank waits for it at each one "
                   r"\(AXOLOTL_DIST_STRAGGLERS=0 turns this report off\)$")


def _checked(text: str, slow: int, host: str) -> Tuple[float, float]:
    """Assert the run's output names rank ``slow`` (on ``host``) once, on rank 0, and every
    rank's ``straggler_report()``; returns (when it began to lag, when rank 0 found it)."""
    text = re.sub(r"^\[rank \d\] ", "", text, flags=re.M)  # axolotl-dist's labels
    said = [(m, _SAID.match(m.group(3))) for m in map(KIT_WARNING.match, text.splitlines()) if m]
    said = [(m, s) for m, s in said if "straggler" in m.group(3)]
    assert len(said) == 1 and said[0][1], text  # once, on rank 0, in these words
    tag, found = said[0]
    assert tag.group(1, 2) == ("0", "3"), text
    assert (int(found.group(1)), found.group(2)) == (slow, host), text
    last, compared, late = int(found.group(3)), int(found.group(4)), int(found.group(5))
    assert 20 <= compared <= 100 and last >= 0.75 * compared, text
    assert 150 <= late <= 400, text  # 200 ms behind, give or take the machine's load
    reports = re.findall(r"^report (\d): StragglerReport\(rank=(\d), host='([\w.-]+)', .*"
                         r"found=([\d.]+)\)$", text, re.M)
    assert sorted(r for r, _, _, _ in reports) == ["0", "1", "2"], text  # each rank's call
    assert {(int(r), h) for _, r, h, _ in reports} == {(slow, host)}, text
    since = re.search(r"^slow since ([\d.]+)$", text, re.M)
    assert since, text
    return float(since.group(1)), min(float(f) for _, _, _, f in reports)


#: (launcher, seconds every rank runs at the same pace first, traced): the store in torchrun's
#: agent, in ``axolotl-dist``, in rank 0 (bare env vars).
CASES = [("torchrun", 20.0, True), ("axolotl-dist", 0.0, False), ("env", 0.0, False)]


@pytest.mark.parametrize("launcher,healthy,traced", CASES)
def test_a_straggler_is_named_within_a_minute(tmp_path, launcher, healthy, traced):
    (tmp_path / "slow.py").write_text(SLOW)
    trace = tmp_path / "trace"
    env = dict(subprocess_env(tmp_path), **({"AXOLOTL_DIST_TRACE": str(trace)} if traced else {}))
    procs = start_logged(launcher, tmp_path, [str(tmp_path / "slow.py"), "1", str(healthy)], 3,
                         free_port(), env)
    try:
        text = await_output(tmp_path, r"^(\[rank \d\] )?report \d: ", 3,
                            time.monotonic() + 90 + healthy + 60)
        for proc in procs:
            assert proc.wait(60) == 0, text
    finally:
        for proc in procs:
            kill_tree(proc.pid)
            proc.wait(30)
    since, found = _checked(text, 1, HOST)
    assert 0 < found - since < 60, (since, found)  # named within a minute of lagging
    if traced:  # rank 0 merged the trace at its exit: the finding is on the timeline
        events = json.loads((trace / "trace.json").read_text())["traceEvents"]
        marks = [e for e in events if e.get("cat") == "finding"]
        assert len(marks) == 1 and marks[0]["pid"] == 0 and marks[0]["ph"] == "i", marks
        assert marks[0]["name"].startswith(f"straggler: rank 1 ({HOST}) arrived last at "), marks
        assert f"straggler: rank 1 ({HOST}) arrived last at " in (trace / "summary.txt").read_text()


@pytest.mark.skipif(hosts.network_available() is not None, reason=str(hosts.network_available()))
def test_a_straggler_on_another_node_is_named(tmp_path):
    # node-a holds rank 0, node-b ranks 1 (the straggler) and 2, each node on a network of its
    # own (bare env vars: rank 0 hosts the store at node-a's address)
    script = tmp_path / "slow.py"
    first, rest = SLOW.split("\n", 1)  # the arguments on its first line: its lines stay
    script.write_text(f"{first}; sys.argv[1:] = ['1', '0']\n{rest}")
    nodes = [hosts.Node([0], "node-a", burn_pids=60), hosts.Node([1, 2], "node-b")]
    with hosts.private_network(nodes, str(tmp_path)):
        ranks = hosts.start_nodes(nodes, str(script), str(tmp_path), free_port())
        text = await_output(tmp_path, r"^report \d: ", 3, time.monotonic() + 150)
    since, found = _checked(text, 1, "node-b")
    assert 0 < found - since < 60, (since, found, ranks.describe())


def test_straggler_report_on_forked_ranks_is_none_at_once_while_rank_0_found_nothing():
    # rank 0 answers from memory; the others look for rank 0's record first and must not wait
    # for one it never wrote (a store get would, for the whole store timeout)
    def body():
        first = ad.straggler_report()
        for _ in range(20):
            ad.all_reduce(torch.ones(4))
        started = time.monotonic()
        again = ad.straggler_report()
        return first, again, time.monotonic() - started

    for first, again, took in run_distributed(body, 3, timeout=60):
        assert first is None and again is None
        assert took < 5, took
