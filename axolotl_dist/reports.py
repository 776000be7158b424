"""The straggler report: the rank that issues the run's collectives last, named while it runs.

Every 30 seconds each rank's heartbeat publishes when it issued its recent collectives (torch's
flight recorder stamps each one), and rank 0 compares the ranks' times collective by collective.
A rank that issued three quarters of the newest 100 compared collectives last, a median 50 ms or
more after the other ranks, is logged on rank 0 (the same rank again after 5 minutes) and
marked on the timeline; :func:`straggler_report` returns the finding on every rank.
``AXOLOTL_DIST_STRAGGLERS=0`` turns it off. The machinery is in
:mod:`axolotl_dist._runtime.liveness.stragglers`; docs/faults.md, "A straggler is named".
"""

from __future__ import annotations

from typing import Optional

from ._runtime.liveness.heartbeat import BEAT
from ._runtime.liveness.stragglers import StragglerReport
from ._runtime.store.access import world_store
from ._runtime.store.clients import raw_store

__all__ = ["straggler_report", "StragglerReport"]


def straggler_report() -> Optional[StragglerReport]:
    """Rank 0's latest straggler finding, on any rank: None while no rank issues most
    collectives last, in a run of one rank, or with ``AXOLOTL_DIST_STRAGGLERS=0``. Rank 0
    answers from memory; another rank reads rank 0's finding from the store (a round trip or
    two: not a call for every step)."""
    watch = BEAT.stragglers
    if watch is None:
        return None
    return watch.report(lambda: raw_store(world_store()))
