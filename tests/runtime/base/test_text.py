"""Unit tests of the words the kit's messages share (``_runtime/base/text.py``)."""

from __future__ import annotations

from axolotl_dist._runtime.base.text import ranks_in_text, ranks_text


def test_a_ranks_label_reads_back():
    for ranks in ([2], [0, 1], [0, 1, 2], [0, 1, 2, 5, 7, 8, 9], list(range(64))):
        assert ranks_in_text(ranks_text(ranks).split(" ", 1)[1]) == ranks
