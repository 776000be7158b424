"""A run stuck inside torch's own collectives (a raw ``dist.all_reduce`` one rank skipped, a
``broadcast`` where the others ``all_reduce``, DDP after one batch fewer, a rank spinning in
Python): ``kill -USR1`` to the launcher and ``axolotl-dist where`` give the verdict from the
ranks' flight recorders, naming the rank, the op and the sequence number."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import pytest

from fixtures import ROOT, finish, free_port, kill_tree, start, subprocess_env, unfold

STUCK = """\
import os, sys, time
import torch, torch.distributed as dist
import axolotl_dist as ad

def evaluate():
    while not os.path.exists("go"): time.sleep(0.05)  # EVALUATE

def spin():
    n = 1
    while n % 100000 or not os.path.exists("go"):
        n += 1  # SPIN

ad.init_distributed()
scenario, rank, last = sys.argv[1], ad.get_rank(), ad.get_world_size() - 1
t = torch.ones(4096)
if scenario == "ddp":
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    for step in range(3 if rank == last else 4):  # the last rank has one batch fewer
        if step == 2:
            sys.stdout.write(f"started {rank} {os.getpid()}\\n"); sys.stdout.flush()
        model(torch.randn(2, 8)).sum().backward()  # BACKWARD
    dist.barrier()  # BARRIER
else:
    for _ in range(3):
        dist.all_reduce(t)
    sys.stdout.write(f"started {rank} {os.getpid()}\\n"); sys.stdout.flush()
    if rank == last and scenario == "skip":
        evaluate()
    elif rank == last and scenario == "loop":
        spin()
    elif rank == last:
        dist.broadcast(t, 0)  # BROADCAST
    dist.all_reduce(t)  # ALL_REDUCE
"""


def _line(marker: str) -> int:
    return next(i for i, text in enumerate(STUCK.splitlines(), 1) if f"# {marker}" in text)


def _verdict(scenario: str, ws: int) -> str:
    """The verdict line the report must hold (a regex)."""
    last = ws - 1
    others = {2: "rank 0", 3: "ranks 0, 1", 4: "ranks 0-2"}[ws]  # the kit folds runs of 3+
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
