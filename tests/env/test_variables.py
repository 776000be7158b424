"""Unit tests of how the kit reads variables (``axolotl_dist/env/variables.py``)."""

from __future__ import annotations

from axolotl_dist.env.variables import is_decimal


def test_a_decimal_is_ascii_digits_only():
    assert is_decimal("0") and is_decimal("29500") and is_decimal("007")
    for text in ("", " 1", "-1", "1.5", "1e3", "\u00b2", "1\u00b2", "\u0663", "x"):
        assert not is_decimal(text), text  # '²' and '٣' are str.isdigit(); int() refuses '²'
    assert "1\u00b2".isdigit()  # why not str.isdigit: int("1²") raises ValueError
