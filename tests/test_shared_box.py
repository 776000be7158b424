"""On a shared box the run is its user's (issue #60; docs/design.md, "Trust model"): with a
run secret, a record someone outside the job writes at a kit key before the genuine one is
ignored and the run ends as it would without it.

The stranger is :class:`hostile_store.HostileStore` in its ``forge_first`` mode: at the first
write of each attacked key it puts a record there itself (the genuine content with every digit
changed, without a seal or with a seal that is not the run's, or bytes that are no record) and
holds the genuine write back (:data:`HOLDS`), so that readers look at the forged record first. Each key family the kit
writes in a phase of ``tests/test_store_fuzz.py`` is attacked on its own, in the first phase
that writes it; every rank must end as without the stranger.
"""

import time

import pytest

from axolotl_dist.testing import run_distributed_outcomes
from hostile_store import HostileStore, family
from test_store_fuzz import BOUND, EXPECTED, PHASES, STALL, WORLD, _classify

pytestmark = pytest.mark.timeout(600)

#: Seconds the genuine write waits behind the stranger's: none (a compare_set finds the
#: stranger's record), and long enough for a reader polling the key to find it.
HOLDS = (0.0, 0.3)
#: The run's secret (what axolotl-dist makes for a one-node run).
SECRET = {"AXOLOTL_DIST_SECRET": "0123456789abcdef0123456789abcdef"}


def _run(phase, target=None, hold=0.0):
    fn, env = PHASES[phase]
    hostile = HostileStore(WORLD, target, (b"",), forge_first=hold)
    try:
        start = time.monotonic()
        outcomes = run_distributed_outcomes(
            fn, WORLD, env={"MASTER_PORT": str(hostile.port), **SECRET, **env},
            timeout=BOUND, pg_timeout=STALL)
        return outcomes, hostile, time.monotonic() - start
    finally:
        hostile.close()


def _families():
    """(phase, family) for every family the kit writes, in the first phase that writes it."""
    seen, todo = set(), []
    for phase in PHASES:
        outcomes, recorder, _ = _run(phase)
        assert [_classify(phase, o) for o in outcomes] == ["ignored"] * WORLD, \
            [o.describe() for o in outcomes]
        for fam in sorted({family(k) for k in recorder.written} - seen):
            seen.add(fam)
            todo.append((phase, fam))
    return todo


def test_a_record_forged_before_the_genuine_one_is_ignored():
    todo = _families()
    assert len(todo) >= 15, todo
    problems, forged, slowest = [], 0, 0.0
    for phase, fam in todo:
        for hold in HOLDS:
            outcomes, hostile, took = _run(phase, lambda key, f=fam: family(key) == f, hold)
            forged += len(hostile.forged)
            slowest = max(slowest, took)
            for outcome in outcomes:
                verdict = _classify(phase, outcome)
                if verdict != "ignored":
                    problems.append(f"{phase}: {fam}, held {hold} s ({took:.1f} s): {verdict}: "
                                    f"{outcome.describe()[:600]}")
    print(f"\n{len(todo)} families, {forged} keys forged, slowest run {slowest:.1f} s")
    assert problems == [], "\n\n".join(problems)
