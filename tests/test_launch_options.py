"""``axolotl-dist`` takes every torchrun command line (#45): each form runs under torchrun
(``python -m torch.distributed.run``) and under ``axolotl-dist`` (``python -m
axolotl_dist.launch``) and must come out the same: exit code, the ranks that ran and the env
each saw, the files written, the rank lines shown. Then what only the kit adds: a terminal
stays a terminal for the ranks, and a signal the user lists is theirs.

Real launchers, real processes, 127.0.0.1 and free ports; every launch bounded.
"""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from fixtures import ROOT, finish, free_port, run, start, subprocess_env, unfold

TIMEOUT = 90
LAUNCHERS = {"torchrun": [sys.executable, "-m", "torch.distributed.run"],
             "axolotl-dist": [sys.executable, "-m", "axolotl_dist.launch"]}
#: What each rank records of its env (torch's and the contract's).
SEEN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_NAME",
        "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RESTART_COUNT")

# A rank: record the env it saw (one file per attempt and rank), print a line on each stream.
# "fail-first": on attempt 0, rank 0 exits 3 once rank 1 has written its file (no collective:
# the ranks only share the directory).
INFO = r'''
import json, os, sys, time
out, mode = sys.argv[1], sys.argv[2]
attempt, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
info = {k: os.environ.get(k) for k in %r}
info["tty"] = sys.stdout.isatty()
path = os.path.join(out, f"a{attempt}_r{rank}.json")
with open(path + ".tmp", "w") as fh:
    json.dump(info, fh)
os.replace(path + ".tmp", path)
sys.stdout.write(f"out from local rank {os.environ['LOCAL_RANK']}\n"); sys.stdout.flush()
sys.stderr.write(f"err from local rank {os.environ['LOCAL_RANK']}\n"); sys.stderr.flush()
if mode == "fail-first" and attempt == "0":
    if rank == "0":
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(out, "a0_r1.json")) and time.monotonic() < deadline:
            time.sleep(0.02)
        sys.exit(3)
    time.sleep(60)  # stopped by the restart
''' % (SEEN,)

# The same for --no-python: a shell script.
INFO_SH = r'''#!/bin/sh
printf '{"RANK": "%s", "WORLD_SIZE": "%s", "LOCAL_RANK": "%s", "ROLE_NAME": "%s", "tty": false}' \
  "$RANK" "$WORLD_SIZE" "$LOCAL_RANK" "$ROLE_NAME" > "$1/a${TORCHELASTIC_RESTART_COUNT}_r$RANK.json"
echo "out from local rank $LOCAL_RANK"
echo "err from local rank $LOCAL_RANK" >&2
'''

#: (id, options before the script, how the script is named, mode). ``{port}`` is a free port,
#: ``{logs}`` a directory; ``script``: "py" (a path), "abs" (an absolute path), "sh" (the
#: shell script).
CASES = [
    ("standalone", ["--standalone", "--nproc-per-node", "2"], "py", "ok"),
    ("c10d-endpoint", ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:{port}",
                       "--rdzv-id", "X", "--nproc_per_node", "2"], "py", "ok"),
    ("local-ranks-filter", ["--nproc-per-node", "2", "--local-ranks-filter", "1"], "py", "ok"),
    ("tee", ["--nproc-per-node", "2", "--tee", "3", "--log-dir", "{logs}"], "py", "ok"),
    ("redirects", ["--nproc-per-node", "2", "--redirects", "3", "--log_dir", "{logs}"], "py",
     "ok"),
    ("no-python", ["--nproc-per-node", "2", "--no-python"], "sh", "ok"),
    ("run-path", ["--nproc-per-node", "2", "--run-path"], "abs", "ok"),
    ("max-restarts", ["--nproc-per-node", "2", "--max-restarts", "1"], "py", "fail-first"),
    # options whose effects do not meet, in one command line
    ("start-method-role-shutdown-timeout", ["--nproc-per-node", "2", "--start-method", "spawn",
                                            "--role", "trainer", "--shutdown-timeout", "5"],
     "py", "ok"),
    ("nproc-cpu", ["--nproc-per-node", "cpu"], "py", "ok"),
    ("master-port", ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                     "{port}"], "py", "ok"),
]


def _script(tmp: Path, kind: str) -> str:
    if kind == "sh":
        path = tmp / "info.sh"
        path.write_text(INFO_SH)
        path.chmod(0o755)
        return "./info.sh"
    path = tmp / "info.py"
    path.write_text(INFO)
    return str(path) if kind == "abs" else "info.py"


def _torch_files(logs: Path) -> Dict[str, str]:
    """torch's --tee/--redirects files, by ``attempt/local rank/name`` (the run's own
    directory has a random name): their text."""
    found = {}
    for path in logs.glob("*/attempt_*/*/*.log"):
        found["/".join(path.parts[-3:])] = path.read_text()
    return found


_TORCH_TAG = re.compile(r"^\[\w+?(\d+)\]:")


def _rank_lines(text: str) -> List[str]:
    """The ranks' lines the launcher showed, without either launcher's labels (the kit's
    ``[rank 1]`` / ``[ranks 0-1]``, torch's ``[default1]:`` under --tee), sorted."""
    lines = []
    for line in unfold(text).splitlines():
        line = _TORCH_TAG.sub("", line)
        line = re.sub(r"^\[rank\d+\]: ", "", line)
        if "from local rank" in line:
            lines.append(line.strip())
    return sorted(lines)


def _launch(launcher: str, options: List[str], kind: str, mode: str,
            tmp: Path) -> Tuple[int, dict, str]:
    """Run one form under ``launcher`` in ``tmp``: ``(exit code, outcome, stderr)``."""
    out, logs = tmp / "out", tmp / "logs"
    out.mkdir()
    port = str(free_port())
    args = [a.replace("{port}", port).replace("{logs}", str(logs)) for a in options]
    script = _script(tmp, kind)
    code, stdout, stderr = run([*LAUNCHERS[launcher], *args, script, str(out), mode],
                               subprocess_env(tmp), TIMEOUT, cwd=tmp)
    seen = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}
    return code, {"code": code, "seen": seen, "files": _torch_files(logs),
                  "stdout": _rank_lines(stdout), "stderr": _rank_lines(stderr)}, stderr


@pytest.mark.timeout(2 * TIMEOUT + 30)
@pytest.mark.parametrize("name, options, kind, mode", CASES, ids=[c[0] for c in CASES])
def test_a_torchrun_command_line_comes_out_the_same(name, options, kind, mode, tmp_path):
    results = {}
    for launcher in LAUNCHERS:
        (tmp_path / launcher).mkdir()
        results[launcher] = _launch(launcher, options, kind, mode, tmp_path / launcher)
    (code, torchrun, torchrun_err), (_, kit, kit_err) = results["torchrun"], results["axolotl-dist"]
    assert code == 0, torchrun_err
    assert kit == torchrun, (kit_err, torchrun_err)
    ranks = 2 if name != "nproc-cpu" else len(kit["seen"])
    attempts = 2 if mode == "fail-first" else 1
    assert len(kit["seen"]) == ranks * attempts and ranks >= 1, kit["seen"]
    if name == "local-ranks-filter":
        assert kit["stdout"] == ["out from local rank 1"], kit
    elif name == "redirects":
        assert kit["stdout"] == kit["stderr"] == [] and len(kit["files"]) == 4, kit
    else:
        assert kit["stdout"] == sorted(f"out from local rank {r}" for r in range(ranks)
                                       for _ in range(attempts)), kit
    if name in ("tee", "redirects"):
        assert kit["files"]["attempt_0/1/stdout.log"] == "out from local rank 1\n", kit["files"]
        assert kit["files"]["attempt_0/0/stderr.log"] == "err from local rank 0\n", kit["files"]
    if "--role" in options:
        assert {s["ROLE_NAME"] for s in kit["seen"].values()} == {"trainer"}
    if mode == "fail-first":
        assert {s["TORCHELASTIC_MAX_RESTARTS"] for s in kit["seen"].values()} == {"1"}
        assert ("axolotl-dist: attempt 1 of 2 failed: rank 0 exited with code 3; restarting "
                "every rank (attempt 2 of 2, --max-restarts 1)") in kit_err, kit_err


# ---- a terminal stays a terminal -----------------------------------------------------------

# Both ranks print the same line once both are there (it folds), then show a tqdm bar.
BAR = r'''
import os, shutil, sys, time
from tqdm import tqdm
out = sys.argv[1]
open(os.path.join(out, os.environ["RANK"]), "w").close()
deadline = time.monotonic() + 60
while len(os.listdir(out)) < 2 and time.monotonic() < deadline:
    time.sleep(0.02)
size = shutil.get_terminal_size((0, 0))
sys.stdout.write(f"tty {sys.stdout.isatty()} {sys.stderr.isatty()} {size.columns}x{size.lines}\n")
sys.stdout.flush()
for _ in tqdm(range(4), disable=None, desc="steps", mininterval=0):
    time.sleep(0.05)
print("after\nthe bar")
'''


def _in_terminal(cmd: List[str], env: Dict[str, str], cwd: Path, timeout: float) -> Tuple[int, bytes]:
    """Run ``cmd`` with a pseudo-terminal of 30 rows, 100 columns as its stdout and stderr:
    ``(exit code, what it wrote)``."""
    import fcntl
    import struct
    import termios

    env = {k: v for k, v in env.items() if k not in ("COLUMNS", "LINES")}  # the size is the
    # terminal's here (a CI runner may export 80x24, which get_terminal_size would prefer)
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env,
                            cwd=str(cwd), start_new_session=True)
    os.close(slave)
    data, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(master, 1 << 16)
                except OSError:  # EIO: every writer is gone
                    break
                if not chunk:
                    break
                data += chunk
            elif proc.poll() is not None and not ready:
                break
        else:
            pytest.fail(f"{cmd} did not finish in {timeout}s: {data!r}")
        return proc.wait(timeout=30), data
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.close(master)


def _both_ranks(text: str, line: str) -> bool:
    """``line`` shown for ranks 0 and 1: folded into one (``[ranks 0, 1] line``), or one per
    rank where a loaded machine let the ranks print it further apart than the fold's window
    (folding itself is tests/test_output.py's)."""
    return (f"[ranks 0, 1] {line}\n" in text
            or f"[rank 0] {line}\n" in text and f"[rank 1] {line}\n" in text)


@pytest.mark.timeout(TIMEOUT + 30)
def test_each_rank_gets_a_terminal_when_the_launcher_has_one(tmp_path):
    (tmp_path / "bar.py").write_text(BAR)
    cmd = [*LAUNCHERS["axolotl-dist"], "-n", "2", "bar.py"]
    (tmp_path / "tty").mkdir()
    code, data = _in_terminal([*cmd, str(tmp_path / "tty")], subprocess_env(tmp_path),
                              tmp_path, TIMEOUT)
    text = data.decode(errors="replace").replace("\r\n", "\n")  # the outer terminal's ONLCR
    assert code == 0, text
    assert _both_ranks(text, "tty True True 100x30"), text  # sized, a terminal, on each rank
    assert re.search(r"steps: 100%\|[^\n]*\| 4/4", text), text  # tqdm drew its bar
    assert _both_ranks(text, "after") and _both_ranks(text, "the bar"), text
    assert "\r\r" not in text, text  # the ranks' own \n came through raw, not as \r\n
    # without a terminal: pipes, as before
    (tmp_path / "pipe").mkdir()
    code, out, err = run([*cmd, str(tmp_path / "pipe")], subprocess_env(tmp_path), TIMEOUT,
                         cwd=tmp_path)
    assert code == 0, err
    assert "[ranks 0, 1] tty False False" in out and "steps" not in err, (out, err)


# ---- a signal the user lists is theirs -----------------------------------------------------

# Each rank joins the kit's group (so `axolotl-dist where` finds it), installs a SIGUSR1
# handler that writes a file, says it is ready and waits.
USR1 = r'''
import os, signal, sys, time
import axolotl_dist as ad
out = sys.argv[1]
ad.init_distributed()
def on_usr1(signum, frame):
    open(os.path.join(out, f"usr1_{ad.get_rank()}"), "w").close()
signal.signal(signal.SIGUSR1, on_usr1)
sys.stdout.write(f"ready {ad.get_rank()}\n"); sys.stdout.flush()
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    time.sleep(0.05)
open(os.path.join(out, f"timed_out_{ad.get_rank()}"), "w").close()
'''


def _ready(proc: subprocess.Popen, count: int) -> None:
    ready, deadline = 0, time.monotonic() + TIMEOUT
    while ready < count and time.monotonic() < deadline:
        line = proc.stdout.readline() if proc.stdout is not None else ""
        if not line:
            break
        ready += unfold(line).count("ready")
    assert ready == count, finish(proc, 30)


@pytest.mark.timeout(2 * TIMEOUT + 60)
def test_a_listed_sigusr1_reaches_every_rank_as_under_torchrun(tmp_path):
    (tmp_path / "usr1.py").write_text(USR1)
    outcome: Dict[str, Tuple[int, List[str], Optional[str]]] = {}
    for launcher in LAUNCHERS:
        out = tmp_path / launcher
        out.mkdir()
        env = subprocess_env(tmp_path, AXOLOTL_DIST_RUN_DIR=str(out / "runs"))
        proc = start([*LAUNCHERS[launcher], "--nproc-per-node", "2", "--signals-to-handle",
                      "SIGTERM,SIGINT,SIGUSR1", "--shutdown-timeout", "5", "usr1.py", str(out)],
                     env, cwd=tmp_path)
        _ready(proc, 2)
        where = subprocess.run([*LAUNCHERS["axolotl-dist"], "where", "--timeout", "60"],
                               env=env, capture_output=True, text=True, timeout=TIMEOUT,
                               cwd=str(ROOT))
        time.sleep(0.5)  # the ranks are in their wait
        os.kill(proc.pid, signal.SIGUSR1)
        code, _, err = finish(proc, TIMEOUT)
        files = sorted(p.name for p in out.iterdir() if p.name != "runs")
        outcome[launcher] = (code, files, where.stdout if where.returncode == 0 else None)
        if launcher == "axolotl-dist":
            assert code == 128 + signal.SIGUSR1, err  # the kit's exit code for a signal
            assert "got SIGUSR1, stopped every rank" in err, err
            assert "where every rank is" not in err, err  # SIGUSR1 is the user's, not a report
        else:
            assert code == 1, err  # torchrun: its SignalException's traceback, exit code 1
    for launcher, (code, files, where_out) in outcome.items():
        assert files == ["usr1_0", "usr1_1"], (launcher, files)  # each rank's handler ran
        assert where_out is not None and re.search(  # both ranks in their wait loop
            r"ranks 0, 1: in <module> at usr1\.py:1[23]\n", where_out), (launcher, where_out)


# ---- restarts: each attempt's own account --------------------------------------------------

# Attempt 0: rank 0 ends cleanly at once, then rank 1 fails. Attempt 1: rank 1 fails while
# rank 0 still runs. Read with attempt 0's records, attempt 1 would look like rank 0 quit early.
RESTARTED = r'''
import os, sys, time
out = sys.argv[1]
attempt, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
open(os.path.join(out, f"a{attempt}_r{rank}"), "w").close()
if attempt == "0" and rank == "0":
    sys.exit(0)
if attempt == "0":
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(out, "a0_r0")) and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(1.0)  # rank 0 has ended
    sys.exit(4)
if rank == "1":  # once rank 0 of this attempt has started (its file is there)
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(out, "a1_r0")) and time.monotonic() < deadline:
        time.sleep(0.02)
    sys.exit(4)
time.sleep(60)
'''


@pytest.mark.timeout(TIMEOUT + 30)
def test_the_report_of_a_restarted_run_reads_its_last_attempt_only(tmp_path):
    (tmp_path / "restarted.py").write_text(RESTARTED)
    code, _, err = run([*LAUNCHERS["axolotl-dist"], "-n", "2", "--max-restarts", "1",
                        "restarted.py", str(tmp_path)], subprocess_env(tmp_path), TIMEOUT,
                       cwd=tmp_path)
    assert code == 4, err
    said = [line for line in err.splitlines() if line.startswith("axolotl-dist:")]
    assert said[0] == ("axolotl-dist: attempt 1 of 2 failed: rank 1 exited with code 4; "
                       "restarting every rank (attempt 2 of 2, --max-restarts 1)"), err
    assert re.match(r"axolotl-dist: attempt 2 of 2: rank 1 \(local rank 1, pid \d+\) failed "
                    r"first: it exited with code 4$", said[1]), err
    assert "exited with code 0 while" not in err, err  # attempt 0's clean end is not read
    assert sorted(p.name for p in tmp_path.glob("a*_r*")) == ["a0_r0", "a0_r1", "a1_r0", "a1_r1"]
