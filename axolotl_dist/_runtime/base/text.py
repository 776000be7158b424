"""Words the kit's messages share: ``ranks 0-3, 8`` for a set of ranks, and the tag that
names a rank at the start of its lines (``[rank 1/4]``), written and read here alone: the kit's
log lines (:mod:`.kitlog`, :mod:`axolotl_dist.log`) write it, ``axolotl-dist``'s folding of
alike lines (:mod:`axolotl_dist.launch._fold`) and the pytest plugin's labels read it back."""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence

__all__ = ["ranks_text", "rank_tag", "RankTag", "find_rank_tag", "tags_rank"]


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 3`` / ``ranks 0-3, 8``: runs of consecutive ranks folded."""
    runs: List[List[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    body = ", ".join(f"{a}" if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}"
                     for a, b in runs)
    return f"rank {body}" if len(ranks) == 1 else f"ranks {body}"


def rank_tag(rank: object, world: object) -> str:
    """The kit's tag of a rank's line: ``[rank 1/4]`` (read back by :func:`find_rank_tag`)."""
    return f"[rank {rank}/{world}]"


class RankTag(NamedTuple):
    """A rank tag found in a line (:func:`find_rank_tag`)."""

    start: int
    end: int  # past the tag, its ``:`` and one space, where they follow it
    rank: int
    rest: bytes  # what follows the rank's number in it: ``b"/4] "``, ``b"] "``, ``b"]:"``

    @property
    def kit(self) -> bool:
        """The kit's own form, with the world's size (:func:`rank_tag`)."""
        return self.rest[:1] == b"/"

    @property
    def torch(self) -> bool:
        """torch's form, ``[rank1]:`` (its excepthook's and C++ logs' prefix)."""
        return self.rest[:2] == b"]:"


_OPEN = b"[rank"
_DIGITS = frozenset(b"0123456789")


def find_rank_tag(line: bytes, within: int) -> Optional[RankTag]:
    """The first rank tag wholly in ``line[:within]``: the kit's (``[rank 1/4]``), a
    launcher's label (``[rank 1]``) or torch's (``[rank1]:``), each with the ``:`` and one
    space that follow it; None if there is none."""
    limit = min(len(line), within)
    at = line.find(_OPEN, 0, limit)
    while at >= 0:
        found = _tag_at(line, at, limit)
        if found is not None:
            return found
        at = line.find(_OPEN, at + 1, limit)
    return None


def tags_rank(line: bytes, rank: int) -> bool:
    """Whether the first rank tag of ``line`` is the kit's (:func:`rank_tag`) of ``rank``."""
    tag = find_rank_tag(line, len(line))
    return tag is not None and tag.kit and tag.rank == rank


def _digits_end(line: bytes, i: int, limit: int) -> int:
    """Where the run of ASCII digits starting at ``i`` ends (``i`` if there is none)."""
    while i < limit and line[i] in _DIGITS:
        i += 1
    return i


def _tag_at(line: bytes, at: int, limit: int) -> Optional[RankTag]:
    """The tag starting at ``at`` (``[rank``, an optional space, the rank, an optional
    ``/size``, ``]``), or None where what follows ``[rank`` is not one."""
    first = at + len(_OPEN) + (line[at + len(_OPEN):at + len(_OPEN) + 1] == b" ")
    number = _digits_end(line, first, limit)
    if number == first:
        return None
    close = number
    if line[close:close + 1] == b"/" and close + 1 < limit:
        close = _digits_end(line, close + 1, limit)
        if close == number + 1:
            return None
    if close >= limit or line[close] != ord("]"):
        return None
    end = close + 1
    end += end < limit and line[end] == ord(":")
    end += end < limit and line[end] == ord(" ")
    return RankTag(at, end, int(line[first:number]), line[number:end])
