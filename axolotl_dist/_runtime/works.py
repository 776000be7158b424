"""Waiting for a collective's work the way the kit waits for anything: interruptible, watching.

A blocking ``work.wait()`` keeps the main thread in C++ until the collective completes: Ctrl-C
and SIGTERM wait for it (Python runs signal handlers between bytecodes), a peer that died
before the call leaves it waiting for the group's timeout (30 minutes by default), and nothing
says who it waits for. So on CPU backends (gloo) :func:`wait` waits in slices of
:data:`SLICE` seconds, each a blocking wait that returns the moment the collective completes
(no latency added); between slices Python handles signals (so Ctrl-C acts within a slice),
and every ``LIVENESS_INTERVAL`` the peers of the group are judged
(:class:`~.watch.Watch`: exit records, pids, heartbeats; a lost peer raises
:class:`~axolotl_dist.errors.RankFailedError` naming it), the wait is registered for
:mod:`.where`, and after ``AXOLOTL_DIST_WAIT_LOG_INTERVAL`` seconds a warning says whom it
waits for and where they are. Before its first slice the wait confirms the ``zero_first``
blocks this rank ran first and left unconfirmed (:func:`~.blocks.confirm_all`): the store read
overlaps the collective already under way. Accelerator backends (NCCL) keep their own wait.
A wait that ends on an exception (Ctrl-C) with the collective still pending marks its group,
which the exit then keeps instead of waiting for its workers (see :func:`keep_abandoned`).
"""

from __future__ import annotations

import ctypes
import threading
import time
from datetime import timedelta
from typing import Any, List

import torch
import torch.distributed as dist

from . import where
from .constants import LIVENESS_INTERVAL, MAX_WAIT_LOG_INTERVAL, WAIT_LOG_INTERVAL_ENV_VAR
from .envvars import kit_seconds
from .logs import kit as log
from .blocks import confirm_all
from .groups import global_ranks, state_of
from .state import STATE
from .store import world_store
from .wait import where_they_are
from .peers import host_leaving
from .watch import Watch, lost_error, pending_key, waiting_key

__all__ = ["wait", "wait_all", "keep_abandoned", "SLICE"]

#: Seconds of one blocking slice of a wait: how long a signal may wait to be handled. A slice
#: ends the moment the collective completes; each one that times out costs a few microseconds.
SLICE = 0.05
_SLICE = timedelta(seconds=SLICE)


def _timed_out(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and "timed out" in str(exc).lower()


def wait(work: Any, group: Any, what: str, cpu: bool = True) -> None:
    """Wait for ``work`` of a collective on ``group`` (``what``: the helper, for messages)."""
    if not cpu:
        work.wait()
        return
    try:
        if STATE.unconfirmed:  # see confirm_in_wait in axolotl_dist.debug.checked
            confirm_all()
        try:
            work.wait(_SLICE)
            return
        except RuntimeError as exc:
            if not _timed_out(exc):
                raise
        _wait_long(work, group, what)
    except BaseException as exc:
        _left(work, group, exc)
        raise


def _left(work: Any, group: Any, exc: BaseException) -> None:
    """The wait ends on ``exc`` (Ctrl-C, a signal handler's ``SystemExit``, a lost peer) with
    the collective maybe still pending: see :func:`keep_abandoned`. An exception raised while a
    slice's timeout was being handled does not show that timeout as its context."""
    try:
        if not work.is_completed():
            state = state_of(group)
            if state is not None:
                state.abandoned = True  # publish_exit then sets .watch.pending_key
                _ABANDONED.append(work)
    except Exception:  # noqa: BLE001 - best effort: the exception itself matters
        pass
    if isinstance(exc.__context__, RuntimeError) and _timed_out(exc.__context__):
        exc.__suppress_context__ = True


#: Collectives whose wait was abandoned, kept (never released) with their groups.
_ABANDONED: List[Any] = []


def keep_abandoned() -> List[Any]:
    """Keep every group with a collective left pending, and that work, alive until the process
    ends; return those groups.

    Destroying a gloo group joins its worker threads, and a worker inside a pending collective
    stays there until every peer arrives or the group's timeout passes (30 minutes by default):
    the exit of a rank interrupted in a barrier would wait for the straggler. The backend's
    ``abort()`` does not wake it (torch 2.13). So such a group gets one reference more than
    anything will ever release: ``destroy_process_group()`` still unregisters it, its destructor
    never runs, and the process exits with the worker still waiting (the OS ends it)."""
    kept = []
    for pg, state in list(STATE.groups.items()):
        if getattr(state, "abandoned", False):
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))
            kept.append(pg)
    for work in _ABANDONED:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(work))
    _ABANDONED.clear()
    return kept


def _wait_long(work: Any, group: Any, what: str) -> None:
    me = dist.get_rank()
    peers: List[int] = [r for r in global_ranks(group) if r != me]
    thread = threading.get_ident()
    waited_for: List[int] = list(peers)
    STATE.waits[thread] = where.Registered(what, waited_for)
    marked = False
    try:
        watcher = Watch(world_store(), me)
        watcher.store.add(waiting_key(me), 1)
        marked = True
        start = time.monotonic()
        every = kit_seconds(WAIT_LOG_INTERVAL_ENV_VAR)
        next_log = start + every
        told_where = False
        next_look = start  # the first look at the peers at once: a dead one is named promptly
        while True:
            now = time.monotonic()
            if now >= next_look:
                next_look = now + LIVENESS_INTERVAL
                lost = watcher.find_lost(peers, now, what)
                if lost and not _completes(work, _grace(watcher, lost)):
                    raise lost_error(lost, what)
                if now >= next_log:
                    place = ""
                    if not told_where:
                        told_where = True
                        text = where_they_are(peers)
                        place = f"; where they are:\n{text}" if text else ""
                    log.warning("rank %d has waited %.0f s in %s for rank(s) %s%s", me,
                                now - start, what, peers, place)
                    every = min(every * 2, MAX_WAIT_LOG_INTERVAL)
                    next_log = now + every
            try:
                work.wait(_SLICE)
                break
            except RuntimeError as exc:
                if not _timed_out(exc):
                    raise
    finally:
        STATE.waits.pop(thread, None)
    if marked:  # a normal end (an exception keeps the count: see watch.waiting_key)
        try:
            watcher.store.add(waiting_key(me), -1)
        except Exception:  # noqa: BLE001 - the collective completed; the store may be gone
            pass


#: Seconds a collective may still take to complete once a peer is found to have exited
#: normally: it finished its part of this collective before it left (its last messages are
#: still being processed here). A peer that failed gets :data:`SLICE` twice: it may have
#: failed on the line after this collective (a wait that looked at the peers just before the
#: collective completed here); one that left this collective pending (Ctrl-C in it) none.
LOST_GRACE = 1.0


def _grace(watcher: Watch, lost: List[Any]) -> float:
    """Seconds the collective gets to complete, given the ``lost`` peers (see
    :data:`LOST_GRACE`): store calls only while the store's host stays."""
    if host_leaving():
        return 0.0
    try:
        if any(watcher.store.check([pending_key(gone.rank)]) for gone in lost):
            return 0.0
    except Exception:  # noqa: BLE001 - the store is going: name the peer now
        return 0.0
    if all(gone.how == "exited" and gone.report is None for gone in lost):
        return LOST_GRACE
    return 2 * SLICE


def _completes(work: Any, grace: float) -> bool:
    """Whether ``work`` completes within ``grace`` seconds (in slices, so that a signal is
    still handled). A collective a lost peer never joined fails at once (its connections
    closed) or times out here: then the caller names the peer."""
    try:
        if work.is_completed():
            return True
    except RuntimeError:
        return False
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            work.wait(_SLICE)
            return True
        except RuntimeError as exc:
            if not _timed_out(exc):
                return False
    return False


def wait_all(works: List[Any], group: Any, what: str, cpu: bool = True) -> None:
    """:func:`wait` for each of ``works`` in turn."""
    for work in works:
        wait(work, group, what, cpu)
