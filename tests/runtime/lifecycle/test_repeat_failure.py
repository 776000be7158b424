"""Unit tests of the start-up failure's record (``_runtime/lifecycle/repeat_failure.py``);
``tests/test_restart_policy.py`` runs the policy under axolotl-dist and torchrun."""

from __future__ import annotations

import os
import sys

from axolotl_dist._runtime.lifecycle import repeat_failure


def _raised(source: str):
    try:
        exec(compile(source, "train.py", "exec"), {})
    except BaseException as exc:  # noqa: BLE001
        return exc, sys.exc_info()[2]
    raise AssertionError("it did not raise")


def test_a_start_up_failure_is_its_type_and_the_line_that_raised_it():
    exc, tb = _raised("x = 1\nimport no_such_module_for_the_unit_test\n")
    assert repeat_failure.startup_failure(exc, tb) == "ModuleNotFoundError at train.py:2"
    exc, tb = _raised("def load():\n    raise MemoryError('out of memory')\n\nload()\n")
    assert repeat_failure.startup_failure(exc, tb) == "MemoryError at train.py:2"  # innermost
    assert repeat_failure.startup_failure(ValueError(), None) == "ValueError"


def test_the_attempt_before_is_the_same_local_rank_one_attempt_down():
    record = os.path.join("/tmp", "torchelastic_x", "run_1", "attempt_3", "1", "rec")
    assert repeat_failure._previous(record) == os.path.join(
        "/tmp", "torchelastic_x", "run_1", "attempt_2", "1", repeat_failure._RECORD)
    first = os.path.join("/tmp", "torchelastic_x", "run_1", "attempt_0", "1", "rec")
    assert repeat_failure._previous(first) is None
    assert repeat_failure._previous(os.path.join("/tmp", "elsewhere", "rec")) is None


def test_it_watches_only_under_an_agent_with_restarts_to_try(monkeypatch):
    registered = []
    monkeypatch.setattr(repeat_failure.atexit, "register", registered.append)
    monkeypatch.setattr(repeat_failure.atexit, "unregister", lambda fn: None)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    repeat_failure.watch()
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", "/tmp/x/attempt_0/0/error.json")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    repeat_failure.watch()
    assert registered == []
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    repeat_failure.watch()
    assert registered == [repeat_failure._at_exit]
