"""The default install keeps every report (issue #77): with the README's install line alone (no
extras, so no ``cryptography``) and a run secret, a rank stuck in a ``zero_first`` body is shown
with its Python stack by SIGUSR1 to ``axolotl-dist``, by ``axolotl-dist where`` and by the
waiting ranks' first wait warning, under ``axolotl-dist`` (whose secret it makes itself),
torchrun and bare env vars (a secret the user exports). The ranks and ``where`` run with an
import of ``cryptography`` that fails, as on a machine without it."""

import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Dict, List

import pytest

from fixtures import ROOT, finish, free_port, start, subprocess_env, unfold

#: Rank 0 tokenizes inside its first run of a zero_first block; ranks 1 and 2 wait for it.
STUCK_FIRST = """
import os, sys, time
import axolotl_dist as ad
END = time.monotonic() + float(sys.argv[1])  # at most; a file "go" in the cwd ends it sooner
def tokenize():
    while not os.path.exists("go") and time.monotonic() < END: time.sleep(0.05)

ad.init_distributed()
sys.stdout.write(f"started {ad.get_rank()} {os.getpid()}\\n"); sys.stdout.flush()
with ad.zero_first():
    if ad.get_rank() == 0:
        tokenize()
ad.barrier()
sys.stdout.write(f"done {ad.get_rank()}\\n"); sys.stdout.flush()
"""
#: Rank 0's stack as a report shows it.
RANK_0 = (r"rank 0: in tokenize at prep\.py:6 ← tokenize at prep\.py:12; inside zero_first block "
          r"#1 at prep\.py:\d+")
SECRET = "5ee0d0c4a1b2c3d4e5f60718293a4b5c"


def _env(tmp_path: Path, **extra: str) -> Dict[str, str]:
    """The test env, with an import of ``cryptography`` that fails (the default install)."""
    blocked = tmp_path / "no_extras" / "cryptography"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text(
        'raise ImportError("no cryptography: the README\'s install line has no extras")\n')
    env = subprocess_env(tmp_path, AXOLOTL_DIST_WAIT_LOG_INTERVAL="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "no_extras"), env["PYTHONPATH"]])
    return env


def _started(procs: List, count: int, deadline: float = 90.0) -> Dict[int, int]:
    pids: Dict[int, int] = {}
    end = time.monotonic() + deadline
    for proc in procs:
        while len(pids) < count and time.monotonic() < end:
            line = proc.stdout.readline()
            if not line:
                break
            line = unfold(line)
            if line.startswith("started"):
                _, rank, pid = line.split()
                pids[int(rank)] = int(pid)
                if len(procs) > 1:
                    break  # one rank per process
    return pids


def _where(env: Dict[str, str], port: int = 0) -> str:
    import subprocess

    address = ["--master-port", str(port)] if port else []
    done = subprocess.run([sys.executable, "-m", "axolotl_dist.launch", "where", *address,
                           "--timeout", "60"], env=env, capture_output=True, text=True,
                          timeout=120, cwd=str(ROOT))
    assert done.returncode == 0, (done.stdout, done.stderr)
    return done.stdout


def _assert_warned(err: str) -> None:
    """A waiting rank's first wait warning names rank 0's stack."""
    assert re.search(r"rank [12] has waited \d+ s for rank\(s\) \[0\] to finish zero_first block #1 "
                     r"at prep\.py:\d+ in <module>; where they are:\n  "
                     + RANK_0, err), err
    assert "cryptography" not in err and "withheld" not in err, err


@pytest.mark.parametrize("launcher", ["axolotl-dist", "torchrun", "env"])
def test_a_stuck_first_run_is_shown_with_its_stack_on_the_default_install(tmp_path, launcher):
    script = tmp_path / "prep.py"
    script.write_text(STUCK_FIRST)
    port = free_port()
    if launcher == "axolotl-dist":  # its own secret, recorded in the run directory
        env = _env(tmp_path, AXOLOTL_DIST_RUN_DIR=str(tmp_path / "runs"))
        procs = [start([sys.executable, "-m", "axolotl_dist.launch", "-n", "3", str(script),
                        "90"], env, cwd=tmp_path)]
    elif launcher == "torchrun":
        env = _env(tmp_path, AXOLOTL_DIST_SECRET=SECRET)
        procs = [start([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3",
                        "--master-addr", "127.0.0.1", "--master-port", str(port), str(script),
                        "90"], env, cwd=tmp_path)]
    else:  # bare env vars: rank 0's own process hosts the store
        env = _env(tmp_path, AXOLOTL_DIST_SECRET=SECRET)
        procs = [start([sys.executable, str(script), "90"],
                       dict(env, RANK=str(r), WORLD_SIZE="3", LOCAL_RANK=str(r),
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)), cwd=tmp_path)
                 for r in range(3)]
    try:
        assert len(_started(procs, 3)) == 3
        time.sleep(2.5)  # rank 0 in tokenize, the others past their first wait warning
        out = _where(env, 0 if launcher == "axolotl-dist" else port)
        if launcher == "axolotl-dist":
            os.kill(procs[0].pid, signal.SIGUSR1)
            time.sleep(6.0)  # a beat (2.5 s) and the answers' wait
    finally:
        (tmp_path / "go").write_text("")
        results = [finish(p, 90) for p in procs]
    assert all(code == 0 for code, _, _ in results), results
    assert re.search(RANK_0, out), out
    assert "cryptography" not in out and "no secret" not in out, out
    err = "".join(e for _, _, e in results)
    _assert_warned(err)
    if launcher == "axolotl-dist":
        report = err[err.index("where every rank is (SIGUSR1; the run goes on)"):]
        assert re.search(RANK_0, report), report
