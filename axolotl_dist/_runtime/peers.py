"""Who is who: each rank's peer record, the heartbeat thread, and whether the store's host is
gone (the second floor: built on :mod:`.store`).

At init the ranks of a multi-rank group agree on a run id (the first to propose one wins);
every rank records itself (``axolotl_dist/<run>/who/<rank>``: host, pid and launcher) at the
root of the store, under no group's prefix (so a client of the store can read them, see
:mod:`.where`), and starts a daemon thread that bumps ``axolotl_dist/<run>/hb/<rank>`` every
:data:`~.constants.HEARTBEAT_INTERVAL` seconds on its own store connection. The thread first
copies the other ranks' records (at once, in short doubling waits), so a rank can still be
named, and the store's host judged gone by its pid, after the store is gone. The sequence is
in docs/design.md, "Heartbeat and peer records".
"""

from __future__ import annotations

import json
import os
import pickle
import threading
import time
import uuid
import weakref
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch.distributed as dist

from . import bells, deadlock, procs, warnfold, where
from .where import Peer, decode_peer, encode_peer, same_machine, who_key
from .constants import HEARTBEAT_INTERVAL, HOST, LONG_WAITS, SILENT_AFTER, WAITERS_KEY
from .groups import default_pg, learn
from .state import STATE
from .store import StoreHostGoneError, is_store_error, store_address, store_host, world_store
from ..errors import DistributedEnvError, RankFailedError

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import Store

__all__ = [
    "Peer",
    "launcher_name",
    "peer",
    "who_key",
    "EVENTS",
    "JUDGED",
    "VERDICTS_KEY",
    "EXIT_LOG_KEY",
    "WAITERS_KEY",
    "JUDGE_INTERVAL",
    "fetch_peers",
    "waiting_key",
    "peer_record",
    "start_heartbeat",
    "host_leaving",
    "stop_heartbeat",
    "exit_connection",
    "store_host_gone",
    "check_store_host",
    "store_lost_error",
    "store_errors",
]


def launcher_name() -> str:
    """Which launcher started this process, from its env (for messages)."""
    env = os.environ
    if env.get(procs.LAUNCHER_PID_ENV_VAR):
        return "axolotl-dist"
    if any(k.startswith("ACCELERATE_") for k in env) and env.get("TORCHELASTIC_RUN_ID"):
        return "accelerate launch"
    if env.get("TORCHELASTIC_RUN_ID"):
        return "torchrun"
    if env.get("SLURM_PROCID") is not None and env.get("RANK") is None:
        return "srun"
    if env.get("OMPI_COMM_WORLD_RANK") is not None and env.get("RANK") is None:
        return "mpirun"
    return "env vars"


def peer_record(rank: int) -> Optional[Peer]:
    """The record of global ``rank`` this process has seen (no store call), or None."""
    return STATE.peers.get(rank)


def waiting_key(rank: int) -> str:
    """The store counter of global ``rank``'s kit waits that have run past their first slice
    or polls (above 0: it is waiting for other ranks, and judges them every
    ``LIVENESS_INTERVAL``). A wait that ends on an exception leaves its count: the rank is
    about to report that exception (see :func:`.records.await_peers_told`). Created (at 0) when
    the rank's heartbeat starts, so the store's key count does not grow with long waits."""
    return f"axd/waiting/{rank}"


def peer(raw: "Store", rank: int) -> Optional[Peer]:
    """The record of global ``rank``: the local copy first, then the root store ``raw``;
    None if unknown."""
    found = STATE.peers.get(rank)
    run = STATE.run
    if found is None and run is not None and raw.check([who_key(run, rank)]):
        found = decode_peer(raw.get(who_key(run, rank)))
        if found is not None:
            STATE.peers[rank] = found
    return found


def fetch_peers(raw: "Store", ranks: Sequence[int]) -> None:
    """Copy the records of ``ranks`` not known yet from the root store ``raw``: one ``check``
    and one ``multi_get`` for all of them (one by one where some rank has not recorded itself
    yet)."""
    run = STATE.run
    missing = [r for r in ranks if r not in STATE.peers]
    if run is None or not missing:
        return
    keys = [who_key(run, r) for r in missing]
    if len(keys) > 1 and raw.check(keys):
        for r, value in zip(missing, raw.multi_get(keys)):
            record = decode_peer(value)
            if record is not None:
                STATE.peers[r] = record
        return
    for r in missing:
        peer(raw, r)


def _run_id(base: "Store") -> str:
    """The id every rank of this group agrees on: the first rank to propose one wins."""
    mine = uuid.uuid4().hex[:12]
    return base.compare_set("axd/run", "", mine).decode()


# --- the heartbeat ---------------------------------------------------------------------------

#: The events part of the ``axd/exits`` counter (see :data:`JUDGED`).
EVENTS = (1 << 32) - 1
#: What the judge adds to ``axd/exits`` each round: the counter's bits above 32 count judge
#: rounds, the bits below count events (exit records, and changes in the judge's verdicts).
JUDGED = 1 << 32
#: The judge's verdicts (JSON ``{"silent": {rank: seconds}}``): ranks whose heartbeat has not
#: moved for :data:`~.constants.SILENT_AFTER` seconds or more.
VERDICTS_KEY = "axd/judged"
#: The ranks that left an exit record, in order (``"3,0,"``): read once per new event.
EXIT_LOG_KEY = "axd/exit_log"
#: Seconds between two rounds of the judge (global rank 0's heartbeat thread, while some
#: rank waits): a dead peer on another machine is named within about
#: ``AXOLOTL_DIST_HEARTBEAT_TIMEOUT`` plus two of these plus a waiter's look.
JUDGE_INTERVAL = 1.0


class _Heartbeat:
    """Beats on the root store (``axolotl_dist/<run>/hb/<rank>``) every interval, answers
    requests for a snapshot of this rank (:mod:`.where`), copies the store host's failure
    record when it leaves one, and, on global rank 0, judges every rank's heartbeat while some
    rank waits (see :meth:`_judge`). Idle, that is one or two store calls per interval, however
    many ranks there are."""

    def __init__(self, store: "Store", raw: "Store", run: str, rank: int, world_size: int,
                 interval: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.stop = threading.Event()
        self.wake = threading.Event()  # halt(); on rank 0 also a warning to fold (.warnfold)
        self.warned = self.warn_read = 0  # rank 0: warnings read, and the log's bytes read
        self.store, self.raw, self.run = store, raw, run  # the group's keys; the root's
        self.interval = interval
        self.pg = default_pg()
        self.answered = 0
        host = store_host()
        #: the records copied at once: the store host's (judged by its pid once its store is
        #: gone) and rank 0's (the rank most waits are for); others when a wait needs them
        self.first = sorted({r for r in (0, host) if r is not None and r != rank})
        self.host = host if host is not None and host != rank else None
        self.beats: Dict[int, Tuple[int, float]] = {}  # the judge's: rank -> (beat, since)
        self.last_round: Optional[float] = None  # when the judge last read every beat
        self.judging = False  # rank 0, while some rank waits: a round every JUDGE_INTERVAL
        self.silent: Dict[int, float] = {}  # the judge's last verdicts
        self.all_beat = False  # every rank's heartbeat key exists (the judge may multi_get)
        self.deadlocks = deadlock.Judge(world_size) if rank == 0 else None
        self.keys: Optional[List[str]] = None  # what the judge reads each round
        me = Peer(HOST, os.getpid(), procs.MACHINE, launcher_name(), procs.beside_store())
        STATE.peers[rank] = me
        # the record, and this rank's long-wait description and verdict (none yet): one call
        keys = [who_key(run, rank), deadlock.wait_key(run, rank), deadlock.stuck_key(run, rank)]
        try:
            raw.multi_set(keys, [encode_peer(me), "", ""])
        except (AttributeError, NotImplementedError, RuntimeError):  # a store without it
            for key, value in zip(keys, [encode_peer(me), "", ""]):
                raw.set(key, value)
        raw.add(where.hb_key(run, rank), 1)
        store.add(waiting_key(rank), 0)  # created now: the key count stays flat afterwards
        store.add("axd/exits", 0)
        store.append(EXIT_LOG_KEY, "")  # created now, so a waiter reads both in one call
        store.compare_set(VERDICTS_KEY, "", "{}")
        store.add(WAITERS_KEY, 0)  # created now: long waits add no key
        self.thread = threading.Thread(target=self._run, name="axolotl-dist-heartbeat", daemon=True)
        self.thread.start()

    def _copy_first(self) -> bool:
        """Copy the records of :attr:`first` that exist; whether all are here."""
        missing = [r for r in self.first if r not in STATE.peers]
        for r in missing:
            peer(self.raw, r)
        return all(r in STATE.peers for r in self.first)

    def _beat(self, key: str) -> None:
        requests = self.raw.add(key, 1) >> 32
        if requests > self.answered:  # someone asked where this rank is
            self.answered = requests
            where.answer(self.raw, self.run, self.rank, requests)
        if self.host is not None:
            self._copy_host_exit()
        if self.rank == 0 and self.world_size > 1:  # the judge: on while some rank waits
            self._waiters()

    def _waiters(self) -> None:
        """Rank 0: judge while some rank's wait runs long; read new warnings (.warnfold)."""
        value = self.store.add(WAITERS_KEY, 0)
        self.judging = value & LONG_WAITS > 0
        warnfold.read(self, value)

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
        (the host lingers until they acknowledged), even one that was not in a kit call
        (:func:`store_lost_error`). One store call while there is none."""
        key = f"axd/exit/{self.host}"
        if self.host in STATE.exits or not self.store.check([key]):
            return
        STATE.exits[self.host] = pickle.loads(self.store.get(key))  # type: ignore[index]
        if host_leaving():  # the store goes once all acknowledged: no wait may be left in it
            bells.release_all()
        self.store.set(f"{key}/ack/{self.rank}", b"")
        if host_leaving():
            raise _HostLeaving()  # the last store call of this heartbeat

    def _judge(self) -> None:
        """One round of judging, for every waiting rank at once: read every rank's heartbeat
        and long-wait description (one ``multi_get``), note the ranks silent for
        ``SILENT_AFTER`` seconds or more and the waits that can never end (:mod:`.deadlock`),
        and publish them (:data:`VERDICTS_KEY`) while there are silent ranks, and whenever the
        deadlocks change; count the round (:data:`JUDGED`). A waiter then reads one counter
        per look instead of every peer's heartbeat (docs/design.md, "Heartbeat and peer
        records")."""
        world = self.world_size
        if self.keys is None:  # every beat's key, then every wait's description: made once
            self.keys = ([where.hb_key(self.run, r) for r in range(world)] +
                         [deadlock.wait_key(self.run, r) for r in range(world)])
        if not self.all_beat:
            self.all_beat = self.raw.check(self.keys[:world])
            if not self.all_beat:
                return  # a rank still initializing: its waiters are not in kit waits yet
        now = time.monotonic()
        silent: Dict[int, float] = {}
        values = self.raw.multi_get(self.keys)  # the waits' descriptions in the same call
        found = self.deadlocks.round(values[world:]) if self.deadlocks is not None else None
        if found is not None and found[0]:  # the marks first: a waiter reads one on the event
            marks = sorted(found[0].items())
            self.raw.multi_set([deadlock.stuck_key(self.run, r) for r, _ in marks],
                               [m for _, m in marks])
        for r, value in enumerate(values[:world]):
            beat = int(value) & where.BEATS
            last = self.beats.get(r)
            if last is None or last[0] != beat:
                # it beat since the last round: halfway, as best known (off by at most half
                # a round either way); after a pause in judging, or at the first look: now
                paused = self.last_round is None or now - self.last_round > 2 * JUDGE_INTERVAL
                since = now if last is None or paused else (self.last_round + now) / 2  # type: ignore[operator]
                self.beats[r] = last = (beat, since)
            if now - last[1] >= SILENT_AFTER:
                silent[r] = now - last[1]
        self.last_round = now
        # republished each round while a rank is silent: a waiter then judges "dead" from
        # what the judge measured at most a round ago, never from its own extrapolation (a
        # rank that beats again is cleared within a round)
        changed = bool(silent) or set(silent) != set(self.silent) or found is not None
        self.silent = silent
        if changed:
            texts = self.deadlocks.texts if self.deadlocks is not None else []
            self.store.set(VERDICTS_KEY, json.dumps({
                "silent": {str(r): round(s, 1) for r, s in silent.items()}, "deadlocks": texts}))
        self.store.add("axd/exits", JUDGED + (1 if changed else 0))

    def _run(self) -> None:
        key = where.hb_key(self.run, self.rank)
        # The first records at once, in short doubling waits (a store host that dies soon
        # after init is then judged by its pid with no store call: see store_host_gone);
        # then one beat per interval.
        wait, copying = min(0.005, self.interval), bool(self.first)
        last_beat = last_round = last_look = time.monotonic()
        folds = self.rank == 0  # prints the warnings ranks raised alike (see .warnfold)
        while True:
            self.wake.wait(wait)
            self.wake.clear()
            if self.stop.is_set():
                return
            if default_pg() is not self.pg or store_host_gone():
                return  # the group this heartbeat belongs to, or the store, is gone
            try:
                if copying:
                    copying = not self._copy_first()
                now = time.monotonic()
                if now - last_beat >= self.interval:
                    last_beat = last_look = now
                    self._beat(key)
                elif folds and warnfold.pending() and now - last_look >= warnfold.LOOK:
                    last_look = now
                    self._waiters()
                if self.judging and now - last_round >= JUDGE_INTERVAL:
                    last_round = now
                    self._judge()
                if folds:
                    warnfold.tick()
            except Exception:  # noqa: BLE001 - store gone, or its host leaving: nothing to do
                return
            due = last_beat + self.interval
            if self.judging:
                due = min(due, last_round + JUDGE_INTERVAL)
            if folds and warnfold.pending():
                due = min(due, last_look + warnfold.LOOK)
            wait = min(wait * 2, self.interval) if copying else max(0.0, due - time.monotonic())


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
        beat = STATE.heartbeat
        if beat is not None and beat.pg is pg:
            return  # running, or ended on purpose: its store's host is gone
        if beat is not None:
            beat.halt()
        if beat is None or beat.pg is not pg:
            STATE.peers.clear()
        base = world_store()
        try:
            store = base.clone()
        except Exception:  # noqa: BLE001 - stores without clone (HashStore, FileStore)
            store = base
        rank, world = dist.get_rank(), dist.get_world_size()
        run = STATE.run = _run_id(base)
        raw = where.raw_store(store)
        raw.set(where.RUN_KEY, json.dumps({"run": run, "world": world}))
        where.note_address(run, rank, world, launcher_name())
        STATE.heartbeat = _Heartbeat(store, raw, run, rank, world, HEARTBEAT_INTERVAL)
        STATE.exit_store = (store, rank, weakref.ref(pg))
        warnfold.started(STATE.heartbeat)  # the warnings held until now


def exit_connection() -> Optional[Tuple["Store", int, Any]]:
    """The heartbeat's store connection for this process's exit record: ``(store, rank,
    weakref to the default group it belongs to)``, or None before the heartbeat started."""
    return STATE.exit_store


def stop_heartbeat() -> None:
    """Stop the heartbeat thread, if any."""
    with _LOCK:
        beat, STATE.heartbeat = STATE.heartbeat, None
    if beat is not None:
        beat.halt()
        if beat.thread is not threading.current_thread():
            # Wait for the thread to let go of its store connection: a TCPStore still in use
            # by a daemon thread when the interpreter exits aborts the process (SIGABRT).
            beat.thread.join(timeout=5.0)
        warnfold.close(beat)  # rank 0: the warnings published before it stopped reading


# --- a store host that is gone ---------------------------------------------------------------

def host_leaving() -> bool:
    """Whether the world store's host (another rank) is ending on a failure: this rank copied
    its exit record. The host keeps the store up only until every rank has that copy, so from
    here on the kit makes no store call it can avoid (one in flight when the host's process
    ends makes torch print a C++ trace). Free while no exit record was copied."""
    if not STATE.exits:
        return False
    host = store_host()
    if host is None or not dist.is_initialized() or host == dist.get_rank():
        return False
    record = STATE.exits.get(host)
    return record is not None and record[0] is not None



def _host_gone_how() -> Optional[str]:
    """How this rank knows the world store's host (another rank's process on this host) has
    ended, judged from ``/proc`` without a store call; None if it is not known to be gone."""
    try:
        host, me = store_host(), dist.get_rank()
    except Exception:  # noqa: BLE001 - no group (any more)
        return None
    if host is None or host == me:
        return None
    record = STATE.peers.get(host)
    if record is not None:
        gone = same_machine(record) and procs.proc_state(record.pid) == "gone"
        return f"judged by its pid {record.pid}" if gone else None
    port = os.environ.get("MASTER_PORT", "")
    if procs.is_loopback(os.environ.get("MASTER_ADDR")) and port.isdigit():
        if procs.listening(int(port)) is False:
            return f"judged by its port: nothing listens on {store_address()} any more"
    return None


def store_host_gone() -> bool:
    """Whether the world store's host is another rank's process on this host that has ended.

    Judged from ``/proc`` without a store call: the host's process is gone (its record is
    known), or, with ``MASTER_ADDR`` on loopback, nothing listens on ``MASTER_PORT`` any more.
    False where that cannot be judged (a launcher's store, another host)."""
    return _host_gone_how() is not None


def check_store_host() -> None:
    """Raise :class:`~.store.StoreHostGoneError` if :func:`store_host_gone`."""
    how = _host_gone_how()
    if how is not None:
        raise StoreHostGoneError(f"the process of rank {store_host()}, which hosted the c10d "
                                 f"store, is gone from this host ({how})")


def store_lost_error(exc: BaseException, what: str) -> Exception:
    """The error to raise when the store vanished while this rank was in ``what``."""
    first = (str(exc).splitlines() or [""])[0]
    host = store_host()
    relayed = STATE.exits.get(host)[0] if host is not None and host in STATE.exits else None
    if relayed is not None:  # the host exited on a failure: name the root cause
        error = RankFailedError.from_report(relayed)
        if error.rank != host:
            note = (f" (rank {host}, the store host, exited on this failure, then its store at "
                    f"{store_address()} went away)")
            return learn(RankFailedError(error.rank, error.exc_type, error.exc_message + note,
                                         error.remote_traceback, where=what,
                                         ranks=(error.rank, host), machine=error.machine))
        note = f" (then its store at {store_address()} went away with it)"
        return learn(RankFailedError(host, error.exc_type, error.exc_message + note,
                                     error.remote_traceback, where=what, machine=error.machine))
    if host is not None:
        record = STATE.peers.get(host)
        where = f" ({record.describe()})" if record is not None else ""
        return learn(RankFailedError(
            host, "died", f"rank {host} (the store host) died or exited{where}: the c10d store "
            f"it hosted at {store_address()} is gone ({type(exc).__name__}: {first}). Look at "
            f"rank {host}'s own output for why it ended", where=what))
    me = dist.get_rank() if dist.is_initialized() else -1
    beside = sorted(r for r, record in STATE.peers.items() if record.by_store and r != me)
    if beside and not (me in STATE.peers and STATE.peers[me].by_store):
        record = STATE.peers[beside[0]]
        return learn(RankFailedError(
            beside[0], "lost", f"the c10d store at {store_address()} is gone, and with it, "
            f"most likely, the node it ran on: {record.host}, where rank(s) {beside} (at "
            f"least: the ranks whose records this rank read) ran "
            f"(rank {beside[0]}: {record.describe()}). That node was lost, or the launcher "
            f"that served the store there exited or was killed ({type(exc).__name__}: "
            f"{first}). Look at {record.host}'s output for why", where=what,
            ranks=tuple(beside)))
    return DistributedEnvError(
        f"lost the c10d store at {store_address()} while in {what}: the launcher process that "
        f"hosted it (torchrun / axolotl-dist / accelerate launch agent) exited or was killed "
        f"({type(exc).__name__}: {first})")


@contextmanager
def store_errors(what: str) -> Iterator[None]:
    """Turn a lost store inside the block into :func:`store_lost_error`'s error."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001
        if is_store_error(exc) and not isinstance(exc, (RankFailedError, DistributedEnvError)):
            raise store_lost_error(exc, what) from exc
        raise
