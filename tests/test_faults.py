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
    from probes import known_failure

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
    learnt = known_failure()
    frames = [o for o in gc.get_objects()
              if type(o).__name__ == "frame" and o.f_code.co_name == "broadcast_value"]
    return len(frames), learnt.rank, learnt.__traceback__ is None


@pytest.mark.parametrize("fault", ["raises", "killed"])
def test_a_caught_failure_keeps_no_frames_alive_and_is_still_relayed(fault):
    outcomes = run_distributed_outcomes(_caught_failure_frames, 3, args=(fault,), timeout=45)
    for outcome in outcomes[1:]:
        assert outcome.ok, outcome.describe()
        assert outcome.value == (0, 0, True)


def _store_host_judged(placement):
    """Rank 0 leaves (``os._exit``: no teardown) once rank 1 has its record; rank 1's next
    collectives then name it. Where rank 0 hosted the store, rank 1 judges it gone without a
    store call (``StoreHostGoneError``): by its pid while its record is known, then, with the
    records forgotten, by the loopback port alone."""
    import axolotl_dist as ad
    from probes import known_peers, process_state, reset_process_state

    deadline = time.monotonic() + 20
    while ad.get_rank() == 1 and 0 not in known_peers() and time.monotonic() < deadline:
        time.sleep(0.01)
    ad.barrier()
    if ad.get_rank() == 0:
        os._exit(0)  # the store it may host goes with it
    pid = known_peers()[0].pid
    while process_state(pid) != "gone" and time.monotonic() < deadline:
        time.sleep(0.01)

    def judged():
        try:
            ad.barrier()
        except ad.RankFailedError as exc:
            return exc.rank, str(exc)
        return None, "barrier returned"

    by_pid = judged()
    reset_process_state("peers")  # a record not copied yet: judged from the loopback port,
    # which closes when rank 0's last thread ends (/proc can say "zombie" a moment before)
    by_port = judged()
    while placement == "rank0" and "by its port" not in by_port[1] and time.monotonic() < deadline:
        time.sleep(0.01)
        by_port = judged()
    return by_pid, by_port


@pytest.mark.parametrize("placement", ["parent", "rank0"])
def test_a_gone_store_host_is_known_without_a_store_call(placement):
    outcomes = run_distributed_outcomes(_store_host_judged, 2, args=(placement,), store=placement,
                                        timeout=45)
    assert outcomes[1].ok, outcomes[1].describe()
    (rank, by_pid), (rank_again, by_port) = outcomes[1].value
    assert rank == rank_again == 0, outcomes[1].value
    if placement == "rank0":  # rank 0 hosted the store: judged gone before any store call
        assert "StoreHostGoneError" in by_pid and "judged by its pid" in by_pid, by_pid
        assert "StoreHostGoneError" in by_port and "judged by its port" in by_port, by_port
    else:  # a launcher's store (the parent) is not rank 0's: rank 0 is named by its pid
        for text in (by_pid, by_port):
            assert "StoreHostGoneError" not in text and "died" in text, text


def _kept_in_a_cycle():
    """A script keeps the RankFailedError in a reference cycle, and the error's frames hold
    the group's header buffers (rank 0 leaves while rank 1's header exchange runs: the error
    is raised inside it); the exit's wait for the buffers collects the cycle instead of
    waiting it out."""
    import os
    import weakref

    import axolotl_dist as ad
    class Keeper:
        pass

    ad.barrier()
    if ad.get_rank() == 0:
        os._exit(3)
    keeper = Keeper()
    try:
        ad.gather_from_all_ranks(lambda: 1)
    except ad.RankFailedError as exc:
        keeper.error, keeper.me = exc, keeper  # a cycle: only the gc frees it
    ref = weakref.ref(keeper)
    del keeper
    ad.cleanup_distributed()  # its wait for the helpers' buffers collects the cycle
    return ref() is None


def test_buffers_held_by_a_reference_cycle_are_collected_at_exit():
    for outcome in run_distributed_outcomes(_kept_in_a_cycle, 2, timeout=45)[1:]:
        assert outcome.ok, outcome.describe()
        assert outcome.value is True
