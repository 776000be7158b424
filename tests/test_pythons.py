"""What differs between the Pythons users have (3.10-3.13; scripts/compat.sh --python runs the
suite on each): a script that ends without ``cleanup_distributed()`` exits cleanly on every
rank (CPython 3.12.0-3.12.2 refuse a thread started at interpreter shutdown, where the exit
hook makes its last store calls), and the test harness's forks raise no warning (3.12 and
newer warn at a fork of a process with other threads)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fixtures import ROOT, launch_script, run, run_bare_env, subprocess_env

#: A script that ends without cleanup_distributed(), as the README's quick start does, with
#: a zero_first block (its keys are deleted in the background) and a value helper.
NO_CLEANUP = '''
import axolotl_dist as ad

ad.init_distributed()
with ad.zero_first():
    rows = list(range(10))
total = ad.reduce_and_broadcast(lambda: len(rows), sum)
print(f"rank {ad.get_rank()} total {total}", flush=True)
'''


def _clean(code: int, out: str, err: str, ranks: int) -> None:
    text = out + err
    assert code == 0, text
    for r in range(ranks):
        assert f"rank {r} total {10 * ranks}" in text, text
    assert "Traceback" not in text and "Exception ignored" not in text, text


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_script_without_cleanup_exits_cleanly_under_the_launcher(tmp_path: Path, ranks):
    _clean(*launch_script(tmp_path, "no_cleanup.py", NO_CLEANUP, ranks, timeout=120), ranks)


def test_a_script_without_cleanup_exits_cleanly_with_the_store_in_rank0(tmp_path: Path):
    for code, out, err in run_bare_env(tmp_path, "no_cleanup.py", NO_CLEANUP, 2, timeout=120):
        assert code == 0 and "Traceback" not in err and "Exception ignored" not in err, err


HARNESS_TESTS = '''
import pytest

import axolotl_dist as ad
from axolotl_dist.testing import run_distributed


@pytest.mark.distributed(world_size=2)
def test_marked():
    assert ad.all_reduce_value(1) == 2


@pytest.mark.parametrize("store", ["parent", "rank0"])
def test_harness(store):
    assert run_distributed(lambda: ad.get_rank(), 3, store=store) == [0, 1, 2]
'''


@pytest.mark.skipif(sys.version_info < (3, 12),
                    reason="CPython warns at a fork of a threaded process from 3.12 on")
@pytest.mark.parametrize("xdist", [[], ["-n", "2"]], ids=["plain", "xdist"])
def test_the_harness_and_the_marker_fork_without_a_warning(tmp_path: Path, xdist):
    (tmp_path / "test_user.py").write_text(HARNESS_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = subprocess_env(tmp_path, PYTHONPATH=str(ROOT))
    env = {k: v for k, v in env.items() if not k.startswith(("PYTEST_", "CI"))}
    code, out, err = run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                          "-p", "pytest_axolotl_dist", "-W", "default", "-rA", *xdist],
                         env, 180, cwd=tmp_path)
    text = out + err
    assert code == 0, text
    assert "3 passed" in text, text
    assert "multi-threaded" not in text and "fork()" not in text, text
