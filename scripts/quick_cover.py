#!/usr/bin/env python
"""Measure which modules of the package each integration test of the quick set goes through.

The quick set (``python -m pytest -m quick``, docs/testing.md, "The quick set") is every unit
test plus the integration tests listed in ``tests/quick.py`` (``INTEGRATION``). This script runs
each of those integration tests alone under coverage.py, following the harness's forked ranks,
``os._exit`` and the subprocesses a test starts (launchers, their ranks, scripts under bare env
vars), and counts a module as gone through when a line inside one of its functions ran:
importing a module runs its definitions, which is not going through it (a module without
functions counts once imported). It writes the result to ``tests/quick_map.py``
(``GOES_THROUGH``: module -> the first quick tests that go through it) and prints the modules
no quick test goes through. ``tests/test_structure.py`` fails while a module of the package is missing
from that map, so a new module needs a quick test (add one to ``INTEGRATION``, run this script).

usage: python scripts/quick_cover.py [-j JOBS] [TEST_ID ...]
  TEST_ID: measure only these and keep what the map says of the others (default: every test of
  INTEGRATION, about 5 minutes at -j 2; the map keeps the first 3 tests per module, so only
  that whole run is the last word); needs ``coverage`` (``pip install coverage``: 7.10
  or newer, for its fork and subprocess patches). A test that fails is said and counts for
  nothing; the script then exits 1.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Sequence, Set

ROOT = Path(__file__).resolve().parents[1]
MAP_FILE = ROOT / "tests" / "quick_map.py"
TIMEOUT_S = 600
#: Tests kept per module in the map: the first of INTEGRATION's order (the cheapest first).
KEPT = 3

_CONFIG = """[run]
branch = False
parallel = True
patch = _exit, fork, subprocess
data_file = {data}
source_pkgs = axolotl_dist, pytest_axolotl_dist
"""


def package_modules() -> Dict[str, Path]:
    """Every module of the package (the pytest plugin included), by its path in the checkout."""
    paths = [ROOT / "pytest_axolotl_dist.py", *(ROOT / "axolotl_dist").rglob("*.py")]
    return dict(sorted((path.relative_to(ROOT).as_posix(), path) for path in paths))


def function_lines(path: Path) -> Set[int]:
    """The lines of the statements inside the module's functions (methods included)."""
    lines: Set[int] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for stmt in node.body:
                for inner in ast.walk(stmt):
                    if isinstance(inner, ast.stmt):
                        lines.add(inner.lineno)
    return lines


def _measure(test_id: str, workdir: Path, inside: Dict[str, Set[int]]) -> Set[str]:
    """Run one test under coverage; the modules it went through (``inside``: each module's
    :func:`function_lines`, by its path)."""
    workdir.mkdir(parents=True)
    rc_file = workdir / ".coveragerc"
    rc_file.write_text(_CONFIG.format(data=workdir / ".coverage"))
    env = dict(os.environ, COVERAGE_RCFILE=str(rc_file))
    cmd = [sys.executable, "-m", "coverage", "run", "--rcfile", str(rc_file), "-m", "pytest",
           "-q", "-p", "no:xdist", "-p", "no:cacheprovider", test_id]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    if done.returncode != 0:
        print(f"{test_id} failed under coverage (it counts for nothing):\n{done.stdout[-3000:]}")
        return set()
    subprocess.run([sys.executable, "-m", "coverage", "combine", "--rcfile", str(rc_file), "-q"],
                   cwd=workdir, env=env, check=True, capture_output=True)
    from coverage import CoverageData

    data = CoverageData(str(workdir / ".coverage"))
    data.read()
    by_path = {str((ROOT / name).resolve()): name for name in inside}
    seen: Set[str] = set()
    for measured in data.measured_files():
        name = by_path.get(str(Path(measured).resolve()))
        if name is None:
            continue
        ran = set(data.lines(measured) or ())
        if ran & inside[name] or (ran and not inside[name]):
            seen.add(name)
    return seen


def _write_map(goes_through: Dict[str, List[str]]) -> None:
    lines = ['"""Which quick tests go through each module of the package: written by',
             "scripts/quick_cover.py (measured with coverage.py), read by tests/test_structure.py.",
             'Do not edit: add a test to tests/quick.py and run the script."""', "",
             "GOES_THROUGH = {"]
    for module, tests in goes_through.items():
        lines.append(f"    {module!r}: (")
        lines.extend(f"        {test!r}," for test in tests)
        lines.append("    ),")
    lines.append("}")
    MAP_FILE.write_text("\n".join(lines) + "\n")


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-j", "--jobs", type=int, default=2)
    parser.add_argument("tests", nargs="*")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    from quick import INTEGRATION  # noqa: E402 - the tests' own list

    chosen = args.tests or list(INTEGRATION)
    unknown = [test for test in chosen if test not in INTEGRATION]
    if unknown:
        parser.error(f"not in tests/quick.py's INTEGRATION: {unknown}")
    inside = {name: function_lines(path) for name, path in package_modules().items()}
    with tempfile.TemporaryDirectory(prefix="quick_cover_") as tmp:
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            futures = {test: pool.submit(_measure, test, Path(tmp) / str(i), inside)
                       for i, test in enumerate(chosen)}
            seen = {test: future.result() for test, future in futures.items()}
    for test, modules in seen.items():
        print(f"{len(modules):3d} modules  {test}")
    seen = {**_measured_before(INTEGRATION), **seen}
    goes_through = {module: [t for t in INTEGRATION if module in seen.get(t, ())][:KEPT]
                    for module in inside}
    _write_map({m: t for m, t in goes_through.items() if t})
    print(f"wrote {MAP_FILE.relative_to(ROOT)}")
    missing = [module for module, tests in goes_through.items() if not tests]
    for module in missing:
        print(f"no quick test goes through {module}")
    return 1 if missing or not all(seen[t] for t in chosen) else 0


def _measured_before(tests: Sequence[str]) -> Dict[str, Set[str]]:
    """What the map says each of ``tests`` goes through (nothing where there is no map)."""
    if not MAP_FILE.exists():
        return {}
    from quick_map import GOES_THROUGH  # noqa: E402 - written by this script

    return {test: {m for m, listed in GOES_THROUGH.items() if test in listed} for test in tests}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
