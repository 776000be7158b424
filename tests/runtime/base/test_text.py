"""Unit tests of the words the kit's messages share (``_runtime/base/text.py``): the ranks
label, and the rank tag of a line, written by :func:`rank_tag` and read back by
:func:`find_rank_tag` (what ``axolotl-dist`` folds by and the pytest plugin labels by)."""

from __future__ import annotations

import random

import pytest

from axolotl_dist._runtime.base.text import find_rank_tag, rank_tag, ranks_text


def test_a_ranks_label_folds_runs_of_consecutive_ranks():
    assert ranks_text([2]) == "rank 2"
    assert ranks_text([1, 0]) == "ranks 0, 1"
    assert ranks_text([0, 1, 2]) == "ranks 0-2"
    assert ranks_text([9, 0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-9"
    assert ranks_text(list(range(64))) == "ranks 0-63"


@pytest.mark.parametrize("rank, world", [(0, 1), (3, 4), (63, 64), (1023, 4096)])
def test_the_kits_tag_reads_back_as_written(rank, world):
    line = f"12:00:01 INFO {rank_tag(rank, world)} loading shard 3".encode()
    tag = find_rank_tag(line, 160)
    assert tag is not None and tag.kit and not tag.torch
    assert (tag.rank, tag.rest) == (rank, f"/{world}] ".encode())
    assert line[tag.start:tag.end] == f"{rank_tag(rank, world)} ".encode()


@pytest.mark.parametrize("line, found", [
    (b"[rank1]: Traceback (most recent call last):", (0, 9, 1, b"]: ")),  # torch's
    (b"[rank 2] x", (0, 9, 2, b"] ")),  # a launcher's label
    (b"W [rank 12/16]:x", (2, 15, 12, b"/16]:")),
    (b"[rank x] [rank 5/8]", (9, 19, 5, b"/8]")),  # the first that is a tag
    (b"[rank 1/] [rank] [rank /2] [rank 1/2", None),  # none is whole
    (b"[rank \xd9\xa3/4]", None),  # an Arabic-Indic digit is not a rank
])
def test_each_form_of_a_rank_tag_is_found_and_nothing_else(line, found):
    tag = find_rank_tag(line, len(line))
    assert (None if tag is None else tuple(tag)) == found


def test_a_tag_must_end_within_the_bound():
    line = b"x" * 155 + rank_tag(3, 4).encode()  # 10 bytes: it ends at 165
    assert find_rank_tag(line, 160) is None
    assert find_rank_tag(line, 160 + 10).rank == 3


def test_the_reader_agrees_with_the_grammar_on_random_lines():
    # the grammar: "[rank", an optional space, ASCII digits, optionally "/" and digits, "]",
    # then an optional ":" and an optional space; the first match wholly in line[:within]
    import re
    grammar = re.compile(rb"\[rank ?(\d+)(/\d+)?\](:? ?)")
    pieces = [b"[rank", b"[rank ", b"1", b"23", b"/", b"]", b":", b" ", b"x", b"[", b"\xd9\xa3"]
    rng = random.Random(7)
    for _ in range(20000):
        line = b"".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))
        within = rng.randint(0, len(line) + 2)
        m = grammar.search(line, 0, within)
        want = None if m is None else (m.start(), m.end(), int(m.group(1)),
                                       (m.group(2) or b"") + b"]" + m.group(3))
        tag = find_rank_tag(line, within)
        assert (None if tag is None else tuple(tag)) == want, (line, within)
