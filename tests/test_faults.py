"""The fault matrix: every communicating helper x every fault x which rank is faulty x where
the c10d store lives. With the group timeout at 300 s, every surviving rank must raise
:class:`RankFailedError` naming the faulty rank (and, where it raised, its exception) within
15 s, in the helper itself or at the script's next step (a barrier: a broadcast can reach some
ranks before the root notices a lost one, and a first rank in zero_first waits for nobody).

Faults, as a script meets them: the faulty rank raises (inside the helper's function where it
takes one, else instead of calling it; the exception is uncaught, so the process ends the way a
script does), is SIGKILLed before the call, or skips the call and exits 0. Store placements:
the test process (like torchrun's agent) and rank 0's own process (bare env vars, srun,
mpirun), where a faulty rank 0 takes the store down with it.
"""

import os
import signal
import time

import pytest

from axolotl_dist import _procs
from axolotl_dist.testing import run_distributed_outcomes
from fault_matrix import FAULTS, HELPERS, fault_body

PG_TIMEOUT = 300.0
DEADLINE = 15.0
WORLD = 3

def _check_survivor(outcome, fault, faulty):
    assert outcome.ok, outcome.describe()
    got = outcome.value
    assert "message" in got, f"rank {outcome.rank} raised nothing: {got}"
    assert got["elapsed"] < DEADLINE, got
    assert got["rank"] == faulty, got
    if fault == "raises":
        assert got["exc_type"] == "ValueError", got
        assert f"fault injected on rank {faulty}" in got["message"], got
    else:
        assert got["exc_type"] in ("died", "exited"), got


@pytest.mark.parametrize("faulty", [0, 1], ids=["rank0-faulty", "rank1-faulty"])
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("helper", HELPERS)
def test_every_survivor_names_the_faulty_rank(helper, fault, faulty, store):
    outcomes = run_distributed_outcomes(fault_body, WORLD, args=(helper, fault, faulty), store=store,
                                        timeout=45, pg_timeout=PG_TIMEOUT)
    for outcome in outcomes:
        if outcome.rank != faulty:
            _check_survivor(outcome, fault, faulty)
    faulty_outcome = outcomes[faulty]
    if fault == "killed":
        assert faulty_outcome.exitcode == -signal.SIGKILL, faulty_outcome.describe()
    elif fault == "raises":
        assert faulty_outcome.error and faulty_outcome.error.startswith("ValueError"), \
            faulty_outcome.describe()
    else:
        assert faulty_outcome.ok and faulty_outcome.value == "skipped the call"


# ---- what a failure leaves behind -----------------------------------------------------------

def _caught_failure_frames(fault):
    """Rank 0's function raises in compute_and_broadcast, or rank 0 is SIGKILLed before it;
    every other rank catches the RankFailedError, drops it and counts the helper's frames still
    alive (no gc pass: they must die with the error, or the exit waits for the buffers they
    hold)."""
    import gc

    import axolotl_dist as ad

    def fn():
        raise ValueError("boom")

    if ad.get_rank() == 0:
        if fault == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            ad.compute_and_broadcast(fn)
        except ValueError:
            pass
        return None
    try:
        ad.compute_and_broadcast(fn)
    except ad.RankFailedError:
        pass
    learnt = ad.errors.learnt_failure()
    frames = [o for o in gc.get_objects()
              if type(o).__name__ == "frame" and o.f_code.co_name == "broadcast_value"]
    return len(frames), learnt.rank, learnt.__traceback__ is None


@pytest.mark.parametrize("fault", ["raises", "killed"])
def test_a_caught_failure_keeps_no_frames_alive_and_is_still_relayed(fault):
    outcomes = run_distributed_outcomes(_caught_failure_frames, 3, args=(fault,), timeout=45)
    for outcome in outcomes[1:]:
        assert outcome.ok, outcome.describe()
        assert outcome.value == (0, 0, True)


def _store_host_judged():
    """Rank 0 leaves (``os._exit``: no teardown) once rank 1 has its record; rank 1 then asks
    whether the store's host is gone: by rank 0's pid, then by the loopback port alone."""
    import axolotl_dist as ad
    from axolotl_dist import _signals

    deadline = time.monotonic() + 20
    while ad.get_rank() == 1 and _signals.peer_record(0) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    ad.barrier()
    if ad.get_rank() == 0:
        os._exit(0)  # the store it may host goes with it
    pid = _signals.peer_record(0).pid
    while _procs.proc_state(pid) != "gone" and time.monotonic() < deadline:
        time.sleep(0.01)
    by_pid = _signals.store_host_gone()
    _signals._PEERS.pop(0)  # a record not copied yet: judged from the loopback port, which
    # closes when rank 0's last thread ends (its /proc entry can read "zombie" a moment before)
    by_port = _signals.store_host_gone()
    while not by_port and _signals.store_host() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
        by_port = _signals.store_host_gone()
    return by_pid, by_port


@pytest.mark.parametrize("placement", ["parent", "rank0"])
def test_a_gone_store_host_is_known_without_a_store_call(placement):
    outcomes = run_distributed_outcomes(_store_host_judged, 2, store=placement, timeout=45)
    expected = (placement == "rank0",) * 2  # a launcher's store (the parent) is not rank 0's
    assert outcomes[1].ok, outcomes[1].describe()
    assert outcomes[1].value == expected


def _kept_in_a_cycle():
    """A script keeps the RankFailedError in a reference cycle (its frames hold the helper's
    buffer); the exit's wait for the buffers collects the cycle instead of waiting it out."""
    import weakref

    import axolotl_dist as ad
    from axolotl_dist import values

    class Keeper:
        pass

    def fn():
        raise ValueError("boom")

    if ad.get_rank() == 0:
        try:
            ad.compute_and_broadcast(fn)
        except ValueError:
            pass
        return None
    keeper = Keeper()
    try:
        ad.compute_and_broadcast(fn)
    except ad.RankFailedError as exc:
        keeper.error, keeper.me = exc, keeper  # a cycle: only the gc frees it
    ref = weakref.ref(keeper)
    del keeper
    values._await_released()
    return ref() is None


def test_buffers_held_by_a_reference_cycle_are_collected_at_exit():
    for outcome in run_distributed_outcomes(_kept_in_a_cycle, 2, timeout=45)[1:]:
        assert outcome.ok, outcome.describe()
        assert outcome.value is True
