"""Whether peers are alive: rank 0's stall detector, and a waiter's own check beside it.

:class:`StallDetector` runs on global rank 0's heartbeat thread while some rank waits: each
round reads every rank's heartbeat and long-wait description in one call, and publishes the
ranks silent too long and the waits that can never end (:mod:`.deadlock`), so a waiter reads
one counter per look instead of every peer's heartbeat.

:class:`PeerChecker` is the waiter's side: it looks at each rank a wait depends on: a rank whose process left an exit record
(:func:`.failures.publish_exit`) or is gone from this host is dead at once; one that is stopped
(``SIGSTOP``) or silent is reported at WARNING level; a rank on another host whose heartbeat
stalls longer than ``AXOLOTL_DIST_HEARTBEAT_TIMEOUT`` seconds (default 15) counts as dead.
:func:`.lost.lost_error` turns the lost ranks into one
:class:`~axolotl_dist.errors.RankFailedError`, the root cause first.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set, Tuple

import torch.distributed as dist

from ..base import procs
from ..base.constants import HEARTBEAT_INTERVAL, SILENT_AFTER, look_interval
from ...env.variables import (HEARTBEAT_TIMEOUT_ENV_VAR, WAIT_LOG_INTERVAL_ENV_VAR, kit_seconds,
                              is_decimal)
from ..base.kitlog import kit as log
from .liveness_state import HEARTBEAT, PEERS
from ..store import keys, records, seals
from ..store.access import checked_or_ignored, genuine, put, store_host, world_store
from . import deadlock
from .peers import (STALL_CHECK_INTERVAL, check_store_host, fetch_peers, host_leaving, same_machine)
from ..store.clients import raw_store
from .lost import Lost, lost_error
from .where_report import BEATS
from ...errors import RankFailedError

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import Store

__all__ = ["ASLEEP_SLOWDOWN", "StallDetector", "create_world_keys", "PeerChecker"]

#: How many look intervals apart a wait blocked on a wake key looks at the store (see
#: :meth:`PeerChecker.find_lost`): the exit of a peer on this machine is seen with no store call
#: meanwhile, and a failure in what the wait waits for wakes its key.
ASLEEP_SLOWDOWN = 4


class StallDetector:
    """Global rank 0's stall detector: it checks every rank's heartbeat and long waits (one per heartbeat)."""

    def __init__(self, run: str, world_size: int) -> None:
        self.run, self.world_size = run, world_size
        self.beats: Dict[int, Tuple[int, float]] = {}  # rank -> (beat, since)
        self.last_round: Optional[float] = None  # when it last read every beat
        self.silent: Dict[int, float] = {}  # its last report
        self.all_beat = False  # every rank's heartbeat key exists (it may multi_get)
        self.deadlocks = deadlock.DeadlockDetector(world_size)
        #: what it reads each round: every beat's key, then every wait's description
        self.keys = ([keys.heartbeat(run, r) for r in range(world_size)] +
                     [keys.long_wait(run, r) for r in range(world_size)])

    def round(self, store: "Store", raw: "Store") -> None:
        """One round, for every waiting rank at once: read every rank's heartbeat and long-wait
        description (one ``multi_get`` on the root store ``raw``), note the ranks silent for
        ``SILENT_AFTER`` seconds or more and the waits that can never end, and publish them
        (:data:`~..store.keys.STALL_REPORT` in the group's ``store``) while there are silent ranks,
        and whenever the deadlocks change; count the round (:data:`~..store.keys.STALL_ROUND`)
        (docs/design/liveness.md, "Heartbeat and peer records")."""
        world = self.world_size
        if not self.all_beat:
            self.all_beat = raw.check(self.keys[:world])
            if not self.all_beat:
                return  # a rank still initializing: its waiters are not in kit waits yet
        now = time.monotonic()
        values = raw.multi_get(self.keys)  # the waits' descriptions in the same call
        found = self.deadlocks.round([_description(k, v) for k, v in
                                      zip(self.keys[world:], values[world:])])
        if found is not None and found[0]:  # the marks first: a waiter reads one on the event
            marks = sorted(found[0].items())
            names = [keys.stuck(self.run, r) for r, _ in marks]
            raw.multi_set(names, [seals.seal(k, m) for k, (_, m) in zip(names, marks)])
        silent = self._silent(values[:world], now)
        # republished each round while a rank is silent: a waiter then checks "dead" from
        # what the stall detector measured at most a round ago, never from its own extrapolation (a
        # rank that beats again is cleared within a round)
        changed = bool(silent) or set(silent) != set(self.silent) or found is not None
        self.silent = silent
        if changed:
            put(store, keys.STALL_REPORT, records.document({
                "silent": {str(r): round(s, 1) for r, s in silent.items()},
                "deadlocks": self.deadlocks.texts}))
        store.add(keys.EXITS, keys.STALL_ROUND + (1 if changed else 0))

    def _silent(self, beats: List[bytes], now: float) -> Dict[int, float]:
        """The ranks whose beat has not moved for ``SILENT_AFTER`` seconds, and for how long."""
        silent: Dict[int, float] = {}
        for r, value in enumerate(beats):
            beat = int(value) & BEATS if is_decimal(value.strip()) else -1  # -1: not a count
            # (a process outside the job overwrote it): that rank is found by its pid, or
            # when its own heartbeat's next add fails
            last = self.beats.get(r)
            if last is None or last[0] != beat:
                # it beat since the last round: halfway, as best known (off by at most half
                # a round either way); after a pause in checking, or at the first look: now
                paused = self.last_round is None or now - self.last_round > 2 * STALL_CHECK_INTERVAL
                since = now if last is None or paused else (self.last_round + now) / 2  # type: ignore[operator]
                self.beats[r] = last = (beat, since)
            if now - last[1] >= SILENT_AFTER:
                silent[r] = now - last[1]
        self.last_round = now
        return silent


def create_world_keys(store: "Store") -> None:
    """Make the world's liveness keys where missing (rank 0's heartbeat does, at its start; a
    waiter that finds an event before it did, itself): the exit count, the exit log and the
    stall report (created, so one ``multi_get`` reads both) and the count of long waits (long
    waits add no key). None is overwritten."""
    store.add(keys.EXITS, 0)
    store.append(keys.EXIT_LOG, "")
    store.compare_set(keys.STALL_REPORT, "", seals.seal(keys.STALL_REPORT, "{}"))
    store.add(keys.WAITERS, 0)


class PeerChecker:
    """Judges the global ranks a waiter depends on (see the module docstring).

    Per look, one store call, however many ranks it checks: ``axd/exits``, whose low bits
    count events (an exit record, a change in the stall detector's report: then this rank reads the
    exit log and the report) and whose high bits count the stall detector's rounds
    (:data:`..store.keys.STALL_ROUND`). Peers on this machine are found by their pids (no store call).
    Only where the detector has stopped (rank 0 gone, or stuck holding the GIL) does a
    look read each remote peer's heartbeat itself. ``look_every``: seconds between two looks
    (a peer found gone on this machine brings the next look forward: its exit record may say
    why)."""

    def __init__(self, store: Optional["Store"] = None, me: Optional[int] = None,
                 look_every: Optional[float] = None) -> None:
        self.store = store if store is not None else world_store()
        self.raw = raw_store(self.store)  # heartbeats and records live at the store's root
        self.me = dist.get_rank() if me is None and dist.is_initialized() else (me or 0)
        self.look_every = look_every if look_every is not None else look_interval(
            dist.get_world_size() if dist.is_initialized() else 1)
        self.next_look = 0.0
        self.events = 0  # the events part of axd/exits when last read
        self.rounds, self.rounds_at = 0, time.monotonic()  # the stall detector's rounds; when they moved
        self.silent: Dict[int, Tuple[float, float]] = {}  # report: rank -> (seconds, read at)
        #: the stall detector's finding on this rank's long wait (:mod:`.deadlock`): (its serial,
        #: deadlock's ``[message, {rank: call}]``), or None
        self.stuck: Optional[Tuple[int, List[Any]]] = None
        #: without a stall detector: rank -> (beat, since when, first read here)
        self.seen: Dict[int, Tuple[int, float, float]] = {}
        self.fetched: Set[int] = set()
        self.have_keys = False  # the exit log and the report exist (one multi_get reads both)
        self.warned: Dict[int, float] = {}
        self.exited: Dict[int, Lost] = {}
        self.remote_timeout = kit_seconds(HEARTBEAT_TIMEOUT_ENV_VAR)
        self.warn_every = kit_seconds(WAIT_LOG_INTERVAL_ENV_VAR)

    def find_lost(self, ranks: Sequence[int], now: float, what: str = "",
                  exits: bool = True, asleep: bool = False) -> List[Lost]:
        """The ranks among ``ranks`` that are gone; warns about stopped or silent ones.
        ``exits``: a rank that left an exit record counts as gone (else only a gone process).
        Raises :class:`~..store.access.StoreHostGoneError` if the store's host is known gone. The
        store's host ending on a failure (its record copied: :func:`.peers.host_leaving`) is
        the one lost rank, found without a store call. ``asleep``: the wait blocks on a wake key
        that a failure in what it waits for wakes too, so its looks come
        :data:`ASLEEP_SLOWDOWN` times less often."""
        if host_leaving():
            host = store_host()
            return [self._from_record(host, *PEERS.exits[host])]
        check_store_host()
        others = [r for r in ranks if r != self.me]
        if not self.fetched.issuperset(others):
            fetch_peers(self.raw, others)  # once per wait, in one batch
            self.fetched.update(others)
        states = self._local_states(others)
        if now >= self.next_look or (exits and any(
                state == "gone" and rank not in self.exited for rank, state in states.items())):
            self._look(now, asleep)  # a peer gone here: its exit record may say why
        lost: List[Lost] = []
        for rank in others:
            if rank in self.exited:
                if exits:
                    lost.append(self.exited[rank])
                    continue
            found = self._check_rank(rank, now, what, states.get(rank))
            if found is not None:
                lost.append(found)
        return lost

    def read_exits_of(self, ranks: Sequence[int]) -> bool:
        """Read the exit records of ``ranks`` that exist though the exit log does not name
        them (a log another process overwrote; a failed collective's diagnosis, one ``check``
        per rank); whether one was found."""
        found = False
        for rank in ranks:
            if rank != self.me and rank not in self.exited and \
                    self.store.check([keys.exit_record(rank)]):
                self._read_exit(rank)
                found = True
        return found

    def check(self, ranks: Sequence[int], now: float, what: str = "") -> None:
        """Raise :class:`RankFailedError` for the first lost rank among ``ranks``."""
        lost = self.find_lost(ranks, now, what)
        if lost:
            raise lost_error(lost, what)

    @staticmethod
    def _local_states(ranks: Sequence[int]) -> Dict[int, Optional[str]]:
        """The ``/proc`` state of each peer among ``ranks`` on this machine (no store call)."""
        states: Dict[int, Optional[str]] = {}
        for rank in ranks:
            record = PEERS.peers.get(rank)
            if record is not None and same_machine(record):
                states[rank] = procs.proc_state(record.pid)
        return states

    def _look(self, now: float, asleep: bool = False) -> None:
        """One store call; more only when something happened (see the class docstring)."""
        self.next_look = now + self.look_every * (ASLEEP_SLOWDOWN if asleep else 1)
        count = self.store.add(keys.EXITS, 0)
        events, rounds = count & keys.EVENTS, count >> 32
        if rounds != self.rounds:
            self.rounds, self.rounds_at = rounds, now
        if events == self.events:
            return
        self.events = events
        if not self.have_keys:  # made by rank 0's heartbeat; by this rank if it has not yet
            if not self.store.check([keys.EXIT_LOG, keys.STALL_REPORT]):
                create_world_keys(self.store)
            self.have_keys = True
        run = HEARTBEAT.run if HEARTBEAT.beating else None  # then its keys exist
        names = [keys.EXIT_LOG, keys.STALL_REPORT]
        if run is not None and self.raw is self.store:  # the finding on this rank's wait too
            names.append(keys.stuck(run, self.me))
        log, report, *mine = self.store.multi_get(names)
        self._read_exits(log)
        self._read_findings(report, mine, run, now)

    def _read_findings(self, report: bytes, mine: List[bytes], run: Optional[str],
                       now: float) -> None:
        """Take the stall detector's ``report`` and this rank's mark (``mine``, where read)."""
        found = checked_or_ignored(_stall_report, report, keys.STALL_REPORT, 0)
        if found is None:
            return  # not this run's report: the stall detector's next one overwrites it
        silent, deadlocks = found
        self.silent = {r: (secs, now) for r, secs in silent.items()}
        if run is not None and self.raw is not self.store:  # the world's keys under a prefix
            mine = [self.raw.get(keys.stuck(run, self.me))]
        mark = (checked_or_ignored(records.read_stuck_mark, mine[0], keys.stuck(run or "", self.me), 0)
                if mine else None)
        self._read_mark(mark or ("", ""), deadlocks)

    def _read_exits(self, log: bytes) -> None:
        """Read the exit records of the ranks the exit log names that are new to this rank (a
        name that is no rank of the world, written by a process outside the job, is none)."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        for item in log.decode("ascii", "replace").split(","):
            if is_decimal(item) and int(item) < world and int(item) not in self.exited \
                    and int(item) != self.me:
                self._read_exit(int(item))

    def _read_mark(self, mark: Tuple[str, str], deadlocks: List[Any]) -> None:
        """This rank's wait as the stall detector marked it (``mark``: its serial and deadlock index,
        read): stuck in one of ``deadlocks``, or not."""
        serial, index = mark
        self.stuck = ((int(serial), deadlocks[int(index)])
                      if serial and int(index) < len(deadlocks) else None)

    def _read_exit(self, rank: int) -> None:
        key = keys.exit_record(rank)
        if not self.store.check([key]):
            return  # named in the log by a process outside the job: a get would wait for it
        try:
            data = genuine(key, self.store.get(key))
            if data is None:
                return  # not this run's: its genuine record overwrites it
            report, when = records.read_exit(data)
        except records.BadRecord as exc:  # not the kit's: the rank is gone all the same
            report, when = records.failure(RankFailedError(
                rank, "DistributedEnvError", records.unreadable(key, rank, exc),
                where="its exit")), time.time()
        self.store.set(keys.ack(key, self.me), b"")
        PEERS.exits.setdefault(rank, (report, when))
        self.exited[rank] = self._from_record(rank, report, when)

    @staticmethod
    def _from_record(rank: int, report: Optional[bytes], when: float) -> Lost:
        """Global ``rank`` found by its exit record (``report``: its failure, if any)."""
        if report is None:
            return Lost(rank, "exited", "its process finished its script and exited (no "
                        "uncaught exception)", None, when)
        error = records.read_failure(report)
        detail = (f"its process exited after learning that rank {error.rank} failed"
                  if error.rank != rank else f"its process exited after an uncaught "
                  f"{error.exc_type}: {error.exc_message}")
        return Lost(rank, "exited", detail, error, when)

    def _silent_for(self, rank: int, now: float) -> Optional[float]:
        """Seconds ``rank``'s heartbeat has not moved: from the stall detector's report while it
        checks, else read here (the stall detector's rounds silent for ``SILENT_AFTER``: rank 0 gone or
        stuck; since the stall detector's last round, with a beat interval to see it not move); None if
        it has not beaten yet (still initializing)."""
        if now - self.rounds_at < SILENT_AFTER:  # the detector runs (a round per beat)
            found = self.silent.get(rank)
            return 0.0 if found is None else found[0]  # as measured, at most a round ago
        run = HEARTBEAT.run
        beat = self.raw.add(keys.heartbeat(run, rank), 0) & BEATS if run is not None else 0
        if beat == 0:
            return None
        last = self.seen.get(rank)
        if last is None:  # it beat, at the latest, at the detector's last round (not silent)
            found = self.silent.get(rank)
            since = self.rounds_at - (found[0] if found is not None else 0.0)
            self.seen[rank] = (beat, since, now)
            return 0.0
        if last[0] != beat:
            self.seen[rank] = (beat, now, now)
            return 0.0
        if now - last[2] < HEARTBEAT_INTERVAL + self.look_every:
            return 0.0  # not read long enough here to know that it stopped beating
        return now - last[1]

    def _check_rank(self, rank: int, now: float, what: str, state: Optional[str]) -> Optional[Lost]:
        """``state``: its ``/proc`` state where it runs on this machine (:meth:`_local_states`)."""
        record = PEERS.peers.get(rank)
        if record is not None and same_machine(record):
            if state == "gone":
                return Lost(rank, "died", f"{record.describe()}, exited without reporting an "
                            "error (judged: process gone on this machine; it returned early, "
                            "called os._exit, was killed by a signal or ran out of memory)", None)
            if state == "stopped":
                self._warn(rank, now, f"rank {rank} ({record.describe()}) is stopped (/proc says "
                           f"state T: SIGSTOP or a debugger); {what or 'this rank'} waits for it")
                return None
            found = self.silent.get(rank)
            if found is not None:
                self._warn(rank, now, f"rank {rank} ({record.describe()}) is running but sent no "
                           f"heartbeat for {found[0] + now - found[1]:.0f} s (busy in code "
                           "that holds the GIL?)")
            return None
        stalled = self._silent_for(rank, now)
        if stalled is None:
            return None  # not initialized yet
        who = record.describe() if record is not None else "its process"
        if stalled > self.remote_timeout:
            return Lost(rank, "unresponsive", f"no heartbeat from {who} for {stalled:.0f} s "
                        f"(judged: no heartbeat; raise {HEARTBEAT_TIMEOUT_ENV_VAR} if it is busy "
                        "holding the GIL)", None)
        if stalled >= SILENT_AFTER:
            self._warn(rank, now, f"no heartbeat from rank {rank} ({who}) for {stalled:.0f} s; "
                       f"it counts as dead after {self.remote_timeout:g} s "
                       f"({HEARTBEAT_TIMEOUT_ENV_VAR})")
        return None

    def _warn(self, rank: int, now: float, message: str) -> None:
        last = self.warned.get(rank)
        if last is None or now - last >= self.warn_every:
            self.warned[rank] = now
            log.warning("rank %d: %s", self.me, message)


def _description(key: str, value: bytes) -> bytes:
    """A rank's long-wait description as published (empty: none, or one not this run's)."""
    try:
        data = genuine(key, value)
    except records.BadRecord:
        return b"?"  # unreadable: that wait is left unjudged
    return b"" if data is None else data


def _stall_report(data: bytes) -> Tuple[Dict[int, float], List[List[Any]]]:
    """``(silent rank -> seconds, deadlocks as [text, {rank: call}, parties])`` of the stall detector's report
    (``{}`` before its first); :class:`~..store.records.BadRecord` for anything else."""
    if data in (b"", b"{}"):
        return {}, []
    doc = records.read_object(data, {"silent": dict, "deadlocks": list}, "the stall detector's report")
    silent = doc["silent"]
    if not all(is_decimal(r) and type(s) in (int, float) for r, s in silent.items()):
        raise records.BadRecord("the stall detector's silent ranks are not rank -> seconds")
    for item in doc["deadlocks"]:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[1], dict)
                and all(is_decimal(r) and isinstance(c, str) for r, c in item[1].items())):
            raise records.BadRecord("a deadlock in the stall detector's report is not "
                                    "[text, {rank: call}, parties]")
        item[2] = records.read_deadlock([item[0], item[2]], "stall detector's report")[1]
    return {int(r): float(s) for r, s in silent.items()}, doc["deadlocks"]
