"""The heartbeat: each rank's daemon thread, soon on its own store connection.

At init the ranks of a multi-rank group agree on a run id (the first to write one wins);
every rank records itself (:mod:`.peers`) and starts a thread that bumps
``axolotl_dist/<run>/hb/<rank>`` every :data:`~..base.constants.HEARTBEAT_INTERVAL` seconds.
The thread opens its own connection (lent to the default group's key waiters:
:class:`~..store.wakeup.LentConnection`) at a moment spread over the ranks, and makes no store
call before (the main thread may hold the group's connection in a C++ wait). It first copies the other ranks' records (at once, in short doubling waits), so a
rank can still be named, and the store's host found gone by its pid, after the store is
gone; it answers requests for a snapshot of this rank (:mod:`.where_report`), copies the store
host's failure record, and on global rank 0 runs the stall detector (:class:`~.stalls.StallDetector`)
while some rank waits, and the tasks (:class:`..base.hooks.HeartbeatTask`). The sequence is in docs/design/liveness.md,
"Heartbeat and peer records".
"""

from __future__ import annotations

import os
import threading
import time
import uuid
import weakref
from typing import TYPE_CHECKING, Any, Optional, Tuple

import torch.distributed as dist

from ..base import hooks, procs
from ..base.state import RoomState, register
from ..base.constants import HEARTBEAT_INTERVAL, HOST
from ..base.groups import default_pg
from .liveness_state import HEARTBEAT, PEERS, Peer
from ..store import keys, records, seals, wakeup
from ..store.access import genuine, parsed, set_if_absent, put, store_host, world_store
from ..store.clients import raw_store
from . import runs, where_report
from .dead_peers import DeadPeers
from .stuck import StuckWatch, stuck_watch
from .stragglers import StragglerWatch, straggler_watch
from .stalls import StallDetector, create_world_keys
from .peers import (STALL_CHECK_INTERVAL, encode_peer, host_leaving, launcher_name, peer, store_host_gone)

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import Store

__all__ = ["start_heartbeat", "stop_heartbeat", "exit_connection", "BEAT", "BeatState"]


def _run_id(base: "Store") -> str:
    """The id every rank of this group agrees on: the first rank to write one wins (one not
    sealed by this run is replaced: :func:`~..store.access.set_if_absent`)."""
    mine = uuid.uuid4().hex[:records.RUN_ID_LENGTH]
    return parsed(records.read_run_id, set_if_absent(base, keys.RUN, mine), keys.RUN)


# --- what runs on rank 0's heartbeat ---------------------------------------------------------

class BeatState(RoomState):
    """``thread``: this rank's :class:`Heartbeat`, if running; ``dead_peers``: the watch that
    ends this process when a peer died (:mod:`.dead_peers`); ``stuck``: the watch that reports
    the run stuck in a collective (:mod:`.stuck`); ``stragglers``: the one that names a rank
    issuing the run's collectives last (:mod:`.stragglers`)."""

    def __init__(self) -> None:
        self.thread: Optional[Heartbeat] = None
        self.dead_peers: Optional[DeadPeers] = None
        self.stuck: Optional[StuckWatch] = None
        self.stragglers: Optional[StragglerWatch] = None


BEAT = register("beat", BeatState())


def _pending() -> bool:
    return any(r.pending() for r in hooks.heartbeat_tasks())


# --- the heartbeat ---------------------------------------------------------------------------


class _Schedule:
    """What a heartbeat does when: ``interval`` between beats; ``connect_at``, when it opens its
    own connection (spread over the ranks: :func:`_connect_delay`); when it last beat, ran a
    stall detector's round and looked for its tasks' work; ``stall_rounds`` (rank 0, while some
    rank waits: a round every :data:`~.peers.STALL_CHECK_INTERVAL`); ``copying`` (the first
    records are still being copied: see :meth:`Heartbeat._run`)."""

    __slots__ = ("interval", "connect_at", "last_beat", "last_round", "last_look", "stall_rounds",
                 "copying")

    def __init__(self, interval: float, connect_at: float) -> None:
        self.interval, self.connect_at = interval, connect_at
        self.last_beat = self.last_round = self.last_look = 0.0
        self.stall_rounds = False
        self.copying = False


class Heartbeat:
    """Beats on the root store (``axolotl_dist/<run>/hb/<rank>``) every interval, answers
    requests for a snapshot of this rank (:mod:`.where_report`), copies the store host's failure
    record when it leaves one, and, on global rank 0, checks every rank's heartbeat while some
    rank waits (see :meth:`_detect_stalls`). Idle, that is one or two store calls per interval, however
    many ranks there are."""

    def __init__(self, store: "Store", raw: "Store", run: str, rank: int, world_size: int,
                 interval: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.stop = threading.Event()
        self.wake = threading.Event()  # halt(); rank 0: a task's work (hooks.HeartbeatTask)
        #: the group's connection (the main thread's too), for the group's keys and the root's
        self.base, self.base_raw, self.run = store, raw, run
        #: what this thread's turn uses: its own connection (:attr:`own`) once made and
        #: while not lent to a key waiter, else the group's (see :meth:`_turn`)
        self.store, self.raw = store, raw
        self.own: Optional[wakeup.LentConnection] = wakeup.LentConnection()
        self.own_raw: Any = None
        self.when = _Schedule(interval, time.monotonic() + _connect_delay(rank, world_size))
        self.pg = default_pg()
        self.answered = 0
        host = store_host()
        #: the records copied at once: the store host's (found by its pid once its store is
        #: gone) and rank 0's (the rank most waits are for); others when a wait needs them
        self.first = sorted({r for r in (0, host) if r is not None and r != rank})
        self.host = host if host is not None and host != rank else None
        self.stall_detector = StallDetector(run, world_size) if rank == 0 else None
        me = Peer(HOST, os.getpid(), procs.MACHINE, launcher_name(), procs.beside_store())
        PEERS.peers[rank] = me
        # the record, and this rank's long-wait description and finding (none yet): one call
        names = [keys.who(run, rank), keys.long_wait(run, rank), keys.stuck(run, rank),
                 keys.arrivals(run, rank)]  # the last: the straggler report's (empty: none yet)
        values = [seals.seal(k, v) for k, v in zip(names, [encode_peer(me), "", "", ""])]
        try:
            raw.multi_set(names, values)
        except (AttributeError, NotImplementedError, RuntimeError):  # a store without it
            for key, value in zip(names, values):
                raw.set(key, value)
        raw.add(keys.heartbeat(run, rank), 1)
        store.add(keys.waiting(rank), 0)  # created now: the key count stays flat afterwards
        if rank == 0:  # the world's keys, made once (a reader that finds none makes them)
            create_world_keys(store)
        wakeup.offer_connection(self.pg, self.own)  # lent to the default group's key waiters
        self.thread = threading.Thread(target=self._run, name="axolotl-dist-heartbeat", daemon=True)
        self.thread.start()

    def _copy_first(self) -> bool:
        """Copy the records of :attr:`first` that exist; whether all are here."""
        missing = [r for r in self.first if r not in PEERS.peers]
        for r in missing:
            peer(self.raw, r)
        return all(r in PEERS.peers for r in self.first)

    def _beat(self, key: str) -> None:
        count = self.raw.add(key, 1)
        requests = keys.requests_of(count)
        dead = BEAT.dead_peers
        if dead is not None:
            dead.turn(self.store, self.raw, count, time.monotonic())
        if requests > self.answered:  # someone asked where this rank is
            self.answered = requests
            where_report.answer(self.raw, self.run, self.rank, requests)
        stuck = BEAT.stuck
        if stuck is not None:  # its own report answers this rank's request
            self.answered = max(self.answered, stuck.beat(self.raw, time.monotonic()))
        stragglers = BEAT.stragglers
        if stragglers is not None:
            stragglers.beat(self.raw, time.time())
        if self.host is not None:
            self._copy_host_exit()
        if self.rank == 0 and self.world_size > 1:  # the stall detector: on while some rank waits
            self._waiters()

    def _waiters(self) -> None:
        """Rank 0: look for stalls while some rank's wait runs long; tell the tasks (see hooks.HeartbeatTask)."""
        value = self.store.add(keys.WAITERS, 0)
        self.when.stall_rounds = value & keys.LONG_WAITS > 0
        for task in hooks.heartbeat_tasks():
            task.read(self, value)

    def store_usable(self) -> bool:
        """Whether a store call may be made (see :func:`host_leaving`)."""
        return not host_leaving() and not store_host_gone()

    def halt(self) -> None:
        """Stop the thread, at once even where it sleeps."""
        self.stop.set()
        self.wake.set()

    def _copy_host_exit(self) -> None:
        """Copy the store host's exit record once it left one, and acknowledge it: where the
        host exits on a failure, every rank then knows the root cause before the store goes
        (the host waits until they acknowledged), even one that was not in a kit call
        (:func:`.peers.store_lost_error`). One store call while there is none."""
        key = keys.exit_record(self.host)
        if self.host in PEERS.exits or not self.store.check([key]):
            return
        try:
            data = genuine(key, self.store.get(key))
            if data is None:
                return  # not this run's: the genuine record overwrites it
            PEERS.exits[self.host] = records.read_exit(data)  # type: ignore[index]
        except records.BadRecord:
            PEERS.exits[self.host] = (None, time.time())  # type: ignore[index] # unreadable
        if host_leaving():  # the store goes once all acknowledged: no wait may be left in it
            wakeup.release_key_waiters()
        self.store.set(keys.ack(key, self.rank), b"")
        if host_leaving():
            raise _HostLeaving()  # the last store call of this heartbeat

    def _detect_stalls(self) -> None:
        """One round of rank 0's stall detector (:class:`~.stalls.StallDetector`)."""
        assert self.stall_detector is not None
        self.stall_detector.round(self.store, self.raw)

    def _run(self) -> None:
        key = keys.heartbeat(self.run, self.rank)
        # The first records at once, in short doubling waits (a store host that dies soon
        # after init is then found by its pid with no store call: see store_host_gone);
        # then one beat per interval.
        wait, self.when.copying = min(0.005, self.when.interval), bool(self.first)
        self.when.last_beat = self.when.last_round = self.when.last_look = time.monotonic()
        runs_tasks = self.rank == 0 and bool(hooks.heartbeat_tasks())  # runs the tasks (see hooks.HeartbeatTask)
        look = min((r.look for r in hooks.heartbeat_tasks()), default=self.when.interval)
        while True:
            self.wake.wait(wait)
            self.wake.clear()
            if self.stop.is_set():
                return
            if default_pg() is not self.pg:
                return  # the group this heartbeat belongs to is gone
            if store_host_gone():
                self._after_store_host()
                return
            try:
                self._turn(key, runs_tasks, look)
            except Exception:  # noqa: BLE001 - store gone, or its host leaving: nothing to do
                return
            wait = self._next_wait(wait, runs_tasks, look)

    def _after_store_host(self) -> None:
        """The store's host is gone: no store call is left to make; the dead-peer watch ends
        this process unless it learns of it otherwise (:mod:`.dead_peers`)."""
        dead = BEAT.dead_peers
        if dead is None or self.host is None:
            return
        dead.store_gone(self.host, "judged by its pid")
        while not self.stop.is_set():
            dead.step(time.monotonic())
            self.wake.wait(dead.next_step() or 0.5)

    def _turn(self, key: str, runs_tasks: bool, look: float) -> None:
        """One turn of the loop, on this thread's own connection unless a key waiter has it."""
        own = self.own
        if own is not None and own.conn is None:
            if time.monotonic() < self.when.connect_at:
                # no store call on the group's connection meanwhile: the main thread may be
                # blocked on it in a C++ call (a store wait) that only a peer can end
                return
            self._connect(own)
            own = self.own
        if own is None or own.conn is None:
            self._turn_on(key, runs_tasks, look)
            return
        with own.lock:
            if not own.lent:
                self.store, self.raw = own.conn, self.own_raw
            try:
                self._turn_on(key, runs_tasks, look)
            finally:
                self.store, self.raw = self.base, self.base_raw

    def _connect(self, own: wakeup.LentConnection) -> None:
        """Open this thread's own connection (lent to the default group's key waiters)."""
        try:
            conn = self.base.clone()
        except Exception:  # noqa: BLE001 - stores without clone (HashStore, FileStore)
            self.own = None
            wakeup.offer_connection(None, None)
            return
        self.own_raw = raw_store(conn)
        own.connected(conn)

    def _turn_on(self, key: str, runs_tasks: bool, look: float) -> None:
        """Copy the first records, beat when due (else, on rank 0, read the counter for the
        tasks when they wait for something), look for stalls when due, run the tasks."""
        if self.when.copying:
            self.when.copying = not self._copy_first()
        now = time.monotonic()
        if now - self.when.last_beat >= self.when.interval:
            self.when.last_beat = self.when.last_look = now
            self._beat(key)
        elif runs_tasks and _pending() and now - self.when.last_look >= look:
            self.when.last_look = now
            self._waiters()
        elif BEAT.dead_peers is not None and BEAT.dead_peers.known is not None:
            BEAT.dead_peers.step(now, self.store)  # between beats: a death's deadlines
        if self.when.stall_rounds and now - self.when.last_round >= STALL_CHECK_INTERVAL:
            self.when.last_round = now
            self._detect_stalls()
        if runs_tasks:
            for task in hooks.heartbeat_tasks():
                task.tick()

    def _next_wait(self, wait: float, runs_tasks: bool, look: float) -> float:
        """Seconds until the next turn: doubling while copying the first records, else until
        the next beat, stall detector's round or tasks' look."""
        if self.when.copying:
            return min(wait * 2, self.when.interval)
        due = self.when.last_beat + self.when.interval
        if self.own is not None and self.own.conn is None:
            due = min(due, self.when.connect_at)
        if self.when.stall_rounds:
            due = min(due, self.when.last_round + STALL_CHECK_INTERVAL)
        if runs_tasks and _pending():
            due = min(due, self.when.last_look + look)
        dead = BEAT.dead_peers
        step = dead.next_step() if dead is not None else None
        if step is not None:
            due = min(due, time.monotonic() + step)
        return max(0.0, due - time.monotonic())


def _connect_delay(rank: int, world_size: int) -> float:
    """Seconds after its start a heartbeat opens its own connection: rank r of W at
    ``r / W`` of a window of 40 ms per rank (at most one interval), so the store's host sees
    about 25 new connections a second, each costing it a reverse name lookup (docs/design/liveness.md,
    "Connections"); till then the thread makes no store call."""
    window = min(HEARTBEAT_INTERVAL, _CONNECT_SPACING * world_size)
    return window * rank / max(1, world_size)


#: Seconds between two ranks' heartbeat connections (see _connect_delay).
_CONNECT_SPACING = 0.04


class _HostLeaving(Exception):
    """The store's host is ending on a failure and this rank has its record: stop beating."""


_LOCK = threading.Lock()


def start_heartbeat() -> None:
    """Record this rank and start its heartbeat thread for the current default group
    (idempotent)."""
    pg = default_pg()
    if pg is None:
        return
    with _LOCK:
        beat = BEAT.thread
        if beat is not None and beat.pg is pg:
            return  # running, or ended on purpose: its store's host is gone
        if beat is not None:
            beat.halt()
        if beat is None or beat.pg is not pg:
            PEERS.peers.clear()
        store = world_store()
        rank, world = dist.get_rank(), dist.get_world_size()
        run = HEARTBEAT.run = _run_id(store)
        raw = raw_store(store)
        if rank == 0:  # the run's note for axolotl-dist where: alike on every rank
            put(raw, keys.RUN_NOTE, records.document({"run": run, "world": world,
                                                       "sealed": seals.sealing()}))
        runs.note_address(run, rank, world, launcher_name())
        BEAT.dead_peers = DeadPeers(run, rank, world) if world > 1 else None
        BEAT.stuck = stuck_watch(run, rank, world)
        BEAT.stragglers = straggler_watch(run, rank, world)
        BEAT.thread = Heartbeat(store, raw, run, rank, world, HEARTBEAT_INTERVAL)
        HEARTBEAT.beating = True
        HEARTBEAT.exit_store = (store, rank, weakref.ref(pg))
        for task in hooks.heartbeat_tasks():
            task.started(BEAT.thread)  # e.g. the warnings held until now


def exit_connection() -> Optional[Tuple["Store", int, Any]]:
    """The heartbeat's store connection for this process's exit record: ``(store, rank,
    weakref to the default group it belongs to)``, or None before the heartbeat started."""
    return HEARTBEAT.exit_store


def stop_heartbeat() -> None:
    """Stop the heartbeat thread, if any."""
    with _LOCK:
        beat, BEAT.thread = BEAT.thread, None
        HEARTBEAT.beating = False
    if beat is not None:
        wakeup.offer_connection(None, None)
        beat.halt()
        if beat.thread is not threading.current_thread():
            # Wait for the thread to let go of its store connection: a TCPStore still in use
            # by a daemon thread when the interpreter exits aborts the process (SIGABRT).
            beat.thread.join(timeout=5.0)
        for task in hooks.heartbeat_tasks():
            task.close(beat)  # e.g. rank 0: the warnings published before it stopped reading


