"""Bounded waits through the store (the top floor of the signalling stack: built on
:mod:`.watch`).

A waiting rank polls a cheap, non-blocking store probe (``add(key, 0)``: no C++ timeout
warnings), the first polls inline, then from the store worker with a backoff to at most
0.25 s; every :data:`~.constants.LIVENESS_INTERVAL` it judges the ranks it waits for
(:class:`~.watch.Watch`), and after ``AXOLOTL_DIST_WAIT_LOG_INTERVAL`` seconds (default 30) it
logs whom it waits for, then at doubling intervals. A store that stops answering (its host is
stopped) does not stop the wait's clock: the call runs on the store worker
(docs/design.md, decision 13).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import procs, where
from .constants import HOST, LIVENESS_INTERVAL, MAX_WAIT_LOG_INTERVAL, WAIT_LOG_INTERVAL_ENV_VAR
from .envvars import kit_seconds
from .logs import kit as log
from .peers import host_leaving, peer_record, store_host_gone, store_lost_error
from .state import STATE
from .store import Job, StoreHostGoneError, is_store_error, store_address, store_host, submit, world_store
from .watch import Watch, lost_error, waiting_key
from ..errors import DistributedEnvError, RankFailedError, RankTimeoutError

__all__ = ["poll_until", "where_they_are", "noted"]

#: How long a store call may take before the waiting rank looks at the store's host.
_STORE_SILENT_AFTER = 1.0


def poll_until(
    ready: Callable[[], bool],
    *,
    watch: Callable[[], Sequence[int]],
    timeout: Optional[float],
    what: str,
    me: int,
    slow: Optional[Callable[[], None]] = None,
) -> None:
    """Return once ``ready()`` is true; raise if a watched rank dies or ``timeout`` expires.

    :param ready: a cheap, non-blocking store probe.
    :param watch: the global ranks we are waiting for (re-evaluated at each liveness check).
    :param what: a description used in log lines and errors ("zero_first block #3 at x.py:4").
    :param slow: called once, on the store worker, when the wait outlasts its first inline
        polls (a check too costly for the fast path, e.g. that blocks pair); it may raise.
    """
    try:
        if ready():
            return
        _poll(ready, watch, timeout, what, me, slow)
    except (RankFailedError, RankTimeoutError, DistributedEnvError):
        raise
    except Exception as exc:  # noqa: BLE001 - the store's host is gone
        if is_store_error(exc):
            raise store_lost_error(exc, what) from exc
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
    state = procs.proc_state(record.pid) if record is not None and record.host == HOST else None
    if host is None:
        who = f"the launcher's store at {store_address()}"
    else:
        who = f"rank {host} (the store host" + (f", {record.describe()})" if record else ")")
    why = (" is stopped (/proc says state T: SIGSTOP, a debugger or a suspended job)"
           if state == "stopped" else " has not answered a store call")
    log.warning("rank %d: %s%s for %.0f s while this rank waits in %s", me, who, why,
                silent_for, what)


def _poll(ready: Callable[[], bool], watch: Callable[[], Sequence[int]], timeout: Optional[float],
          what: str, me: int, slow: Optional[Callable[[], None]]) -> None:
    thread = threading.get_ident()
    watched: List[int] = []  # the last answer of watch(), for a timeout while the store is silent
    STATE.waits[thread] = where.Registered(what, watched)  # what a snapshot of this rank says
    try:
        _wait(ready, watch, timeout, what, me, slow, watched)
    finally:
        STATE.waits.pop(thread, None)


def where_they_are(ranks: Sequence[int]) -> str:
    """Where ``ranks`` are, one line per place (:mod:`.where`); asked through the store."""
    run = STATE.run
    if run is None or not ranks:
        return ""
    raw = where.raw_store(world_store())
    answers, silent = where.collect(raw, run, where.ask(raw, run, ranks))
    records = {r: (p.host, p.pid) for r, p in STATE.peers.items() if r in silent}
    return where.report(answers, silent, records)


def _wait(ready: Callable[[], bool], watch: Callable[[], Sequence[int]], timeout: Optional[float],
          what: str, me: int, slow: Optional[Callable[[], None]], watched: List[int]) -> None:
    start = time.monotonic()
    watcher = Watch(world_store())
    log_every = kit_seconds(WAIT_LOG_INTERVAL_ENV_VAR)
    next_log = start + log_every
    next_check = start + LIVENESS_INTERVAL / 2
    spins, delay = 0, 0.0005
    job: Optional[Job] = None
    job_since = start
    told_where = False
    pending_slow = [slow] if slow is not None else []
    marked: List[bool] = []

    def probe(liveness: bool, now: float, inline: bool = False) -> Tuple[str, Any]:
        if host_leaving():  # no store call: the host's store is about to go
            return "lost", watcher.find_lost([], now, what)
        if ready():
            return "ready", None
        if pending_slow and not inline:  # on the worker: the wait has left its inline polls
            pending_slow.pop()()
        if liveness:
            if not marked:
                watcher.store.add(waiting_key(watcher.me), 1)
                marked.append(True)
            watched[:] = watch()
            lost = watcher.find_lost(watched, now, what)
            if lost:
                return ("ready", None) if ready() else ("lost", lost)
        return "waiting", None

    while True:
        if job is None:
            if spins < 20:  # the first polls inline: a store call costs ~30 us, a handoff more
                spins += 1
                verdict, lost = probe(False, time.monotonic(), inline=True)
                if verdict == "ready":
                    return
                continue
            time.sleep(delay)
            delay = min(delay * 2, 0.05 if time.monotonic() - start < 10 else 0.25)
            now = time.monotonic()
            liveness = now >= next_check
            if liveness:
                next_check = now + LIVENESS_INTERVAL
            job = submit(lambda liveness=liveness, now=now: probe(liveness, now))
            job_since = now
        answered = job.done.wait(_STORE_SILENT_AFTER)
        now = time.monotonic()
        if answered:
            verdict, lost = job.result()
            job = None
            if verdict == "ready":
                if marked:  # a normal end (an exception keeps the count: see waiting_key)
                    submit(lambda: watcher.store.add(waiting_key(watcher.me), -1))
                return
            if verdict == "lost":
                raise lost_error(lost, what)
        elif now - job_since >= _STORE_SILENT_AFTER:
            if store_host_gone():  # the call waits in torch's reconnect: stop waiting for it
                gone = StoreHostGoneError(f"no answer for {now - job_since:.1f} s")
                raise store_lost_error(gone, what)
            _silent_store(what, me, now - job_since, watcher.warned, now)
        if timeout is not None and now - start >= timeout:
            ranks = list(watch()) if job is None else list(watched)
            raise RankTimeoutError(
                f"rank {me} gave up after waiting {timeout:g} s for rank(s) {ranks} to finish "
                f"{what} (timeout={timeout:g}); raise the timeout or find why they are slow",
                ranks,
            )
        if now >= next_log and job is None:
            ranks = list(watch())
            place = ""
            if not told_where:  # the first warning says where they are, the later ones don't
                told_where = True
                place = where_they_are(ranks)
                place = f"; where they are:\n{place}" if place else ""
            log.warning("rank %d has waited %.0f s for rank(s) %s to finish %s%s", me,
                        now - start, ranks, what, place)
            log_every = min(log_every * 2, MAX_WAIT_LOG_INTERVAL)
            next_log = now + log_every


class noted:
    """Around a call that blocks in C++ (a rendezvous): a daemon thread logs ``message(s)``
    (``s``: seconds waited) at ``AXOLOTL_DIST_WAIT_LOG_INTERVAL`` seconds, then at doubling
    intervals, until the call returns: the call's wait says what it waits for, like every
    kit wait."""

    def __init__(self, message: Callable[[float], str]) -> None:
        self.message = message
        self.done = threading.Event()
        self.thread: Optional[threading.Thread] = None

    def __enter__(self) -> "noted":
        every = kit_seconds(WAIT_LOG_INTERVAL_ENV_VAR)
        start = time.monotonic()

        def run() -> None:
            interval, next_at = every, start + every
            while not self.done.wait(max(0.0, next_at - time.monotonic())):
                log.warning("%s", self.message(time.monotonic() - start))
                interval = min(interval * 2, MAX_WAIT_LOG_INTERVAL)
                next_at = time.monotonic() + interval

        self.thread = threading.Thread(target=run, name="axolotl-dist-init-wait", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.done.set()
