"""Every kit wait, one watching wait (the top floor of the signalling stack: on :mod:`.stalls`).

A kit wait is a :class:`Waiting`: registered for :mod:`.where_report` (what, since when, for whom),
counted on this rank's waiting key once it runs long (:func:`..store.keys.waiting`: a failing
peer's exit grace reads it), checking the awaited ranks (:class:`~.stalls.PeerChecker`: exit records,
pids, heartbeats) every ``LIVENESS_INTERVAL``, and after ``AXOLOTL_DIST_WAIT_LOG_INTERVAL``
seconds (default 30), then at doubling intervals, logging whom it waits for (the first time,
where they are). What it waits on comes in two kinds:

* :func:`.polls.poll_until`: a cheap, non-blocking store probe (``add(key, 0)``: no C++ timeout
  warnings) for the ordering blocks, debug checks and ``shared_map``; the first polls inline,
  then from the store worker with a backoff to at most 0.25 s, so a store that stops answering
  (its host is stopped) does not stop the wait's clock (docs/design/decisions.md, decision 13); an
  optional ``timeout``.
* :func:`collective`: a collective's work past its first slice (:func:`..protocols.exchange.run` waits
  the first), unmarked and without a store call for ``UNMARKED_WAIT`` seconds, then in
  blocking slices of :data:`SLICE` seconds, each returning the moment the
  collective completes; between them Python handles signals (Ctrl-C acts within a slice). A
  peer found gone first gets a grace for the collective to complete (it may have left after
  its part). A wait that ends on an exception with its collective still pending marks the
  group (:func:`left`), which the exit keeps (:func:`..lifecycle.teardown.keep_abandoned`).

:class:`logged_blocking_call` logs the same way around a call that blocks in C++ (a rendezvous).
"""

from __future__ import annotations

import hashlib
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence

from ..base.callsite import call_site
from ..base.constants import LIVENESS_INTERVAL, MAX_WAIT_LOG_INTERVAL, SLICE, UNMARKED_WAIT
from ...env.variables import WAIT_LOG_INTERVAL_ENV_VAR, kit_seconds
from ..base.groups import Group
from ..base.kitlog import kit as log
from ..base import torch_messages
from .liveness_state import HEARTBEAT, PEERS, WAITS, Registered
from ..store import keys, seals
from ..store.access import StoreHostGoneError, bounded, is_store_error, put, world_store
from ..store.clients import raw_store
from . import where_report
from . import progress
from .deadlock import CALLS_PER_RANK, describe, new_serial
from .progress import Point
from .failures import await_readers
from .lost import Lost, deadlock_from_report, lost_error, deadlock_from_lost
from .stalls import PeerChecker
from .peers import check_store_host, host_leaving, store_host_gone
from ...errors import CollectiveMismatchError, RankFailedError

__all__ = ["Waiting", "collective", "own_part", "where_they_are", "logged_blocking_call", "left",
           "take_abandoned", "abandoned_groups", "SLICE", "LOST_GRACE"]

_SLICE = timedelta(seconds=SLICE)  # SLICE: one blocking slice (base.constants)


class _Interval:
    """When a wait's next warning is due: ``AXOLOTL_DIST_WAIT_LOG_INTERVAL`` seconds after it
    began, then at doubling intervals (at most ``MAX_WAIT_LOG_INTERVAL``)."""

    __slots__ = ("every", "next_at")

    def __init__(self, start: float) -> None:
        self.every = kit_seconds(WAIT_LOG_INTERVAL_ENV_VAR)
        self.next_at = start + self.every

    def due(self, now: float) -> bool:
        """Whether a warning is due now (and, if so, schedule the next one)."""
        if now < self.next_at:
            return False
        self.every = min(self.every * 2, MAX_WAIT_LOG_INTERVAL)
        self.next_at = now + self.every
        return True


def where_they_are(ranks: Sequence[int]) -> str:
    """Where ``ranks`` are, one line per place (:mod:`.where_report`); asked through the store."""
    run = HEARTBEAT.run
    if run is None or not ranks:
        return ""
    raw = raw_store(world_store())
    answers, silent = where_report.collect(raw, run, where_report.ask(raw, run, ranks))
    records = {r: p for r, p in PEERS.peers.items() if r in silent}
    return where_report.report(answers, silent, records)


class Waiting:
    """One kit wait on this thread (see the module docstring): ``ranks`` is the list of global
    ranks it waits for (kept up to date by the wait, read by :mod:`.where_report`); ``says`` is how
    its warning reads after "rank R has waited N s ", with ``{what}`` and ``{ranks}``;
    ``point``: where it is in terms every rank counts alike (None: a wait :mod:`.deadlock`
    does not stall detector); ``shown``: how a deadlock's report names it (default ``what``)."""

    __slots__ = ("what", "me", "ranks", "says", "checker", "start", "interval", "told",
                 "marked", "thread", "point", "serial", "published", "shown")

    def __init__(self, what: str, me: int, ranks: List[int], says: str,
                 point: Optional[Point] = None, shown: Optional[str] = None) -> None:
        self.what, self.me, self.ranks, self.says = what, me, ranks, says
        self.checker = PeerChecker(world_store(), me)
        self.start = time.monotonic()
        self.interval = _Interval(self.start)
        self.told = False
        self.marked = False
        self.thread = threading.get_ident()
        self.point, self.serial, self.published = point, 0, ""
        self.shown = shown or what
        WAITS.waits[self.thread] = Registered(what, ranks)  # what a snapshot says

    def mark(self) -> None:
        """Count this wait on this rank's waiting key (once): it runs long; and say where it
        is, for the deadlock stall detector."""
        if not self.marked:
            self.checker.store.add(keys.waiting(self.me), 1)
            self.checker.store.add(keys.WAITERS, 1)  # the detector runs while above 0
            self.marked = True
            run = HEARTBEAT.run
            if self.point is not None and run is not None:
                self.serial = new_serial()
                awaits = None if self.point.kind == "collective" else list(self.ranks)
                self.published = describe(self.point, self.serial, self.shown, self.thread,
                                          awaits)
                put(self.checker.raw, keys.long_wait(run, self.me), self.published)

    def lost(self, now: float, asleep: bool = False) -> List[Lost]:
        """The awaited ranks that are gone (see :meth:`.stalls.PeerChecker.find_lost`)."""
        return self.checker.find_lost(self.ranks, now, self.what, asleep=asleep)

    def stuck(self) -> Optional[CollectiveMismatchError]:
        """The deadlock this wait is in, as the stall detector found it at this rank's last look (no
        store call); None if none."""
        entry = self.checker.stuck
        if entry is None or entry[0] != self.serial or not self.serial:
            return None
        text, calls, parties = entry[1]
        return CollectiveMismatchError(f"rank {self.me}'s {self.shown} can never complete: {text}",
                                       calls={int(r): c for r, c in calls.items()},
                                       deadlock=(text, [(r, c) for r, c in parties]))

    def failure(self, lost: List[Lost]) -> Exception:
        """The error for the ``lost`` peers: this rank's own finding where a peer failed on the
        deadlock this wait is part of (:func:`.lost.deadlock_from_lost`), else
        :func:`.lost.lost_error`."""
        return deadlock_from_lost(lost, self.me, self.shown) or lost_error(lost, self.what)

    def deadlock(self, error: CollectiveMismatchError) -> None:
        """Raise ``error`` (from :meth:`stuck`), first acknowledging it: a rank that hosts the
        store keeps it up until every other rank of the deadlock has read its own finding (it
        would otherwise learn of this rank's exit instead)."""
        # the ranks the error names (every rank of a deadlock of up to CALLS_PER_RANK ranks)
        ranks = sorted(error.calls) if len(error.calls) <= CALLS_PER_RANK else []
        same = repr(sorted(error.calls.items())).encode()  # alike on every rank of the deadlock
        key = keys.deadlock(hashlib.blake2b(same, digest_size=6).hexdigest())
        try:
            self.checker.store.set(keys.ack(key, self.me), b"")
            self._unpublish()
            await_readers(self.checker.store, key, [r for r in ranks if r != self.me])
        except Exception:  # noqa: BLE001 - the store is going: the error is still this rank's
            pass
        raise error

    def _unpublish(self) -> None:
        run = HEARTBEAT.run
        if self.published and run is not None:
            key = keys.long_wait(run, self.me)
            self.checker.raw.compare_set(key, seals.seal(key, self.published), seals.seal(key, ""))
            self.published = ""

    def warn(self, now: float, ranks: Sequence[int]) -> None:
        """Log whom the wait waits for, if a warning is due; the first says where they are."""
        if not self.interval.due(now):
            return
        place = ""
        if not self.told:  # the first warning says where they are, the later ones don't
            self.told = True
            text = where_they_are(ranks)
            place = f"; where they are:\n{text}" if text else ""
            command = where_report.where_command()  # what shows every rank, from a shell
            place += f"\n  (every rank: {command})" if command else ""
        log.warning("rank %d has waited %.0f s %s%s", self.me, now - self.start,
                    self.says.format(what=self.what, ranks=list(ranks)), place)

    def end(self, normal: bool, unmark: Callable[[Callable[[], Any]], Any]) -> None:
        """The wait is over; ``normal``: it ended without an exception, so its count on the
        waiting key is taken back (by ``unmark(call)``: at once, or on the store worker). An
        exception keeps the count until the process exits (see :func:`..store.keys.waiting`).
        Either way its description goes (only if still this wait's: compare-and-set), on an
        exception within a second at most (the store may be going)."""
        WAITS.waits.pop(self.thread, None)
        if normal and self.marked:
            store, key = self.checker.store, keys.waiting(self.me)

            def call() -> None:
                if store_host_gone():  # a call would fail, with torch's C++ trace
                    return
                store.add(key, -1)
                store.add(keys.WAITERS, -1)
                self._unpublish()

            unmark(call)
        elif self.published and not host_leaving() and not store_host_gone() \
                and not getattr(sys.exc_info()[1], "store_refused", False):
            # (a wait ending on a store that closed this connection: a call on it makes torch
            # print a C++ trace)
            bounded(self._unpublish, 1.0)


def _now(call: Callable[[], Any]) -> None:
    try:
        call()
    except Exception:  # noqa: BLE001 - the wait is over; the store may be gone
        pass



# --- waiting for a collective ----------------------------------------------------------------

def collective(work: Any, g: Group, what: str) -> None:
    """Wait for ``work`` of a collective on ``g`` past its first slice: in slices, watching the
    group's peers (see the module docstring)."""
    me = g.ranks[g.rank]
    peers = [r for r in g.ranks if r != me]
    w = Waiting(what, me, peers, "in {what} for rank(s) {ranks}",
                Point(g, "collective", progress.count(g, "collective"), what),
                shown=f"{what} at {call_site()}")
    normal = False
    try:
        if _ends_unmarked(work) or not _mark(w, work):  # a short wait makes no store call
            normal = True
            return
        next_look = w.start  # the first look at the peers at once: a dead one is named promptly
        while True:
            now = time.monotonic()
            if now >= next_look:
                next_look = now + LIVENESS_INTERVAL
                lost = _look(w, work, now)
                stuck = w.stuck()
                if stuck is not None and not _completes(work, 0.0):
                    w.deadlock(stuck)
                if lost and not _completes(work, _grace(w.checker, lost)):
                    raise w.failure(lost)
                w.warn(now, peers)
            try:
                work.wait(_SLICE)
                break
            except RuntimeError as exc:
                if not torch_messages.timed_out(exc):
                    raise
        normal = True
    finally:
        w.end(normal, _now)


#: Seconds a collective may still take to complete once a peer is found to have exited
#: normally: it finished its part of this collective before it left (its last messages are
#: still being processed here). A peer that failed gets :data:`SLICE` twice: it may have
#: failed on the line after this collective (a wait that looked at the peers just before the
#: collective completed here); one that left this collective pending (Ctrl-C in it) none.
LOST_GRACE = 1.0


def _look(w: Waiting, work: Any, now: float) -> List[Lost]:
    """The awaited ranks that are gone; none where the look found the store's host gone but
    the collective then succeeded within :data:`LOST_GRACE`: a store host that did its part
    and then ended (a script's last collective, then ``os._exit``) fails no collective its
    peers finish; the store's loss is then said at this rank's next store call."""
    try:
        return w.lost(now)
    except StoreHostGoneError:
        if _succeeds(work, LOST_GRACE):
            return []
        raise


def _mark(w: Waiting, work: Any) -> bool:
    """Mark the wait as long (:meth:`Waiting.mark`); False where the store's host is found
    gone but the collective then succeeded within :data:`LOST_GRACE` (as in :func:`_look`:
    its host did its part of this collective, then ended)."""
    try:
        check_store_host()  # gone: no store call, which would print torch's C++ trace
        w.mark()
        return True
    except Exception as exc:  # noqa: BLE001 - re-raised unless the collective succeeded
        if is_store_error(exc) and _succeeds(work, LOST_GRACE):
            return False
        raise


def _ends_unmarked(work: Any) -> bool:
    """Whether ``work`` completes within ``UNMARKED_WAIT`` seconds (in slices: a signal is still
    handled); its failure (a peer gone) raises at once."""
    return _succeeds(work, UNMARKED_WAIT, failure_raises=True)


def _succeeds(work: Any, grace: float, failure_raises: bool = False) -> bool:
    """Whether ``work`` ends without an error within ``grace`` seconds, waited for in slices so
    that a signal is still handled (a collective a lost peer never joined fails: its
    connections closed); with ``failure_raises``, its error raises instead of giving False."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            work.wait(_SLICE)
            return True
        except RuntimeError as exc:
            if not torch_messages.timed_out(exc):
                if failure_raises:
                    raise
                return False
    return False


def _grace(checker: PeerChecker, lost: List[Lost]) -> float:
    """Seconds the collective gets to complete, given the ``lost`` peers (see
    :data:`LOST_GRACE`): store calls only while the store's host stays."""
    if host_leaving():
        return 0.0
    try:
        if any(checker.store.check([keys.exit_pending(gone.rank)]) for gone in lost):
            return 0.0
    except Exception:  # noqa: BLE001 - the store is going: name the peer now
        return 0.0
    if all(gone.how == "exited" and gone.report is None for gone in lost):
        return LOST_GRACE
    return 2 * SLICE


def _completes(work: Any, grace: float) -> bool:
    """Whether ``work`` completes within ``grace`` seconds: it has already ended (with or
    without an error), or it succeeds within them (:func:`_succeeds`). A collective a lost
    peer never joined fails at once (its connections closed) or times out here: then the
    caller names the peer."""
    try:
        if work.is_completed():
            return True
    except RuntimeError:
        return False
    return _succeeds(work, grace)


def own_part(error: BaseException, g: Group, what: str) -> BaseException:
    """The error for a collective of ``what`` on ``g`` that failed with ``error`` (from
    :func:`.failures.diagnose_lost_peer`): where it names a peer that ended on a deadlock this
    collective is part of (the peer read the stall detector's finding first, and its exit
    closed the collective's connections before this rank's next look), this rank's own
    :class:`CollectiveMismatchError`; else ``error``."""
    if not isinstance(error, RankFailedError):
        return error
    found = deadlock_from_report(error, g.ranks[g.rank], f"{what} at {call_site()}")
    return error if found is None else found


def left(work: Any, g: Group, exc: BaseException) -> None:
    """A collective's wait ends on ``exc`` (Ctrl-C, a signal handler's ``SystemExit``, a lost
    peer) with the collective maybe still pending: see :func:`..lifecycle.teardown.keep_abandoned`. An
    exception raised while a slice's timeout was being handled does not show that timeout as
    its context."""
    try:
        if not work.is_completed():
            WAITS.abandoned_in.add(g)  # publish_exit then sets keys.exit_pending
            WAITS.abandoned.append(work)
    except Exception:  # noqa: BLE001 - best effort: the exception itself matters
        pass
    if isinstance(exc.__context__, RuntimeError) and torch_messages.timed_out(exc.__context__):
        exc.__suppress_context__ = True


# --- around a call that blocks in C++ --------------------------------------------------------

class logged_blocking_call:
    """Around a call that blocks in C++ (a rendezvous): a daemon thread logs ``message(s)``
    (``s``: seconds waited) when a kit wait would warn, until the call returns: the call's
    wait says what it waits for, like every kit wait."""

    def __init__(self, message: Callable[[float], str]) -> None:
        self.message = message
        self.done = threading.Event()
        self.thread: Optional[threading.Thread] = None

    def __enter__(self) -> "logged_blocking_call":
        start = time.monotonic()
        interval = _Interval(start)

        def run() -> None:
            while not self.done.wait(max(0.0, interval.next_at - time.monotonic())):
                if interval.due(time.monotonic()):
                    log.warning("%s", self.message(time.monotonic() - start))

        self.thread = threading.Thread(target=run, name="axolotl-dist-init-wait", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.done.set()


def take_abandoned() -> List[Any]:
    """The collectives left pending by a wait that ended on an exception (see :func:`left`),
    handed over once (the exit keeps them alive: ``lifecycle/teardown.keep_abandoned``)."""
    taken, WAITS.abandoned = WAITS.abandoned, []
    return taken


def abandoned_groups() -> List[Group]:
    """The groups a collective was left pending on (see :func:`left`): kept at exit."""
    return list(WAITS.abandoned_in)
