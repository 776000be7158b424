"""``axolotl-dist --max-restarts``: a restart that cannot help is not tried, and every restart
line names the rank that failed (docs/launching.md, "Restarts").

A script that fails at start-up the same way twice (the same exception type and line, before
its first collective) stops after the second attempt with one line; one that fails once and
then starts, or fails the same way after its first collective, restarts as asked;
``--retry-same-failure`` restarts anyway. Under torchrun the rank itself stops its agent. A rank SIGKILLed or gone through ``os._exit`` is the
one the restart line names, not a rank that failed because of it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest

from fixtures import run, subprocess_env

pytestmark = pytest.mark.timeout(180)

HEAD = """\
import os, signal, sys
import axolotl_dist as ad
ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
open(f"attempt{ATTEMPT}-rank{os.environ['RANK']}", "w").close()
"""

SCRIPTS = {
    # the same ImportError on every attempt, before the group exists
    "import": "import no_such_module_for_the_policy\n",
    # the first attempt only: a flaky mount, say
    "transient": "if ATTEMPT == 0:\n    import no_such_module_for_the_policy\nad.init_distributed()\n"
                 "ad.barrier()\n",
    # after init, before the first collective: a model that does not fit, every time
    "after_init": "ad.init_distributed()\nraise MemoryError('CUDA out of memory (as a stand-in)')\n",
    # the same line every attempt, but after a collective: training, not start-up
    "in_training": "ad.init_distributed()\nad.barrier()\nif ad.get_rank() == 1:\n"
                   "    raise RuntimeError('loss is NaN at step 1')\nad.barrier()\n",
}


LAUNCHERS = {"axolotl-dist": [sys.executable, "-m", "axolotl_dist.launch"],
             "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone"]}


def _launch(tmp_path: Path, kind: str, ranks: int = 2, restarts: int = 3,
            extra: Tuple[str, ...] = (), launcher: str = "axolotl-dist",
            env: Optional[Dict[str, str]] = None) -> Tuple[int, str, List[str]]:
    (tmp_path / "train.py").write_text(HEAD + SCRIPTS[kind])
    code, _out, err = run([*LAUNCHERS[launcher], "--nproc-per-node", str(ranks),
                           "--max-restarts", str(restarts), *extra, "train.py"],
                          subprocess_env(tmp_path, **(env or {})), timeout=150, cwd=tmp_path)
    attempts = sorted({p.name.split("-")[0] for p in tmp_path.glob("attempt*-rank*")})
    return code, err, attempts


def _said(err: str) -> List[str]:
    return [line for line in err.splitlines() if line.startswith("axolotl-dist: attempt")]


def test_the_same_import_error_at_start_up_stops_after_the_second_attempt(tmp_path):
    code, err, attempts = _launch(tmp_path, "import")
    assert code == 1, err
    assert attempts == ["attempt0", "attempt1"], (attempts, err)
    said = _said(err)
    assert said[0].startswith("axolotl-dist: attempt 1 of 4 failed: rank "), err
    stop = [line for line in said if "not restarting" in line]
    assert len(stop) == 1, err
    assert stop[0].startswith("axolotl-dist: attempt 2 of 4 failed as attempt 1 did, before its "
                              "first collective (rank "), stop
    assert "ModuleNotFoundError at train.py:5" in stop[0]
    assert "--retry-same-failure" in stop[0]
    assert any(line.startswith("axolotl-dist: attempt 2 of 4: rank ") for line in said), err


def test_a_failure_after_init_before_the_first_collective_is_a_start_up_failure(tmp_path):
    code, err, attempts = _launch(tmp_path, "after_init", restarts=2)
    assert code == 1, err
    assert attempts == ["attempt0", "attempt1"], (attempts, err)
    assert "MemoryError at train.py:6" in err and "not restarting" in err


def test_a_transient_start_up_failure_still_restarts(tmp_path):
    code, err, attempts = _launch(tmp_path, "transient")
    assert code == 0, err
    assert attempts == ["attempt0", "attempt1"], (attempts, err)
    assert "restarting every rank (attempt 2 of 4" in err and "not restarting" not in err


def test_the_same_failure_in_training_restarts_every_time(tmp_path):
    code, err, attempts = _launch(tmp_path, "in_training", restarts=2)
    assert code == 1, err
    assert attempts == ["attempt0", "attempt1", "attempt2"], (attempts, err)
    assert "not restarting" not in err
    assert err.count("failed: rank 1 exited with code 1; restarting every rank") == 2, err


def test_retry_same_failure_restarts_anyway(tmp_path):
    code, err, attempts = _launch(tmp_path, "import", restarts=2, extra=("--retry-same-failure",))
    assert code == 1, err
    assert attempts == ["attempt0", "attempt1", "attempt2"], (attempts, err)
    assert "not restarting" not in err


KILLED = HEAD + """\
ad.init_distributed()
ad.barrier()
if ad.get_rank() == 2 and ATTEMPT == 0:
    os.kill(os.getpid(), signal.SIGKILL)
if ad.get_rank() == 1 and ATTEMPT == 1:
    os._exit(3)
ad.barrier()
"""


def test_the_restart_line_names_the_rank_that_was_killed_or_left_by_os_exit(tmp_path):
    (tmp_path / "train.py").write_text(KILLED)
    code, _, err = run([sys.executable, "-m", "axolotl_dist.launch", "-n", "3",
                        "--max-restarts", "2", "train.py"], subprocess_env(tmp_path),
                       timeout=150, cwd=tmp_path)
    assert code == 0, err
    said = _said(err)
    assert said[0] == ("axolotl-dist: attempt 1 of 3 failed: rank 2 was killed by SIGKILL; "
                       "restarting every rank (attempt 2 of 3, --max-restarts 2)"), err
    assert said[1] == ("axolotl-dist: attempt 2 of 3 failed: rank 1 exited with code 3 without "
                       "finishing its script (os._exit?); restarting every rank (attempt 3 of 3, "
                       "--max-restarts 2)"), err


# ---- torchrun: the rank stops its agent ----------------------------------------------------

TORCHRUN_STOP = ("this attempt failed as the attempt before did, before its first collective "
                 "(ModuleNotFoundError at train.py:5): stopping the launcher's restarts (pid ")


def test_under_torchrun_the_same_import_error_stops_after_the_second_attempt(tmp_path):
    code, err, attempts = _launch(tmp_path, "import", launcher="torchrun")
    assert code != 0, err
    assert attempts == ["attempt0", "attempt1"], (attempts, err)
    assert 1 <= err.count(TORCHRUN_STOP) <= 2, err  # a line per local rank that saw it
    assert "ERROR axolotl_dist: [rank " in err


def test_under_torchrun_a_transient_start_up_failure_still_restarts(tmp_path):
    code, err, attempts = _launch(tmp_path, "transient", launcher="torchrun")
    assert code == 0, err
    assert attempts == ["attempt0", "attempt1"], (attempts, err)
    assert "stopping the launcher's restarts" not in err


def test_under_torchrun_the_retry_variable_restarts_anyway(tmp_path):
    code, err, attempts = _launch(tmp_path, "import", restarts=2, launcher="torchrun",
                                  env={"AXOLOTL_DIST_RETRY_SAME_FAILURE": "1"})
    assert code != 0, err
    assert attempts == ["attempt0", "attempt1", "attempt2"], (attempts, err)
    assert "stopping the launcher's restarts" not in err
