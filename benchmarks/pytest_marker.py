"""What ``@pytest.mark.distributed`` costs per test, next to a ``run_distributed`` call.

Run: ``python benchmarks/pytest_marker.py [--tests 30] [--world-size 2]``. One pytest session,
in this process, runs a generated file of interleaved pairs: a marked test whose body is one
``all_reduce_value`` on every rank, and an unmarked test that calls ``run_distributed`` on the
same body and times that call itself. It prints the medians of:

* the marked test's call (the plugin's whole work: forking, running, the account),
* the ``run_distributed`` call inside the unmarked test,
* each test's setup + call + teardown, as pytest reports them,

and the ratios marked / ``run_distributed`` (docs/testing.md, "pytest: the distributed
marker"; the target is at most 1.5x).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections import defaultdict
from typing import Any, Dict, List

# this checkout's axolotl_dist and plugin, not whichever one is installed
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import pytest  # noqa: E402

PAIR = '''
@pytest.mark.distributed(world_size={n})
def test_marked_{i}():
    assert ad.all_reduce_value(1) == {n}


def test_wrapped_{i}():
    start = time.perf_counter()
    assert run_distributed(body, {n}) == [{n}] * {n}
    CALLS.append(time.perf_counter() - start)
'''

HEAD = '''
import time

import pytest

import axolotl_dist as ad
from axolotl_dist.testing import run_distributed

CALLS = []


def body():
    return ad.all_reduce_value(1)
'''


class _Durations:
    """Each test's phase durations, as pytest reports them."""

    def __init__(self) -> None:
        self.phases: Dict[str, Dict[str, float]] = defaultdict(dict)

    def pytest_runtest_logreport(self, report: Any) -> None:
        self.phases[report.nodeid.split("::")[-1]][report.when] = report.duration


def _median_ms(values: List[float]) -> str:
    return f"{statistics.median(values) * 1000:7.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tests", type=int, default=30, help="pairs of tests (default 30)")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="pytest-marker-bench-")
    path = os.path.join(work, "test_bench.py")
    with open(path, "w") as fh:
        fh.write(HEAD + "".join(PAIR.format(i=i, n=args.world_size) for i in range(args.tests)))
    durations = _Durations()
    code = pytest.main([path, "-q", "-p", "pytest_axolotl_dist", "-p", "no:cacheprovider",
                        "--rootdir", work], plugins=[durations])
    if code != 0:
        raise SystemExit(f"the benchmark's tests failed (pytest exit {code})")
    bench = sys.modules["test_bench"]
    marked = [p for name, p in durations.phases.items() if name.startswith("test_marked")]
    wrapped = [p for name, p in durations.phases.items() if name.startswith("test_wrapped")]
    calls = list(bench.CALLS)  # type: ignore[attr-defined]
    marked_call = [p["call"] for p in marked]
    marked_all = [sum(p.values()) for p in marked]
    wrapped_all = [sum(p.values()) for p in wrapped]
    print(f"{args.tests} tests of each kind, {args.world_size} gloo ranks, pytest "
          f"{pytest.__version__}, {os.cpu_count()} CPUs")
    print(f"  marked test, call          {_median_ms(marked_call)}")
    print(f"  run_distributed call       {_median_ms(calls)}")
    print(f"  marked test, whole         {_median_ms(marked_all)}")
    print(f"  run_distributed test, whole{_median_ms(wrapped_all)}")
    print(f"ratio marked call / run_distributed call: "
          f"{statistics.median(marked_call) / statistics.median(calls):.2f}x")
    print(f"ratio marked test / run_distributed test: "
          f"{statistics.median(marked_all) / statistics.median(wrapped_all):.2f}x")


if __name__ == "__main__":
    main()
