"""Unit tests of the words the kit's messages share (``_runtime/base/text.py``)."""

from __future__ import annotations

from axolotl_dist._runtime.base.text import ranks_in_text, ranks_text


def test_a_ranks_label_reads_back():
    for ranks in ([2], [0, 1], [0, 1, 2], [0, 1, 2, 5, 7, 8, 9], list(range(64))):
        assert ranks_in_text(ranks_text(ranks).split(" ", 1)[1]) == ranks


def test_a_decimal_is_ascii_digits_only():
    from axolotl_dist._runtime.base.text import is_decimal

    assert is_decimal("0") and is_decimal("29500") and is_decimal("007")
    for text in ("", " 1", "-1", "1.5", "1e3", "\u00b2", "1\u00b2", "\u0663", "x"):
        assert not is_decimal(text), text  # '²' and '٣' are str.isdigit(); int() refuses '²'
    assert "1\u00b2".isdigit()  # why not str.isdigit: int("1²") raises ValueError
