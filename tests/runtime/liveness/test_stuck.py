"""Unit tests of the stuck watch's rules (``_runtime/liveness/stuck.py``): the bound from the
run's rhythm, when a rank reads its flight recorder, which rank reports a stuck collective and
how often, on torch's in-process ``HashStore``. The report itself (every rank asked, real
collectives stuck) runs in tests/test_stuck_collectives.py."""

from __future__ import annotations

import math

import pytest
import torch.distributed as dist

import axolotl_dist as ad
from axolotl_dist._runtime.liveness import stuck
from axolotl_dist.env.variables import kit_bound

RUN = "s" * 12
NAME = "AXOLOTL_DIST_STUCK_AFTER"


def test_the_bound_is_ten_times_the_slowest_percent_of_the_rhythm_and_at_least_a_minute():
    rhythm = stuck.Rhythm()
    assert rhythm.bound() == 60.0  # nothing seen yet
    for _ in range(200):
        rhythm.add(2.5)
    assert rhythm.p99() == 2.5 and rhythm.bound() == 60.0
    for _ in range(3):  # 1.5% of the stretches are 30 s (an evaluation every 70 steps)
        rhythm.add(30.0)
    assert rhythm.p99() == 30.0 and rhythm.bound() == 300.0
    for _ in range(256):  # only the newest stretches count
        rhythm.add(1.0)
    assert rhythm.bound() == 60.0


@pytest.mark.parametrize("value,want", [("600", 600.0), (" 2.5 ", 2.5), ("off", math.inf),
                                        ("OFF", math.inf), ("", None)])
def test_the_variable_takes_seconds_or_off(monkeypatch, value, want):
    monkeypatch.setenv(NAME, value)
    assert kit_bound(NAME) == want
    monkeypatch.delenv(NAME)
    assert kit_bound(NAME) is None


@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "soon", "1e9999"])
def test_a_bad_bound_names_the_variable_and_the_fix(monkeypatch, value):
    monkeypatch.setenv(NAME, value)
    with pytest.raises(ad.DistributedEnvError,
                       match=rf"^{NAME}='{value}' is neither a positive number of seconds nor "
                             rf"'off': set e\.g\. {NAME}=600 for a report after 10 minutes, "
                             rf"{NAME}=off for none, or unset it for a bound from the run's "
                             r"rhythm$"):
        ad.validate_env_vars()


def test_no_watch_alone_or_switched_off(monkeypatch):
    monkeypatch.delenv(NAME, raising=False)
    assert stuck.stuck_watch(RUN, 0, 1) is None
    assert stuck.stuck_watch(RUN, 0, 2) is not None
    monkeypatch.setenv(NAME, "off")
    assert stuck.stuck_watch(RUN, 0, 2) is None


class _Run:
    """Two ranks' watches on one store, their torch counters and recorders set by the test."""

    def __init__(self, monkeypatch, bound="4"):
        monkeypatch.setenv(NAME, bound)
        monkeypatch.delenv("AXOLOTL_DIST_SECRET", raising=False)
        monkeypatch.delenv("AXOLOTL_DIST_SECRET_FILE", raising=False)
        self.store = dist.HashStore()
        self.seqs = {"0": 1}
        self.pending = True
        self.reads = 0
        self.reports = []
        monkeypatch.setattr(stuck, "sequence_numbers", lambda: dict(self.seqs))
        monkeypatch.setattr(stuck.flight, "positions", self._positions)
        monkeypatch.setattr(stuck.StuckWatch, "_report",
                            lambda watch, store, found, quiet: self._report(watch, found))
        self.watches = [stuck.StuckWatch(RUN, r, 2) for r in range(2)]

    def _positions(self):
        self.reads += 1
        pos = {"seq": self.seqs["0"], "op": "all_reduce", "shapes": [[4]], "dtypes": ["float32"],
               "done": not self.pending, "ranks": [0, 1]}
        return {"0": pos}

    def _report(self, watch, found):
        self.reports.append((watch.rank, found[1]["seq"], watch.told))
        return 0

    def beat(self, now):
        for watch in self.watches:
            watch.beat(self.store, now)


def test_one_rank_reports_a_stuck_collective_then_once_more(monkeypatch):
    run = _Run(monkeypatch)
    t = run.watches[0].since
    run.beat(t + 1)  # the first look at the counters
    run.beat(t + 3)
    assert run.reads == 0 and run.reports == []  # within the bound: nothing read
    run.beat(t + 5.5)
    assert len(run.reports) == 1 and run.reports[0][1:] == (1, 1)  # one of the two ranks
    run.beat(t + 7)
    assert len(run.reports) == 1  # not yet twice the bound
    run.beat(t + 9.5)
    assert len(run.reports) == 2 and run.reports[1][1:] == (1, 2)
    for k in range(10):
        run.beat(t + 12 + 3 * k)
    assert len(run.reports) == 2  # then silence for this collective
    run.seqs["0"] = 2  # it finished; the next one sticks: reported again
    run.beat(t + 50)
    run.beat(t + 55)
    assert len(run.reports) == 3 and run.reports[2][1:] == (2, 1)


def test_a_rank_quiet_outside_a_collective_reads_its_recorder_once_per_bound(monkeypatch):
    run = _Run(monkeypatch)
    run.pending = False  # e.g. loading data, evaluating alone
    t = run.watches[0].since
    for k in range(1, 13):
        run.beat(t + 1.0 * k)
    assert run.reports == []
    assert run.reads == 2 * 2  # each rank at 5 s and 10 s: once per bound (4 s), a beat late


def test_the_rhythm_learns_from_the_stretches_between_collectives(monkeypatch):
    run = _Run(monkeypatch, bound="")
    watch = run.watches[0]
    t = watch.since
    for k in range(1, 6):
        run.seqs["0"] += 1
        watch.beat(run.store, t + 20.0 * k)  # a collective every 20 s
    assert watch.bound() == 200.0
    watch.beat(run.store, t + 100 + 150)
    assert run.reads == 0  # 150 s of quiet: within 10x the rhythm
    watch.beat(run.store, t + 100 + 201)
    assert run.reads == 1 and len(run.reports) == 1
