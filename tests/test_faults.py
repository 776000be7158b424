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

import signal

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
