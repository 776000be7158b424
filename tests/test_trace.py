"""The cross-rank timeline: every rank records its kit calls, the merged ``trace.json`` is a
valid Chrome trace whose waits name the rank waited for, under every launcher; a killed rank
keeps what it recorded."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import sys

import pytest

from fixtures import ROOT, free_port, run, start, finish, subprocess_env

#: The test extra has matplotlib; a core install (scripts/compat.sh) does not.
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None

SCRIPT = """
import os, sys, time
import axolotl_dist as ad

ad.init_distributed()
rank = ad.get_rank()

@ad.trace_span("prepare")
def prepare():
    time.sleep(0.05)

prepare()

def arrived(name):                         # this rank is at the next wait
    open(f"{name}.{rank}", "w").close()

def after_arrivals(name, ranks, seconds):  # once those ranks are at it: a late start on a
    deadline = time.monotonic() + 60       # loaded machine does not shorten their wait
    while not all(os.path.exists(f"{name}.{r}") for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(seconds)

if rank != 0:
    arrived("block")
with ad.zero_first():                      # rank 0's body takes 0.5 s; ranks 1, 2 wait for it
    if rank == 0:
        after_arrivals("block", (1, 2), 0.5)
with ad.trace_span("straggle"):
    if rank == 2:                          # ranks 0 and 1 wait 1 s for rank 2 below
        after_arrivals("reduce", (0, 1), 1.0)
if rank != 2:
    arrived("reduce")
total = ad.reduce_and_broadcast(lambda: rank + 1, sum)
assert total == 6
if sys.argv[1:] == ["kill"] and rank == 1:
    os.kill(os.getpid(), 9)                # dies mid-run: its events so far must survive
ad.barrier()
sys.stdout.write(f"done {rank}\\n"); sys.stdout.flush()  # one write: a shared stdout
"""

PHASES = {"X", "M", "s", "f", "i"}


def _check_chrome_format(doc):
    """The Trace Event format's required fields, per event type."""
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    for e in doc["traceEvents"]:
        assert e["ph"] in PHASES, e
        assert isinstance(e["name"], str) and isinstance(e["pid"], int), e
        assert isinstance(e["tid"], int), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name", "process_sort_index"), e
            assert isinstance(e["args"], dict), e
            continue
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
        if e["ph"] in ("s", "f"):
            assert isinstance(e["id"], int) and e.get("cat"), e
        if e["ph"] == "i":
            assert e["s"] in ("g", "p", "t"), e


def _waits(doc, name):
    return {e["pid"]: e for e in doc["traceEvents"]
            if e["ph"] == "X" and e["name"] == f"wait: {name}"}


def _check_timeline(directory, ranks=(0, 1, 2)):
    with open(os.path.join(directory, "trace.json")) as fh:
        doc = json.load(fh)
    _check_chrome_format(doc)
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e["name"] == "process_name"}
    assert sorted(names) == list(ranks), names
    zf = _waits(doc, "zero_first")
    assert sorted(zf) == [1, 2], zf
    for rank in (1, 2):  # upper bounds: the waiter's wake-up on a loaded machine
        assert 0.3e6 <= zf[rank]["dur"] <= 2e6, zf[rank]
        assert zf[rank]["args"]["waited_for"] == [0], zf[rank]
    rb = _waits(doc, "reduce_and_broadcast")
    assert sorted(rb) == [0, 1], rb
    for rank in (0, 1):
        assert 0.8e6 <= rb[rank]["dur"] <= 3e6, rb[rank]
        assert rb[rank]["args"]["waited_for"] == [2], rb[rank]
    bodies = [e for e in doc["traceEvents"] if e["name"] == "zero_first body"]
    assert [e["pid"] for e in bodies] == [0] and 0.45e6 <= bodies[0]["dur"], bodies
    users = {(e["pid"], e["name"]) for e in doc["traceEvents"] if e.get("cat") == "user"}
    assert {(r, "prepare") for r in ranks} <= users
    starts = {e["id"]: e["pid"] for e in doc["traceEvents"] if e["ph"] == "s"}
    arrows = {(starts[e["id"]], e["pid"]) for e in doc["traceEvents"] if e["ph"] == "f"}
    # rank 0 released the block's waiters, rank 2 the reduce's
    assert {(0, 1), (0, 2), (2, 0), (2, 1)} <= arrows, arrows
    helpers = [e for e in doc["traceEvents"] if e.get("cat") == "helper"]
    assert all(re.match(r"snippet\.py:\d+ in <module>", e["args"]["site"]) for e in helpers)
    assert all(e["args"]["group"] == "0" for e in helpers)
    summary = open(os.path.join(directory, "summary.txt")).read()
    assert re.search(r"reduce_and_broadcast at snippet\.py:\d+ in <module>\s+1\s+\d\.\d+\s+"
                     r"\d\.\d+ s for 2\s+\d\.\d+ s for 2\s+-", summary), summary
    assert re.search(r"zero_first at snippet\.py:\d+ in <module>\s+1\s+\d\.\d+\s+-\s+\d\.\d+ s "
                     r"for 0\s+\d\.\d+ s for 0", summary), summary
    return doc


def _env(tmp_path, **extra):
    return subprocess_env(tmp_path, AXOLOTL_DIST_TRACE=str(tmp_path / "trace"), **extra)


@pytest.mark.parametrize("launcher", ["axolotl-dist", "torchrun", "env"])
def test_the_merged_trace_names_whom_each_rank_waited_for(tmp_path, launcher):
    script = tmp_path / "snippet.py"
    script.write_text(SCRIPT)
    env = _env(tmp_path)
    if launcher == "env":
        port = free_port()
        procs = [start([sys.executable, str(script)],
                       dict(env, RANK=str(r), WORLD_SIZE="3", LOCAL_RANK=str(r),
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)), cwd=tmp_path)
                 for r in range(3)]
        results = [finish(p, 120) for p in procs]
        assert [code for code, _, _ in results] == [0, 0, 0], results
        err = results[0][2]
    else:
        cmd = ([sys.executable, "-m", "axolotl_dist.launch", "-n", "3"] if launcher == "axolotl-dist"
               else [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
                     "--master-addr", "127.0.0.1", "--master-port", str(free_port())])
        code, out, err = run(cmd + [str(script)], env, 120, cwd=tmp_path)
        assert code == 0, err
    _check_timeline(tmp_path / "trace")
    # the merge said where the trace is and printed the summary once; matplotlib (the test
    # extra has it) drew the picture
    assert err.count("timeline of the kit's calls:") == 1, err
    png = tmp_path / "trace" / "timeline.png"
    if HAS_MATPLOTLIB:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    else:  # a core install (scripts/compat.sh): the merge says why there is no picture
        assert "no timeline.png: drawing it needs matplotlib" in err and not png.exists(), err
    assert "reduce_and_broadcast at snippet.py:" in err


def test_a_killed_rank_keeps_its_events_and_is_marked_lost(tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(SCRIPT)
    port = free_port()
    env = _env(tmp_path)
    procs = [start([sys.executable, str(script), "kill"],
                   dict(env, RANK=str(r), WORLD_SIZE="3", LOCAL_RANK=str(r),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)), cwd=tmp_path)
             for r in range(3)]
    results = [finish(p, 120) for p in procs]
    assert results[1][0] == -signal.SIGKILL, results[1]
    assert results[0][0] == 1 and re.search(r"RankFailedError at \S+ in \S+: rank 1 failed in "
                                            r"barrier", results[0][2]), results[0]
    doc = _check_timeline(tmp_path / "trace")
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names[1].endswith("lost: no exit record"), names
    assert "lost" not in names[0] and "lost" not in names[2]
    lost = [e for e in doc["traceEvents"] if e.get("cat") == "lost"]
    assert [e["pid"] for e in lost] == [1]
    last_of_1 = max(e["ts"] + e.get("dur", 0) for e in doc["traceEvents"]
                    if e["pid"] == 1 and e["ph"] == "X")
    assert lost[0]["ts"] == pytest.approx(last_of_1, abs=1)  # its row ends at its death
    exits = [e for e in doc["traceEvents"] if e.get("cat") == "exit"]
    assert {e["pid"] for e in exits} == {0, 2} and all("RankFailedError" in e["name"] for e in exits)


def test_the_cli_merges_again_and_tracing_off_writes_nothing(tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(SCRIPT)
    code, _, err = run([sys.executable, "-m", "axolotl_dist.launch", "-n", "3", str(script)],
                       _env(tmp_path), 120, cwd=tmp_path)
    assert code == 0, err
    first = json.loads((tmp_path / "trace" / "trace.json").read_text())
    (tmp_path / "trace" / "trace.json").unlink()
    code, out, err = run([sys.executable, "-m", "axolotl_dist.launch", "trace",
                          str(tmp_path / "trace")], subprocess_env(tmp_path), 60, cwd=tmp_path)
    assert code == 0, err
    assert "reduce_and_broadcast at snippet.py:" in out and "trace.json" in out
    assert json.loads((tmp_path / "trace" / "trace.json").read_text()) == first
    # without matplotlib (the trace extra) the merge says why there is no picture
    blocker = tmp_path / "no_matplotlib"
    blocker.mkdir()
    (blocker / "matplotlib.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'matplotlib'\", name='matplotlib')\n")
    (tmp_path / "trace" / "timeline.png").unlink(missing_ok=not HAS_MATPLOTLIB)
    code, out, err = run([sys.executable, "-m", "axolotl_dist.launch", "trace",
                          str(tmp_path / "trace")],
                         subprocess_env(tmp_path, PYTHONPATH=f"{blocker}{os.pathsep}{ROOT}"), 60,
                         cwd=tmp_path)
    assert code == 0, err
    assert "no timeline.png: drawing it needs matplotlib" in out and "'trace' extra" in out, out
    assert not (tmp_path / "trace" / "timeline.png").exists()
    off = tmp_path / "off"  # no AXOLOTL_DIST_TRACE: no file, no merge
    off.mkdir()
    (off / "plain.py").write_text("import axolotl_dist as ad\nad.init_distributed()\n"
                                  "assert not ad.is_tracing()\nad.barrier()\n")
    code, _, err = run([sys.executable, "-m", "axolotl_dist.launch", "-n", "2", "plain.py"],
                       subprocess_env(off), 120, cwd=off)
    assert code == 0 and "timeline" not in err, err
    assert not list(off.rglob("*.jsonl")) and not list(off.rglob("trace.json"))
    code, out, err = run([sys.executable, "-m", "axolotl_dist.launch", "trace",
                          str(tmp_path / "nothing")], subprocess_env(tmp_path), 60, cwd=tmp_path)
    assert code == 1 and "no rank<k>.jsonl trace files in" in err, err


def test_trace_span_needs_a_name():
    import axolotl_dist as ad

    with pytest.raises(TypeError, match=r"trace_span\(name=''\): pass a non-empty str"):
        ad.trace_span("")
    with ad.trace_span("off"):  # tracing off: a no-op
        pass
    assert not ad.is_tracing()


def test_the_traced_example_names_its_slow_rank(tmp_path):
    # examples/traced_preprocess.py: the timeline's summary says who waited for whom
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "traced_preprocess.py")
    trace = tmp_path / "trace"
    code, out, err = run([sys.executable, "-m", "axolotl_dist.launch", "-n", "3", example,
                          "--trace-dir", str(trace), "--cache-dir", str(tmp_path / "cache"),
                          "--samples", "3000", "--slow-seconds", "0.6"],
                         _env(tmp_path, PYTHONWARNINGS="error"), 180, cwd=tmp_path)
    assert code == 0, err  # and without a warning (PYTHONWARNINGS=error), as every example
    summary = (trace / "summary.txt").read_text()
    rows = {line.split(" at ")[0]: line for line in summary.splitlines()[1:]}
    # ranks 1 and 2 waited for rank 0's zero_first body; ranks 0 and 1 for rank 2, the packer
    assert re.search(r"\d\.\d+ s for 0 +\d\.\d+ s for 0$", rows["zero_first"]), summary
    assert re.search(r"\d\.\d+ s for 2 +\d\.\d+ s for 2 +-$", rows["reduce_and_broadcast"]), summary
    assert (trace / "timeline.png").exists() or not HAS_MATPLOTLIB
    assert (trace / "trace.json").exists()


RAW = """
import torch, torch.distributed as dist
import axolotl_dist as ad
ad.init_distributed()
t = torch.ones(16)
for _ in range(3):
    dist.all_reduce(t)
with ad.trace_span("between"):
    ad.barrier()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
model(torch.randn(2, 8)).sum().backward()
"""


def test_torchs_own_collectives_are_on_a_row_of_their_own(tmp_path):
    (tmp_path / "raw.py").write_text(RAW)
    code, out, err = run([sys.executable, "-m", "axolotl_dist.launch", "-n", "2", "raw.py"],
                         _env(tmp_path), 120, cwd=tmp_path)
    assert code == 0, err
    doc = json.loads((tmp_path / "trace" / "trace.json").read_text())
    events = doc["traceEvents"]
    for rank in (0, 1):
        rows = {e["tid"] for e in events if e["pid"] == rank and e["name"] == "thread_name"
                and e["args"]["name"] == "torch's collectives (flight recorder)"}
        torch_events = [e for e in events if e["pid"] == rank and e.get("cat") == "torch"]
        assert {e["tid"] for e in torch_events} == rows and len(rows) == 1, torch_events
        names = [e["name"] for e in torch_events]
        raw = [n for n in names if n.endswith("(float32[16])")]
        assert len(raw) == 3 and all(re.fullmatch(r"all_reduce #\d+ \(float32\[16\]\)", n)
                                     for n in raw), names
        assert any(re.fullmatch(r"all_reduce #\d+ \(float32\[36\]\)", n) for n in names), names
        assert all(e["ph"] == "i" and e["args"]["group"] == "0" for e in torch_events)
        between = next(e for e in events if e["pid"] == rank and e["name"] == "between")
        # the clocks agree: the raw all-reduces come before the user's span, DDP's after it
        stamps = {e["name"]: e["ts"] for e in torch_events}
        assert all(stamps[n] <= between["ts"] + 1 for n in raw), (stamps, between)
        ddp = [e["ts"] for e in torch_events if "float32[36]" in e["name"]]
        assert ddp and min(ddp) >= between["ts"] + between["dur"] - 1, (ddp, between)
