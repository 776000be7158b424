"""Sleeping through a long kit wait: one blocking ``store.wait`` instead of polls.

A rank that waits for a store word to change (a ``zero_first`` waiter, for rank 0's body)
polls it only briefly; then it asks to be woken (:func:`arm`: one ``compare_set`` that sets
the word's :data:`BELL` bit unless the word changed meanwhile) and a :class:`Bell` sleeps on
the block's bell key: a daemon thread blocked in ``store.wait`` on a second connection, so
the waiting rank sends no request until the rank it waits for rings (``set`` of the bell key,
made only by an ``add`` that finds the bell bit set). The wait itself keeps its liveness looks
(:mod:`..liveness.waits`).

The second connection of the default group is the heartbeat's (a :class:`Spare`, lent while
the bell sleeps: the heartbeat uses the group's own connection meanwhile), so a rank opens one
extra connection in its life, at a moment staggered by its rank: every connection costs the
store's host a reverse name lookup in its event loop (docs/design.md, "Connections"), and W
ranks opening one each at the same moment stall the store for seconds at W >= 16. Another
group's sleep clones the group's store once and keeps the clone for its next sleep.

A ``store.wait`` cannot be interrupted, and one that times out makes torch print two C++
warnings, so a bell's wait has no timeout of its own: a wait that ends before the bell rang
(a lost peer, a timeout, Ctrl-C) rings its own bell (:meth:`Bell.release`), and a rank that
learns that the store's host is leaving releases every bell first (:func:`release_all`), so
no thread is left inside a store call when the store goes, or when the interpreter exits.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Optional, Tuple

from ..base.groups import Group
from ..base.state import STATE
from . import records
from .access import bounded, checked

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import Store

__all__ = ["BELL", "Bell", "Spare", "arm", "bell_key", "ring", "sleep_on", "spare_of", "release_all"]

#: A block's word 0, bit 31: a waiter sleeps on the block's bell (see docs/design.md,
#: "A long wait sleeps").
BELL = 1 << 31

#: How long a bell's ``store.wait`` may block: in effect for ever (it ends when rung).
_FOREVER = timedelta(days=3650)
#: Seconds a release may wait for the store to answer its ring.
_RELEASE_WAIT = 1.0
#: Guards ``STATE.bells``: the bells whose thread may still be blocked in the store.
_LOCK = threading.Lock()


class Spare:
    """The heartbeat's own connection to the default group's store, lent to that group's
    bells. The heartbeat holds :attr:`lock` around each turn and uses the group's connection
    while :attr:`lent` (a connection blocked in ``wait`` answers nothing else); a bell takes it
    only between turns (:meth:`borrow` never waits for the lock) and gives it back when its
    wait returns."""

    __slots__ = ("lock", "conn", "lent")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.conn: Optional["Store"] = None  # set by the heartbeat once it connected
        self.lent = False

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


class Bell:
    """A thread blocked in ``conn.wait([key])`` until ``key`` is set; ``rung`` is set then."""

    __slots__ = ("group", "store", "conn", "key", "rung", "failed", "thread", "spare")

    def __init__(self, group: Group, store: "Store", conn: "Store", key: str,
                 spare: Optional[Spare] = None) -> None:
        self.group, self.store, self.conn, self.key, self.spare = group, store, conn, key, spare
        self.rung = threading.Event()
        self.failed = False  # the wait raised (the store is gone): the caller's next call says why
        self.thread = threading.Thread(target=self._sleep, name="axolotl-dist-bell", daemon=True)
        with _LOCK:
            STATE.bells.append(self)
        self.thread.start()

    def _sleep(self) -> None:
        try:
            self.conn.wait([self.key])
        except Exception:  # noqa: BLE001 - the store is gone; the waiting thread's call says so
            self.failed = True
        with _LOCK:
            if self in STATE.bells:
                STATE.bells.remove(self)
            if self.spare is None and not self.failed and self.group.sleep_store is None:
                self.group.sleep_store = self.conn  # free for the group's next sleep
        if self.spare is not None:
            self.spare.give_back()
        self.rung.set()

    def release(self) -> None:
        """End the sleep if the bell has not rung: ring it (waking any other rank asleep on
        it too, which then reads its word and polls), on the store worker, for at most
        :data:`_RELEASE_WAIT` seconds (the store's host may be stopped). Never raises."""
        if not self.rung.is_set():
            bounded(lambda: self.store.set(self.key, b""), _RELEASE_WAIT)


def bell_key(word0: str) -> str:
    """The bell of the block whose word 0 is ``word0``."""
    return f"{word0}/bell"


def ring(store: "Store", word0: str) -> None:
    """Wake the ranks asleep on ``word0``'s bell (an ``add`` that can release them found
    :data:`BELL` set)."""
    store.set(bell_key(word0), b"")


def arm(group: Group, store: "Store", word0: str, seen: int) -> Tuple[Optional["Bell"], int]:
    """Ask to be woken when ``word0`` changes in a way that releases this waiter: set its
    :data:`BELL` bit unless the word changed since it read ``seen``, then sleep. Returns the
    bell (None: the word changed, or no connection to sleep on: poll once more) and the word
    as now known."""
    if not seen & BELL:
        have = _word(store.compare_set(word0, str(seen), str(seen | BELL)), word0)
        if have != seen | BELL:
            return None, have
        seen = have
    return sleep_on(group, group.store, bell_key(word0)), seen


def _word(data: bytes, key: str) -> int:
    """A block's word as ``compare_set`` returned it; DistributedEnvError naming ``key`` for
    anything but the number the ranks' ``add`` calls keep there."""
    return checked(lambda raw: records.read_number(raw, "a block's word"), data, key)


def sleep_on(group: Group, store: "Store", key: str) -> Optional[Bell]:
    """Start sleeping on ``key`` of ``group``'s ``store`` (see the module docstring); None if
    there is no second connection now (the heartbeat's is not made yet, or in use) or ever (a
    ``HashStore``, a ``FileStore``)."""
    spare = spare_of(group)
    if spare is not None:
        conn = spare.borrow()
        return None if conn is None else Bell(group, store, conn, key, spare)
    with _LOCK:
        conn, group.sleep_store = group.sleep_store, None
    if conn is None:
        try:
            conn = store.clone()
            conn.set_timeout(_FOREVER)
        except Exception:  # noqa: BLE001 - no clone: poll
            return None
    return Bell(group, store, conn, key)


def spare_of(group: Group) -> Optional[Spare]:
    """The heartbeat's connection if ``group`` is the default group and its heartbeat can
    make one (its store has ``clone``), else None."""
    beat = STATE.heartbeat
    spare = getattr(beat, "spare", None) if group.default else None
    return spare if spare is not None and getattr(beat, "pg", None) is group.pg_ref() else None


def release_all() -> None:
    """Release every bell still asleep (the store's host is about to leave)."""
    with _LOCK:
        active = list(STATE.bells)
    for bell in active:
        bell.release()
