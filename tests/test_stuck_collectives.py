"""A run stuck inside torch's own collectives (a raw ``dist.all_reduce`` one rank skipped, a
``broadcast`` where the others ``all_reduce``, DDP after one batch fewer, a rank spinning in
Python): ``kill -USR1`` to the launcher and ``axolotl-dist where`` give the verdict from the
ranks' flight recorders, naming the rank, the op and the sequence number."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional

import pytest

from fixtures import (KIT_WARNING, ROOT, await_output, finish, free_port, kill_tree, start,
                      start_logged, subprocess_env, unfold)
import hosts

STUCK = """\
import os, random, sys, time
import torch, torch.distributed as dist
import axolotl_dist as ad

def evaluate():
    while not os.path.exists("go"): time.sleep(0.05)  # EVALUATE

def spin():
    n = 1
    while n % 100000 or not os.path.exists("go"):
        n += 1  # SPIN

ad.init_distributed()
scenario, rank = sys.argv[1], ad.get_rank()
last = int(sys.argv[2]) if len(sys.argv) > 2 else ad.get_world_size() - 1  # the odd rank
t = torch.ones(4096)
if scenario == "ddp":
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    for step in range(3 if rank == last else 4):  # the odd rank has one batch fewer
        if step == 2:
            sys.stdout.write(f"started {rank} {os.getpid()}\\n"); sys.stdout.flush()
        model(torch.randn(2, 8)).sum().backward()  # BACKWARD
    dist.barrier()  # BARRIER
else:
    steps = random.Random(rank)
    for _ in range(UNEVEN if scenario == "uneven" else 3):
        if scenario == "uneven":  # a healthy run's steps of uneven length (0.1-3 s)
            time.sleep(steps.uniform(0.1, 3.0))
        dist.all_reduce(t)
    sys.stdout.write(f"started {rank} {os.getpid()}\\n"); sys.stdout.flush()
    if rank == last and scenario in ("skip", "uneven"):
        evaluate()
    elif rank == last and scenario == "loop":
        spin()
    elif rank == last:
        dist.broadcast(t, 0)  # BROADCAST
    dist.all_reduce(t)  # ALL_REDUCE
"""


#: The healthy steps of the "uneven" scenario (then it is stuck the way "skip" is).
UNEVEN = 15
STUCK = STUCK.replace("UNEVEN", str(UNEVEN))


def _line(marker: str) -> int:
    return next(i for i, text in enumerate(STUCK.splitlines(), 1) if f"# {marker}" in text)


def _others(ws: int, last: int) -> str:
    """The ranks but ``last``, as the kit names them (runs of 3 or more folded)."""
    rest = [r for r in range(ws) if r != last]
    if len(rest) == 1:
        return f"rank {rest[0]}"
    if len(rest) >= 3 and rest == list(range(rest[0], rest[-1] + 1)):
        return f"ranks {rest[0]}-{rest[-1]}"
    return "ranks " + ", ".join(map(str, rest))


def _verdict(scenario: str, ws: int, last: Optional[int] = None) -> str:
    """The verdict line the report must hold (a regex); ``last``: the odd rank (the last)."""
    last = ws - 1 if last is None else last
    others = _others(ws, last)
    at = lambda marker: rf"at stuck\.py:{_line(marker)}"  # noqa: E731
    if scenario in ("skip", "loop"):
        head = (rf"verdict: {others} wait in torch's all_reduce #4 \(float32\[4096\]\) on the "
                rf"default group {at('ALL_REDUCE')}; rank {last} ")
        if scenario == "skip":
            return (head + rf"never issued #4: its last was #3 \(all_reduce\), it is in "
                    rf"evaluate {at('EVALUATE')}(, in exists)?$")
        # its heartbeat answers between the loop's bytecodes, or, starved of the GIL (the
        # loop's os.stat every 100,000 turns keeps it from asking), not at all
        return head + (rf"(never issued #4: its last was #3 \(all_reduce\), it is in spin at "
                       rf"stuck\.py:({_line('SPIN') - 1}|{_line('SPIN')})|did not answer: its "
                       r"process runs but its heartbeat got no turn \(Python code holding the "
                       r"GIL\), so it is not in #4)")
    if scenario == "bcast":
        return (rf"verdict: torch's collective #4 on the default group differs across ranks: "
                rf"all_reduce \(float32\[4096\]\) on {others} {at('ALL_REDUCE')}; broadcast "
                rf"\(float32\[4096\]\) on rank {last} {at('BROADCAST')}\. Every rank must issue "
                r"the same collectives in the same order")
    return (rf"verdict: torch's collective #\d+ on the default group differs across ranks: "
            rf"all_reduce \(float32\[\d+\]\) on {others} {at('BACKWARD')}; barrier on rank "
            rf"{last} {at('BARRIER')}\.")


def _started(procs, count: int, deadline: float = 90.0) -> None:
    """Read ``started`` lines from the launchers' stdout until ``count`` ranks said it."""
    seen = 0
    end = time.monotonic() + deadline
    for proc in procs:
        while seen < count and time.monotonic() < end:
            line = proc.stdout.readline()
            if not line:
                break
            if unfold(line).startswith("started"):
                seen += 1
                if len(procs) > 1:
                    break
    assert seen == count, f"{seen} of {count} ranks started"


def _start(launcher: str, tmp_path: Path, scenario: str, ws: int, port: int,
           debug: bool = False):
    env = dict(subprocess_env(tmp_path), **({"AXOLOTL_DIST_DEBUG": "1"} if debug else {}))
    script = str(tmp_path / "stuck.py")
    if launcher == "axolotl-dist":
        return [start([sys.executable, "-m", "axolotl_dist.launch", "-n", str(ws), "--master-port",
                       str(port), script, scenario], env, cwd=tmp_path)]
    if launcher == "torchrun":
        return [start([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                       str(ws), "--master-addr", "127.0.0.1", "--master-port", str(port), script,
                       scenario], env, cwd=tmp_path)]
    return [start([sys.executable, script, scenario],
                  dict(env, RANK=str(r), WORLD_SIZE=str(ws), LOCAL_RANK=str(r),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)), cwd=tmp_path)
            for r in range(ws)]


def _where(port: int, tmp_path: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "axolotl_dist.launch", "where", "--master-port",
                           str(port), "--timeout", "60"], env=subprocess_env(tmp_path),
                          capture_output=True, text=True, timeout=120, cwd=str(ROOT))
    assert done.returncode == 0, done.stderr
    return done.stdout


#: Each scenario once and each launcher at least once, on 2, 3 and 4 ranks: the verdict is read
#: from the ranks' flight recorders the same way whoever started them; what the launcher
#: changes is how the report is asked for (SIGUSR1 to ``axolotl-dist``, ``axolotl-dist where``
#: for a run torchrun or bare env vars started) and where the store lives. DDP, the case users
#: hit most, under both kinds of asking.
CASES = [("skip", "torchrun", 3), ("bcast", "env", 4), ("ddp", "axolotl-dist", 2),
         ("ddp", "env", 4), ("loop", "axolotl-dist", 2)]


@pytest.mark.parametrize("scenario,launcher,ws", CASES)
def test_where_gives_the_verdict_on_torchs_collectives(tmp_path, scenario, launcher, ws):
    (tmp_path / "stuck.py").write_text(STUCK)
    port = free_port()
    procs = _start(launcher, tmp_path, scenario, ws, port)
    recovers = scenario in ("skip", "loop")  # the last rank issues the collective after "go"
    try:
        _started(procs, ws)
        time.sleep(1.0)  # every rank in place: the others in the collective
        asked = time.monotonic()
        if launcher == "axolotl-dist":
            os.kill(procs[0].pid, signal.SIGUSR1)
            time.sleep(7.5)  # the report takes a beat (2.5 s) and the answers' wait (4 s)
            out = ""
        else:
            out = _where(port, tmp_path)
        took = time.monotonic() - asked
    finally:
        (tmp_path / "go").write_text("")
        if not recovers:  # a mismatched collective never completes: end the run here
            for proc in procs:
                kill_tree(proc.pid)
        results = [finish(p, 90) for p in procs]
    if recovers:
        assert all(code == 0 for code, _, _ in results), results
    report = out or results[0][2]
    assert re.search(_verdict(scenario, ws), report, re.M), report
    assert report.count("verdict:") == 1, report  # said once
    assert took < 30, took  # `where`'s own start-up included; the report itself: docs/faults.md


def _per_rank(launcher: str, results, ws: int) -> List[str]:
    """What each rank printed: its lines of the launcher's output, or its own stderr."""
    if launcher == "env":
        return [err for _, _, err in results]
    text = unfold(results[0][1] + results[0][2], labelled=True)
    tags = (lambda r: f"[rank {r}] ") if launcher == "axolotl-dist" else (lambda r: f"[rank{r}]: ")
    return ["\n".join(line[len(tags(r)):] for line in text.splitlines() if line.startswith(tags(r)))
            for r in range(ws)]


#: Debug mode on the two mismatches: the broadcast (checked on every rank before torch issues
#: it) and DDP's all-reduce (issued in C++: the rank at dist.barrier finds the others in it
#: through their flight recorders; they, inside gloo, end with that rank's account).
#: Each launcher once (each rank's output reaches the test its own way).
DEBUG_CASES = [("bcast", "axolotl-dist", 2), ("ddp", "torchrun", 3), ("ddp", "env", 4)]


@pytest.mark.parametrize("scenario,launcher,ws", DEBUG_CASES)
def test_debug_mode_raises_torchs_mismatch_on_every_rank(tmp_path, scenario, launcher, ws):
    (tmp_path / "stuck.py").write_text(STUCK)
    (tmp_path / "go").write_text("")
    port = free_port()
    started = time.monotonic()
    procs = _start(launcher, tmp_path, scenario, ws, port, debug=True)
    results = [finish(p, 90) for p in procs]
    took = time.monotonic() - started
    last = ws - 1
    texts = _per_rank(launcher, results, ws)
    if scenario == "bcast":
        want = ["mismatched call #4 on the default group: the ranks called different collectives",
                f"rank {last}: torch.distributed.broadcast(tensor=float32[4096], src=0)",
                "rank 0: torch.distributed.all_reduce(tensor=float32[4096], op=SUM)"]
        wants = {r: want for r in range(ws)}
    else:
        others = {2: "rank 0 is", 3: "ranks 0, 1 are", 4: "ranks 0-2 are"}[ws]
        finding = (rf"debug mode: torch's collective #(\d+) on the default group differs across "
                   rf"ranks: {others} in torch's all_reduce #\1 \(float32\[36\]\) on the default "
                   rf"group \(in <module> at stuck\.py:{_line('BACKWARD')}, in "
                   rf"torch\._tensor\.backward\), which no checked call issued .*; rank {last} "
                   rf"is at checked call #1 torch\.distributed\.barrier\(\) at "
                   rf"stuck\.py:{_line('BARRIER')} in <module>, its last torch collective #")
        # inside gloo's all-reduce, the others end with one line naming rank `last`'s account
        # at their line: its line, type and first words; the whole is in its output (#77)
        wants = {r: [rf"RankFailedError at stuck\.py:{_line('BACKWARD')} in <module>: rank "
                     rf"{last} failed at stuck\.py:{_line('BARRIER')}: CollectiveMismatchError: "
                     rf"debug mode: torch's… \(its traceback is in rank {last}'s output\)$"]
                 for r in range(last)}
        wants[last] = ["CollectiveMismatchError: " + finding]
    for r in range(ws):
        for pattern in wants[r]:
            found = (re.search(pattern, texts[r], re.M) if scenario == "ddp"
                     else pattern in texts[r])
            assert found, (r, pattern, texts[r], results)
        if scenario == "ddp" and r != last:  # one line: no gloo message, no torch frames
            assert "GLHF" not in texts[r] and "Traceback" not in texts[r], texts[r]
            assert all(len(line) < 200 for line in texts[r].splitlines()), texts[r]
    if scenario == "ddp":  # the finding's whole text once in the run's output
        assert sum(text.count("The ranks can never meet") for text in texts) == 1, texts
    assert all(code != 0 for code, _, _ in results), results
    assert took < 40, took


# --- the stuck report, unasked (#78) -------------------------------------------------------

#: The bound the tests set (seconds): the derived one is at least 60 s.
BOUND = 4


def _start_logged(launcher: str, tmp_path: Path, scenario: str, ws: int, port: int, last: int,
                  bound: float, **extra: str):
    """The run, each process's stdout and stderr to files of ``tmp_path`` (read while it runs)."""
    env = dict(subprocess_env(tmp_path), AXOLOTL_DIST_STUCK_AFTER=str(bound), **extra)
    return start_logged(launcher, tmp_path, [str(tmp_path / "stuck.py"), scenario, str(last)],
                        ws, port, env)


#: A raw all_reduce rank 1 never reaches, and DDP where rank 2 has one batch fewer (its barrier
#: meets the others' gradient all-reduce), on 3 ranks; the store in torchrun's agent, in
#: ``axolotl-dist``, and in rank 0 (bare env vars). "uneven": 15 healthy steps of 0.1-3 s on a
#: machine two busy processes load, which must not be reported (its bound: 8 s), then "skip".
AUTO_CASES = [("skip", "torchrun", 3, 1), ("ddp", "env", 3, 2), ("ddp", "axolotl-dist", 3, 2),
              ("skip", "env", 3, 1), ("uneven", "axolotl-dist", 3, 1)]


@pytest.mark.parametrize("scenario,launcher,ws,last", AUTO_CASES)
def test_a_stuck_run_reports_itself_within_the_bound(tmp_path, scenario, launcher, ws, last):
    (tmp_path / "stuck.py").write_text(STUCK)
    bound = 2 * BOUND if scenario == "uneven" else BOUND
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(2 if scenario == "uneven" else 0)]
    procs = _start_logged(launcher, tmp_path, scenario, ws, free_port(), last, bound)
    try:
        await_output(tmp_path, r"^(\[rank \d\] )?started", ws, time.monotonic() + 90)
        started = time.monotonic()
        text = await_output(tmp_path, "the run is still stuck", 1, started + 60)
        took = time.monotonic() - started
    finally:
        (tmp_path / "go").write_text("")
        for proc in procs + busy:
            kill_tree(proc.pid)
            proc.wait(30)
    kit = [m for m in map(KIT_WARNING.match, text.splitlines()) if m]
    heads = [m for m in kit if "the run looks stuck" in m.group(3)]
    assert len(heads) == 1, text  # one rank reports, the first time whole
    first = re.search(r"has issued no collective for (\d+) s, waiting in torch's (\w+) #(\d+) ",
                      heads[0].group(3))
    assert first and int(first.group(1)) <= bound + 2 * 2.5, text  # a beat late at most
    if scenario != "ddp":  # the collective rank `last` never reached, none before it
        assert first.group(3) == str(UNEVEN + 1 if scenario == "uneven" else 4), text
    if scenario == "skip":  # a rank that waits reports, not the one elsewhere (in DDP it
        assert heads[0].group(1) != str(last), text  # waits too, in its barrier)
    assert all(m.group(2) == str(ws) for m in kit), text
    verdicts = [m.group(3).strip() for m in kit if m.group(3).strip().startswith("verdict:")]
    assert len(verdicts) == 2, text
    verdict = _verdict("skip" if scenario == "uneven" else scenario, ws, last)
    if scenario == "uneven":
        verdict = verdict.replace("#4", f"#{UNEVEN + 1}").replace("#3", f"#{UNEVEN}")
    assert all(re.search(verdict, v) for v in verdicts), text
    assert sum("the run is still stuck" in m.group(3) for m in kit) == 1, text  # then once shorter
    assert took < 45, took


def test_a_stuck_runs_timeline_shows_every_ranks_collectives_and_the_open_one(tmp_path):
    # DDP where rank 2 has a batch fewer, traced, bare env vars: the report merges the timeline
    # so far; each rank's row holds torch's collectives up to the stuck one, drawn open
    (tmp_path / "stuck.py").write_text(STUCK)
    trace = tmp_path / "trace"
    procs = _start_logged("env", tmp_path, "ddp", 3, free_port(), 2, BOUND,
                          AXOLOTL_DIST_TRACE=str(trace))
    try:
        await_output(tmp_path, r"^started", 3, time.monotonic() + 90)
        text = await_output(tmp_path, "the timeline so far: ", 1, time.monotonic() + 60)
    finally:
        for proc in procs:
            kill_tree(proc.pid)
            proc.wait(30)
    head = re.search(r"waiting in torch's \w+ #(\d+) ", text)
    assert head, text
    stuck = int(head.group(1))
    assert f"the timeline so far: {trace / 'trace.json'}, {trace / 'timeline.png'}" in text, text
    events = json.loads((trace / "trace.json").read_text())["traceEvents"]
    torch_events = [e for e in events if e.get("cat") == "torch"]
    end_us = max(e["ts"] + e.get("dur", 0) for e in torch_events)
    for rank in range(3):
        mine = sorted((e for e in torch_events if e["pid"] == rank),
                      key=lambda e: e["args"]["call"])
        assert [e["args"]["call"] for e in mine] == list(range(1, stuck + 1)), (rank, mine)
        assert mine[-1]["name"].endswith(": not finished"), mine[-1]  # the open one, drawn open
        assert mine[-1]["dur"] >= BOUND * 1e6 * 0.9, mine[-1]  # to the report's time
        assert all(not e["name"].endswith(": not finished") for e in mine[:-1]), mine
    want = {0: "all_reduce", 1: "all_reduce", 2: "barrier"}  # rank 2 went on to its barrier
    assert all(next(e for e in torch_events if e["pid"] == r and e["args"]["call"] == stuck)
               ["name"].startswith(f"{op} #{stuck}") for r, op in want.items()), torch_events
    # times in seconds from the run's start: none before it, none past the last look
    assert all(0 <= e["ts"] <= end_us + 1 for e in events if "ts" in e), events  # 1 us: rounding
    assert end_us < 120e6, end_us
    summary = (trace / "summary.txt").read_text()
    assert re.search(rf"rank 0: in torch's all_reduce #{stuck} \(float32\[36\]\), not finished "
                     r"\d+\.\d s after it was issued", summary), summary
    assert (trace / "timeline.png").stat().st_size > 10_000


@pytest.mark.skipif(hosts.network_available() is not None, reason=str(hosts.network_available()))
@pytest.mark.parametrize("scenario,last", [("skip", 1), ("ddp", 2)])
def test_a_stuck_run_across_two_nodes_reports_itself(tmp_path, scenario, last):
    # node-a holds ranks 0, 1, node-b rank 2, each on a network of its own (bare env vars: rank
    # 0 hosts the store at node-a's address); the report names the rank on the other host too
    script = tmp_path / "stuck.py"
    first, rest = STUCK.split("\n", 1)  # the arguments on its first line: its lines stay
    script.write_text(f"{first}; sys.argv[1:] = [{scenario!r}, '{last}']\n{rest}")
    nodes = [hosts.Node([0, 1], "node-a", burn_pids=60), hosts.Node([2], "node-b")]
    with hosts.private_network(nodes, str(tmp_path)):
        ranks = hosts.start_nodes(nodes, str(script), str(tmp_path), free_port(),
                                  extra_env={"AXOLOTL_DIST_STUCK_AFTER": str(BOUND)})
        await_output(tmp_path, r"^started", 3, time.monotonic() + 90)
        text = await_output(tmp_path, "the run is still stuck", 1, time.monotonic() + 60)
    kit = [m for m in map(KIT_WARNING.match, text.splitlines()) if m]
    assert sum("the run looks stuck" in m.group(3) for m in kit) == 1, ranks.describe()
    verdicts = [m.group(3).strip() for m in kit if m.group(3).strip().startswith("verdict:")]
    assert len(verdicts) == 2, ranks.describe()
    verdict = _verdict(scenario, 3, last).replace(r"stuck\.py", r"\S*stuck\.py")  # its path
    assert all(re.search(verdict, v) for v in verdicts), ranks.describe()
