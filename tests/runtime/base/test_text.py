"""Unit tests of the words the kit's messages share (``_runtime/base/text.py``)."""

from __future__ import annotations

from axolotl_dist._runtime.base.text import ranks_text


def test_a_ranks_label_folds_runs_of_consecutive_ranks():
    assert ranks_text([2]) == "rank 2"
    assert ranks_text([1, 0]) == "ranks 0, 1"
    assert ranks_text([0, 1, 2]) == "ranks 0-2"
    assert ranks_text([9, 0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-9"
    assert ranks_text(list(range(64))) == "ranks 0-63"
