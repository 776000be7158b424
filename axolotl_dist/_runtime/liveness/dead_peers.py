"""A group with a dead rank is over: a rank whose peer died ends within seconds, wherever it
waits (docs/faults.md, "A dead peer").

A kit wait names a lost peer on its own. A rank blocked where the kit cannot look (an NCCL
collective, which neither returns nor raises when a peer dies; a C++ store wait; DDP's
backward on NCCL) would wait for torch's timeout, 10 to 30 minutes, and then be aborted by
its watchdog naming no one. So each rank's heartbeat thread learns of deaths
(:meth:`DeadPeers.turn`, once a beat) and ends its process when the process has not learned of
the death otherwise. A death is known when:

* a peer on this machine is gone (``/proc``, no store call) without a clean exit record (it
  failed, or left none: killed, ``os._exit``, out of memory);
* another rank announced one: it wrote the run's first death (:func:`~..store.keys.dead`, a
  sealed failure report) and added :data:`~..store.keys.NOTICE` to every rank's heartbeat
  counter, which each beat reads back anyway: no store call while nobody dies;
* the store's host is gone (its process, on this machine);
* on global rank 0, where the run spans several machines: a rank whose heartbeat did not move
  for ``AXOLOTL_DIST_HEARTBEAT_TIMEOUT`` seconds (one ``multi_get`` of the other machines'
  beats a turn).

Then the process gets :data:`GRACE` seconds to learn of it otherwise: a kit wait, or a gloo
collective that fails once the peer's connections close, raises, and the kit then knows it
told this process (:func:`~..base.groups.known_failure`); teardown stops the heartbeat. Past
them the NCCL communicators are aborted (the collective pending in the main thread raises),
and :data:`ABORT_WAIT` seconds later the process logs its account naming the dead rank, leaves
its exit record (a store host first waits for the others to read it) and exits with status 1,
as torch's watchdog would. A peer that is only slow (its process runs and beats: in Python, in
a long kernel, asleep) is never taken for dead. ``AXOLOTL_DIST_DEAD_PEER_EXIT=0`` turns the
exit off (a script that handles lost ranks itself).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

import torch.distributed as dist

from ..base import procs
from ..base.callsite import short_path
from ...env.variables import (DEAD_PEER_EXIT_ENV_VAR, HEARTBEAT_TIMEOUT_ENV_VAR, kit_seconds,
                              kit_switch, is_decimal)
from ..base.groups import failure_record, known_failure, restore_failure_record
from ..base.kitlog import kit as log
from ..base.tracebacks import kit_frame
from ..store import keys, records
from ..store.access import genuine, hosts_store, set_if_absent
from ..store.clients import raw_store
from .liveness_state import PEERS
from .peers import fetch_peers, same_machine, store_host_gone
from .lost import Lost, lost_error
from .stalls import PeerChecker
from ...errors import RankFailedError

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import Store

__all__ = ["DeadPeers", "GRACE", "ABORT_WAIT", "DEAD_PEER_EXIT_ENV_VAR"]

#: Seconds a process that knows a peer died gets to learn of it otherwise before the kit
#: aborts its NCCL communicators.
GRACE = 3.0
#: Seconds between the abort and the process's own end.
ABORT_WAIT = 3.0
_TORCH = os.sep + "torch" + os.sep


class DeadPeers:
    """One rank's watch for dead peers (see the module docstring); its heartbeat calls
    :meth:`turn` once a beat and :meth:`store_gone` when the store's host is gone."""

    def __init__(self, run: str, rank: int, world_size: int) -> None:
        self.run, self.rank, self.world_size = run, rank, world_size
        local_rank = _env_int("LOCAL_RANK", 0)
        local_size = _env_int("LOCAL_WORLD_SIZE", world_size)
        first = rank - local_rank
        #: the ranks that share this machine, by the launcher's numbering (checked by record)
        self.local = [r for r in range(max(0, first), min(world_size, first + local_size))
                      if r != rank]
        #: global rank 0 watches the beats of the ranks on other machines
        self.remote = ([r for r in range(1, world_size) if r not in self.local]
                       if rank == 0 else [])
        self.beats: Dict[int, Tuple[int, float]] = {}  # remote rank -> (beat, moved at)
        self.clean: set = set()  # peers that ended their script normally
        self.notices = 0
        self.known: Optional[RankFailedError] = None
        self.since = 0.0
        self.aborted = False
        self.checker: Optional[PeerChecker] = None

    # --- learning of a death -----------------------------------------------------------------

    def turn(self, store: "Store", raw: "Store", count: int, now: float) -> None:
        """One beat: ``count`` is the value this rank's heartbeat counter had after the beat."""
        if self.known is None:
            before = failure_record()  # the errors built here tell this process nothing
            try:
                found = self._announced(raw, count) or self._local_death(store, raw) or \
                    self._remote_death(raw, now)
            except Exception:  # noqa: BLE001 - the store is going: the next beat looks again
                found = None
            finally:
                restore_failure_record(before)
            if found is None:
                return
            if isinstance(found, _Announced):
                self._know(found.error, now)
            else:
                self._know(found, now)
                self._announce(raw, found)
        self.step(now, store)

    def store_gone(self, host: int, how: str) -> None:
        """The store's host (global rank ``host``) is gone: no store call is left to make."""
        if self.known is None:
            before = failure_record()
            self._know(lost_error([Lost(host, "died", f"it hosted the c10d store and its "
                                        f"process is gone from this host ({how})", None)], ""),
                       time.monotonic())
            restore_failure_record(before)

    def _announced(self, raw: "Store", count: int) -> Optional["_Announced"]:
        notices = keys.notices_of(count)
        if notices <= self.notices:
            return None
        self.notices = notices
        key = keys.dead(self.run)
        try:
            data = genuine(key, raw.get(key)) if raw.check([key]) else None
            return None if data is None else _Announced(records.read_failure(data))
        except records.BadRecord:
            return None  # not this run's: a genuine announcement comes with its own notice

    def _local_death(self, store: "Store", raw: "Store") -> Optional[RankFailedError]:
        """A peer on this machine that is gone without a clean exit record (``store``,
        ``raw``: this turn's connection, the group's keys and the root's)."""
        if not self.local:
            return None
        fetch_peers(raw, self.local)
        for rank in self.local:
            record = PEERS.peers.get(rank)
            if rank in self.clean or not same_machine(record) or \
                    procs.proc_state(record.pid) != "gone":  # type: ignore[union-attr]
                continue
            lost = self._checker(store).find_lost([rank], time.monotonic(), "")
            if lost and lost[0].how == "exited" and lost[0].report is None:
                self.clean.add(rank)  # its script ended normally: it is not a failure
                continue
            if lost:
                return lost_error(lost, "")
        return None

    def _remote_death(self, raw: "Store", now: float) -> Optional[RankFailedError]:
        """Global rank 0: a rank on another machine whose heartbeat has not moved for the
        heartbeat timeout (one ``multi_get`` of their beats)."""
        if not self.remote:
            return None
        names = [keys.heartbeat(self.run, r) for r in self.remote]
        timeout = kit_seconds(HEARTBEAT_TIMEOUT_ENV_VAR)
        for rank, value in zip(self.remote, raw.multi_get(names)):
            try:
                beat = records.read_number(value, "a heartbeat") & keys.BEATS
            except records.BadRecord:
                continue
            last = self.beats.get(rank)
            if last is None or last[0] != beat:
                self.beats[rank] = (beat, now)
            elif beat and now - last[1] > timeout:
                record = PEERS.peers.get(rank)
                who = record.describe() if record is not None else "its process"
                return lost_error([Lost(rank, "unresponsive", f"no heartbeat from {who} for "
                                        f"{now - last[1]:.0f} s (judged: no heartbeat; raise "
                                        f"{HEARTBEAT_TIMEOUT_ENV_VAR} if it is busy holding "
                                        "the GIL)", None)], "")
        return None

    def _checker(self, store: "Store") -> PeerChecker:
        if self.checker is None:
            self.checker = PeerChecker(store, self.rank)
        # this turn's connection (the heartbeat's own, or the group's)
        self.checker.store, self.checker.raw = store, raw_store(store)
        return self.checker

    def _know(self, error: RankFailedError, now: float) -> None:
        """The death ``error`` names is known here since ``now``."""
        self.known, self.since = error, now

    def _announce(self, raw: "Store", error: RankFailedError) -> None:
        """Tell every rank: the run's first death (the first announcement wins), then a notice
        on each rank's heartbeat counter (one ``add`` each, once)."""
        try:
            set_if_absent(raw, keys.dead(self.run), records.failure(error))
            for rank in range(self.world_size):
                if rank != self.rank and rank != error.rank:
                    raw.add(keys.heartbeat(self.run, rank), keys.NOTICE)
        except Exception:  # noqa: BLE001 - the store is going: each rank finds out its own way
            pass

    # --- ending ------------------------------------------------------------------------------

    def step(self, now: float, store: Optional["Store"] = None) -> None:
        """Abort the NCCL communicators :data:`GRACE` seconds after the death was known, end
        the process :data:`ABORT_WAIT` seconds later; unless the process was told meanwhile."""
        if self.known is None or self._told() or not kit_switch(DEAD_PEER_EXIT_ENV_VAR):
            return
        if now - self.since >= GRACE and not self.aborted:
            self.aborted = True
            _abort_nccl()
        if now - self.since >= GRACE + ABORT_WAIT:
            self._end(store)

    def _told(self) -> bool:
        """Whether this process learned of a failure through the kit (its own handling, or its
        exit, takes it from there)."""
        return known_failure() is not None

    def next_step(self) -> Optional[float]:
        """Seconds until :meth:`step` has something to do (None: nothing known)."""
        if self.known is None:
            return None
        due = self.since + (GRACE if not self.aborted else GRACE + ABORT_WAIT)
        return max(0.0, due - time.monotonic())

    def _end(self, store: "Store") -> None:
        """Log this rank's account, leave its exit record through ``store`` (the heartbeat's
        own connection) and exit with status 1."""
        from .failures import await_peers_exit, mark_exited, publish_exit_on

        error = self.known
        assert error is not None
        log.error("%s at %s: %s; this rank was blocked there in a call the kit cannot interrupt "
                  "(an NCCL collective, a C++ store wait): it ends now, as torch's watchdog "
                  "would after its timeout", type(error).__name__, _main_site(), error)
        try:
            record = publish_exit_on(store, self.rank, error) if store is not None else None
            if record is not None and hosts_store():  # the others read the record first
                await_peers_exit(record[0], self.rank, self.world_size, failed=True)
            elif record is not None:
                mark_exited(record)
        except Exception:  # noqa: BLE001 - ending anyway
            pass
        procs.flush_standard_streams()
        os._exit(1)


class _Announced:
    """A death another rank announced (not announced again)."""

    __slots__ = ("error",)

    def __init__(self, error: RankFailedError) -> None:
        self.error = error


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    return int(value) if is_decimal(value) else default


def _abort_nccl() -> None:
    """Abort the NCCL communicators of every process group (the backends' own ``abort``: what
    torch's watchdog does at its timeout), so the collective the main thread waits in raises."""
    if not (dist.is_available() and dist.is_nccl_available()):
        return
    import torch

    for pg in list(dist.distributed_c10d._world.pg_map):
        try:
            backend = pg._get_backend(torch.device("cuda"))
        except Exception:  # noqa: BLE001 - a group without a CUDA backend
            continue
        if isinstance(backend, dist.ProcessGroupNCCL):
            try:
                backend.abort()
            except Exception:  # noqa: BLE001 - aborted already
                pass


def _main_site() -> str:
    """``path:line in function`` where the main thread is, its innermost frame outside the kit
    and torch (``?`` where it has none)."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "?"
    stack: List[traceback.FrameSummary] = [
        f for f in traceback.extract_stack(frame) if not kit_frame(f.filename)
        and _TORCH not in f.filename]
    if not stack:
        return "?"
    top = stack[-1]
    return f"{short_path(top.filename)}:{top.lineno} in {top.name}"
