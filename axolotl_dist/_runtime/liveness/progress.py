"""How far this rank is on each process group: its call counters, kind by kind.

Every rank counts the same calls on a group in the same order (the group's kit collectives,
its ``zero_first`` blocks, ``do_n_at_a_time`` and ``shared_map`` calls, ``checkpoint_dir``
commits, debug checks, traced calls), so a counter names a meeting point all ranks agree on: a
block's store keys, a debug check's number, and the wait-for graph of :mod:`.deadlock`, which
compares the counters of :data:`KINDS` across ranks. Kept in this room (:data:`PROGRESS`),
not on the group; counted only through :func:`advance`.

A counter is an iterator over 1, 2, 3, ...: ``next()`` counts one call and returns its number
in C, so a hot path may count with ``next(PROGRESS.counts[g][kind])`` (what :func:`advance`
does, without its Python frame: :func:`..protocols.exchange.run`, once per kit collective);
:func:`count` reads how many were counted (what is left of the range) without counting.
"""

from __future__ import annotations

import operator
from typing import Dict, Iterator, List, NamedTuple

from ..base.groups import Group
from ..base.state import PerGroup, RoomState, register

__all__ = ["KINDS", "Point", "PROGRESS", "ProgressState", "Counters", "advance", "count",
           "counters"]

#: The kinds of meeting the wait-for graph compares, in the order of a rank's counters: the
#: group's kit collectives (counted by :func:`..protocols.exchange.run`), then the blocks and
#: calls that pair across ranks.
KINDS = ("collective", "zero_first", "do_n_at_a_time", "shared_map", "checkpoint_dir")


class Point(NamedTuple):
    """Where a wait is, in terms every rank of ``group`` counts alike."""

    group: Group
    kind: str  # one of KINDS
    seq: int  # the group's counter of that kind at this call (1, 2, ...)
    label: str  # the helper's name; a block's pairing tag
    finish: bool = False  # the awaited ranks must end the body (a zero_first waiter)


#: The numbers a counter can give: past this many calls of one kind it stops (never reached).
_LIMIT = 1 << 62


class Counters(Dict[str, Iterator[int]]):
    """One group's counters, kind -> an iterator over 1, 2, ... (made at the kind's first call)."""

    def __missing__(self, kind: str) -> Iterator[int]:
        counter = self[kind] = iter(range(1, _LIMIT))
        return counter


def _fresh(_: Group) -> Counters:
    return Counters()


class ProgressState(RoomState):
    """``counts``: each group's counters, kind -> calls so far (see the module docstring)."""

    def __init__(self) -> None:
        self.counts: PerGroup[Counters] = PerGroup(_fresh)


PROGRESS = register("progress", ProgressState())


def advance(g: Group, kind: str) -> int:
    """Count one more ``kind`` call on ``g``; its number (1, 2, ...)."""
    return next(PROGRESS.counts[g][kind])


def count(g: Group, kind: str) -> int:
    """The ``kind`` calls counted on ``g`` so far."""
    counts = PROGRESS.counts.get(g)
    counter = None if counts is None else counts.get(kind)
    return 0 if counter is None else _LIMIT - 1 - operator.length_hint(counter)


def counters(g: Group) -> List[int]:
    """``g``'s counters of :data:`KINDS`, in that order (what a wait's description carries)."""
    return [count(g, kind) for kind in KINDS]
