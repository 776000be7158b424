"""Nothing the kit reads off the network is unpickled unless the user's own call asked for an
object (docs/design/decisions.md, decision 19): a run that uses blocks and the value helpers on numbers
and tensors, a stall report and a relayed failure makes no ``pickle.loads`` or
``Unpickler.load`` call from the kit's frames, in any rank or the launcher.

Every Python process of the run (launcher, ranks, ``axolotl-dist where``) starts with a
``sitecustomize`` (this test's, first on ``PYTHONPATH``) that wraps ``pickle.loads`` and
``pickle.Unpickler`` before anything else is imported, counts the calls whose caller is a file
of the kit, and writes the count when the process exits."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fixtures import ROOT, free_port, start, finish, subprocess_env

COUNTER = r'''
import atexit, json, os, pickle, sys

_KIT = os.environ["COUNT_KIT_DIR"]
_OUT = os.environ["COUNT_OUT_DIR"]
_seen = []


def _from_kit(depth):
    frame = sys._getframe(depth)
    name = frame.f_code.co_filename
    if name.startswith(_KIT):
        _seen.append(f"{os.path.relpath(name, _KIT)}:{frame.f_lineno}")


_loads = pickle.loads


def loads(*args, **kwargs):
    _from_kit(2)
    return _loads(*args, **kwargs)


class Unpickler(pickle.Unpickler):
    def load(self):
        _from_kit(2)
        return super().load()


pickle.loads, pickle.Unpickler = loads, Unpickler


@atexit.register
def _write():
    with open(os.path.join(_OUT, f"{os.getpid()}.json"), "w") as fh:
        json.dump({"argv": sys.argv, "kit": _seen}, fh)
'''

SCRIPT = r'''
import os, sys, time
import torch
import axolotl_dist as ad

ad.init_distributed()
rank = ad.get_rank()
with ad.zero_first():
    if rank == 0:
        open("in-block", "w").close()
        hold = time.monotonic() + float(os.environ.get("HOLD", "0"))  # the others wait:
        while time.monotonic() < hold and not os.path.exists("asked"):  # a stall report now
            time.sleep(0.05)
assert ad.compute_and_broadcast(lambda: 2**70) == 2**70
assert ad.compute_and_broadcast(lambda: 0.1) == 0.1
assert torch.equal(ad.compute_and_broadcast(lambda: torch.arange(3.0)), torch.arange(3.0))
assert ad.reduce_and_broadcast(lambda: rank + 1, sum) == 3
gathered = ad.gather_from_all_ranks(lambda: torch.tensor([rank, 2**40]))
assert rank != 0 or gathered[1].tolist() == [1, 2**40]
ad.barrier()
try:
    ad.compute_and_broadcast(lambda: int("not a number"), src=1)  # a ValueError on rank 1
except ad.RankFailedError as exc:
    print(f"RELAYED {exc.exc_type}: {exc.exc_message}", flush=True)
    print("TRACEBACK" if exc.remote_traceback and "int(" in exc.remote_traceback else "NO TB",
          flush=True)
except ValueError:
    pass
if rank == 1:
    raise ValueError("rank 1 stops here")  # relayed through its exit record
try:
    ad.barrier()
except ad.AxolotlDistError as exc:  # debug mode: a CollectiveMismatchError naming the exit
    print("EXIT RELAYED", str(exc).replace("\n", " "), flush=True)
'''


def _env(tmp_path: Path, **extra: str) -> dict:
    (tmp_path / "site").mkdir(exist_ok=True)
    (tmp_path / "site" / "sitecustomize.py").write_text(COUNTER)
    (tmp_path / "counts").mkdir(exist_ok=True)
    env = subprocess_env(tmp_path, COUNT_KIT_DIR=str(ROOT / "axolotl_dist") + os.sep,
                         COUNT_OUT_DIR=str(tmp_path / "counts"),
                         AXOLOTL_DIST_WAIT_LOG_INTERVAL="1", **dict({"HOLD": "3"}, **extra))
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), env["PYTHONPATH"]])
    (tmp_path / "run.py").write_text(SCRIPT)
    return env


def _await_block(tmp_path: Path, proc: subprocess.Popen) -> None:
    """Until rank 0 is inside its block (it leaves a file there), at most 60 s."""
    deadline = time.monotonic() + 60
    while not (tmp_path / "in-block").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "rank 0 never got there"
        time.sleep(0.05)


def _counts(tmp_path: Path) -> list:
    return [json.loads(p.read_text()) for p in sorted((tmp_path / "counts").glob("*.json"))]


def _check(tmp_path: Path, output: str, processes: int) -> None:
    counts = _counts(tmp_path)
    assert len(counts) >= processes, (counts, output[-3000:])
    assert [c for c in counts if c["kit"]] == [], output[-3000:]
    assert "RELAYED ValueError: invalid literal for int() with base 10: 'not a number'" in output
    assert "TRACEBACK" in output
    assert re.search(r"EXIT RELAYED .*ValueError.*rank 1 stops here|EXIT RELAYED .*exited: "
                     r"rank 1 stops here", output), output[-3000:]


def test_under_axolotl_dist_with_a_stall_report(tmp_path):
    env = _env(tmp_path)
    proc = start([sys.executable, "-m", "axolotl_dist.launch", "-n", "2", "run.py"], env,
                 cwd=tmp_path)
    _await_block(tmp_path, proc)  # rank 0 holds the block for 3 s
    os.kill(proc.pid, signal.SIGUSR1)  # the stall report, to the launcher's stderr
    code, out, err = finish(proc, 90)
    assert code != 0  # rank 1 failed
    assert "rank 0" in out + err and "zero_first" in out + err, (out + err)[-3000:]
    _check(tmp_path, out + err, 3)


@pytest.mark.parametrize("debug", ["0", "1"], ids=["plain", "debug-mode"])
def test_under_bare_env_vars_store_in_rank0_with_where(tmp_path, debug):
    port = free_port()
    env = _env(tmp_path, AXOLOTL_DIST_DEBUG=debug, HOLD="60", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), WORLD_SIZE="2")  # held until where has answered
    procs = [start([sys.executable, "run.py"], dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                   cwd=tmp_path) for r in range(2)]
    _await_block(tmp_path, procs[0])
    where = subprocess.run([sys.executable, "-m", "axolotl_dist.launch", "where",
                            "--master-addr", "127.0.0.1", "--master-port", str(port)],
                           env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    (tmp_path / "asked").touch()
    results = [finish(p, 90) for p in procs]
    output = "".join(o + e for _, o, e in results) + where.stdout + where.stderr
    assert "zero_first" in where.stdout + where.stderr, output[-3000:]
    _check(tmp_path, output, 3)
