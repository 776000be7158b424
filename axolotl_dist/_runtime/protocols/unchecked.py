"""Debug mode, while a check waits: the ranks that sit in a torch collective no check saw.

A rank waiting at a checked call (:mod:`.debug_checks`) for ranks that have not come asks them,
after :data:`ASK_AFTER` seconds, where they are: their heartbeats answer with their place in
torch's collective sequence (:mod:`..liveness.where_report`, :mod:`..liveness.flight`). Every
checked call issues the same torch collectives on every rank, so a missing rank whose last
collective on the group is past this rank's last is in one that no checked call issued: DDP's
bucket all-reduce in ``backward()``, FSDP's all-gathers, a call inside torch. The ranks can
never meet, and the check raises it at once instead of waiting for its timeout. A missing rank
that is merely late (computing, in Python) is past nothing and left to the timeout.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from ..base.constants import HEARTBEAT_INTERVAL
from ..base.groups import Group
from ..liveness import flight, where_report
from ..liveness.liveness_state import HEARTBEAT
from ..store.access import world_store
from ..store.clients import raw_store

__all__ = ["ASK_AFTER", "UncheckedLook"]

#: Seconds a check waits before asking the missing ranks where they are in torch's collectives.
ASK_AFTER = 1.0
#: Seconds between two reads of their answers (one ``multi_get`` each).
_POLL = 0.25


class UncheckedLook:
    """One waiting check's look at the missing ranks' torch collectives.

    :param call: how the error names this rank's call (``rank 2 is at checked call #5
        torch.distributed.barrier() at train.py:22``)."""

    __slots__ = ("group", "name", "call", "mine", "wanted", "next_at", "complete_by")

    def __init__(self, group: Group, start: float, call: str) -> None:
        self.group, self.call = group, call
        self.name = flight.group_name(group.pg_ref())
        self.mine = 0
        self.wanted: Optional[Dict[int, Tuple[int, int]]] = None
        self.next_at = start + ASK_AFTER
        self.complete_by = 0.0  # once one rank is found past: the others' answers awaited till

    def look(self, now: float, present: Callable[[], List[int]]) -> Optional[Tuple[str, List[int]]]:
        """Ask the missing ranks (``present``: the group ranks at the check) once, then read
        their answers; the finding and the ranks past this one, or None (yet)."""
        if self.name is None or now < self.next_at or HEARTBEAT.run is None:
            return None
        self.next_at = now + _POLL
        raw, run = raw_store(world_store()), HEARTBEAT.run
        if self.wanted is None:
            self._ask(raw, run, present)
            return None
        answers, _ = where_report.collect(raw, run, self.wanted, within=0)
        ahead = flight.ahead_of(self.name, self.mine, {
            r: a.get("torch") for r, a in answers.items() if "unreadable" not in a})
        if not ahead:
            return None
        if len(answers) < len(self.wanted):  # the rest answer at their next beat: name them all
            self.complete_by = self.complete_by or now + HEARTBEAT_INTERVAL + _POLL
            if now < self.complete_by:
                return None
        label = flight.group_label(self.name, next(iter(ahead.values()))["ranks"])
        return (flight.unchecked_finding(label, self.mine, self.call, ahead,
                                         lambda r: f" ({where_report.place(answers[r])})"),
                sorted(self.group.ranks.index(r) for r in ahead if r in self.group.ranks))

    def _ask(self, raw: Any, run: str, present: Callable[[], List[int]]) -> None:
        """Note this rank's last collective on the group and ask the missing ranks theirs."""
        mine = flight.positions()
        if mine is None:  # torch records nothing here: nothing to compare
            self.name = None
            return
        self.mine = mine[self.name]["seq"] if self.name in mine else 0
        there = set(present())
        self.wanted = where_report.ask(raw, run, [self.group.global_rank(r) for r in
                                                  range(self.group.size) if r not in there])
