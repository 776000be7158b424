"""The pytest plugin, as a user meets it: pytest runs, in a process of its own, a test file
written only against the documented marker (docs/testing.md, "pytest: the distributed
marker"), with the plugin loaded through its ``pytest11`` entry point as an install declares it.
"""

from __future__ import annotations

import configparser
import json
import re
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List, Tuple

import pytest

from fixtures import ROOT, run, subprocess_env

#: What a user writes. The hang is rank 0 asleep before a barrier rank 1 waits in; the test
#: after it finds the hung ranks gone. ``TESTS_PID`` is the pytest process's own.
USER_TESTS = '''
import os
import time

import pytest

import axolotl_dist as ad

TESTS_PID = os.getpid()


@pytest.mark.distributed(world_size=2)
def test_two_ranks_share_tmp_path(tmp_path):
    assert os.getpid() != TESTS_PID
    (tmp_path / f"rank{ad.get_rank()}").write_text(str(os.getpid()))
    ad.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0", "rank1"]


@pytest.mark.distributed(world_size=[1, 2, 3])
def test_sizes():
    assert ad.all_reduce_value(ad.get_rank() + 1) == sum(range(1, ad.get_world_size() + 1))


@pytest.mark.distributed(world_size=2, store="rank0")
def test_rank1_fails():
    ad.barrier()
    assert ad.get_rank() != 1, "RANK-ONE-" + "SAYS-NO"
    ad.barrier()


@pytest.mark.distributed(world_size=2, timeout=12)
def test_rank0_hangs(tmp_path_factory):
    pids = tmp_path_factory.getbasetemp() / "hung"
    pids.mkdir(exist_ok=True)
    (pids / str(ad.get_rank())).write_text(str(os.getpid()))
    if ad.get_rank() == 0:
        time.sleep(3600)
    ad.barrier()


@pytest.mark.distributed(world_size=2)
def test_after_the_hang(tmp_path_factory):
    pids = tmp_path_factory.getbasetemp() / "hung"
    for f in pids.iterdir() if pids.exists() else ():
        assert not os.path.exists(f"/proc/{f.read_text()}"), f"rank {f.name} still there"
    ad.barrier()


@pytest.mark.distributed(world_size=2)
def test_skipped_everywhere():
    pytest.skip("NO-GPU-" + "HERE")


def test_unmarked():
    assert os.getpid() == TESTS_PID and "RANK" not in os.environ
'''

#: The line of ``USER_TESTS`` a line that starts with ``text`` has.
def _line(text: str) -> int:
    return next(n for n, line in enumerate(USER_TESTS.splitlines(), 1)
                if line.strip().startswith(text))


def _entry_point() -> Tuple[str, str]:
    """setup.cfg's ``pytest11`` entry point: ``(name, module)``."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    [line] = [x for x in cfg["options.entry_points"]["pytest11"].splitlines() if x.strip()]
    name, _, module = (s.strip() for s in line.partition("="))
    return name, module


def _installed(site: Path) -> None:
    """A distribution in ``site`` that declares setup.cfg's ``pytest11`` entry point, as pip
    records it: pytest finds the plugin through ``importlib.metadata`` as in an install."""
    info = site / "axolotl_dist_plugin_check-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: axolotl-dist-plugin-check\n"
                                   "Version: 0\n")
    name, module = _entry_point()
    (info / "entry_points.txt").write_text(f"[pytest11]\n{name} = {module}\n")


def _pytest(tmp_path: Path, *args: str, tests: str = USER_TESTS,
            timeout: float = 150) -> Tuple[int, str, float]:
    """pytest on ``tests`` (``test_user.py``) in a directory of its own: exit code, output,
    seconds."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    (work / "test_user.py").write_text(tests)
    (work / "pytest.ini").write_text("[pytest]\n")
    _installed(tmp_path / "site")
    env = subprocess_env(tmp_path, PYTHONPATH=f"{ROOT}:{tmp_path / 'site'}")
    for name in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD",
                 "BUILD_NUMBER"):
        env.pop(name, None)
    # as on CI, where pytest's short summary prints a failure's message whole, not cut
    env["CI"] = "true"
    env = {k: v for k, v in env.items() if not k.startswith("PYTEST_XDIST")}
    start = time.monotonic()
    code, out, err = run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA",
                          "--junitxml", str(work / "report.xml"), *args], env, timeout,
                         cwd=work)
    return code, out + err, time.monotonic() - start


def _failures(out: str) -> str:
    """The FAILURES section of pytest's output: the accounts of failed tests."""
    return out.split(" FAILURES ", 1)[1].split(" short test summary info ", 1)[0]


def _messages(tmp_path: Path) -> Dict[str, str]:
    """Each failed test's ``message``, from the run's JUnit report."""
    return {case.get("name", ""): failure.get("message", "")
            for case in ET.parse(tmp_path / "work" / "report.xml").getroot().iter("testcase")
            for failure in case.iter("failure")}


def _outcomes(tmp_path: Path) -> Dict[str, str]:
    """Each test's outcome, from the run's JUnit report: passed, failed, skipped, error."""
    found = {}
    for case in ET.parse(tmp_path / "work" / "report.xml").getroot().iter("testcase"):
        kinds = [c.tag for c in case if c.tag in ("failure", "skipped", "error")]
        found[case.get("name", "")] = {"failure": "failed"}.get(kinds[0], kinds[0]) \
            if kinds else "passed"
    return found


def _seconds(tmp_path: Path, name: str) -> float:
    for case in ET.parse(tmp_path / "work" / "report.xml").getroot().iter("testcase"):
        if case.get("name") == name:
            return float(case.get("time", "nan"))
    raise AssertionError(f"no test {name}")


EXPECTED = {
    "test_two_ranks_share_tmp_path": "passed",
    "test_sizes[ranks1]": "passed",
    "test_sizes[ranks2]": "passed",
    "test_sizes[ranks3]": "passed",
    "test_rank1_fails": "failed",
    "test_skipped_everywhere": "skipped",
    "test_unmarked": "passed",
}


#: Every rank asks the session's base directory itself (lazily, after the fork).
ONE_BASE = '''
import pytest

import axolotl_dist as ad


@pytest.mark.distributed(world_size=4)
def test_one_base(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    (base / f"rank{ad.get_rank()}").write_text("here")
    ad.barrier()
    assert sorted(p.name for p in base.iterdir() if p.name.startswith("rank")) == [
        "rank0", "rank1", "rank2", "rank3"]
'''


@pytest.mark.parametrize("xdist", [(), ("-n", "2")], ids=["plain", "xdist"])
def test_every_rank_gets_the_one_base_directory_of_the_session(tmp_path, xdist):
    # it was made lazily in each rank: without xdist four numbered directories, one per rank;
    # under xdist pytest empties the given one and makes it again, so ranks removed each
    # other's files or failed to make it (FileExistsError)
    code, out, _ = _pytest(tmp_path, *xdist, tests=ONE_BASE, timeout=120)
    assert code == 0, out
    assert _outcomes(tmp_path) == {"test_one_base": "passed"}, out


def test_marked_tests_run_on_their_ranks_and_fail_with_one_account(tmp_path):
    code, out, _ = _pytest(tmp_path, "-k", "not hang")
    assert code == 1, out
    assert _outcomes(tmp_path) == EXPECTED, out
    # the failing rank's assertion, rewritten by pytest, once; the rank it stopped, one line
    assert _failures(out).count("RANK-ONE-SAYS-NO") == 1, out
    # the short summary says it in one line, as pytest's own failures
    assert re.search(r"^FAILED test_user.py::test_rank1_fails - rank 1 of 2 failed: "
                     r"AssertionError: RANK-ONE-SAYS-NO$", out, re.M), out
    assert out.count("RANK-ONE-SAYS-NO") == 2, out
    assert _messages(tmp_path)["test_rank1_fails"] == \
        "rank 1 of 2 failed: AssertionError: RANK-ONE-SAYS-NO", out
    assert "rank 1 of 2 failed (AssertionError):" in out, out
    assert re.search(rf"^E +AssertionError: RANK-ONE-SAYS-NO\nE +assert 1 != 1$", out, re.M), out
    assert f"test_user.py:{_line('assert ad.get_rank() != 1')}: AssertionError" in out, out
    assert re.search(r"^rank 0: failed because rank 1 did \(RankFailedError in barrier at "
                     rf"test_user.py:{_line('assert ad.get_rank() != 1') + 1}\)$", out, re.M), out
    # the skip is the test's, at its own line (not the plugin's)
    skip = _line("def test_skipped_everywhere")  # the def's line or its decorator's
    assert re.search(rf"^SKIPPED \[1\] test_user\.py:({skip - 1}|{skip}): "
                     r"NO-GPU-HERE \(ranks 0, 1\)$", out, re.M), out


def test_a_hang_fails_at_its_timeout_saying_where_each_rank_is(tmp_path):
    code, out, _ = _pytest(tmp_path, "-k", "hang")
    assert code == 1, out
    assert _outcomes(tmp_path) == {"test_rank0_hangs": "failed",
                                   "test_after_the_hang": "passed"}, out
    assert _seconds(tmp_path, "test_rank0_hangs") < 20, out
    sleep = _line("time.sleep(3600)")
    barrier = sleep + 1  # rank 1's
    assert "timed out: ranks 0, 1 of 2 still running after 12 s (the marker's timeout=12); " \
           "where each was, before every rank was killed:" in out, out
    assert re.search(r"^FAILED test_user.py::test_rank0_hangs - timed out: ranks 0, 1 of 2 still "
                     r"running after 12 s \(the marker's timeout=12\)$", out, re.M), out
    # each with its place in torch's collectives: the harness's init barrier #1, the kit's #2
    assert (f"  rank 0: in test_rank0_hangs at test_user.py:{sleep}; torch's last: barrier #1 "
            "on the default group, finished\n") in out, out
    assert re.search(rf"^  rank 1: barrier at test_user.py:{barrier} \(waiting 1\d s for "
                     r"rank\(s\) \[0\]\); in torch's barrier #2 on the default group, not "
                     r"finished$", out, re.M), out


def test_the_same_file_under_xdist(tmp_path):
    code, out, _ = _pytest(tmp_path, "-n", "2", timeout=200)
    assert code == 1, out
    assert _outcomes(tmp_path) == dict(EXPECTED, test_rank0_hangs="failed",
                                       test_after_the_hang="passed"), out
    assert _failures(out).count("RANK-ONE-SAYS-NO") == 1, out
    assert re.search(r"^FAILED test_user.py::test_rank1_fails - rank 1 of 2 failed: "
                     r"AssertionError: RANK-ONE-SAYS-NO$", out, re.M), out
    assert _seconds(tmp_path, "test_rank0_hangs") < 20, out


@pytest.mark.parametrize("marker, message", [
    ("world_size=0", "world_size=0: give a number of ranks >= 1 or a list of them, e.g. "
                     "world_size=2 or world_size=[1, 2, 3]"),
    ("world_size=[2, 0]", "world_size=[2, 0]: give a number of ranks >= 1"),
    ("store='nowhere'", "store='nowhere': give one of 'parent', 'rank0', 'both'"),
    ("worldsize=2", "unknown argument(s) worldsize; it takes world_size, store, backend, init, "
                    "timeout"),
    ("2", "takes keyword arguments only, got (2,): write world_size=..."),
    ("timeout=0", "timeout=0: give seconds > 0, e.g. timeout=30"),
    ("init='yes'", "init='yes': give True"),
    ("backend=''", "backend='': give a torch.distributed backend name such as 'gloo' or 'nccl'"),
    ("timeout=True", "timeout=True: give seconds > 0"),
])
def test_a_wrong_marker_is_a_collection_error_naming_the_argument(tmp_path, marker, message):
    tests = f"import pytest\n\n@pytest.mark.distributed({marker})\ndef test_x():\n    pass\n"
    code, out, _ = _pytest(tmp_path, tests=tests, timeout=60)
    assert code == 2, out
    assert f"test_user.py::test_x: @pytest.mark.distributed: {message}" in out, out


#: An unrelated test file: whether torch was imported, and whether the plugin is registered.
UNRELATED = '''
import sys

def test_unrelated(request):
    print("torch imported:", "torch" in sys.modules)
    print("plugin:", request.config.pluginmanager.has_plugin("pytest_axolotl_dist"))
'''


@pytest.mark.parametrize("plugin, registered", [
    ("", True),  # the entry point
    ("pytest_axolotl_dist", True),  # named as well: not registered twice
    ("no:pytest_axolotl_dist", False),
], ids=["installed", "named-too", "disabled"])
def test_a_session_without_the_marker_imports_no_torch(tmp_path, plugin, registered):
    args = ["-s", "-p", plugin] if plugin else ["-s"]
    code, out, _ = _pytest(tmp_path, *args, tests=UNRELATED, timeout=60)
    assert code == 0, out
    assert "torch imported: False" in out, out
    assert f"plugin: {registered}" in out, out
    assert "Error" not in out, out


def test_the_entry_point_is_declared_and_registered_by_an_install():
    name, module = _entry_point()
    assert (name, module) == ("pytest_axolotl_dist", "pytest_axolotl_dist")
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert module in cfg["options"]["py_modules"].split()
    from importlib import metadata

    dist = metadata.distribution("axolotl-dist")  # an install's record (or this checkout's)
    points = [(ep.name, ep.value) for ep in dist.entry_points if ep.group == "pytest11"]
    url = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    if not points and url != ROOT.as_uri():
        pytest.skip(f"the axolotl-dist installed here ({url or dist.version}) is not this "
                    "checkout and predates the plugin (the tests above load it through a "
                    "distribution that declares setup.cfg's entry point)")
    assert points == [(name, module)]


def test_the_plugin_module_imports_neither_torch_nor_the_kit():
    code = ("import sys, pytest_axolotl_dist\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'axolotl_dist')))")
    got = run([sys.executable, "-c", code], subprocess_env(), 60)
    assert got[0] == 0 and got[1].strip() == "[]", got


#: Each rank's repr of the same failure is identical: folded.
FOLDED = '''
import pytest
import axolotl_dist as ad

@pytest.mark.distributed(world_size=3)
def test_every_rank_fails():
    ad.barrier()
    assert ad.get_world_size() == 2, "EVERY-" + "RANK"

@pytest.mark.distributed(world_size=2)
def test_xfails():
    pytest.xfail("KNOWN")

@pytest.mark.xfail(reason="MARKED", strict=True)
@pytest.mark.distributed(world_size=2, store="both")
def test_marked_xfail():
    assert ad.get_rank() == 1
'''


def test_identical_failures_fold_and_xfail_is_xfail(tmp_path):
    code, out, _ = _pytest(tmp_path, tests=FOLDED, timeout=90)
    assert code == 1, out
    assert _outcomes(tmp_path) == {"test_every_rank_fails": "failed", "test_xfails": "skipped",
                                   "test_marked_xfail[store-parent]": "skipped",
                                   "test_marked_xfail[store-rank0]": "skipped"}, out
    assert "ranks 0-2 of 3 failed (AssertionError):" in out, out
    assert _failures(out).count("EVERY-RANK") == 1, out
    assert re.search(r"^FAILED test_user.py::test_every_rank_fails - ranks 0-2 of 3 failed: "
                     r"AssertionError: EVERY-RANK$", out, re.M), out
    assert re.search(r"^XFAIL test_user.py::test_xfails - KNOWN \(ranks 0, 1\)$", out, re.M), out


#: Rank 1 hangs; the marker sets no timeout.
HANG = '''
import time

import pytest

import axolotl_dist as ad


@pytest.mark.distributed(world_size=2)
def test_hangs():
    if ad.get_rank() == 1:
        time.sleep(3600)
    ad.barrier()
'''


def test_without_a_marker_timeout_pytest_timeouts_limit_applies_report_first(tmp_path):
    pytest.importorskip("pytest_timeout")
    code, out, _ = _pytest(tmp_path, "--timeout", "16", tests=HANG, timeout=90)
    assert code == 1, out
    assert "timed out: ranks 0, 1 of 2 still running after 8 s (pytest-timeout's 16 s less 8 s " \
           "for this report)" in out, out
    sleep = HANG.splitlines().index("        time.sleep(3600)") + 1
    assert (f"  rank 1: in test_hangs at test_user.py:{sleep}; torch's last: barrier #1 on the "
            "default group, finished\n") in out, out
    assert "+++ Timeout +++" not in out, out  # pytest-timeout's own stack dump never came
    assert _seconds(tmp_path, "test_hangs") < 16, out


#: Accounts of what a rank did that is not an exception of its own (tests/test_pytest_plugin.py,
#: issue #56): a peer that passed and returned, a raw torch collective after it, a mismatch.
ACCOUNTS = '''
import pytest
import torch.distributed as dist

import axolotl_dist as ad


@pytest.mark.distributed(world_size=2)
def test_peer_passed():
    if ad.get_rank() == 0:
        ad.barrier()  # a save's barrier rank 1 never calls


@pytest.mark.distributed(world_size=2)
def test_raw_barrier_after_peer_passed():
    if ad.get_rank() == 0:
        dist.barrier()


@pytest.mark.distributed(world_size=3)
def test_mismatch():
    if ad.get_rank() == 0:
        ad.barrier()
    else:
        ad.all_reduce_value(1)
'''


def _account(out: str, test: str) -> str:
    """The FAILURES section's part for ``test``."""
    part = _failures(out).split(f" {test} ", 1)[1]
    return part.split("\n____", 1)[0].split("\n=====", 1)[0]


def test_accounts_name_what_really_happened_in_few_lines(tmp_path):
    code, out, _ = _pytest(tmp_path, tests=ACCOUNTS, timeout=200)
    assert code == 1, out
    lines = ACCOUNTS.splitlines()
    at = {name: next(n for n, ln in enumerate(lines, 1) if name in ln)
          for name in ("    ad.barrier()  # a save", "        dist.barrier()")}
    passed = _account(out, "test_peer_passed")
    assert re.search(r"^rank 0 of 2 failed \(waiting in barrier at test_user\.py:"
                     rf"{at['    ad.barrier()  # a save']} for rank 1, which passed and returned",
                     passed, re.M), out
    assert "failed because rank 1 did" not in passed, out
    raw = _account(out, "test_raw_barrier_after_peer_passed")
    assert re.search(r"^rank 0 of 2 failed \(waiting in torch\.distributed\.barrier at "
                     rf"test_user\.py:{at['        dist.barrier()']} for rank 1, which passed",
                     raw, re.M), out
    assert "Connection closed" not in raw and "distributed_c10d.py" not in raw, raw
    assert len(raw.strip().splitlines()) <= 5, raw
    mismatch = _account(out, "test_mismatch")
    assert mismatch.count("CollectiveMismatchError") >= 2, mismatch
    assert "_runtime" not in mismatch and "site-packages" not in mismatch, mismatch
    assert re.search(r"^ranks? [12](, 2)?: failed with the same CollectiveMismatchError at "
                     r"test_user\.py:\d+ \(told by rank \d above\)$", mismatch, re.M), mismatch
    assert len(mismatch.strip().splitlines()) <= 25, mismatch


#: Both ranks write at once, each line in two pieces (where block-buffered text merged:
#: ``loading shardloading shard``), then fail, so that pytest shows what they printed.
LOUD = '''
import sys

import pytest

import axolotl_dist as ad


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("round", range(%d))
def test_loud(round):
    for i in range(300):
        sys.stdout.write("loading ")
        sys.stdout.write(f"shard {i}\\n")
    ad.barrier()
    assert False, "SHOW-THE-OUTPUT"
'''


def test_captured_output_is_labelled_by_rank_and_never_merged(tmp_path):
    rounds = 20  # the same test 20 times: the merge showed in 1 run in 4
    code, out, _ = _pytest(tmp_path, tests=LOUD % rounds, timeout=300)
    assert code == 1, out
    captured = re.findall(r"-+ Captured stdout call -+\n(.*?)(?=\n[-=_]{5,}|\n- generated|\Z)",
                          out, re.S)
    assert len(captured) == rounds, out[-3000:]
    for text in captured:
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        bad = [ln for ln in lines if not re.fullmatch(r"\[rank [01]\] loading shard \d+", ln)]
        assert bad == [], bad[:5]
        assert len(lines) == 600, len(lines)
        for r in (0, 1):
            assert [int(ln.rsplit(" ", 1)[1]) for ln in lines
                    if ln.startswith(f"[rank {r}]")] == list(range(300))
