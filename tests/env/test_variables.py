"""Unit tests of how the kit reads variables (``axolotl_dist/env/variables.py``)."""

from __future__ import annotations

from axolotl_dist.env.variables import is_decimal


def test_a_decimal_is_ascii_digits_only():
    assert is_decimal("0") and is_decimal("29500") and is_decimal("007")
    for text in ("", " 1", "-1", "1.5", "1e3", "\u00b2", "1\u00b2", "\u0663", "x"):
        assert not is_decimal(text), text  # '²' and '٣' are str.isdigit(); int() refuses '²'
    assert "1\u00b2".isdigit()  # why not str.isdigit: int("1²") raises ValueError


def test_a_kit_seconds_variable_is_read_again_only_when_its_value_changed(monkeypatch):
    import pytest

    from axolotl_dist.env import variables
    from axolotl_dist.errors import DistributedEnvError

    name = variables.WAIT_LOG_INTERVAL_ENV_VAR
    monkeypatch.delenv(name, raising=False)
    assert variables.kit_seconds(name) == variables.DEFAULT_WAIT_LOG_INTERVAL
    monkeypatch.setenv(name, "2.5")
    assert variables.kit_seconds(name) == 2.5
    reads = []
    monkeypatch.setattr(variables, "read_seconds", lambda *a: reads.append(a) or 9.0)
    assert variables.kit_seconds(name) == 2.5 and reads == []  # the same stored value: cached
    monkeypatch.setenv(name, "2.5")  # set again (a new stored object): read again
    assert variables.kit_seconds(name) == 9.0 and len(reads) == 1
    monkeypatch.undo()
    monkeypatch.setenv(name, "-1")
    for _ in range(2):  # a bad value is never cached: each ask raises, naming it
        with pytest.raises(DistributedEnvError, match=rf"^{name}='-1' must be a positive number"):
            variables.kit_seconds(name)
    monkeypatch.setenv(name, " ")
    assert variables.kit_seconds(name) == variables.DEFAULT_WAIT_LOG_INTERVAL
