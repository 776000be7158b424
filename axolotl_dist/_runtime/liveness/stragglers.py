"""A straggler named: rank 0 compares when the ranks issued the same collectives.

The moments are the wall clock's multiples of :data:`ROUND` seconds, alike on every host. At
its first beat past one, each rank's heartbeat reads its flight recorder once
(:func:`.flight.arrivals`) and, if it issued a collective since its last look, publishes in one
``set`` (:func:`~..store.keys.arrivals`) when it issued its last :data:`SAMPLE` collectives of
each process group before the moment. :data:`READ_AFTER` seconds after the moment (every rank
has beaten since), rank 0 reads them all in one ``multi_get`` and, for each collective that
every rank of its group published, finds the rank that issued it last and how long after the
median of the others. Over the newest :data:`KEEP` collectives compared (:data:`MIN_COMPARED`
at least), a rank last at :data:`SHARE` of them or more, a median :data:`MIN_LATE` or more
behind, is a straggler: rank 0 logs it (the same rank again only after :data:`REPEAT`
seconds), :meth:`StragglerWatch.report` returns it (other ranks read rank 0's finding from
:func:`~..store.keys.straggler`), and the timeline marks it (:func:`..base.hooks.straggler`).

torch stamps a collective with the wall clock as the rank issues it. Ranks of one machine share
that clock; across machines the comparison relies on the hosts' clocks agreeing (NTP or chrony
keep a managed cluster's within a millisecond or so, well under the lateness named).
docs/faults.md, "A straggler is named".
"""

from __future__ import annotations

import collections
import statistics
import time
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from ...env.variables import STRAGGLERS_ENV_VAR, kit_switch
from ..base import hooks
from ..base.constants import HOST
from ..base.kitlog import kit as log
from ..store import keys, records
from ..store.access import checked_or_ignored, put
from . import flight

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import Store

__all__ = ["StragglerReport", "StragglerWatch", "straggler_watch", "Sample", "Arrival", "compare",
           "finding", "encode_sample", "read_sample", "encode_report", "read_report", "ROUND",
           "READ_AFTER", "SAMPLE", "KEEP", "MIN_COMPARED", "SHARE", "MIN_LATE", "REPEAT"]

#: Seconds between two moments at which the ranks publish when they issued their collectives.
ROUND = 30.0
#: Seconds after a moment that rank 0 reads what the ranks published (two heartbeats).
READ_AFTER = 5.0
#: Collectives a rank publishes per process group: its last ones before the moment.
SAMPLE = 100
#: Collectives rank 0 keeps compared, the newest: a finding is over them.
KEEP = 100
#: The fewest compared collectives a finding needs.
MIN_COMPARED = 20
#: The share of them a straggler issued last, at least.
SHARE = 0.75
#: Seconds after the others' median a straggler issued them, at least (the median over those).
MIN_LATE = 0.05
#: Seconds before the same straggler is logged again.
REPEAT = 300.0


@dataclass(frozen=True)
class StragglerReport:
    """A rank that issued most of the run's recent collectives last
    (:func:`axolotl_dist.straggler_report`)."""

    #: the straggler's global rank and its host
    rank: int
    host: str
    #: the collectives it issued last, of the newest ``compared``
    last: int
    compared: int
    #: seconds after the other ranks' median it issued those (their median)
    late: float
    #: seconds between two collectives of its process group, recently
    interval: float
    #: when rank 0 found it (``time.time()``)
    found: float

    def __str__(self) -> str:
        return (f"rank {self.rank} ({self.host}) arrived last at {self.last} of the last "
                f"{self.compared} collectives, {self.late * 1000:.0f} ms after the other ranks' "
                f"median (a collective every {_seconds(self.interval)})")


def _seconds(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.1f} s"


class Sample(NamedTuple):
    """What one rank published for one moment: its host, and per process group its global
    ranks and ``(seq, ns)`` of its last collectives (when it issued them, its wall clock)."""

    moment: int
    host: str
    groups: Dict[str, Tuple[List[int], List[Tuple[int, int]]]]


class Arrival(NamedTuple):
    """One compared collective: the rank that issued it last, ns after the others' median,
    and that median (ns, the wall clock)."""

    group: str
    seq: int
    last: int
    late: int
    median: float


_SAMPLE_FIELDS = MappingProxyType({"moment": int, "host": str, "groups": dict})
_GROUP_FIELDS = MappingProxyType({"ranks": list, "seqs": list, "us": list})
_REPORT_FIELDS = MappingProxyType({"rank": int, "host": str, "last": int, "compared": int,
                                   "late": (int, float), "interval": (int, float),
                                   "found": (int, float)})


def encode_sample(moment: int, groups: Mapping[str, Tuple[List[int], List[Tuple[int, int]]]]) -> str:
    """The record of :class:`Sample` (times as microseconds before the moment: short)."""
    end = moment * 1_000_000_000
    doc = {name: {"ranks": ranks, "seqs": [seq for seq, _ in issued],
                  "us": [(end - ns) // 1000 for _, ns in issued]}
           for name, (ranks, issued) in groups.items()}
    return records.document({"moment": moment, "host": HOST, "groups": doc}, compact=True)


def read_sample(data: Optional[bytes]) -> Optional[Sample]:
    """The :class:`Sample` of a record, None for the empty one each rank starts with;
    :class:`~..store.records.BadRecord` for one the kit did not write."""
    if not data:
        return None
    doc = records.read_object(data, _SAMPLE_FIELDS, "an arrivals record")
    end = doc["moment"] * 1_000_000_000
    groups = {}
    for name, group in doc["groups"].items():
        group = records.check_fields(group, _GROUP_FIELDS, "an arrivals record's group")
        seqs = records.int_list(group["seqs"], "its seqs")
        us = records.int_list(group["us"], "its times")
        if len(seqs) != len(us):
            raise records.BadRecord("an arrivals record's seqs and times differ in length")
        issued = [(seq, end - t * 1000) for seq, t in zip(seqs, us)]
        groups[str(name)] = (records.int_list(group["ranks"], "its ranks"), issued)
    return Sample(doc["moment"], doc["host"], groups)


def encode_report(found: Optional[StragglerReport]) -> str:
    """The record of rank 0's finding (empty: none)."""
    return "" if found is None else records.document(
        {name: getattr(found, name) for name in _REPORT_FIELDS})


def read_report(data: Optional[bytes]) -> Optional[StragglerReport]:
    """The :class:`StragglerReport` of :func:`encode_report`'s record."""
    if not data:
        return None
    doc = records.read_object(data, _REPORT_FIELDS, "a straggler record")
    return StragglerReport(**doc)


def compare(samples: Mapping[int, Sample]) -> List[Arrival]:
    """Every collective that each rank of its group published, with the rank that issued it
    last, oldest first."""
    times: Dict[Tuple[str, int], Dict[int, int]] = {}
    members: Dict[str, List[int]] = {}
    for rank, sample in samples.items():
        for name, (ranks, issued) in sample.groups.items():
            members.setdefault(name, ranks)
            for seq, ns in issued:
                times.setdefault((name, seq), {})[rank] = ns
    out = []
    for (name, seq), by_rank in times.items():
        if len(by_rank) < 2 or sorted(by_rank) != sorted(members[name]):
            continue  # a rank's sample missed it (issued after the moment), or a bad record
        last = max(by_rank, key=lambda r: (by_rank[r], r))
        median = statistics.median(ns for r, ns in by_rank.items() if r != last)
        out.append(Arrival(name, seq, last, int(by_rank[last] - median), median))
    return sorted(out, key=lambda a: a.median)


def finding(arrivals: Sequence[Arrival], hosts: Mapping[int, str],
            now: float) -> Optional[StragglerReport]:
    """The straggler of ``arrivals`` (the newest compared), if one rank issued
    :data:`SHARE` of them last, a median :data:`MIN_LATE` behind or more."""
    if len(arrivals) < MIN_COMPARED:
        return None
    counts = collections.Counter(a.last for a in arrivals)
    rank, last = counts.most_common(1)[0]
    late = statistics.median(a.late for a in arrivals if a.last == rank) / 1e9
    if last < SHARE * len(arrivals) or late < MIN_LATE:
        return None
    return StragglerReport(rank, hosts.get(rank, "?"), last, len(arrivals), late,
                           _interval(arrivals), now)


def _interval(arrivals: Sequence[Arrival]) -> float:
    """Seconds between two collectives of the group most compared (gaps between the rounds'
    samples left out by counting sequence numbers)."""
    by_group = collections.Counter(a.group for a in arrivals)
    group = by_group.most_common(1)[0][0]
    mine = sorted((a.seq, a.median) for a in arrivals if a.group == group)
    (s0, t0), (s1, t1) = mine[0], mine[-1]
    return (t1 - t0) / 1e9 / (s1 - s0) if s1 > s0 else 0.0


class StragglerWatch:
    """One rank's part (see the module's docstring): :meth:`beat` on each heartbeat."""

    def __init__(self, run: str, rank: int, world_size: int, wall: float) -> None:
        self.run, self.rank, self.world_size = run, rank, world_size
        self.moment = int(wall // ROUND * ROUND)  # the last moment published (none before start)
        self.read_moment = self.moment  # rank 0: the last moment whose samples it compared
        self.issued: Dict[str, int] = {}  # the last seq per group published
        #: rank 0: the newest compared collectives, by (group, seq); each rank's host; the
        #: finding; the last told
        self.arrivals: "collections.OrderedDict[Tuple[str, int], Arrival]" = collections.OrderedDict()
        self.hosts: Dict[int, str] = {}
        self.keys_made = False  # rank 0: every rank's arrivals key exists (multi_get waits for one)
        self.current: Optional[StragglerReport] = None
        self.told: Optional[StragglerReport] = None

    def beat(self, store: "Store", wall: float) -> None:
        """One heartbeat's look: publish past a moment; rank 0, compare after it."""
        moment = int(wall // ROUND * ROUND)
        try:
            if moment > self.moment:
                self.moment = moment
                self._publish(store, moment)
            if self.rank == 0 and self.read_moment < self.moment <= wall - READ_AFTER:
                self.read_moment = self.moment
                self._compare_round(store, self.moment, wall)
        except Exception:  # noqa: BLE001 - no report this round, but the heartbeat goes on: a
            pass  # store that is gone ends it at its own next call

    def _publish(self, store: "Store", moment: int) -> None:
        """This rank's arrivals before ``moment``, unless it issued nothing since the last."""
        found = flight.arrivals(moment * 1_000_000_000, SAMPLE)
        issued = {name: seqs[-1][0] for name, (_, seqs) in found.items() if seqs}
        if issued and issued != self.issued:
            self.issued = issued
            put(store, keys.arrivals(self.run, self.rank), encode_sample(moment, found))

    def _samples(self, store: "Store", moment: int) -> Dict[int, Sample]:
        """Every rank's sample of ``moment`` (none where a rank has not made its key yet)."""
        names = [keys.arrivals(self.run, r) for r in range(self.world_size)]
        if not self.keys_made and not store.check(names):
            return {}  # a rank whose heartbeat has not started (it makes its key first)
        self.keys_made = True
        out = {}
        for rank, (name, data) in enumerate(zip(names, store.multi_get(names))):
            sample = checked_or_ignored(read_sample, data, name, rank)
            if sample is not None and sample.moment == moment:
                out[rank] = sample
        return out

    def _compare_round(self, store: "Store", moment: int, wall: float) -> None:
        """Rank 0: compare the ranks' arrivals; log a straggler found (rate-limited)."""
        samples = self._samples(store, moment)
        for arrival in compare(samples):
            self.arrivals[(arrival.group, arrival.seq)] = arrival
            self.arrivals.move_to_end((arrival.group, arrival.seq))
        while len(self.arrivals) > KEEP:
            self.arrivals.popitem(last=False)
        self.hosts.update((rank, sample.host) for rank, sample in samples.items())
        found, told = finding(list(self.arrivals.values()), self.hosts, wall), self.told
        tell = found is not None and (told is None or told.rank != found.rank
                                      or wall - told.found >= REPEAT)
        if tell or (found is None) != (self.current is None):
            put(store, keys.straggler(self.run), encode_report(found))  # before it is said
        self.current = found
        if tell:
            self.told = found
            log.warning("a straggler: %s: every other rank waits for it at each one (%s=0 "
                        "turns this report off)", found, STRAGGLERS_ENV_VAR)
            hooks.straggler(found)

    def report(self, store_of: Callable[[], "Store"]) -> Optional[StragglerReport]:
        """Rank 0's latest finding: its own, or on another rank read from the store
        ``store_of()`` gives."""
        if self.rank == 0:
            return self.current
        key, store = keys.straggler(self.run), store_of()
        if not store.check([key]):
            return None
        return checked_or_ignored(read_report, store.get(key), key, 0)


def straggler_watch(run: str, rank: int, world_size: int) -> Optional[StragglerWatch]:
    """This rank's part; None for one rank alone, or where
    :data:`~...env.variables.STRAGGLERS_ENV_VAR` is off."""
    if world_size < 2 or not kit_switch(STRAGGLERS_ENV_VAR):
        return None
    return StragglerWatch(run, rank, world_size, time.time())
