"""Store-based signalling between ranks: who is who, heartbeats, judging peers, bounded waits.

Rank-ordered blocks (:func:`~axolotl_dist.zero_first`, :func:`~axolotl_dist.do_n_at_a_time`)
signal through the process group's c10d store instead of collectives, so a wait is not bound
by the collective timeout, costs a store round trip when there is nothing to wait for, and
can watch the ranks it waits for:

* at init every rank of a multi-rank group records who it is (``axd/who/<rank>``: host, pid
  and launcher) and runs a daemon thread that bumps ``axd/hb/<rank>`` every
  :data:`HEARTBEAT_INTERVAL` seconds on its own store connection; the thread also copies the
  other ranks' records locally, so a rank can still be named after the store is gone;
* :class:`Watch` judges the ranks a waiter depends on: a rank whose process left an exit
  record (:func:`axolotl_dist._records.publish_exit`) or is gone from this host is dead at once; one that is stopped
  (``SIGSTOP``) or silent is reported at WARNING level; a rank on another host whose heartbeat
  stalls longer than ``AXOLOTL_DIST_HEARTBEAT_TIMEOUT`` seconds (default 15) counts as dead;
* a waiting rank polls with non-blocking ``add(key, 0)`` (no C++ timeout warnings), spinning
  briefly and then backing off to at most 0.25 s, and logs at WARNING whom it waits for after
  ``AXOLOTL_DIST_WAIT_LOG_INTERVAL`` seconds (default 30), then at doubling intervals;
* a failure published for other ranks (:mod:`axolotl_dist._records`: ``publish_error``) is
  acknowledged by each rank that reads it (``read_error``). Where the store lives in rank 0's own process (a plain
  env launch: bare ``RANK``/``WORLD_SIZE``, ``srun``, ``mpirun``) rank 0 waits, before it
  raises, until every live reader has acknowledged, at most ``AXOLOTL_DIST_STORE_LINGER``
  seconds (default 5) (``await_readers``), so its peers read the real cause even if its
  process ends at once (``os._exit``, an uncaught exception);
* a store that is really gone is reported as such, naming its host (:func:`store_lost_error`),
  and a collective that fails because a peer is gone is turned into a
  :class:`~axolotl_dist.errors.RankFailedError` naming the lost rank and how that was judged
  (``_records.diagnose_lost_peer``).

The records themselves (failure reports, exit records, the store host's bounded linger) live in
:mod:`axolotl_dist._records`, built on this module.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import socket
import threading
import time
import weakref
from contextlib import contextmanager
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterator, List, NamedTuple, Optional,
                    Sequence, Tuple)

import torch.distributed as dist

from . import _procs
from ._envvars import read_seconds
from ._groups import resolve
from .errors import DistributedEnvError, RankFailedError, RankTimeoutError

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup, Store

__all__ = [
    "HEARTBEAT_INTERVAL",
    "HEARTBEAT_TIMEOUT_ENV_VAR",
    "WAIT_LOG_INTERVAL_ENV_VAR",
    "STORE_LINGER_ENV_VAR",
    "AGENT_STORE_ENV_VAR",
    "HOST",
    "Peer",
    "Watch",
    "group_store",
    "world_store",
    "store_host",
    "hosts_store",
    "store_host_gone",
    "check_store_host",
    "StoreHostGoneError",
    "is_store_error",
    "store_lost_error",
    "store_errors",
    "start_heartbeat",
    "stop_heartbeat",
    "exit_connection",
    "peer_record",
    "exit_key",
    "lost_error",
    "LIVENESS_INTERVAL",
    "poll_until",
    "bounded",
]

log = logging.getLogger("axolotl_dist")

HEARTBEAT_INTERVAL = 1.0
#: How often a waiting rank judges the ranks it waits for (seconds).
LIVENESS_INTERVAL = 0.5
HEARTBEAT_TIMEOUT_ENV_VAR = "AXOLOTL_DIST_HEARTBEAT_TIMEOUT"
WAIT_LOG_INTERVAL_ENV_VAR = "AXOLOTL_DIST_WAIT_LOG_INTERVAL"
STORE_LINGER_ENV_VAR = "AXOLOTL_DIST_STORE_LINGER"
#: torch elastic's switch: set to ``True`` when the launcher's agent hosts the store.
AGENT_STORE_ENV_VAR = "TORCHELASTIC_USE_AGENT_STORE"
_MAX_WAIT_LOG_INTERVAL = 600.0
#: A heartbeat silent this long (seconds) is worth a warning.
_SILENT_AFTER = 3.0 * HEARTBEAT_INTERVAL
HOST = socket.gethostname()


# --- stores and sequence numbers --------------------------------------------------------------

def group_store(group: Optional["ProcessGroup"] = None) -> "Store":
    """The c10d store of ``group`` (default: the world's)."""
    from torch.distributed import distributed_c10d as c10d

    if group is None:
        return c10d._get_default_store()
    return c10d._get_process_group_store(group)


def world_store() -> "Store":
    """The world's store, where heartbeats, peer records and exit records live."""
    return group_store(None)


# --- where the store lives -------------------------------------------------------------------

def store_host() -> Optional[int]:
    """The global rank whose process hosts the world store, or None if it lives elsewhere.

    torch's ``env://``/``tcp://`` rendezvous makes rank 0 host the ``TCPStore`` unless the
    launcher's agent hosts it (torchrun, ``axolotl-dist``, ``accelerate launch`` set
    ``TORCHELASTIC_USE_AGENT_STORE=True``); a file or in-memory store has no host process.
    """
    if os.environ.get(AGENT_STORE_ENV_VAR) == "True":
        return None
    try:
        store = world_store()
    except Exception:  # noqa: BLE001 - no group
        return None
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return 0 if isinstance(store, dist.TCPStore) else None


def hosts_store() -> bool:
    """Whether this process hosts the world store (see :func:`store_host`)."""
    return dist.is_initialized() and store_host() == dist.get_rank()


class StoreHostGoneError(RuntimeError):
    """The store's host process is known to have ended: a store call was not even tried.

    Not only to save time. A call to a dead store usually fails at once, but torch's client may
    first try to reconnect, and that can wait for a reverse DNS lookup (glibc's resolver
    timeout, 5 s by default, where no resolver answers for 127.0.0.1), holding the
    connection's lock for every later call."""


def store_host_gone() -> bool:
    """Whether the world store's host is another rank's process on this host that has ended.

    Judged from ``/proc`` without a store call: the host's process is gone (its record is
    known), or, with ``MASTER_ADDR`` on loopback, nothing listens on ``MASTER_PORT`` any more.
    False where that cannot be judged (a launcher's store, another host)."""
    try:
        host, me = store_host(), dist.get_rank()
    except Exception:  # noqa: BLE001 - no group (any more)
        return False
    if host is None or host == me:
        return False
    peer = _PEERS.get(host)
    if peer is not None:
        return peer.host == HOST and _procs.proc_state(peer.pid) == "gone"
    port = os.environ.get("MASTER_PORT", "")
    if _procs.is_loopback(os.environ.get("MASTER_ADDR")) and port.isdigit():
        return _procs.listening(int(port)) is False
    return False


def check_store_host() -> None:
    """Raise :class:`StoreHostGoneError` if :func:`store_host_gone`."""
    if store_host_gone():
        raise StoreHostGoneError(f"the process of rank {store_host()}, which hosted the c10d "
                                 "store, is gone from this host")


def _store_address() -> str:
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f"{addr}:{port}" if addr and port else "its address"


def is_store_error(exc: BaseException) -> bool:
    """Whether ``exc`` says the store's connection is gone (not a timeout, not a bad key)."""
    network = getattr(dist, "DistNetworkError", None)
    if isinstance(exc, StoreHostGoneError) or (network is not None and isinstance(exc, network)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in (
        "Broken pipe", "Connection reset", "Connection was likely closed", "Connection refused"))


@contextmanager
def store_errors(what: str) -> Iterator[None]:
    """Turn a lost store inside the block into :func:`store_lost_error`'s error."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001
        if is_store_error(exc) and not isinstance(exc, (RankFailedError, DistributedEnvError)):
            raise store_lost_error(exc, what) from exc
        raise


def store_lost_error(exc: BaseException, what: str) -> Exception:
    """The error to raise when the store vanished while this rank was in ``what``."""
    first = (str(exc).splitlines() or [""])[0]
    host = store_host()
    if host is not None:
        peer = _PEERS.get(host)
        where = f" ({peer.describe()})" if peer is not None else ""
        return RankFailedError(
            host, "died", f"rank {host} (the store host) died or exited{where}: the c10d store "
            f"it hosted at {_store_address()} is gone ({type(exc).__name__}: {first}). Look at "
            f"rank {host}'s own output for why it ended", where=what)
    return DistributedEnvError(
        f"lost the c10d store at {_store_address()} while in {what}: the launcher process that "
        f"hosted it (torchrun / axolotl-dist / accelerate launch agent) exited or was killed "
        f"({type(exc).__name__}: {first})")


# --- who is who ------------------------------------------------------------------------------

class Peer(NamedTuple):
    """What a rank recorded about itself at init."""

    host: str
    pid: int
    launcher: str

    def describe(self) -> str:
        return f"process {self.pid} on {self.host}, started by {self.launcher}"


_PEERS: Dict[int, Peer] = {}  # global rank -> record, copied from the store by the heartbeat


def _launcher() -> str:
    env = os.environ
    if env.get(_procs.LAUNCHER_PID_ENV_VAR):
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


def _encode_peer(peer: Peer) -> str:
    return f"{peer.host}|{peer.pid}|{peer.launcher}"


def _decode_peer(raw: bytes) -> Optional[Peer]:
    parts = raw.decode(errors="replace").split("|", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return Peer(parts[0], int(parts[1]), parts[2])


def _peer(store: "Store", rank: int) -> Optional[Peer]:
    """The record of global ``rank`` (local copy first, then the store; None if unknown)."""
    peer = _PEERS.get(rank)
    if peer is None and store.check([f"axd/who/{rank}"]):
        peer = _decode_peer(store.get(f"axd/who/{rank}"))
        if peer is not None:
            _PEERS[rank] = peer
    return peer


class _Heartbeat:
    def __init__(self, store: "Store", rank: int, world_size: int, interval: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.stop = threading.Event()
        self.store = store
        self.interval = interval
        self.pg = resolve(None)
        me = Peer(HOST, os.getpid(), _launcher())
        _PEERS[rank] = me
        store.set(f"axd/who/{rank}", _encode_peer(me))
        store.add(f"axd/hb/{rank}", 1)
        self.thread = threading.Thread(target=self._run, name="axolotl-dist-heartbeat", daemon=True)
        self.thread.start()

    def _copy_peers(self) -> None:
        missing = [r for r in range(self.world_size) if r not in _PEERS]
        if missing and self.store.check([f"axd/who/{r}" for r in missing]):
            for r, raw in zip(missing, self.store.multi_get([f"axd/who/{r}" for r in missing])):
                peer = _decode_peer(raw)
                if peer is not None:
                    _PEERS[r] = peer

    def _run(self) -> None:
        key = f"axd/hb/{self.rank}"
        # The peers' records first, at once (they record themselves at init), so that a peer
        # that dies soon after is judged by its pid with no store call (see store_host_gone):
        # short, doubling waits until every record is here, then one beat per interval.
        wait = min(0.005, self.interval)
        while not self.stop.wait(wait):
            if resolve(None) is not self.pg or store_host_gone():
                return  # the group this heartbeat belongs to, or the store, is gone
            beating = wait >= self.interval
            try:
                if beating:
                    self.store.add(key, 1)
                if len(_PEERS) < self.world_size:
                    self._copy_peers()
            except Exception:  # noqa: BLE001 - store gone: nothing to report to
                return
            copying = not beating and len(_PEERS) < self.world_size
            wait = min(wait * 2, self.interval) if copying else self.interval


_HEARTBEAT: Optional[_Heartbeat] = None
_HB_LOCK = threading.Lock()
#: The last heartbeat's store connection, kept for the exit record after the thread stopped.
_EXIT_STORE: Optional[Tuple["Store", int, Any]] = None


def start_heartbeat() -> None:
    """Record this rank and start its heartbeat thread for the current default group (idempotent)."""
    global _HEARTBEAT, _EXIT_STORE
    pg = resolve(None)
    if pg is None:
        return
    with _HB_LOCK:
        if _HEARTBEAT is not None and _HEARTBEAT.pg is pg and _HEARTBEAT.thread.is_alive():
            return
        if _HEARTBEAT is not None:
            _HEARTBEAT.stop.set()
        if _HEARTBEAT is None or _HEARTBEAT.pg is not pg:
            _PEERS.clear()
        base = world_store()
        try:
            store = base.clone()
        except Exception:  # noqa: BLE001 - stores without clone (HashStore, FileStore)
            store = base
        _HEARTBEAT = _Heartbeat(store, dist.get_rank(), dist.get_world_size(), HEARTBEAT_INTERVAL)
        _EXIT_STORE = (store, dist.get_rank(), weakref.ref(pg))


def exit_connection() -> Optional[Tuple["Store", int, Any]]:
    """The heartbeat's store connection for this process's exit record: ``(store, rank,
    weakref to the default group it belongs to)``, or None before the heartbeat started."""
    return _EXIT_STORE


def peer_record(rank: int) -> Optional[Peer]:
    """The record of global ``rank`` (pid, host, launcher) this process has seen, or None."""
    return _PEERS.get(rank)


def stop_heartbeat() -> None:
    """Stop the heartbeat thread, if any."""
    global _HEARTBEAT
    with _HB_LOCK:
        beat, _HEARTBEAT = _HEARTBEAT, None
    if beat is not None:
        beat.stop.set()
        if beat.thread is not threading.current_thread():
            # Wait for the thread to let go of its store connection: a TCPStore still in use
            # by a daemon thread when the interpreter exits aborts the process (SIGABRT).
            beat.thread.join(timeout=5.0)


# --- judging other ranks ---------------------------------------------------------------------

class Lost(NamedTuple):
    """A rank judged gone: how, the failure it reported at exit (if it did), and when it exited
    (``inf`` if unknown)."""

    rank: int
    how: str
    detail: str
    report: Optional[RankFailedError]
    when: float = float("inf")


def exit_key(rank: int) -> str:
    return f"axd/exit/{rank}"


class Watch:
    """Judges the global ranks a waiter depends on (see the module docstring)."""

    def __init__(self, store: Optional["Store"] = None, me: Optional[int] = None) -> None:
        self.store = store if store is not None else world_store()
        self.me = dist.get_rank() if me is None and dist.is_initialized() else (me or 0)
        self.seen: Dict[int, Tuple[int, float]] = {}
        self.warned: Dict[int, float] = {}
        self.checked: Dict[int, int] = {}  # rank -> exit count when its record was looked for
        self.exited: Dict[int, Lost] = {}
        self.remote_timeout = read_seconds(HEARTBEAT_TIMEOUT_ENV_VAR, 15.0)
        self.warn_every = read_seconds(WAIT_LOG_INTERVAL_ENV_VAR, 30.0)

    def find_lost(self, ranks: Sequence[int], now: float, what: str = "",
                  exits: bool = True) -> List[Lost]:
        """The ranks among ``ranks`` that are gone; warns about stopped or silent ones.
        ``exits``: a rank that left an exit record counts as gone (else only a gone process).
        Raises :class:`StoreHostGoneError` if the store's host is known gone."""
        check_store_host()
        exited = self._exit_records(ranks) if exits else {}
        lost: List[Lost] = []
        for rank in ranks:
            if rank == self.me:
                continue
            if rank in exited:
                lost.append(exited[rank])
                continue
            verdict = self._judge(rank, now, what)
            if verdict is not None:
                lost.append(verdict)
        return lost

    def check(self, ranks: Sequence[int], now: float, what: str = "") -> None:
        """Raise :class:`RankFailedError` for the first lost rank among ``ranks``."""
        lost = self.find_lost(ranks, now, what)
        if lost:
            raise lost_error(lost, what)

    def _exit_records(self, ranks: Sequence[int]) -> Dict[int, Lost]:
        """Exit records of ``ranks`` (one store round trip unless some rank exited since)."""
        count = self.store.add("axd/exits", 0)
        for rank in ranks:
            if rank == self.me or rank in self.exited or self.checked.get(rank) == count:
                continue
            self.checked[rank] = count
            if count == 0 or not self.store.check([exit_key(rank)]):
                continue
            report, when = pickle.loads(self.store.get(exit_key(rank)))
            self.store.set(f"{exit_key(rank)}/ack/{self.me}", b"")
            if report is None:
                self.exited[rank] = Lost(rank, "exited", "its process finished its script and "
                                         "exited (no uncaught exception)", None, when)
            else:
                error = RankFailedError.from_report(report)
                detail = (f"its process exited after learning that rank {error.rank} failed"
                          if error.rank != rank else f"its process exited after an uncaught "
                          f"{error.exc_type}: {error.exc_message}")
                self.exited[rank] = Lost(rank, "exited", detail, error, when)
        return {r: self.exited[r] for r in ranks if r in self.exited}

    def _judge(self, rank: int, now: float, what: str) -> Optional[Lost]:
        beat = self.store.add(f"axd/hb/{rank}", 0)
        last = self.seen.get(rank)
        if last is None or last[0] != beat:
            self.seen[rank] = last = (beat, now)
        stalled = now - last[1]
        peer = _peer(self.store, rank)
        if peer is not None and peer.host == HOST:
            state = _procs.proc_state(peer.pid)
            if state == "gone":
                return Lost(rank, "died", f"{peer.describe()}, exited without reporting an "
                            "error (judged: process gone on this host; it returned early, called "
                            "os._exit, was killed by a signal or ran out of memory)", None)
            if state == "stopped":
                self._warn(rank, now, f"rank {rank} ({peer.describe()}) is stopped (/proc says "
                           f"state T: SIGSTOP or a debugger); {what or 'this rank'} waits for it")
            elif beat and stalled >= _SILENT_AFTER:
                self._warn(rank, now, f"rank {rank} ({peer.describe()}) is running but sent no "
                           f"heartbeat for {stalled:.0f} s (busy in code that holds the GIL?)")
            return None
        if beat == 0:
            return None  # not initialized yet
        if stalled > self.remote_timeout:
            who = peer.describe() if peer is not None else "its process"
            return Lost(rank, "unresponsive", f"no heartbeat from {who} for {stalled:.0f} s "
                        f"(judged: no heartbeat; raise {HEARTBEAT_TIMEOUT_ENV_VAR} if it is busy "
                        "holding the GIL)", None)
        if stalled >= _SILENT_AFTER:
            who = peer.describe() if peer is not None else "its process"
            self._warn(rank, now, f"no heartbeat from rank {rank} ({who}) for {stalled:.0f} s; "
                       f"it counts as dead after {self.remote_timeout:g} s "
                       f"({HEARTBEAT_TIMEOUT_ENV_VAR})")
        return None

    def _warn(self, rank: int, now: float, message: str) -> None:
        last = self.warned.get(rank)
        if last is None or now - last >= self.warn_every:
            self.warned[rank] = now
            log.warning("rank %d: %s", self.me, message)


def lost_error(lost: Sequence[Lost], what: str) -> RankFailedError:
    """One :class:`RankFailedError` for the lost ranks, naming the root cause first: a rank
    that failed on its own exception, then one that died without a word, then the earliest
    normal exit; a rank that exited after learning of another rank's failure comes last and
    is explained by that rank."""
    def secondary(item: Lost) -> bool:  # it exited on a failure it learnt from another rank
        return item.report is not None and item.report.rank != item.rank

    def order(item: Lost) -> Tuple[int, float, int]:
        if secondary(item):
            category = 3
        elif item.report is not None:
            category = 0
        else:
            category = 1 if item.how != "exited" else 2
        return category, item.when, item.rank

    ordered = sorted(lost, key=order)
    root, others = ordered[0], ordered[1:]
    also = "".join(f"; also rank {o.rank} {o.how}: {o.detail}" for o in others)
    ranks = tuple(o.rank for o in ordered)
    if root.report is not None and not secondary(root):
        error = root.report
        return RankFailedError(root.rank, error.exc_type, error.exc_message + also,
                               error.remote_traceback, where=what, ranks=ranks)
    if root.report is not None:  # every lost rank only relayed another rank's failure
        error = root.report
        relay = f" (rank {root.rank} exited on this failure)"
        return RankFailedError(error.rank, error.exc_type, error.exc_message + relay + also,
                               error.remote_traceback, where=what, ranks=(error.rank,) + ranks)
    return RankFailedError(root.rank, root.how, root.detail + also, where=what, ranks=ranks)


# --- waiting ---------------------------------------------------------------------------------

def poll_until(
    ready: Callable[[], bool],
    *,
    watch: Callable[[], Sequence[int]],
    timeout: Optional[float],
    what: str,
    me: int,
) -> None:
    """Return once ``ready()`` is true; raise if a watched rank dies or ``timeout`` expires.

    :param ready: a cheap, non-blocking store probe.
    :param watch: the global ranks we are waiting for (re-evaluated at each liveness check).
    :param what: a description used in log lines and errors ("zero_first block #3 at x.py:4").
    """
    try:
        if ready():
            return
        _poll(ready, watch, timeout, what, me)
    except (RankFailedError, RankTimeoutError, DistributedEnvError):
        raise
    except Exception as exc:  # noqa: BLE001 - the store's host is gone
        if is_store_error(exc):
            raise store_lost_error(exc, what) from exc
        raise


class _Job:
    """A store call handed to the :class:`_StoreWorker`."""

    __slots__ = ("fn", "done", "value", "error")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn, self.done = fn, threading.Event()
        self.value: Any = None
        self.error: Optional[BaseException] = None

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class _StoreWorker:
    """One daemon thread that makes a waiting rank's store calls.

    A store call blocks for as long as the store's host process is stopped (``SIGSTOP``, a
    debugger, a suspended job): torch applies no timeout to it. Made here, the waiting rank
    keeps its own clock: it warns about the silent host and raises at its ``timeout``.
    """

    def __init__(self) -> None:
        self._jobs: "queue.SimpleQueue[_Job]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], Any]) -> _Job:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="axolotl-dist-store",
                                                daemon=True)
                self._thread.start()
        job = _Job(fn)
        self._jobs.put(job)
        return job

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job.value = job.fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                job.error = exc
            job.done.set()


_WORKER = _StoreWorker()
#: How long a store call may take before the waiting rank looks at the store's host.
_STORE_SILENT_AFTER = 1.0


def bounded(fn: Callable[[], Any], seconds: float, default: Any = None) -> Any:
    """``fn()`` made on the store worker; ``default`` if it has not answered within
    ``seconds`` (the store's host is stopped or unreachable) or raised. For calls that must not
    hold up an exit."""
    job = _WORKER.submit(fn)
    if not job.done.wait(seconds) or job.error is not None:
        return default
    return job.value


def _silent_store(what: str, me: int, silent_for: float, warned: Dict[int, float],
                  now: float) -> None:
    """Warn (at most every 30 s) that the store has not answered a call for ``silent_for`` s."""
    last = warned.get(-1)
    if last is not None and now - last < 30.0:
        return
    warned[-1] = now
    host = store_host()
    peer = _PEERS.get(host) if host is not None else None
    state = _procs.proc_state(peer.pid) if peer is not None and peer.host == HOST else None
    if host is None:
        who = f"the launcher's store at {_store_address()}"
    else:
        who = f"rank {host} (the store host" + (f", {peer.describe()})" if peer else ")")
    why = (" is stopped (/proc says state T: SIGSTOP, a debugger or a suspended job)"
           if state == "stopped" else " has not answered a store call")
    log.warning("rank %d: %s%s for %.0f s while this rank waits in %s", me, who, why,
                silent_for, what)


def _poll(ready: Callable[[], bool], watch: Callable[[], Sequence[int]], timeout: Optional[float],
          what: str, me: int) -> None:
    start = time.monotonic()
    watcher = Watch(world_store())
    log_every = read_seconds(WAIT_LOG_INTERVAL_ENV_VAR, 30.0)
    next_log = start + log_every
    next_check = start + LIVENESS_INTERVAL / 2
    spins, delay = 0, 0.0005
    job: Optional[_Job] = None
    job_since = start
    watched: List[int] = []  # the last answer of watch(), for a timeout while the store is silent

    def probe(liveness: bool, now: float) -> Tuple[str, Any]:
        if ready():
            return "ready", None
        if liveness:
            watched[:] = watch()
            lost = watcher.find_lost(watched, now, what)
            if lost:
                return ("ready", None) if ready() else ("lost", lost)
        return "waiting", None

    while True:
        if job is None:
            if spins < 20:  # the first polls inline: a store call costs ~30 us, a handoff more
                spins += 1
                verdict, lost = probe(False, time.monotonic())
                if verdict == "ready":
                    return
                continue
            time.sleep(delay)
            delay = min(delay * 2, 0.05 if time.monotonic() - start < 10 else 0.25)
            now = time.monotonic()
            liveness = now >= next_check
            if liveness:
                next_check = now + LIVENESS_INTERVAL
            job = _WORKER.submit(lambda liveness=liveness, now=now: probe(liveness, now))
            job_since = now
        answered = job.done.wait(_STORE_SILENT_AFTER)
        now = time.monotonic()
        if answered:
            verdict, lost = job.result()
            job = None
            if verdict == "ready":
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
            log.warning("rank %d has waited %.0f s for rank(s) %s to finish %s", me, now - start,
                        list(watch()), what)
            log_every = min(log_every * 2, _MAX_WAIT_LOG_INTERVAL)
            next_log = now + log_every
