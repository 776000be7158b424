"""Unit tests of the lease rule (``_runtime/protocols/leases.py``): a lease's state is known where
its process can be seen, the ranks' states are pooled, and only a run that is over loses its
files. Plain directories under ``tmp_path``; real processes for dead and live pids."""

import json
import os
import subprocess
import sys
import time

from axolotl_dist._runtime.base import procs
from axolotl_dist._runtime.protocols import checkpointing as ck
from axolotl_dist._runtime.protocols import leases as ls

A, D, U = ls.ALIVE, ls.DEAD, ls.UNKNOWN


def _dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _lease(root, run, rank, **fields):
    directory = os.path.join(root, ls.LEASES_DIR, run)
    os.makedirs(directory, exist_ok=True)
    lease = {"job": "j", "run": run, "rank": rank, "host": "h", "machine": procs.MACHINE,
             "pid": os.getpid(), "start": ls.process_start(os.getpid()), "time": time.time()}
    lease.update(fields)
    with open(os.path.join(directory, f"{rank}.json"), "w") as fh:
        json.dump(lease, fh)
    return lease


def test_a_leases_state_is_its_process_on_its_machine_only(tmp_path):
    me = _lease(str(tmp_path), "r", 0)
    assert ls.lease_state(me) == A
    assert ls.lease_state(dict(me, pid=_dead_pid())) == D
    assert ls.lease_state(dict(me, start=me["start"] + 1)) == D  # the pid now names another process
    assert ls.lease_state(dict(me, machine="another-boot/4026531836")) == U
    assert ls.lease_state(dict(me, start=None)) == A  # no start time recorded: the pid decides


def test_hold_writes_this_process_and_release_removes_it(tmp_path):
    root = str(tmp_path)
    ls.hold(root, "job7", "run1", 3)
    (lease,) = ls.read_run(root, "run1")
    assert (lease["job"], lease["rank"], lease["pid"], lease["machine"]) == \
        ("job7", 3, os.getpid(), procs.MACHINE)
    assert ls.lease_state(lease) == A
    ls.release(root, "run1", 3)
    assert not os.path.exists(os.path.join(root, ls.LEASES_DIR, "run1"))


def test_survey_skips_this_run_and_says_each_leases_state(tmp_path):
    root = str(tmp_path)
    dead = _dead_pid()
    _lease(root, "mine", 0)
    _lease(root, "old", 0, pid=dead)
    _lease(root, "old", 1, pid=dead)
    _lease(root, "far", 0, machine="elsewhere", host="node-b")
    seen = ls.survey(root, "mine")
    assert sorted(seen) == ["far", "old"]
    assert seen["old"][0] == {0: D, 1: D} and seen["far"][0] == {0: U}
    job, holders, fresh = seen["far"][1]
    assert job == "j" and holders == [(0, "node-b", os.getpid())] and fresh


def _view(states, fresh=True):
    return (states, ("j", [(r, "h", 100 + r) for r in states], fresh))


def test_pooling_removes_only_runs_every_lease_of_which_is_dead():
    views = [{"gone": _view({0: D, 1: U}), "far": _view({0: U, 1: U}),
              "live": _view({0: D, 1: U})},
             {"gone": _view({0: U, 1: D}), "far": _view({0: U, 1: U}),
              "live": _view({0: U, 1: A})}]
    over, live = ls.pool(views)
    assert over == {"gone": [0]}  # one filesystem (both ranks saw the same leases): rank 0
    assert list(live) == ["live"] and live["live"][1][1] == (1, "h", 101)
    # a run no rank can see is left alone until its leases are stale, then removed
    assert ls.pool([{"far": _view({0: U}, fresh=False)}]) == ({"far": [0]}, {})
    assert ls.pool([{"far": _view({0: U}, fresh=False)}, {"far": _view({0: A})}])[0] == {}


def test_node_local_disks_each_remove_their_own_copy():
    node_a = {"old": _view({0: D, 1: D})}  # ranks 0-1's disk holds the old run's ranks 0-1
    node_b = {"old": _view({2: D, 3: D})}
    over, live = ls.pool([node_a, node_a, node_b, node_b])
    assert over == {"old": [0, 2]} and live == {}


def test_remove_run_takes_its_stagings_and_leases_and_nothing_else(tmp_path):
    root = str(tmp_path)
    theirs = ls.staging_dir(root, 5, "job", "abc123", 3)
    ours = ls.staging_dir(root, 5, "job", "def456", 3)
    for path in (theirs, ours, ck.final_dir(root, 4)):
        os.makedirs(path)
    _lease(root, "abc123", 0)
    assert ls.staging_run(os.path.basename(theirs)) == "abc123"
    assert ls.staging_run("step-4") is None
    assert ls.stagings_by_run(root) == {"abc123": [theirs], "def456": [ours]}
    assert ls.remove_run(root, "abc123") == [theirs]
    assert sorted(os.listdir(root)) == sorted([os.path.basename(ours), "step-4", ls.LEASES_DIR])
    assert os.listdir(os.path.join(root, ls.LEASES_DIR)) == []


def test_an_older_kits_staging_without_leases_is_removed_only_once_stale(tmp_path):
    root = str(tmp_path)
    old = ls.staging_dir(root, 3, "none", "a1b2c3", 1)
    os.makedirs(old)
    seen = ls.survey(root, "mine")
    assert seen == {"a1b2c3": ({}, ("", [], True))}
    assert ls.pool([seen]) == ({}, {})  # fresh: it may be a live run of an older kit
    os.utime(old, (0, 0))
    assert ls.pool([ls.survey(root, "mine")]) == ({"a1b2c3": [0]}, {})


def test_a_torn_or_foreign_lease_file_is_skipped(tmp_path):
    root = str(tmp_path)
    _lease(root, "r", 0)
    _lease(root, "r", 1, time="yesterday")
    directory = os.path.join(root, ls.LEASES_DIR, "r")
    with open(os.path.join(directory, "2.json"), "w") as fh:
        fh.write('{"pid": 1')
    assert [lease["rank"] for lease in ls.read_run(root, "r")] == [0]
    assert ls.survey(root, "mine")["r"][0] == {0: A}
