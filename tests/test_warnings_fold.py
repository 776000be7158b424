"""Python warnings raised alike on several ranks are printed once, by rank 0, naming the
ranks (issue #35), under launchers that do not fold output themselves: real ``torchrun``
(its agent hosts the store) and bare env vars (rank 0's process hosts it), real gloo.
``AXOLOTL_DIST_FOLD=0`` and a one-rank run print as Python does. See docs/launching.md,
"Under other launchers"."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import List

import pytest

from fixtures import run, run_bare_env, subprocess_env

TIMEOUT = 120
#: A folded warning's line: the time, the level, the logger, the ranks, Python's own line.
LINE = r"^\d\d:\d\d:\d\d WARNING py\.warnings: \[{ranks}\] \S*{name}:\d+: UserWarning: {msg}$"

EVERY_RANK = """
import warnings
import axolotl_dist as ad
ad.init_distributed()
warnings.warn("same everywhere")
ad.barrier()
"""


def _torchrun(tmp_path: Path, script: str, ranks: int, **env: str) -> str:
    """Run ``script`` as w.py under ``torchrun --standalone``: its whole output (it must
    succeed)."""
    (tmp_path / "w.py").write_text(script)
    code, out, err = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", str(ranks), "w.py"],
                         subprocess_env(tmp_path, **env), TIMEOUT, cwd=tmp_path)
    assert code == 0, out + err
    return out + err


def _lines(output: str, text: str) -> List[str]:
    return [line for line in output.splitlines() if text in line]


def _folded(output: str, ranks: str, msg: str, source: str) -> None:
    """``msg`` is in ``output`` once: one kit line naming ``ranks``, then its source line."""
    found = _lines(output, f"UserWarning: {msg}")
    assert len(found) == 1, output
    assert re.match(LINE.format(ranks=re.escape(ranks), name=r"w\.py", msg=re.escape(msg)),
                    found[0]), output
    lines = output.splitlines()
    assert lines[lines.index(found[0]) + 1] == f"  {source}", output
    assert len(_lines(output, source)) == 1, output


#: One launch for the checks of the same path (torchrun, 4 ranks, folding on): a warning every
#: rank raises, one only rank 2 raises, one per rank that differs, one raised before init.
ALIKE_AND_NOT = """
import warnings
import axolotl_dist as ad
warnings.warn("before init")
ad.init_distributed()
warnings.warn("same everywhere")
if ad.get_rank() == 2:
    warnings.warn("only here")
warnings.warn(f"w{ad.get_rank()}")
ad.barrier()
"""


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> str:
    """The output of :data:`ALIKE_AND_NOT` under torchrun on 4 ranks, launched once for the
    module's checks of it (``xdist_group``: on one worker under ``--dist loadgroup``)."""
    return _torchrun(tmp_path_factory.mktemp("four_ranks"), ALIKE_AND_NOT, 4)


@pytest.mark.xdist_group("warnings_fold_four_ranks")
def test_a_warning_every_rank_raises_is_one_line_under_torchrun(four_ranks):
    _folded(four_ranks, "ranks 0-3", "same everywhere", 'warnings.warn("same everywhere")')


@pytest.mark.xdist_group("warnings_fold_four_ranks")
def test_a_warning_of_one_rank_names_that_rank(four_ranks):
    _folded(four_ranks, "rank 2", "only here", 'warnings.warn("only here")')


@pytest.mark.xdist_group("warnings_fold_four_ranks")
def test_different_warnings_are_each_printed_once_with_their_rank(four_ranks):
    for r in range(4):
        lines = _lines(four_ranks, f"UserWarning: w{r}")
        assert len(lines) == 1, four_ranks
        assert re.match(LINE.format(ranks=f"rank {r}", name=r"w\.py", msg=f"w{r}"), lines[0])
    assert len(_lines(four_ranks, 'warnings.warn(f"w{ad.get_rank()}")')) == 4, four_ranks


@pytest.mark.xdist_group("warnings_fold_four_ranks")
def test_a_warning_raised_before_init_is_folded_too(four_ranks):
    _folded(four_ranks, "ranks 0-3", "before init", 'warnings.warn("before init")')


def test_fold_off_prints_every_ranks_copy_as_python_does(tmp_path):
    output = _torchrun(tmp_path, EVERY_RANK, 4, AXOLOTL_DIST_FOLD="0")
    plain = f"{tmp_path / 'w.py'}:5: UserWarning: same everywhere"
    assert _lines(output, "UserWarning: same everywhere") == [plain] * 4, output
    assert "py.warnings" not in output, output


def test_three_ranks_with_bare_env_vars_and_the_store_in_rank_0(tmp_path):
    results = run_bare_env(tmp_path, "w.py", EVERY_RANK, 3, TIMEOUT)
    output = "".join(out + err for _, out, err in results)
    assert [code for code, _, _ in results] == [0, 0, 0], output
    _folded(output, "ranks 0-2", "same everywhere", 'warnings.warn("same everywhere")')
    assert "same everywhere" in results[0][2], output  # rank 0 printed it


def test_one_rank_prints_the_warning_as_python_does(tmp_path):
    output = _torchrun(tmp_path, EVERY_RANK, 1)
    python = f"{tmp_path / 'w.py'}:5: UserWarning: same everywhere\n" \
             f"  warnings.warn(\"same everywhere\")\n"
    assert output.count(python) == 1 and output.count("same everywhere") == 2, output
    assert "py.warnings" not in output, output


def test_a_warning_after_rank_0_ended_is_printed_by_its_rank(tmp_path):
    # rank 0 reads no warning after its exit: a rank that raises one later prints it itself
    done = tmp_path / "rank0-ended"
    script = f"""
import atexit, os, time, warnings
if os.environ["RANK"] == "0":  # registered first, so it runs after the kit's exit hooks
    atexit.register(lambda: open({str(done)!r}, "w").close())
import axolotl_dist as ad
ad.init_distributed()
ad.barrier()
if ad.get_rank() == 1:
    deadline = time.monotonic() + 60
    while not os.path.exists({str(done)!r}) and time.monotonic() < deadline:
        time.sleep(0.05)
    warnings.warn("after rank 0")
"""
    output = _torchrun(tmp_path, script, 2)
    plain = f"{tmp_path / 'w.py'}:12: UserWarning: after rank 0"
    assert _lines(output, "UserWarning: after rank 0") == [plain], output


def test_with_logging_set_up_the_line_goes_to_the_py_warnings_logger(tmp_path):
    script = """
import logging, warnings
import axolotl_dist as ad
logging.basicConfig(format="LOGGED %(name)s %(levelname)s %(message)s")
ad.init_distributed()
warnings.warn("same everywhere")
ad.barrier()
"""
    output = _torchrun(tmp_path, script, 4)
    found = _lines(output, "UserWarning: same everywhere")
    assert found == [f"LOGGED py.warnings WARNING [ranks 0-3] {tmp_path / 'w.py'}:6: "
                     "UserWarning: same everywhere"], output


def test_the_judge_still_finds_a_deadlock_after_warnings(tmp_path):
    # the published warnings' count shares axd/waiters with the long waits: the judge reads
    # only its waits' part
    script = """
import warnings
import axolotl_dist as ad
ad.init_distributed()
warnings.warn("same everywhere")
ad.barrier()
if ad.is_main_process():
    ad.barrier()
ad.compute_and_broadcast(lambda: 42)
"""
    (tmp_path / "w.py").write_text(script)
    code, out, err = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", "w.py"], subprocess_env(tmp_path), TIMEOUT,
                         cwd=tmp_path)
    output = out + err
    assert code != 0, output
    for r in range(2):
        assert re.search(rf"^\[rank{r}\]: axolotl_dist\.errors\.CollectiveMismatchError: "
                         rf"rank {r}'s \w+ at w\.py:\d+ .* can never complete", output,
                         re.M), output
    _folded(output, "ranks 0, 1", "same everywhere", 'warnings.warn("same everywhere")')
