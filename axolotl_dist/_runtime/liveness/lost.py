"""A lost peer's account: the one :class:`~axolotl_dist.errors.RankFailedError` for the ranks
a wait found gone, naming the root cause first (:func:`lost_error`), and this rank's own part
of a deadlock a lost peer ended on (:func:`deadlock_from_lost`, :func:`deadlock_from_report`), read from the
peer's record, not from its message.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Tuple

from ..base.groups import remember_failure
from ...errors import CollectiveMismatchError, RankFailedError

__all__ = ["Lost", "lost_error", "deadlock_from_lost", "deadlock_from_report"]


class Lost(NamedTuple):
    """A rank found gone: how, the failure it reported at exit (if it did), and when it exited
    (``inf`` if unknown)."""

    rank: int
    how: str
    detail: str
    report: Optional[RankFailedError]
    when: float = float("inf")


def lost_error(lost: Sequence[Lost], what: str) -> RankFailedError:
    """One :class:`RankFailedError` for the lost ranks, naming the root cause first: a rank
    that failed on its own exception, then one that died without a word, then the earliest
    normal exit; a rank that exited after hearing of another rank's failure comes last and
    is explained by that rank."""
    def secondary(item: Lost) -> bool:  # it exited on a failure it received from another rank
        return item.report is not None and item.report.rank != item.rank

    def order(item: Lost) -> Tuple[int, float, int]:
        if secondary(item):
            category = 3
        elif item.report is not None:
            category = 0
        else:
            category = 1 if item.how != "exited" else 2
        return category, item.when, item.rank

    ordered = sorted(lost, key=order)
    root, others = ordered[0], ordered[1:]
    also = "".join(f"; also rank {o.rank} {o.how}: {o.detail}" for o in others)
    ranks = tuple(o.rank for o in ordered)
    if root.report is not None and not secondary(root):
        error = root.report
        return remember_failure(RankFailedError(root.rank, error.exc_type, error.exc_message + also,
                                     error.remote_traceback, where=what, ranks=ranks,
                                     machine=error.machine, site=error.site,
                                     deadlock=error.deadlock))
    if root.report is not None:  # every lost rank only relayed another rank's failure
        error = root.report
        relay = f" (rank {root.rank} exited on this failure)"
        return remember_failure(RankFailedError(error.rank, error.exc_type, error.exc_message + relay + also,
                                     error.remote_traceback, where=what,
                                     ranks=(error.rank,) + ranks, machine=error.machine,
                                     site=error.site, deadlock=error.deadlock))
    return remember_failure(RankFailedError(root.rank, root.how, root.detail + also, where=what, ranks=ranks))


def deadlock_from_lost(lost: Sequence[Lost], me: int, shown: str) -> Optional[CollectiveMismatchError]:
    """Rank ``me``'s own :class:`CollectiveMismatchError` where a lost peer failed on a deadlock
    in which ``me`` waits in ``shown`` (the call as the finding names it): the peer read the
    stall detector's finding first; on a loaded machine this rank may look again only after the
    peer is gone, and must still say what it is part of. None otherwise."""
    for item in lost:
        found = deadlock_from_report(item.report, me, shown)
        if found is not None:
            return found
    return None


def deadlock_from_report(report: Optional[RankFailedError], me: int,
                  shown: str) -> Optional[CollectiveMismatchError]:
    """Rank ``me``'s own :class:`CollectiveMismatchError` where a peer's failure ``report`` is a
    deadlock in which ``me`` waits in ``shown``, as the report's finding says (its parties:
    the ranks of each wait and their call); None otherwise (see :func:`deadlock_from_lost`)."""
    if report is None or report.deadlock is None:
        return None
    text, parties = report.deadlock
    if any(me in ranks and call.startswith(shown) for ranks, call in parties):
        return CollectiveMismatchError(f"rank {me}'s {shown} can never complete: {text}",
                                       deadlock=report.deadlock)
    return None
