"""A stuck run reports itself: each rank's heartbeat watches its own torch collectives.

Once per beat (:data:`~..base.constants.HEARTBEAT_INTERVAL`) the heartbeat reads the sequence
number of every process group of this process (torch's counter of the collectives it issued: a
fraction of a microsecond each, no store call) and keeps the run's rhythm, the lengths of the
stretches between two beats that saw a new collective. When none was issued for longer than
the bound (:data:`~...env.variables.STUCK_AFTER_ENV_VAR`, else 10x the recent 99th percentile
of those stretches, at least :data:`MIN_BOUND` seconds), the rank reads its flight recorder
once (:mod:`.flight`): if it waits in a collective that has not finished, it is stuck. The
first rank stuck in that collective (``compare_set`` on
:func:`~..store.keys.stuck_report`) asks every rank where it is and logs the report
(:mod:`.where_report`); again, only the verdicts, if the collective is still open after as long
again. A rank quiet outside a collective (loading data, evaluating alone) reads its recorder
once per bound and reports nothing: the ranks waiting for it do. docs/faults.md, "A stuck run
reports itself".
"""

from __future__ import annotations

import collections
import math
import time
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional, Tuple

from ...env.variables import OFF, STUCK_AFTER_ENV_VAR, kit_bound
from ..base import hooks
from ..base.kitlog import kit as log
from ..store import keys
from ..store.access import set_if_absent
from . import flight, where_report

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import Store

__all__ = ["StuckWatch", "stuck_watch", "Rhythm", "sequence_numbers", "MIN_BOUND", "RHYTHM_FACTOR", "REPORTS"]

#: The shortest bound the kit derives from a run's rhythm, in seconds.
MIN_BOUND = 60.0
#: The derived bound: this many times the recent 99th percentile of the quiet stretches.
RHYTHM_FACTOR = 10.0
#: Reports of one stuck collective: the whole report, then the verdicts once more.
REPORTS = 2
#: Quiet stretches the rhythm keeps (the newest).
_KEEP = 256


class Rhythm:
    """The lengths of the run's recent quiet stretches (seconds between two beats that saw a
    new collective issued), and the bound they give."""

    def __init__(self) -> None:
        self.gaps: Deque[float] = collections.deque(maxlen=_KEEP)

    def add(self, gap: float) -> None:
        self.gaps.append(gap)

    def p99(self) -> float:
        """The 99th percentile of the stretches kept (0 with none)."""
        if not self.gaps:
            return 0.0
        ordered = sorted(self.gaps)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]

    def bound(self) -> float:
        """``RHYTHM_FACTOR`` x :meth:`p99`, at least :data:`MIN_BOUND`."""
        return max(MIN_BOUND, RHYTHM_FACTOR * self.p99())


def sequence_numbers() -> Dict[str, int]:
    """Every live process group's name -> the number of collectives this process issued on it
    (torch's own counter; groups whose backend keeps none are left out)."""
    from torch.distributed import distributed_c10d

    out: Dict[str, int] = {}
    try:
        groups = list(distributed_c10d._world.pg_names.items())
    except Exception:  # noqa: BLE001 - the main thread changed the registry meanwhile
        return out
    for pg, name in groups:
        try:
            out[str(name)] = int(getattr(pg, "_get_sequence_number_for_group")())
        except Exception:  # noqa: BLE001 - a backend without the counter, or a group going
            continue
    return out


def _open_collective(found: Optional[Dict[str, Dict[str, Any]]]) -> Optional[Tuple[str, Dict[str, Any]]]:
    """The collective this rank waits in (its recorder's positions: :func:`.flight.positions`),
    the default group's first; None where every last collective finished."""
    pending = sorted(((n, p) for n, p in (found or {}).items() if not p["done"]),
                     key=lambda item: (item[0] != "0", item[0]))
    return pending[0] if pending else None


class StuckWatch:
    """One rank's watch (see the module's docstring): :meth:`beat` on each heartbeat."""

    def __init__(self, run: str, rank: int, world_size: int) -> None:
        self.run, self.rank, self.world_size = run, rank, world_size
        #: the bound :data:`~...env.variables.STUCK_AFTER_ENV_VAR` sets (read at the start:
        #: a bad value raises there, in the main thread), or None: the rhythm's
        self.fixed = kit_bound(STUCK_AFTER_ENV_VAR)
        self.rhythm = Rhythm()
        self.seen: Dict[str, int] = {}
        self.since = time.monotonic()  # the last beat that saw a new collective
        self.told = 0  # reports of the current quiet stretch (this rank's or another's)

    def bound(self) -> float:
        """Seconds of quiet before a rank waiting in a collective reports the run stuck."""
        return self.rhythm.bound() if self.fixed is None else self.fixed

    def beat(self, store: "Store", now: float) -> int:
        """One heartbeat's look; the where request this rank answered for its own report
        (0 for none), so the heartbeat does not answer it again."""
        seqs = sequence_numbers()
        if seqs != self.seen:
            if self.seen:
                self.rhythm.add(now - self.since)
            self.seen, self.since, self.told = seqs, now, 0
            return 0
        quiet = now - self.since
        if self.told >= REPORTS or quiet < self.bound() * (self.told + 1):
            return 0
        stuck = _open_collective(flight.positions())
        if stuck is None:  # quiet outside a collective: look again after another bound
            self.since = now
            return 0
        self.told += 1
        key = keys.stuck_report(self.run, stuck[0], stuck[1]["seq"], self.told)
        try:
            if set_if_absent(store, key, str(self.rank)) != str(self.rank).encode():
                return 0  # another rank waiting in it reports
            return self._report(store, stuck, quiet)
        except Exception:  # noqa: BLE001 - no report, but the heartbeat goes on: a store
            return 0  # that is gone ends it at its own next call

    def _report(self, store: "Store", stuck: Tuple[str, Dict[str, Any]], quiet: float) -> int:
        """Ask every rank where it is and log the report: whole the first time, its verdicts
        the second. The where request this rank answered itself."""
        name, pos = stuck
        wanted = where_report.ask(store, self.run, range(self.world_size))
        request = wanted[self.rank][0]
        where_report.answer(store, self.run, self.rank, request)  # this thread is the asker
        answers, silent = where_report.collect(store, self.run, wanted)
        peers = where_report.peer_records(store, self.run, list(silent))
        lines = where_report.report(answers, silent, peers).splitlines()
        if self.told > 1:
            lines = [line for line in lines if line.lstrip().startswith("verdict:")]
        for line in _head(name, pos, quiet, self.told, self.bound()) + lines:
            log.warning("%s", line)
        if self.told == 1:
            hooks.stuck_report()  # e.g. the timeline so far
        return request


def stuck_watch(run: str, rank: int, world_size: int) -> Optional[StuckWatch]:
    """This rank's watch; None for one rank alone, or where
    :data:`~...env.variables.STUCK_AFTER_ENV_VAR` is ``off``."""
    if world_size < 2 or kit_bound(STUCK_AFTER_ENV_VAR) == math.inf:
        return None
    return StuckWatch(run, rank, world_size)


def _head(name: str, pos: Dict[str, Any], quiet: float, told: int, bound: float) -> List[str]:
    """The report's first line: what this rank waits in, for how long, and the bound."""
    where = f"torch's {flight.what(pos, seq=True)} on {flight.group_label(name, pos['ranks'])}"
    if told > 1:
        return [f"the run is still stuck: this rank has issued no collective for {quiet:.0f} s, "
                f"waiting in {where}"]
    return [f"the run looks stuck: this rank has issued no collective for {quiet:.0f} s, "
            f"waiting in {where}, past the bound of {bound:.0f} s ({STUCK_AFTER_ENV_VAR} sets "
            f"it, ={OFF} turns this report off). Where every rank is:"]
