"""torchrun's own summary names the rank whose exception started a failure (issue #45).

torch's elastic agent names as "Root Cause" the failure with the smallest timestamp, the first
one it found on a tie (``ChildFailedError.get_first_failure``), and stamps a failure without an
error file with the second it saw the process end. A rank that raised ``RankFailedError``
because another failed waits, under the agent, until the agent stops it
(``teardown._await_agent_stop``): the failing rank is seen first, with its own exit code, and
is never SIGTERMed. Each case runs the real launcher with real gloo ranks.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import List, Tuple

import pytest

from fixtures import free_port, run, subprocess_env

pytestmark = pytest.mark.timeout(150)

LAUNCH_TIMEOUT = 120  # below pytest-timeout's, so a stuck launch is reported with its output

BEFORE_BARRIER = """\
import axolotl_dist as ad
ad.init_distributed()
if ad.get_rank() == 1:
    raise ValueError("boom from rank 1")
ad.barrier()
"""

IN_ZERO_FIRST = """\
import axolotl_dist as ad
ad.init_distributed()
with ad.zero_first():
    if ad.get_rank() == 0:
        raise ValueError("boom from rank 0")
ad.barrier()
"""

IN_HELPER = """\
import axolotl_dist as ad
ad.init_distributed()
def f():
    raise ValueError("boom from rank %d" % ad.get_rank())
ad.compute_and_broadcast(lambda: f(), src=2)  # f runs on rank 2 only
"""

#: (script, ranks, the rank that raises)
CASES = {"before_barrier": (BEFORE_BARRIER, 2, 1), "in_zero_first": (IN_ZERO_FIRST, 2, 0),
         "in_helper": (IN_HELPER, 3, 2)}


def _torchrun(script: str, n: int) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            str(n), script]


def _accelerate(script: str, n: int) -> List[str]:
    """``--multi_gpu`` starts ``n`` processes through torch's elastic agent even without a GPU
    (``--cpu`` starts one); the rest are the values a config file would give."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
            str(n), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), script]


def _summary(err: str) -> Tuple[List[Tuple[int, int]], Tuple[int, int]]:
    """From torchrun's ``ChildFailedError`` table: ``(rank, exitcode)`` of every failure listed,
    and of the one under "Root Cause"."""
    table = err[err.index("ChildFailedError"):]
    listed = [(int(r), int(c)) for r, c in
              re.findall(r"rank\s*: (\d+) \(local_rank: \d+\)\n\s*exitcode\s*: (-?\d+)", table)]
    root = table[table.index("Root Cause"):]
    found = re.search(r"rank\s*: (\d+) \(local_rank: \d+\)\n\s*exitcode\s*: (-?\d+)", root)
    assert found, table
    return listed, (int(found.group(1)), int(found.group(2)))


def _check(cmd: List[str], n: int, failing: int, tmp_path: Path) -> None:
    code, out, err = run(cmd, subprocess_env(tmp_path), LAUNCH_TIMEOUT, cwd=tmp_path)
    assert code == 1, err[-3000:]
    listed, root = _summary(err)
    assert root == (failing, 1), err[-3000:]
    assert (failing, -15) not in listed, err[-3000:]  # never stopped before it ended
    assert len(listed) == n, err[-3000:]  # the relaying ranks are listed, as "Other Failures"
    output = out + err
    for rank in range(n):  # the kit's own account, on every rank, is unchanged
        if rank != failing:
            assert re.search(rf"\[(rank{rank}|ranks [0-9, ]*{rank}[0-9, ]*)\]: "
                             rf"axolotl_dist\.errors\.RankFailedError.*rank {failing} failed",
                             output), output[-3000:]


@pytest.mark.parametrize("case", sorted(CASES))
def test_torchrun_root_cause_is_the_failing_rank(case: str, tmp_path: Path) -> None:
    script, n, failing = CASES[case]
    (tmp_path / "s.py").write_text(script)
    _check(_torchrun("s.py", n), n, failing, tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="needs accelerate")
@pytest.mark.parametrize("case", sorted(CASES))
def test_accelerate_launch_root_cause_is_the_failing_rank(case: str, tmp_path: Path) -> None:
    script, n, failing = CASES[case]
    (tmp_path / "s.py").write_text(script)
    _check(_accelerate("s.py", n), n, failing, tmp_path)
