"""Waiting for a collective's work the way the kit waits for anything: interruptible, watching.

A blocking ``work.wait()`` keeps the main thread in C++ until the collective completes: Ctrl-C
and SIGTERM wait for it (Python runs signal handlers between bytecodes), a peer that died
before the call leaves it waiting for the group's timeout (30 minutes by default), and nothing
says who it waits for. So on CPU backends (gloo) :func:`wait` waits in slices: a collective
that completes within the first slice costs what a blocking wait costs; past it, between
slices, Python handles signals, the peers of the group are judged
(:class:`~.watch.Watch`: exit records, pids, heartbeats; a lost peer raises
:class:`~axolotl_dist.errors.RankFailedError` naming it), the wait is registered for
:mod:`.where`, and after ``AXOLOTL_DIST_WAIT_LOG_INTERVAL`` seconds a warning says whom it
waits for and where they are. Accelerator backends (NCCL) keep their own wait.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, List

import torch.distributed as dist

from . import where
from .constants import (DEFAULT_WAIT_LOG_INTERVAL, LIVENESS_INTERVAL, MAX_WAIT_LOG_INTERVAL,
                        WAIT_LOG_INTERVAL_ENV_VAR)
from .envvars import read_seconds
from .logs import kit as log
from .groups import global_ranks
from .state import STATE
from .store import world_store
from .wait import where_they_are
from .watch import Watch, lost_error

__all__ = ["wait", "wait_all", "FIRST_SLICE"]

#: Seconds of the first (blocking) slice: most collectives are done by then.
FIRST_SLICE = 0.25
_FIRST = timedelta(seconds=FIRST_SLICE)
_SLICE = timedelta(seconds=LIVENESS_INTERVAL)


def _timed_out(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and "timed out" in str(exc).lower()


def wait(work: Any, group: Any, what: str, cpu: bool = True) -> None:
    """Wait for ``work`` of a collective on ``group`` (``what``: the helper, for messages)."""
    if not cpu:
        work.wait()
        return
    try:
        work.wait(_FIRST)
        return
    except RuntimeError as exc:
        if not _timed_out(exc):
            raise
    _wait_long(work, group, what)


def _wait_long(work: Any, group: Any, what: str) -> None:
    me = dist.get_rank()
    peers: List[int] = [r for r in global_ranks(group) if r != me]
    thread = threading.get_ident()
    waited_for: List[int] = list(peers)
    STATE.waits[thread] = where.Registered(what, waited_for)
    try:
        watcher = Watch(world_store(), me)
        start = time.monotonic()
        every = read_seconds(WAIT_LOG_INTERVAL_ENV_VAR, DEFAULT_WAIT_LOG_INTERVAL)
        next_log = start + every
        told_where = False
        while True:
            now = time.monotonic()
            lost = watcher.find_lost(peers, now, what)
            if lost:
                raise lost_error(lost, what)
            if now >= next_log:
                place = ""
                if not told_where:
                    told_where = True
                    text = where_they_are(peers)
                    place = f"; where they are:\n{text}" if text else ""
                log.warning("rank %d has waited %.0f s in %s for rank(s) %s%s", me, now - start,
                            what, peers, place)
                every = min(every * 2, MAX_WAIT_LOG_INTERVAL)
                next_log = now + every
            try:
                work.wait(_SLICE)
                return
            except RuntimeError as exc:
                if not _timed_out(exc):
                    raise
    finally:
        STATE.waits.pop(thread, None)


def wait_all(works: List[Any], group: Any, what: str, cpu: bool = True) -> None:
    """:func:`wait` for each of ``works`` in turn."""
    for work in works:
        wait(work, group, what, cpu)
