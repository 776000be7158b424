"""Who is who: each rank's peer record (host, pid, launcher), the counters and report every
waiter reads about its peers, and whether the store's host is gone.

At init every rank records itself (``axolotl_dist/<run>/who/<rank>``, at the root of the
store, under no group's prefix, so a client of the store can read them); the heartbeat
(:mod:`.heartbeat`) copies the records a rank may need, so a peer can still be named, and the
store's host found gone by its pid, after the store is gone. The sequence is in
docs/design/liveness.md, "Heartbeat and peer records".
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import torch.distributed as dist

from ..base import procs
from ..base.groups import remember_failure
from .liveness_state import HEARTBEAT, PEERS, Peer
from ..store import keys, records
from ..store.access import StoreHostGoneError, genuine, is_store_error, store_address, store_host
from ...errors import DistributedEnvError, RankFailedError
from ...env.variables import LAUNCHER_PID_ENV_VAR, is_decimal

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import Store

__all__ = [ "encode_peer", "decode_peer", "same_machine", "launcher_name",
    "peer_record", "peer", "fetch_peers", "STALL_CHECK_INTERVAL", "host_leaving", "store_host_gone", "check_store_host",
    "store_lost_error", "store_errors", "store_answers",
]


# --- a rank's record -------------------------------------------------------------------------


def encode_peer(record: Peer) -> str:
    return records.peer(record.host, record.pid, record.machine, record.by_store,
                        record.launcher)


def decode_peer(key: str, raw: bytes) -> Optional[Peer]:
    """The peer record at store ``key``; None where it is unreadable or not this run's."""
    try:
        data = genuine(key, raw)
    except records.BadRecord:
        return None
    fields = records.read_peer(data) if data is not None else None
    if fields is None:
        return None
    host, pid, machine, by_store, launcher = fields
    return Peer(host, pid, machine, launcher, by_store)


def same_machine(record: Optional[Peer]) -> bool:
    """Whether ``record``'s pid names a process this process can see in ``/proc``: same kernel
    boot and PID namespace (:data:`..base.procs.MACHINE`), not merely the same hostname."""
    return record is not None and record.machine == procs.MACHINE


def launcher_name() -> str:
    """Which launcher started this process, from its env (for messages)."""
    env = os.environ
    if env.get(LAUNCHER_PID_ENV_VAR):
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
    return PEERS.peers.get(rank)


def peer(raw: "Store", rank: int) -> Optional[Peer]:
    """The record of global ``rank``: the local copy first, then the root store ``raw``;
    None if unknown."""
    found = PEERS.peers.get(rank)
    run = HEARTBEAT.run
    if found is None and run is not None and raw.check([keys.who(run, rank)]):
        found = decode_peer(keys.who(run, rank), raw.get(keys.who(run, rank)))
        if found is not None:
            PEERS.peers[rank] = found
    return found


def fetch_peers(raw: "Store", ranks: Sequence[int]) -> None:
    """Copy the records of ``ranks`` not known yet from the root store ``raw``: one ``check``
    and one ``multi_get`` for all of them (one by one where some rank has not recorded itself
    yet)."""
    run = HEARTBEAT.run
    missing = [r for r in ranks if r not in PEERS.peers]
    if run is None or not missing:
        return
    names = [keys.who(run, r) for r in missing]
    if len(names) > 1 and raw.check(names):
        for r, name, value in zip(missing, names, raw.multi_get(names)):
            record = decode_peer(name, value)
            if record is not None:
                PEERS.peers[r] = record
        return
    for r in missing:
        peer(raw, r)


# --- what waiters read about their peers -------------------------------------------------



#: Seconds between two rounds of the stall detector (global rank 0's heartbeat thread, while some
#: rank waits): a dead peer on another machine is named within about
#: ``AXOLOTL_DIST_HEARTBEAT_TIMEOUT`` plus two of these plus a waiter's look.
STALL_CHECK_INTERVAL = 1.0


# --- a store host that is gone ---------------------------------------------------------------

def host_leaving() -> bool:
    """Whether the world store's host (another rank) is ending on a failure: this rank copied
    its exit record. The host keeps the store up only until every rank has that copy, so from
    here on the kit makes no store call it can avoid (one in flight when the host's process
    ends makes torch print a C++ trace). Free while no exit record was copied."""
    if not PEERS.exits:
        return False
    host = store_host()
    if host is None or not dist.is_initialized() or host == dist.get_rank():
        return False
    record = PEERS.exits.get(host)
    return record is not None and record[0] is not None


def _host_gone_how() -> Optional[str]:
    """How this rank knows the world store's host (another rank's process on this host) has
    ended, found from ``/proc`` without a store call; None if it is not known to be gone."""
    try:
        host, me = store_host(), dist.get_rank()
    except Exception:  # noqa: BLE001 - no group (any more)
        return None
    if host is None or host == me:
        return None
    record = PEERS.peers.get(host)
    if record is not None:
        gone = same_machine(record) and procs.proc_state(record.pid) == "gone"
        return f"judged by its pid {record.pid}" if gone else None
    port = os.environ.get("MASTER_PORT", "")
    if procs.is_loopback(os.environ.get("MASTER_ADDR")) and is_decimal(port):
        if procs.listening(int(port)) is False:
            return f"judged by its port: nothing listens on {store_address()} any more"
    return None


def store_host_gone() -> bool:
    """Whether the world store's host is another rank's process on this host that has ended.

    Judged from ``/proc`` without a store call: the host's process is gone (its record is
    known), or, with ``MASTER_ADDR`` on loopback, nothing listens on ``MASTER_PORT`` any more.
    False where that cannot be found (a launcher's store, another host)."""
    return _host_gone_how() is not None


def check_store_host() -> None:
    """Raise :class:`~..store.access.StoreHostGoneError` if :func:`store_host_gone`."""
    how = _host_gone_how()
    if how is not None:
        raise StoreHostGoneError(f"the process of rank {store_host()}, which hosted the c10d "
                                 f"store, is gone from this host ({how})")


def store_lost_error(exc: BaseException, what: str, key: str = "") -> Exception:
    """The error to raise when the store vanished while this rank was in ``what`` (``key``:
    the counter it was adding to, if any), from the most to the least this rank knows: the
    failure its host relayed, a store that refused a request, the host rank that ended, the
    node the store ran on, the launcher."""
    cause = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
    host = store_host()
    relayed = PEERS.exits.get(host)[0] if host is not None and host in PEERS.exits else None
    if relayed is not None:  # the host exited on a failure: name the root cause
        return remember_failure(_relayed_by_host(host, relayed, what))
    if store_answers():  # up, so its host is: it refused this rank's request
        held = _held(key)
        refused = DistributedEnvError(
            f"the c10d store at {store_address()} closed this rank's connection while in "
            f"{what}, and it still answers: it refused a request of this rank, as it does when "
            + (f"store key{held}" if held else f"store key {key!r}," if key else
               "a key") + " where the kit keeps a number (a block's word, a counter)"
            + " holds something else: a process outside the job overwrote it. Only the "
            'job\'s own processes may write to its store (docs/design/store.md, "Trust model")'
            f" ({cause})")
        refused.store_refused = True  # type: ignore[attr-defined] # its connection is dead
        return refused
    if host is not None:
        record = PEERS.peers.get(host)
        where = f" ({record.describe()})" if record is not None else ""
        return remember_failure(RankFailedError(
            host, "died", f"rank {host} (the store host) died or exited{where}: the c10d store "
            f"it hosted at {store_address()} is gone ({cause}). Look at "
            f"rank {host}'s own output for why it ended", where=what))
    lost_node = _lost_node(what, cause)
    if lost_node is not None:
        return remember_failure(lost_node)
    return DistributedEnvError(
        f"lost the c10d store at {store_address()} while in {what}: the launcher process that "
        f"hosted it (torchrun / axolotl-dist / accelerate launch agent) exited or was killed "
        f"({cause})")


def _relayed_by_host(host: int, relayed: bytes, what: str) -> RankFailedError:
    """The failure the store's host exited on (``relayed``), as this rank's error in
    ``what``: the root cause, and that the host's store went with it."""
    error = records.read_failure(relayed)
    if error.rank != host:
        note = (f" (rank {host}, the store host, exited on this failure, then its store at "
                f"{store_address()} went away)")
        return RankFailedError(error.rank, error.exc_type, error.exc_message + note,
                               error.remote_traceback, where=what,
                               ranks=(error.rank, host), machine=error.machine, site=error.site)
    note = f" (then its store at {store_address()} went away with it)"
    return RankFailedError(host, error.exc_type, error.exc_message + note,
                           error.remote_traceback, where=what, machine=error.machine,
                           site=error.site)


def _lost_node(what: str, cause: str) -> Optional[RankFailedError]:
    """Where a launcher's store is gone and ranks whose records said they ran beside it
    are known (this rank not among them): their node, most likely lost. None otherwise."""
    me = dist.get_rank() if dist.is_initialized() else -1
    beside = sorted(r for r, record in PEERS.peers.items() if record.by_store and r != me)
    if not beside or (me in PEERS.peers and PEERS.peers[me].by_store):
        return None
    record = PEERS.peers[beside[0]]
    return RankFailedError(
        beside[0], "lost", f"the c10d store at {store_address()} is gone, and with it, "
        f"most likely, the node it ran on: {record.host}, where rank(s) {beside} (at "
        f"least: the ranks whose records this rank read) ran "
        f"(rank {beside[0]}: {record.describe()}). That node was lost, or the launcher "
        f"that served the store there exited or was killed ({cause}). "
        f"Look at {record.host}'s output for why", where=what, ranks=tuple(beside))


def _held(key: str) -> Optional[str]:
    """`` now holding b'...'``: what a key the kit counts in holds instead of a number (``key``,
    or where it is not known, every counter of the kit's: the first such), read through a
    fresh connection to the store's root (the group's prefix unknown: every key that ends in
    ``key``); None where none does or it cannot be read."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    try:
        probe = dist.TCPStore(str(addr), int(port), is_master=False,
                              timeout=timedelta(seconds=2), wait_for_workers=False)
        for name in probe.list_keys():
            if (name == key or name.endswith("/" + key)) if key else keys.is_counter(name):
                value = probe.get(name)
                if not value.strip().lstrip(b"-").isdigit():
                    return f" {keys.as_named(name)!r}, now holding {value[:40]!r},"
    except Exception:  # noqa: BLE001 - a torch without list_keys, a store going: say less
        return None
    return None


def store_answers() -> bool:
    """Whether the store at ``MASTER_ADDR:MASTER_PORT``, on this host, still answers a fresh
    connection (asked only where a socket listens on that port: a store that is gone is not
    connected to, which would make torch print its connection errors)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    if not addr or not is_decimal(port) or not procs.is_loopback(addr) \
            or procs.listening(int(port)) is not True:
        return False
    try:
        probe = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=2),
                              wait_for_workers=False)
        probe.check([keys.RUN_NOTE])
        return True
    except Exception:  # noqa: BLE001 - it does not answer: it is lost
        return False


@contextmanager
def store_errors(what: str) -> Iterator[None]:
    """Turn a lost store inside the block into :func:`store_lost_error`'s error."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001
        if is_store_error(exc) and not isinstance(exc, (RankFailedError, DistributedEnvError)):
            raise store_lost_error(exc, what) from None  # it quotes exc
        raise
