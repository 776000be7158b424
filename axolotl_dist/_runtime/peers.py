"""Who is who: each rank's peer record, the heartbeat thread, and whether the store's host is
gone (the second floor: built on :mod:`.store`).

At init every rank of a multi-rank group records itself (``axd/who/<rank>``: host, pid and
launcher) and starts a daemon thread that bumps ``axd/hb/<rank>`` every
:data:`~.constants.HEARTBEAT_INTERVAL` seconds on its own store connection. The thread first
copies the other ranks' records (at once, in short doubling waits), so a rank can still be
named, and the store's host judged gone by its pid, after the store is gone. The sequence is
in docs/design.md, "Heartbeat and peer records".
"""

from __future__ import annotations

import os
import threading
import weakref
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterator, NamedTuple, Optional, Tuple

import torch.distributed as dist

from . import procs
from .constants import HEARTBEAT_INTERVAL, HOST
from .groups import resolve
from .state import STATE
from .store import StoreHostGoneError, is_store_error, store_address, store_host, world_store
from ..errors import DistributedEnvError, RankFailedError

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import Store

__all__ = [
    "Peer",
    "launcher_name",
    "peer",
    "peer_record",
    "start_heartbeat",
    "stop_heartbeat",
    "exit_connection",
    "store_host_gone",
    "check_store_host",
    "store_lost_error",
    "store_errors",
]


class Peer(NamedTuple):
    """What a rank recorded about itself at init."""

    host: str
    pid: int
    launcher: str

    def describe(self) -> str:
        return f"process {self.pid} on {self.host}, started by {self.launcher}"


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


def _encode(record: Peer) -> str:
    return f"{record.host}|{record.pid}|{record.launcher}"


def _decode(raw: bytes) -> Optional[Peer]:
    parts = raw.decode(errors="replace").split("|", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return Peer(parts[0], int(parts[1]), parts[2])


def peer_record(rank: int) -> Optional[Peer]:
    """The record of global ``rank`` this process has seen (no store call), or None."""
    return STATE.peers.get(rank)


def peer(store: "Store", rank: int) -> Optional[Peer]:
    """The record of global ``rank``: the local copy first, then the store; None if unknown."""
    found = STATE.peers.get(rank)
    if found is None and store.check([f"axd/who/{rank}"]):
        found = _decode(store.get(f"axd/who/{rank}"))
        if found is not None:
            STATE.peers[rank] = found
    return found


# --- the heartbeat ---------------------------------------------------------------------------

class _Heartbeat:
    def __init__(self, store: "Store", rank: int, world_size: int, interval: float) -> None:
        self.rank = rank
        self.world_size = world_size
        self.stop = threading.Event()
        self.store = store
        self.interval = interval
        self.pg = resolve(None)
        me = Peer(HOST, os.getpid(), launcher_name())
        STATE.peers[rank] = me
        store.set(f"axd/who/{rank}", _encode(me))
        store.add(f"axd/hb/{rank}", 1)
        self.thread = threading.Thread(target=self._run, name="axolotl-dist-heartbeat", daemon=True)
        self.thread.start()

    def _copy_peers(self) -> None:
        peers = STATE.peers
        missing = [r for r in range(self.world_size) if r not in peers]
        if missing and self.store.check([f"axd/who/{r}" for r in missing]):
            for r, raw in zip(missing, self.store.multi_get([f"axd/who/{r}" for r in missing])):
                record = _decode(raw)
                if record is not None:
                    peers[r] = record

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
                if len(STATE.peers) < self.world_size:
                    self._copy_peers()
            except Exception:  # noqa: BLE001 - store gone: nothing to report to
                return
            copying = not beating and len(STATE.peers) < self.world_size
            wait = min(wait * 2, self.interval) if copying else self.interval


_LOCK = threading.Lock()


def start_heartbeat() -> None:
    """Record this rank and start its heartbeat thread for the current default group
    (idempotent)."""
    pg = resolve(None)
    if pg is None:
        return
    with _LOCK:
        beat = STATE.heartbeat
        if beat is not None and beat.pg is pg and beat.thread.is_alive():
            return
        if beat is not None:
            beat.stop.set()
        if beat is None or beat.pg is not pg:
            STATE.peers.clear()
        base = world_store()
        try:
            store = base.clone()
        except Exception:  # noqa: BLE001 - stores without clone (HashStore, FileStore)
            store = base
        rank = dist.get_rank()
        STATE.heartbeat = _Heartbeat(store, rank, dist.get_world_size(), HEARTBEAT_INTERVAL)
        STATE.exit_store = (store, rank, weakref.ref(pg))


def exit_connection() -> Optional[Tuple["Store", int, Any]]:
    """The heartbeat's store connection for this process's exit record: ``(store, rank,
    weakref to the default group it belongs to)``, or None before the heartbeat started."""
    return STATE.exit_store


def stop_heartbeat() -> None:
    """Stop the heartbeat thread, if any."""
    with _LOCK:
        beat, STATE.heartbeat = STATE.heartbeat, None
    if beat is not None:
        beat.stop.set()
        if beat.thread is not threading.current_thread():
            # Wait for the thread to let go of its store connection: a TCPStore still in use
            # by a daemon thread when the interpreter exits aborts the process (SIGABRT).
            beat.thread.join(timeout=5.0)


# --- a store host that is gone ---------------------------------------------------------------

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
        gone = record.host == HOST and procs.proc_state(record.pid) == "gone"
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
    if host is not None:
        record = STATE.peers.get(host)
        where = f" ({record.describe()})" if record is not None else ""
        return RankFailedError(
            host, "died", f"rank {host} (the store host) died or exited{where}: the c10d store "
            f"it hosted at {store_address()} is gone ({type(exc).__name__}: {first}). Look at "
            f"rank {host}'s own output for why it ended", where=what)
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
