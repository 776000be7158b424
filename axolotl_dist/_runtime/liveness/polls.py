"""Waiting on a store probe: the kind of kit wait the blocks, debug checks, the
shared-filesystem probe and ``shared_map`` make (the other kind, a collective's, is in
:mod:`.waits`, which also holds :class:`~.waits.Waiting`, what every kit wait is).

The first polls run inline, then from the store worker with a backoff to at most 0.25 s, so a
store that stops answering (its host is stopped) does not stop the wait's clock
(docs/design/decisions.md, decision 13); a wait that can, blocks on a wake key (:mod:`..store.wakeup`)
instead of polling.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..base import procs
from ..base.constants import LIVENESS_INTERVAL, UNMARKED_WAIT
from ..base.kitlog import kit as log
from ..store.access import (Job, StoreHostGoneError, is_store_error, store_address,
                            store_host, submit)
from ..store.wakeup import KeyWaiter
from . import where_report
from .progress import Point
from .peers import host_leaving, peer_record, store_host_gone, store_lost_error
from .waits import Waiting
from ...errors import (CollectiveMismatchError, DistributedEnvError, RankFailedError,
                       RankTimeoutError)

__all__ = ["poll_until"]


#: How long a store call may take before the waiting rank looks at the store's host.
_STORE_SILENT_AFTER = 1.0


#: Seconds between an asleep wait's checks of its clock (timeout, warnings): no store call.
_ASLEEP = 0.25

#: How many polls a wait makes inline before it goes to the store worker (and asleep): few,
#: as every poll of every waiting rank is a request at the one store (they were 20: a tenth
#: of a waiting rank's budget of 2 requests a second over a 10 s wait, each).
_INLINE_POLLS = 2
#: Seconds before the first look on the store worker (then doubling, to at most 50 ms).
_FIRST_DELAY = 0.0002


def poll_until(
    ready: Callable[[], bool],
    *,
    watch: Callable[[], Sequence[int]],
    timeout: Optional[float],
    what: str,
    me: int,
    slow: Optional[Callable[[], None]] = None,
    sleep: Optional[Callable[[], Optional[KeyWaiter]]] = None,
    point: Optional[Point] = None,
    fresh: bool = False,
) -> None:
    """Return once ``ready()`` is true; raise if a watched rank dies or ``timeout`` expires.

    :param ready: a cheap, non-blocking store probe.
    :param watch: the global ranks we are waiting for (re-evaluated at each liveness check).
    :param what: a description used in log lines and errors ("zero_first block #3 at x.py:4").
    :param slow: called once, on the store worker, when the wait outlasts its first inline
        polls (a check too costly for the fast path, e.g. that blocks pair); it may raise.
    :param sleep: called on the store worker after ``slow``, until it returns a key waiter: a
        :class:`~..store.wakeup.KeyWaiter` asleep until ``ready()`` may have become true (then the wait
        stops polling: it only looks at the watched ranks), or None (not now: polls go on).
    :param point: where the wait is, for the deadlock stall detector (:mod:`.deadlock`).
    :param fresh: the caller has just read what ``ready()`` reads, and it was not ready: no
        check before the wait is set up (its inline polls come next).
    """
    try:
        if not fresh and ready():
            return
        waiting = Waiting(what, me, [], "for rank(s) {ranks} to finish {what}", point)
        normal = False
        box: List[Optional[KeyWaiter]] = [None]
        try:
            _Poll(ready, watch, timeout, slow, waiting, sleep, box).run()
            normal = True
        finally:
            if box[0] is not None:
                box[0].release()
            waiting.end(normal, submit)
    except (RankFailedError, RankTimeoutError, DistributedEnvError, CollectiveMismatchError):
        raise
    except Exception as exc:  # noqa: BLE001 - the store's host is gone
        if is_store_error(exc):
            raise store_lost_error(exc, what) from None  # it quotes exc
        raise


def _silent_store(what: str, me: int, silent_for: float, warned: Dict[int, float],
                  now: float) -> None:
    """Warn (at most every 30 s) that the store has not answered a call for ``silent_for`` s."""
    last = warned.get(-1)
    if last is not None and now - last < 30.0:
        return
    warned[-1] = now
    host = store_host()
    record = peer_record(host) if host is not None else None
    state = procs.proc_state(record.pid) if where_report.same_machine(record) else None
    if host is None:
        who = f"the launcher's store at {store_address()}"
    else:
        who = f"rank {host} (the store host" + (f", {record.describe()})" if record else ")")
    why = (" is stopped (/proc says state T: SIGSTOP, a debugger or a suspended job)"
           if state == "stopped" else " has not answered a store call")
    log.warning("rank %d: %s%s for %.0f s while this rank waits in %s", me, who, why,
                silent_for, what)


class _Poll:
    """One store-probe wait (see :func:`poll_until`): the first probes inline, then on the
    store worker at doubling intervals (or blocked on a wake key), the watched ranks found every
    ``LIVENESS_INTERVAL``, a store that does not answer warned about, the timeout kept."""

    def __init__(self, ready: Callable[[], bool], watch: Callable[[], Sequence[int]],
                 timeout: Optional[float], slow: Optional[Callable[[], None]], w: Waiting,
                 sleep: Optional[Callable[[], Optional[KeyWaiter]]],
                 box: List[Optional[KeyWaiter]]) -> None:
        self.ready, self.watch, self.timeout, self.w, self.box = ready, watch, timeout, w, box
        self.next_check = w.start + UNMARKED_WAIT
        self.spins, self.delay = 0, _FIRST_DELAY
        self.job: Optional[Job] = None
        self.job_since = w.start
        self.pending_slow = [slow] if slow is not None else []
        self.pending_sleep = [sleep] if sleep is not None else []

    def probe(self, liveness: bool, now: float, inline: bool = False) -> Tuple[str, Any]:
        """One look: ``("ready", None)``, ``("waiting", None)``, ``("lost", ranks)`` or
        ``("stuck", finding)``; on the worker (not ``inline``) it also runs ``slow`` once and
        tries to fall asleep."""
        w = self.w
        if host_leaving():  # no store call: the host's store is about to go
            return "lost", w.checker.find_lost([], now, w.what)
        waiter = self.box[0]
        if waiter is None or waiter.woken.is_set():  # asleep, the word is not read: the waiter says
            if self.ready():
                return "ready", None
        if not inline:  # on the worker: the wait has left its inline polls
            self._leave_the_fast_path()
        if liveness:
            w.ranks[:] = self.watch()
            w.mark()
            lost = w.lost(now, asleep=waiter is not None and not waiter.woken.is_set())
            stuck = w.stuck()  # read by the same look: this wait's own finding comes first
            if stuck is not None:
                return ("ready", None) if self.ready() else ("stuck", stuck)
            if lost:
                return ("ready", None) if self.ready() else ("lost", lost)
        return "waiting", None

    def _leave_the_fast_path(self) -> None:
        """The first look on the worker runs ``slow``; each until one works tries to sleep."""
        if self.pending_slow:
            self.pending_slow.pop()()
        if self.pending_sleep:
            self.box[0] = self.pending_sleep[0]()
            if self.box[0] is not None:
                self.pending_sleep.clear()  # a key wakes once: after a spurious wake-up, polls

    def _schedule(self) -> None:
        """Between looks: sleep (on the wake key, or a doubling delay), then hand the next look to
        the store worker when one is due."""
        waiter = self.box[0]
        if waiter is not None and not waiter.woken.is_set():  # asleep: look at the peers only
            waiter.woken.wait(min(_ASLEEP, max(0.0, self.next_check - time.monotonic())))
            now = time.monotonic()
            due = now >= self.next_check or waiter.woken.is_set()
        else:
            time.sleep(self.delay)
            limit = 0.05 if time.monotonic() - self.w.start < 10 else 0.25
            self.delay = min(self.delay * 2, limit)
            now, due = time.monotonic(), True
        if due:
            liveness = now >= self.next_check
            if liveness:
                self.next_check = now + LIVENESS_INTERVAL
            self.job = submit(lambda: self.probe(liveness, now))
            self.job_since = now

    def _settle(self, answered: bool, now: float) -> bool:
        """The look in flight answered (True once ready; raises for a lost or stuck peer), or
        has not for a while: a gone store host ends the wait, a silent store is warned of."""
        w = self.w
        if answered:
            outcome, found = self.job.result()  # type: ignore[union-attr]
            self.job = None
            if outcome == "ready":
                return True
            if outcome == "lost":
                raise w.failure(found)
            if outcome == "stuck":
                w.deadlock(found)
        elif now - self.job_since >= _STORE_SILENT_AFTER:
            if store_host_gone():  # the call waits in torch's reconnect: stop waiting for it
                gone = StoreHostGoneError(f"no answer for {now - self.job_since:.1f} s")
                raise store_lost_error(gone, w.what)
            _silent_store(w.what, w.me, now - self.job_since, w.checker.warned, now)
        return False

    def _check_timeout(self, now: float) -> None:
        timeout, w = self.timeout, self.w
        if timeout is not None and now - w.start >= timeout:
            ranks = list(self.watch()) if self.job is None else list(w.ranks)
            raise RankTimeoutError(
                f"rank {w.me} gave up after waiting {timeout:g} s for rank(s) {ranks} to finish "
                f"{w.what} (timeout={timeout:g}); raise the timeout or find why they are slow",
                ranks,
            )

    def run(self) -> None:
        """Return once ready; raise for a lost or stuck peer, a gone store, the timeout."""
        while True:
            if self.job is None:
                if self.spins < _INLINE_POLLS:  # the first polls inline: a store call costs
                    self.spins += 1             # ~30 us, a handoff more
                    if self.probe(False, time.monotonic(), inline=True)[0] == "ready":
                        return
                    continue
                self._schedule()
            job = self.job
            answered = job.done.wait(_STORE_SILENT_AFTER) if job is not None else False
            now = time.monotonic()
            if job is not None and self._settle(answered, now):
                return
            self._check_timeout(now)
            if self.job is None and now >= self.w.interval.next_at:
                self.w.warn(now, list(self.watch()))
