"""Unit tests of the straggler report's rules (``_runtime/liveness/stragglers.py``): what a rank
publishes and when, how rank 0 compares the ranks' times and when it names a straggler, how often
it says so, on torch's in-process ``HashStore``. Real ranks and a real slow one run in
tests/test_stragglers.py."""

from __future__ import annotations

import logging

import pytest
import torch.distributed as dist

import axolotl_dist as ad
from axolotl_dist._runtime.liveness import stragglers as st
from axolotl_dist._runtime.store import keys, records
from axolotl_dist._runtime.store.access import put

RUN = "g" * 12
NAME = "AXOLOTL_DIST_STRAGGLERS"
SECOND = 1_000_000_000
#: The watches' start: a moment (a multiple of the round); ROUND: the seconds between moments.
T0, ROUND = 100 * st.ROUND, st.ROUND


def _sample(times, ranks=(0, 1, 2), group="0", first=1, moment=100):
    """A rank's sample: its collectives #first.. issued at ``times`` (seconds)."""
    issued = [(first + i, int(t * SECOND)) for i, t in enumerate(times)]
    return st.Sample(moment, "h", {group: (list(ranks), issued)})


def test_a_sample_reads_back_as_written_and_a_forged_one_is_refused():
    groups = {"0": ([0, 1, 2], [(7, 99 * SECOND + 123_456_000), (8, 99_500_000_000)]),
              "3": ([0, 1], [(1, 98 * SECOND)])}
    read = st.read_sample(st.encode_sample(100, groups).encode())
    assert read.moment == 100 and read.groups == groups
    assert st.read_sample(b"") is None  # the empty record each rank starts with
    for forged in [b'{"moment": 1}', b'{"moment": 1, "host": "h", "groups": {"0": {"ranks": [0],'
                   b' "seqs": [1, 2], "us": [5]}}}', b'{"moment": true, "host": "h", "groups": {}}',
                   b"not json"]:
        with pytest.raises(records.BadRecord):
            st.read_sample(forged)


def test_a_report_reads_back_as_written():
    found = st.StragglerReport(1, "node-b", 96, 100, 0.18, 1.2, 5.0)
    assert st.read_report(st.encode_report(found).encode()) == found
    assert st.read_report(st.encode_report(None).encode()) is None
    assert str(found) == ("rank 1 (node-b) arrived last at 96 of the last 100 collectives, 180 ms "
                          "after the other ranks' median (a collective every 1.2 s)")
    with pytest.raises(records.BadRecord):
        st.read_report(b'{"rank": "1"}')


def test_each_collective_every_member_published_names_the_last_and_its_lead_over_the_median():
    samples = {0: _sample([1.0, 2.0, 3.0]), 1: _sample([1.2, 2.1, 3.4]),
               2: _sample([1.1, 2.4])}  # rank 2 issued #3 after the moment: #3 is not compared
    found = st.compare(samples)
    assert [(a.seq, a.last) for a in found] == [(1, 1), (2, 2)]
    assert found[0].late == pytest.approx(0.15 * SECOND, abs=10)  # 1.2 after (1.0 + 1.1) / 2
    assert found[1].late == pytest.approx(0.35 * SECOND, abs=10)
    # a group's collectives count only with every member's time; one of two ranks: compared
    samples[3] = st.Sample(100, "h", {"5": ([0, 3], [(1, 4 * SECOND)])})
    assert [(a.group, a.last) for a in st.compare(samples) if a.group == "5"] == []
    samples[0] = st.Sample(100, "h", {**samples[0].groups, "5": ([0, 3], [(1, 3 * SECOND)])})
    assert [(a.group, a.last, a.late) for a in st.compare(samples) if a.group == "5"] == [
        ("5", 3, SECOND)]


def _arrivals(lasts, late=0.2, every=0.5):
    return [st.Arrival("0", i + 1, rank, int(late * SECOND), i * every * SECOND)
            for i, rank in enumerate(lasts)]


def test_a_straggler_is_last_at_three_quarters_of_twenty_or_more_and_far_enough_behind():
    hosts = {1: "node-b"}
    found = st.finding(_arrivals([1] * 96 + [0] * 4), hosts, 7.0)
    assert found == st.StragglerReport(1, "node-b", 96, 100, 0.2, 0.5, 7.0)
    assert st.finding(_arrivals([1] * 19), hosts, 0) is None  # too few compared
    assert st.finding(_arrivals([1] * 20), hosts, 0) is not None
    assert st.finding(_arrivals([1] * 74 + [0] * 26), hosts, 0) is None  # last at 74%
    assert st.finding(_arrivals([1] * 75 + [0] * 25), hosts, 0).rank == 1
    assert st.finding(_arrivals([1] * 100, late=0.049), hosts, 0) is None  # ahead by noise only
    # the interval counts sequence numbers: a gap between two rounds' samples changes nothing
    gapped = _arrivals([1] * 40, every=0.5)
    gapped = gapped[:20] + [a._replace(seq=a.seq + 500, median=a.median + 250 * SECOND)
                            for a in gapped[20:]]
    assert st.finding(gapped, hosts, 0).interval == pytest.approx(0.5)


class _Ranks:
    """Three ranks' watches on one store; each rank's recorder holds what the test puts there."""

    def __init__(self, monkeypatch, world=3):
        for name in ("AXOLOTL_DIST_SECRET", "AXOLOTL_DIST_SECRET_FILE", NAME):
            monkeypatch.delenv(name, raising=False)
        self.store = dist.HashStore()
        self.issued = {r: [] for r in range(world)}  # rank -> [(seq, wall ns)]
        self.reading = 0
        self.said = []
        monkeypatch.setattr(st.flight, "arrivals", self._arrivals)
        monkeypatch.setattr(st.hooks, "straggler", self.said.append)
        self.watches = [st.StragglerWatch(RUN, r, world, T0) for r in range(world)]
        for r in range(world):
            put(self.store, keys.arrivals(RUN, r), "")  # as the heartbeat's first call makes it

    def _arrivals(self, before_ns, keep):
        mine = [(s, t) for s, t in self.issued[self.reading] if t < before_ns][-keep:]
        return {"0": (sorted(self.issued), mine)} if mine else {}

    def run(self, start, end, late=None, step=0.25):
        """Each rank issues a collective every ``step`` s in [start, end); rank ``late`` 0.2 s
        after the others; every rank beats every 2.5 s over the same stretch."""
        t = start
        while t < end:
            for r in self.issued:
                seq = len(self.issued[r]) + 1
                self.issued[r].append((seq, int((t + (0.2 if r == late else 0.01 * r)) * SECOND)))
            t += step
            if round(t / 2.5, 6).is_integer():
                for self.reading, watch in enumerate(self.watches):
                    watch.beat(self.store, t)


def test_rank_zero_names_the_straggler_after_a_round_and_says_it_once(monkeypatch, caplog):
    ranks = _Ranks(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="axolotl_dist"):
        ranks.run(T0, T0 + ROUND, late=None)  # a healthy round: compared, nobody named
        assert [w.current for w in ranks.watches] == [None, None, None] and not ranks.said
        ranks.run(T0 + ROUND, T0 + 3 * ROUND, late=2)
    assert [f.rank for f in ranks.said] == [2]  # said once although found each round
    found = ranks.watches[0].current
    assert found.rank == 2 and found.last == found.compared == 100
    assert found.late == pytest.approx(0.195, abs=1e-3) and found.interval == pytest.approx(0.25)
    lines = [r.getMessage() for r in caplog.records if "straggler" in r.getMessage()]
    assert lines == [f"[rank 0/1] a straggler: {ranks.said[0]}: every other rank waits for it at "
                     f"each one ({NAME}=0 turns this report off)"]
    assert ranks.watches[1].report(lambda: ranks.store) == ranks.said[0]  # read from rank 0's record
    assert ranks.watches[0].report(lambda: ranks.store) is found


def test_a_straggler_is_said_again_after_five_minutes_or_when_another_rank_is_one(monkeypatch):
    ranks = _Ranks(monkeypatch)
    ranks.run(T0, T0 + ROUND + 2 * st.READ_AFTER, late=1)
    first = ranks.said[0].found  # the first moment's samples, read 5 s after it
    assert first == T0 + ROUND + st.READ_AFTER
    ranks.run(T0 + ROUND + 2 * st.READ_AFTER, first + st.REPEAT - 5, late=1)  # found each round: said once
    assert [f.rank for f in ranks.said] == [1]
    ranks.run(first + st.REPEAT - 5, first + st.REPEAT + 5, late=1)
    assert [(f.rank, f.found) for f in ranks.said][1:] == [(1, first + st.REPEAT)]
    ranks.run(first + st.REPEAT + 5, first + st.REPEAT + 65, late=2)  # another rank: at once
    assert [f.rank for f in ranks.said] == [1, 1, 2]
    ranks.run(first + st.REPEAT + 65, first + st.REPEAT + 125, late=None)
    assert ranks.watches[0].current is None and ranks.watches[2].report(lambda: ranks.store) is None


class _Counted:
    """A store that counts its calls by kind."""

    def __init__(self, store):
        self.store, self.calls = store, []

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args[0] if name == "set" else None))
            return getattr(self.store, name)(*args)
        return call


def test_a_rank_publishes_once_a_round_and_not_while_it_issues_nothing(monkeypatch):
    ranks = _Ranks(monkeypatch)
    ranks.store = counted = _Counted(ranks.store)
    ranks.run(T0, T0 + 2 * ROUND + 2 * st.READ_AFTER)  # two moments, each read 5 s after
    mine = ("set", keys.arrivals(RUN, 1))
    assert counted.calls.count(mine) == 2
    # rank 0 read the samples twice: the keys' first check once, then a multi_get alone
    assert [name for name, _ in counted.calls if name != "set"] == ["check", "multi_get",
                                                                    "multi_get"]
    for ranks.reading, watch in enumerate(ranks.watches):  # idle for a minute: nothing new
        for t in (T0 + 2.5 + 3 * ROUND, T0 + 2.5 + 4 * ROUND, T0 + 2.5 + 5 * ROUND):
            watch.beat(counted, t)
    assert counted.calls.count(mine) == 3  # the first: those issued after the last moment


def test_no_watch_alone_or_switched_off_and_a_bad_switch_names_the_fix(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert st.straggler_watch(RUN, 0, 1) is None
    assert st.straggler_watch(RUN, 0, 2) is not None
    monkeypatch.setenv(NAME, "0")
    assert st.straggler_watch(RUN, 0, 2) is None
    monkeypatch.setenv(NAME, "sometimes")
    with pytest.raises(ad.DistributedEnvError, match=rf"{NAME}='sometimes'.*set {NAME}=0 for no "
                                                      rf"straggler report or {NAME}=1"):
        ad.validate_env_vars()


def test_the_public_call_answers_none_without_a_watch_and_rank_zeros_finding_with_one(monkeypatch):
    from axolotl_dist._runtime.liveness.heartbeat import BEAT

    monkeypatch.setattr(BEAT, "stragglers", None)
    assert ad.straggler_report() is None  # one rank alone, no group, or switched off
    ranks = _Ranks(monkeypatch)
    ranks.run(T0, T0 + ROUND + 2 * st.READ_AFTER, late=1)
    monkeypatch.setattr(BEAT, "stragglers", ranks.watches[0])
    assert ad.straggler_report() == ranks.said[0]
