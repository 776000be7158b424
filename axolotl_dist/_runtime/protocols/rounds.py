"""``do_n_at_a_time``'s protocol: a block kind whose ranks run in rounds (:mod:`.blocks`)."""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

from ..base.callsite import CallSite
from ..base.groups import Group
from . import timeline
from .blocks import Block, together
from .timeline import TIMELINE

__all__ = ["run_in_rounds"]

T = TypeVar("T")


class _Rounds(Block):
    kind, family, noun = "dn", "do_n_at_a_time", "do_n_at_a_time call"
    __slots__ = ()
    sited = False  # "do_n_at_a_time call #3": its messages have always read so


def run_in_rounds(f: Callable[[], T], g: Group, seq: int, rounds: int, timeout: Optional[float],
                  site: CallSite, desc: Optional[str]) -> T:
    """``do_n_at_a_time``'s protocol: round ``k`` holds the group ranks with
    ``rank % rounds == k``; every rank waits for the rounds before its own, runs ``f``, then
    waits for the rest."""
    block = _Rounds(g, seq, site, desc)
    rank, ws, group = g.rank, g.size, g
    before = [r for r in range(ws) if r % rounds < rank % rounds]
    if before:
        t0 = timeline.now()
        block.wait(lambda: block.full(before), (), lambda: block.missing(before), timeout)
        if TIMELINE.recorder is not None:
            timeline.wait_span("do_n_at_a_time", t0, [g.global_rank(r) for r in before], site,
                            group, seq)
    return together(f, block, timeout, lambda: [g.global_rank(r) for r in range(ws)
                                                 if r % rounds > rank % rounds])
