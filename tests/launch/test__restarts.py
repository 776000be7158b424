"""Unit tests of the launcher's restart account (``launch/_restarts.py``): which rank a restart
line names, and when a repeated start-up failure stops the restarts. The launches themselves
are in ``tests/test_restart_policy.py`` and ``tests/test_elastic_nodes.py``."""

from __future__ import annotations

import json
import os
import signal
from types import SimpleNamespace

from axolotl_dist.launch import _restarts
from axolotl_dist.launch._report import attempt_dir


def _end(directory, rank, code, at, **extra):
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, f"{rank}.json"), "w") as fh:
        json.dump({"rank": rank, "code": code, "time": at, **extra}, fh)


def test_the_first_failure_is_the_earliest_non_zero_end():
    ends = {0: {"code": 0, "time": 1.0}, 1: {"code": 1, "time": 3.0, "startup": "ImportError at a.py:1"},
            2: {"code": 2, "time": 2.0}}
    assert _restarts._first_failure(ends) == (2.0, 2, 2, "")
    assert _restarts._first_failure({0: {"code": 0, "time": 1.0}}) is None


def test_a_rank_that_left_no_end_record_is_named_unless_the_agent_stopped_it():
    killed = SimpleNamespace(exitcode=-int(signal.SIGKILL))
    stopped = SimpleNamespace(exitcode=-int(signal.SIGTERM))
    result = SimpleNamespace(failures={0: stopped, 2: killed, 3: SimpleNamespace(exitcode=3)})
    assert _restarts._abrupt(result, {1: {"code": 1}}) == \
        ": rank 2 was killed by SIGKILL (ranks 3 too)"
    gone = SimpleNamespace(failures={1: SimpleNamespace(exitcode=3)})
    assert "rank 1 exited with code 3 without finishing its script" in _restarts._abrupt(gone, {})
    assert _restarts._abrupt(SimpleNamespace(failures={0: stopped}), {}) == ""
    assert _restarts._abrupt(None, {}) == ""


def test_a_rank_ending_on_a_lost_ranks_failure_names_that_rank():
    ends = {0: {"code": 1, "time": 1.0, "blames": 2, "why": "unresponsive: no heartbeat"}}
    first = _restarts._first_failure(ends)
    assert _restarts._blamed(first, ends) == \
        ": rank 2 failed (unresponsive: no heartbeat), as rank 0 reported"
    ends[2] = {"code": 1, "time": 0.5}  # the blamed rank left its own record: it is named itself
    assert _restarts._blamed(_restarts._first_failure(ends), ends) == ""


def test_the_same_start_up_failure_twice_is_a_restart_that_cannot_help(tmp_path):
    restarts = _restarts.Restarts(3, str(tmp_path), say=lambda text: None)
    try:
        same = "ModuleNotFoundError at train.py:5"
        _end(attempt_dir(str(tmp_path), 0), 1, 1, 1.0, startup=same)
        _end(attempt_dir(str(tmp_path), 1), 0, 1, 2.0, startup=same)
        restarts.attempt = 1
        first = _restarts._first_failure({0: {"code": 1, "time": 2.0, "startup": same}})
        assert restarts._same_start_up_failure(first)
        other = _restarts._first_failure({0: {"code": 1, "time": 2.0, "startup": "OSError at x.py:2"}})
        assert not restarts._same_start_up_failure(other)
        restarts.retry_same = True
        assert not restarts._same_start_up_failure(first)
    finally:
        restarts.close()
    assert not _restarts._stop_agent()  # no agent's monitor loop up this stack
