"""Output from N ranks reads like one program (issue #35), under ``axolotl-dist`` with real
processes: what several ranks print alike is printed once with the ranks that printed it;
different lines carry their rank; a progress bar updates in place; a traceback comes out whole;
one rank's lines keep their order; ``--log-dir`` keeps every rank's every line; ``--no-fold``
and ``AXOLOTL_DIST_FOLD=0`` print every rank's lines as they come. torch's C++ warnings that
differ only in their time and pid or thread id are one line (issue #46). The kit's folding of
warnings under other launchers is in tests/test_warnings_fold.py."""

import re
import sys

from fixtures import label_ranks, run, subprocess_env

TIMEOUT = 120

CHATTY = """
import sys, time, warnings
import axolotl_dist as ad
from tqdm import tqdm

ad.init_distributed()
r = ad.get_rank()
# Lines fold when the launcher reads them within its 0.25 s window of each other. Together
# from here (ranks leave init up to a second apart on a loaded 2-core machine), and at a
# pace the launcher keeps up with on 2 cores beside 4 ranks: a flood of 4 x 220 lines at
# once left one rank's lines in its socket past the window (1 run in 6 failed).
ad.barrier()
warnings.warn("the same warning on every rank")
print("the same line on every rank")
print(f"a line of rank {r} alone")
time.sleep(0.3)
for i in range(200):  # alike on every rank, with lines of each rank's own between
    print(f"step {i}")
    if i % 10 == 0:
        print(f"rank {r} passed step {i}")
    time.sleep(0.002)
ad.barrier()
if r == 0:
    for _ in tqdm(range(20), desc="bar of rank 0", mininterval=0, file=sys.stderr):
        time.sleep(0.03)
elif r == 1:
    time.sleep(0.25)
    print("rank 1 speaks while the bar runs", file=sys.stderr)
ad.barrier()
"""

CRASH = """
import sys, time
import axolotl_dist as ad

ad.init_distributed()
r = ad.get_rank()
ad.barrier()
if r == 1:
    time.sleep(0.3)
    def deep(n):
        if n == 0:
            raise ValueError("boom in rank 1")
        deep(n - 1)
    deep(30)
for i in range(100000):  # the others keep talking on stderr while rank 1's traceback comes
    print(f"rank {r} busy {i}", file=sys.stderr)
    time.sleep(0.002)
"""


def _launch(tmp_path, script, ranks, *options, **env):
    (tmp_path / "s.py").write_text(script)
    return run([sys.executable, "-m", "axolotl_dist.launch", "-n", str(ranks), *options, "s.py"],
               subprocess_env(tmp_path, **env), TIMEOUT, cwd=tmp_path, keep_cr=True)


def test_alike_lines_once_with_their_ranks_and_logs_keep_every_line(tmp_path):
    code, out, err = _launch(tmp_path, CHATTY, 4, "--log-dir", "logs")
    assert code == 0, err
    # alike on every rank: once, with the ranks
    assert out.count("the same line on every rank") == 1, out
    assert "[ranks 0-3] the same line on every rank\n" in out, out
    assert err.count("UserWarning: the same warning on every rank") == 1, err
    assert re.search(r"^\[ranks 0-3\] \S*s\.py:\d+: UserWarning: the same warning on every rank$",
                     err, re.M), err
    # a rank's own line: with its rank
    for r in range(4):
        assert out.count(f"a line of rank {r} alone") == 1, out
        assert f"[rank {r}] a line of rank {r} alone\n" in out, out
    # every rank's lines in its own order, each step of each rank accounted for once
    seen = {r: [] for r in range(4)}
    for label, text in re.findall(r"^\[(ranks? [\d, -]+)\] (step \d+)$", out, re.M):
        for r in label_ranks(label):
            seen[r].append(int(text.split()[1]))
    assert all(seen[r] == list(range(200)) for r in range(4)), seen
    assert len(re.findall(r"^\[ranks 0-3\] step \d+$", out, re.M)) >= 100, out  # mostly folded
    # the bar updates in place: one stderr line of \r-separated states, no label on it
    bar = [line for line in err.split("\n") if "bar of rank 0" in line]
    assert bar and max(line.count("\r") for line in bar) >= 10, err
    assert "20/20" in err and not any(line.startswith("[rank") for line in bar), err
    # a line of another rank while the bar runs gets its own line, labelled
    assert re.search(r"^(\r?\x1b\[2K)?\[rank 1\] rank 1 speaks while the bar runs$", err, re.M), err
    # the log directory: every rank's every line, unfolded, with its time and stream
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert logs == [f"rank{r}.log" for r in range(4)], logs
    for r in range(4):
        text = (tmp_path / "logs" / f"rank{r}.log").read_text()
        lines = text.splitlines()
        assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} \[rank %d\] std(out|err): " % r,
                            line) for line in lines), text
        steps = [int(m) for m in re.findall(r"stdout: step (\d+)$", text, re.M)]
        assert steps == list(range(200)), text
        assert f"stdout: a line of rank {r} alone" in text
        assert "stdout: the same line on every rank" in text
        assert "UserWarning: the same warning on every rank" in text
    assert "stderr: bar of rank 0: 100%" in (tmp_path / "logs" / "rank0.log").read_text()


def test_a_traceback_comes_out_whole_and_the_report_points_to_it(tmp_path):
    code, out, err = _launch(tmp_path, CRASH, 3, "--log-dir", "logs")
    assert code == 1, err
    lines = err.split("\n")
    start = next(i for i, line in enumerate(lines) if "Traceback (most recent call last)" in line)
    end = next(i for i, line in enumerate(lines) if line.endswith("ValueError: boom in rank 1"))
    block = lines[start:end + 1]
    assert len(block) >= 8 and all(line.startswith("[rank 1] ") for line in block), block
    assert any("Previous line repeated" in line for line in block), block
    assert err.count("Traceback (most recent call last)") == 1, err
    assert re.search(r"^axolotl-dist: rank 1 \(local rank 1, pid \d+\) failed first: it raised "
                     r"ValueError.*; its traceback is above \(marked rank 1, "
                     r"logs/rank1\.log\)$", err, re.M), err
    assert "ValueError: boom in rank 1" in (tmp_path / "logs" / "rank1.log").read_text()


def test_no_fold_prints_every_rank_as_it_comes(tmp_path):
    script = "import axolotl_dist as ad\nad.init_distributed()\nprint('hello')\nad.barrier()\n"
    # the same script folded (the launcher's default): test_alike_lines_once_with_their_ranks...
    for options, env in ((("--no-fold",), {}), ((), {"AXOLOTL_DIST_FOLD": "0"})):
        code, out, err = _launch(tmp_path, script, 3, *options, **env)
        assert code == 0, err
        assert out.split("\n").count("hello") == 3, (options, env, out)


def test_a_log_file_that_cannot_be_written_is_said_once_and_the_rest_kept(tmp_path):
    (tmp_path / "logs" / "rank0.log").mkdir(parents=True)  # rank 0's file cannot be opened
    code, out, err = _launch(tmp_path, "import axolotl_dist as ad\nad.init_distributed()\n"
                             "print('hello')\nad.barrier()\n", 2, "--log-dir", "logs")
    assert code == 0, err
    assert out == "[ranks 0, 1] hello\n", (out, err)
    said = [line for line in err.splitlines() if "--log-dir is off" in line]
    assert len(said) == 1 and re.fullmatch(
        r"axolotl-dist: cannot write logs/rank0\.log \(.+\); --log-dir is off for the rest "
        r"of the run", said[0]), err


CPP_LINES = """
import os, sys
import axolotl_dist as ad

ad.init_distributed()
r, pid = ad.get_rank(), os.getpid()
ad.barrier()
sys.stderr.write(
    # alike but for the time and the pid or thread id: one line each
    f"[rank{r}]:[W1126 21:40:0{r}.12345678{r} reducer.cpp:1529] Warning: c10's (function f)\\n"
    f"[W1126 21:40:08.12345678{r} {pid} ProcessGroupGloo.cpp:12] Warning: with a pid\\n"
    f"W1126 21:40:08.12345{r} {pid % 10 ** (4 + r):5d} file.cpp:123] glog's\\n"
    f"I20261126 21:40:08.12345{r} {pid} file.cpp:9] glog's with the year\\n"
    # differ in something else: a line each
    f"[W1126 21:40:08.123456789 a.cpp:{10 + r}] Warning: another line of the file\\n"
    f"[W1126 21:40:08.123456789 a.cpp:5] Warning: rank {r}'s own\\n"
    f"[{'EW'[r]}1126 21:40:08.12345678{r} b.cpp:7] another severity\\n")
sys.stderr.flush()
ad.barrier()
"""

DDP_UNUSED = """
import torch
import axolotl_dist as ad
from torch.nn.parallel import DistributedDataParallel

ad.init_distributed(backend="gloo")
model = DistributedDataParallel(torch.nn.Linear(4, 2), find_unused_parameters=True)
model(torch.randn(3, 4)).sum().backward()  # every parameter used: torch's C++ warns on each rank
ad.barrier()
"""


def test_cpp_log_lines_alike_but_for_time_and_pid_are_one_line(tmp_path):
    code, out, err = _launch(tmp_path, CPP_LINES, 2)
    assert code == 0, err
    lines = err.splitlines()

    def shown(pattern, end, ending=1):  # one line matches; ``ending`` lines end with ``end``
        assert sum(bool(re.fullmatch(pattern, line)) for line in lines) == 1, (pattern, err)
        assert sum(line.endswith(end) for line in lines) == ending, (end, err)

    # once, the first rank's line with the ranks
    shown(r"\[ranks 0, 1\] \[W1126 21:40:0\d\.12345678\d reducer\.cpp:1529\] Warning: c10's "
          r"\(function f\)", "c10's (function f)")
    shown(r"\[ranks 0, 1\] \[W1126 21:40:08\.12345678\d \d+ ProcessGroupGloo\.cpp:12\] "
          r"Warning: with a pid", "with a pid")
    shown(r"\[ranks 0, 1\] W1126 21:40:08\.12345\d +\d+ file\.cpp:123\] glog's", "glog's")
    shown(r"\[ranks 0, 1\] I20261126 21:40:08\.12345\d \d+ file\.cpp:9\] glog's with the year",
          "glog's with the year")
    # a line each
    for r in range(2):
        shown(rf"\[rank {r}\] \[W1126 21:40:08\.123456789 a\.cpp:{10 + r}\] Warning: another "
              r"line of the file", "another line of the file", 2)
        shown(rf"\[rank {r}\] \[W1126 21:40:08\.123456789 a\.cpp:5\] Warning: rank {r}'s own",
              f"rank {r}'s own")
        shown(rf"\[rank {r}\] \[{'EW'[r]}1126 21:40:08\.12345678{r} b\.cpp:7\] another severity",
              "another severity", 2)


def test_torchs_ddp_warning_of_every_rank_is_shown_once(tmp_path):
    code, out, err = _launch(tmp_path, DDP_UNUSED, 2)
    assert code == 0, err
    found = [line for line in (out + err).splitlines()
             if "find_unused_parameters=True was specified" in line]
    assert len(found) == 1, out + err
    assert re.match(r"\[ranks 0, 1\] \[W\d+ \d\d:\d\d:\d\d\.\d+ reducer\.cpp:\d+\] Warning: "
                    r"find_unused_parameters=True was specified in DDP constructor", found[0]), err


RESTARTED = """
import os
import axolotl_dist as ad

ad.init_distributed()
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"attempt {attempt} of rank {ad.get_rank()}")
if attempt == "0" and ad.get_rank() == 1:
    raise SystemExit(3)
ad.barrier()
"""


def test_log_dir_marks_where_each_restart_begins_in_a_ranks_file(tmp_path):
    # --max-restarts with --log-dir: each rank's file held its attempts run together
    code, out, err = _launch(tmp_path, RESTARTED, 2, "--max-restarts", "1", "--log-dir", "logs")
    assert code == 0, err
    for rank in (0, 1):
        text = (tmp_path / "logs" / f"rank{rank}.log").read_text()
        said = [line.split(f"[rank {rank}] ", 1)[1] for line in text.splitlines()]
        first, mark, second = (said.index(f"stdout: attempt {n} of rank {rank}") if n != "mark"
                               else said.index("axolotl-dist: attempt 2 (restart 1) starts here")
                               for n in ("0", "mark", "1"))
        assert first < mark < second, text
        assert said.count("axolotl-dist: attempt 2 (restart 1) starts here") == 1, text

