"""Deleting finished blocks' store keys in the background (see docs/design/blocks.md, "zero_first
blocks"): a daemon thread with a connection of its own per group, so the deletions neither
wait on nor are counted against the caller's; if it falls behind, the caller deletes its
own, so the backlog stays bounded. On the default group that connection is the heartbeat's,
borrowed (:class:`.wakeup.LentConnection`; the group's own while a key waiter has it): every new connection
costs the store's host a name lookup (docs/design/liveness.md, "Connections").
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, List, Optional

from ..base.groups import Group
from ..base.state import RoomState, register
from .store_state import STORE
from . import wakeup
from .access import kit_store

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import Store

__all__ = ["delete", "flush_cleanup", "SWEEP", "SweepState"]


class Cleanup:
    """A daemon thread that deletes finished blocks' keys on its own store connection per
    group, so none of it waits on, or is counted against, the caller's connection. Once woken
    it looks for more work every :data:`POLL` seconds (doubling while it finds none) until it
    has found none for :data:`LINGER` seconds: in a loop of blocks the caller just appends to
    its list (waking a thread costs the caller a system call, tens of microseconds on a busy
    VM)."""

    def __init__(self) -> None:
        self._todo: List[Any] = []
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._batch = False  # the thread is deleting a batch it took from _todo
        self._queued = 0  # keys in _todo (a count, not a sum per call)

    def kick(self) -> None:
        """Wake the thread if work waits and it is parked (checked under the lock, which the
        thread holds while it decides to park: no job is left behind)."""
        if not self._todo:
            return
        with self._lock:
            alive = self._thread is not None and self._thread.is_alive()  # not after a fork
            if alive and not self._idle.is_set():
                return  # awake: it will find the job
            self._idle.clear()
            if not alive:
                thread = threading.Thread(target=self._run, daemon=True,
                                          name="axolotl-dist-cleanup")
                try:
                    thread.start()
                except RuntimeError:  # at interpreter shutdown (CPython 3.12.0-3.12.2)
                    self._idle.set()
                    todo, self._todo, self._queued = self._todo, [], 0
                    for group, store, keys in todo:
                        self._delete(group, store, keys)
                    return
                self._thread = thread
            self._work.set()

    def flush(self, seconds: float) -> bool:
        """Wait (at most ``seconds``) until every queued deletion is done; True if so."""
        self.kick()
        deadline = time.monotonic() + seconds
        while self._todo or self._batch:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.001)
        return True

    def _run(self) -> None:
        while True:
            self._work.wait()
            last = time.monotonic()  # when work was last found
            delay = POLL
            while True:
                if self._todo:
                    self._batch = True
                    todo, self._todo = self._todo, []
                    self._queued = 0
                    for group, store, keys in todo:
                        self._delete(group, store, keys)
                    self._batch = False
                    last, delay = time.monotonic(), POLL
                    continue
                with self._lock:
                    if not self._todo and time.monotonic() - last >= LINGER:
                        self._work.clear()
                        self._idle.set()
                        break
                time.sleep(delay)
                delay = min(2 * delay, _MAX_POLL)  # found none: look less often

    @staticmethod
    def _delete(group: Group, store: "Store", keys: List[str]) -> None:
        lent = wakeup.lent_connection_of(group)
        borrowed = lent.borrow() if lent is not None else None
        try:
            conn = borrowed or (kit_store(group) if lent is not None
                                else _own_connection(group, store))
            for key in keys:
                conn.delete_key(key)
        except Exception:  # noqa: BLE001 - the store or group is gone: nothing left to clean
            pass
        finally:
            if borrowed is not None:
                lent.give_back()  # type: ignore[union-attr]


def _own_connection(group: Group, store: "Store") -> "Store":
    """The cleanup's connection for a group without the heartbeat's to borrow: a clone of
    ``store``, made once (``store`` itself where it has no ``clone``)."""
    connections = STORE.groups[group]
    if connections.cleanup is None:
        try:
            connections.cleanup = store.clone()
        except Exception:  # noqa: BLE001 - stores without clone: the same connection
            connections.cleanup = store
    return connections.cleanup


#: Seconds between the awake thread's looks for work, and how long it stays awake without any.
#: A look that finds none doubles the next gap, up to :data:`_MAX_POLL`: lingering costs about
#: 7 wake-ups, not 125 (at 64 ranks on 2 cores, 64 threads polling every 2 ms took CPU from
#: the collectives that followed a block: docs/performance.md, "Many ranks").
POLL = 0.002
LINGER = 0.25
_MAX_POLL = 0.064
#: Queued keys beyond which the caller deletes its own (see :func:`delete`).
_BACKLOG = 8


class SweepState(RoomState):
    """``cleanup``: this process's :class:`Cleanup`, made at its first use."""

    def __init__(self) -> None:
        self.cleanup: Optional[Cleanup] = None


SWEEP = register("sweep", SweepState())


def delete(group: Group, store: "Store", keys: List[str]) -> None:
    """Delete ``keys`` of ``group``'s blocks in the background, on this process's
    :class:`Cleanup` (``SWEEP.cleanup``, made at its first use). With :data:`_BACKLOG` keys
    already queued (the thread is short of CPU), delete them here instead, so the backlog stays
    bounded."""
    cleanup = SWEEP.cleanup
    if cleanup is None:
        cleanup = SWEEP.cleanup = Cleanup()
    if cleanup._queued >= _BACKLOG:
        for key in keys:
            store.delete_key(key)
        return
    cleanup._queued += len(keys)
    cleanup._todo.append((group, store, keys))
    cleanup.kick()


def flush_cleanup(seconds: float = 1.0) -> bool:
    """Let the background cleanup finish the deletions queued (at most ``seconds``)."""
    return SWEEP.cleanup is None or SWEEP.cleanup.flush(seconds)
