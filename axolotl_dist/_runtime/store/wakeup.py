"""Waking a long kit wait: one blocking ``store.wait`` instead of polls.

A rank that waits for a store word to change (a ``zero_first`` waiter, for rank 0's body)
polls it only briefly; then it asks to be woken (:func:`request_wake`: one ``compare_set`` that
sets the word's :data:`WAKE_BIT` unless the word changed meanwhile) and a :class:`KeyWaiter`
blocks on the block's wake key: a daemon thread in ``store.wait`` on a second connection, so
the waiting rank sends no request until the rank it waits for wakes it (:func:`wake`: a
``set`` of the wake key, made only by an ``add`` that finds the wake bit set). The wait itself
keeps its liveness checks (:mod:`..liveness.waits`).

The second connection of the default group is the heartbeat's (a :class:`LentConnection`, lent
while the key waiter blocks: the heartbeat uses the group's own connection meanwhile), so a
rank opens one extra connection in its life, at a moment staggered by its rank: every
connection costs the store's host a reverse name lookup in its event loop (docs/design/liveness.md,
"Connections"), and W ranks opening one each at the same moment stall the store for seconds at
W >= 16. Another group's key waiter clones the group's store once and keeps the clone for its
next wait.

A ``store.wait`` cannot be interrupted, and one that times out makes torch print two C++
warnings, so a key waiter has no timeout of its own: a wait that ends before it was woken (a
lost peer, a timeout, Ctrl-C) wakes its own key (:meth:`KeyWaiter.release`), and a rank that
finds that the store's host is leaving releases every key waiter first
(:func:`release_key_waiters`), so no thread is left inside a store call when the store goes,
or when the interpreter exits.
"""
from __future__ import annotations

import threading
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple

from ..base.groups import Group
from ..base.state import RoomState, register
from .store_state import STORE
from .access import bounded, counter, kit_store

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import Store

__all__ = ["WAKE_BIT", "KeyWaiter", "LentConnection", "request_wake", "wake_key", "wake",
           "start_key_waiter", "offer_connection", "lent_connection_of", "release_key_waiters",
           "WAKEUP", "WakeupState"]

#: A block's word 0, bit 31: a waiter blocks on the block's wake key (see docs/design/blocks.md,
#: "A long wait sleeps").
WAKE_BIT = 1 << 31

#: How long a key waiter's ``store.wait`` may block: in effect for ever (it ends when woken).
_FOREVER = timedelta(days=3650)
#: Seconds a release may wait for the store to answer its wake-up.
_RELEASE_WAIT = 1.0
#: Guards ``WAKEUP.key_waiters``: the key waiters whose thread may still be blocked in the store.
_LOCK = threading.Lock()


class LentConnection:
    """The heartbeat's own connection to the default group's store, lent to that group's
    key waiters. The heartbeat holds :attr:`lock` around each turn and uses the group's connection
    while :attr:`lent` (a connection blocked in ``wait`` answers nothing else); a key waiter takes it
    only between turns (:meth:`borrow` never waits for the lock) and gives it back when its
    wait returns."""

    __slots__ = ("lock", "conn", "lent")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.conn: Optional["Store"] = None  # set by the heartbeat once it connected
        self.lent = False

    def connected(self, conn: "Store") -> None:
        """The heartbeat's connection is made: ``conn``, offered from now on."""
        self.conn = conn

    def borrow(self) -> Optional["Store"]:
        """The connection, now lent; None while it is not made yet, lent, or in use."""
        if not self.lock.acquire(blocking=False):
            return None
        try:
            if self.conn is None or self.lent:
                return None
            self.lent = True
            return self.conn
        finally:
            self.lock.release()

    def give_back(self) -> None:
        with self.lock:
            self.lent = False


class KeyWaiter:
    """A thread blocked in ``conn.wait([key])`` until ``key`` is set; ``woken`` is set then."""

    __slots__ = ("group", "store", "conn", "key", "woken", "failed", "thread", "lent")

    def __init__(self, group: Group, store: "Store", conn: "Store", key: str,
                 lent: Optional[LentConnection] = None) -> None:
        self.group, self.store, self.conn, self.key, self.lent = group, store, conn, key, lent
        self.woken = threading.Event()
        self.failed = False  # the wait raised (the store is gone): the caller's next call says why
        self.thread = threading.Thread(target=self._sleep, name="axolotl-dist-key-wait", daemon=True)
        with _LOCK:
            WAKEUP.key_waiters.append(self)
        self.thread.start()

    def _sleep(self) -> None:
        try:
            self.conn.wait([self.key])
        except Exception:  # noqa: BLE001 - the store is gone; the waiting thread's call says so
            self.failed = True
        with _LOCK:
            if self in WAKEUP.key_waiters:
                WAKEUP.key_waiters.remove(self)
            connections = STORE.groups[self.group]
            if self.lent is None and not self.failed and connections.idle is None:
                connections.idle = self.conn  # free for the group's next sleep
        if self.lent is not None:
            self.lent.give_back()
        self.woken.set()

    def release(self) -> None:
        """End the wait if it was not woken: wake its key (waking any other rank blocked on
        it too, which then reads its word and polls), on the store worker, for at most
        :data:`_RELEASE_WAIT` seconds (the store's host may be stopped). Never raises."""
        if not self.woken.is_set():
            bounded(lambda: self.store.set(self.key, b""), _RELEASE_WAIT)


def wake_key(word0: str) -> str:
    """The wake key of the block whose word 0 is ``word0``."""
    return f"{word0}/wake"


def wake(store: "Store", word0: str) -> None:
    """Wake the ranks blocked on ``word0``'s wake key (an ``add`` that can release them found
    :data:`WAKE_BIT` set)."""
    store.set(wake_key(word0), b"")


def request_wake(group: Group, store: "Store", word0: str, seen: int) -> Tuple[Optional["KeyWaiter"], int]:
    """Ask to be woken when ``word0`` changes in a way that releases this waiter: set its
    :data:`WAKE_BIT` bit unless the word changed since it read ``seen``, then wait for the key. Returns the
    key waiter (None: the word changed, or no connection to wait on: poll once more) and the word
    as now known."""
    if not seen & WAKE_BIT:
        have = _word(store.compare_set(word0, str(seen), str(seen | WAKE_BIT)), word0)
        if have != seen | WAKE_BIT:
            return None, have
        seen = have
    return start_key_waiter(group, kit_store(group), wake_key(word0)), seen


def _word(data: bytes, key: str) -> int:
    """A block's word as ``compare_set`` returned it; DistributedEnvError naming ``key`` for
    anything but the number the ranks' ``add`` calls keep there."""
    return counter(data, key, "a block's word")


def start_key_waiter(group: Group, store: "Store", key: str) -> Optional[KeyWaiter]:
    """Start a key waiter on ``key`` of ``group``'s ``store`` (see the module docstring); None if
    there is no second connection now (the heartbeat's is not made yet, or in use) or ever (a
    ``HashStore``, a ``FileStore``)."""
    lent = lent_connection_of(group)
    if lent is not None:
        conn = lent.borrow()
        return None if conn is None else KeyWaiter(group, store, conn, key, lent)
    connections = STORE.groups[group]
    with _LOCK:
        conn, connections.idle = connections.idle, None
    if conn is None:
        try:
            conn = store.clone()
            conn.set_timeout(_FOREVER)
        except Exception:  # noqa: BLE001 - no clone: poll
            return None
    return KeyWaiter(group, store, conn, key)


class WakeupState(RoomState):
    """``key_waiters``: the threads blocked in a ``store.wait`` for this process's long waits;
    ``offered``: the heartbeat's own connection, offered to the default group's key waiters,
    with a reference to that group (:func:`offer_connection`)."""

    def __init__(self) -> None:
        self.key_waiters: List[KeyWaiter] = []
        self.offered: Optional[Tuple[Callable[[], Any], LentConnection]] = None


WAKEUP = register("wakeup", WakeupState())


def offer_connection(pg: Any, conn: Optional[LentConnection]) -> None:
    """The heartbeat of ``pg`` (the default group) lends ``conn`` to that group's key waiters
    from now on; ``conn`` None: it lends nothing (stopped, or its store cannot ``clone``)."""
    WAKEUP.offered = None if conn is None or pg is None else (weakref.ref(pg), conn)


def lent_connection_of(group: Group) -> Optional[LentConnection]:
    """The heartbeat's connection if ``group`` is the default group and its heartbeat offers
    one (:func:`offer_connection`), else None."""
    offer = WAKEUP.offered
    if offer is None or not group.default:
        return None
    pg, conn = offer
    return conn if pg() is group.pg_ref() else None


def release_key_waiters() -> None:
    """Release every key waiter still blocked (the store's host is about to leave)."""
    with _LOCK:
        active = list(WAKEUP.key_waiters)
    for waiter in active:
        waiter.release()
