"""Shared pytest setup: rank tests run under axolotl_dist.testing (forked gloo ranks)."""

import os
import zlib

import pytest

# The c10d store server (hosted in this process by the harness) reverse-resolves each client
# address; where no resolver answers that for 127.0.0.1, glibc waits 5 s per try and a rank's
# rendezvous stalls. Bound the wait before the resolver is first used.
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")

# The ranks are forked from this process, and a process forked after CUDA was initialized
# cannot use it: ``torch.cuda.is_available()`` initializes it unless asked to use NVML (the
# kit's own checks do; a library imported by a test might not).
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

# Every rank, launcher and script the tests start imports the package: let them keep its
# compiled bytecode, as a user's install does, instead of compiling ~21,000 lines again in each
# of several hundred processes (about 10% of the suite's CPU where the shell that started pytest
# sets PYTHONDONTWRITEBYTECODE).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# Tests must not inherit a launcher environment (the library's own list) or debug mode from
# whatever started pytest.
from axolotl_dist.env import LAUNCHER_ENV_VARS  # noqa: E402

for _name in (*LAUNCHER_ENV_VARS, "AXOLOTL_DIST_DEBUG"):
    os.environ.pop(_name, None)

# The kit's pytest plugin (@pytest.mark.distributed): an install of this checkout registers it
# (setup.cfg's pytest11 entry point, of the same name, so it is never registered twice); a
# checkout tested from PYTHONPATH beside another install takes it from here.
pytest_plugins = ["pytest_axolotl_dist"]


@pytest.fixture(autouse=True, scope="session")
def _session_run_dir(tmp_path_factory):
    """The runs the tests start record themselves in this session's own run directory, not
    in the user's (``axolotl-dist where`` without an address reads it); a test that lists
    runs points ``AXOLOTL_DIST_RUN_DIR`` at a directory of its own."""
    before = os.environ.get("AXOLOTL_DIST_RUN_DIR")
    os.environ["AXOLOTL_DIST_RUN_DIR"] = str(tmp_path_factory.mktemp("runs"))
    yield
    if before is None:
        os.environ.pop("AXOLOTL_DIST_RUN_DIR", None)
    else:
        os.environ["AXOLOTL_DIST_RUN_DIR"] = before


@pytest.fixture(params=["parent", "rank0"], ids=lambda s: f"store-{s}")
def store(request):
    """Where the c10d store lives: the test process (like torchrun's agent) or rank 0's own
    process (bare env vars, srun, mpirun); every fault test runs with both."""
    return request.param


@pytest.fixture(params=[1, 2, 3], ids=lambda n: f"ws{n}")
def world_size(request):
    """World sizes every multi-process behaviour is checked at (3 catches uneven splits)."""
    return request.param


#: Modules whose tests start the most processes (each 5-20 s): run first, so that no worker is
#: left finishing one alone at the end. (The longest waits, the store fuzz's and the shared
#: box's bounds of up to 50 s, are shuffled among the rest: run first together, they left a
#: quarter of the cores idle for a minute.)
_FIRST = ("test_hf.py", "test_examples.py", "test_launch.py")


def _order(item, trees: tuple) -> tuple:
    """Where a test runs in the suite: :data:`_FIRST`'s modules, then the other integration
    tests, then the unit trees (hundreds of tests of milliseconds, to even out the end). Within
    each part the order is a fixed shuffle: a module's tests are alike (all waiting out a peer's
    death, or all launching), so in file order pytest-xdist's workers wait together and leave
    the cores idle (13 % of a run), or all launch at once. Tests of one ``xdist_group`` stay
    together (the launch they share is made once)."""
    part = 2 if item.nodeid.startswith(trees) else 0 if item.path.name in _FIRST else 1
    group = item.get_closest_marker("xdist_group")
    key = f"group:{group.args[0]}" if group and group.args else item.nodeid
    return part, zlib.crc32(key.encode())


def _is_quick(nodeid: str, trees: tuple, entries: tuple) -> bool:
    """Whether a test is in the quick set (``tests/quick.py``): in one of its unit ``trees``,
    or named by one of its ``entries`` (a file, a test, or one parametrization of it)."""
    return nodeid.startswith(trees) or any(
        nodeid == entry or nodeid.split("[")[0] == entry or nodeid.startswith(entry + "::")
        for entry in entries)


def pytest_collection_modifyitems(items):
    from quick import INTEGRATION, STATIC, UNIT_TREES

    trees = tuple(tree + "/" for tree in UNIT_TREES)

    items.sort(key=lambda item: _order(item, trees))  # stable: a group's order stays
    for item in items:
        if _is_quick(item.nodeid, trees, (*INTEGRATION, *STATIC)):
            item.add_marker(pytest.mark.quick)


#: ``AXOLOTL_DIST_TEST_CPU=<file>``: each test's CPU-seconds (its own process and every child
#: it waited for: the harness's forked ranks, launchers and their ranks) appended to the file
#: as ``<seconds> <test id>``, for the suite's profile (docs/performance.md, "The test suite").
_CPU_FILE = os.environ.get("AXOLOTL_DIST_TEST_CPU")


def _cpu_seconds() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not _CPU_FILE:
        yield
        return
    before = _cpu_seconds()
    yield
    with open(_CPU_FILE, "a") as fh:
        fh.write(f"{_cpu_seconds() - before:.2f} {item.nodeid}\n")
