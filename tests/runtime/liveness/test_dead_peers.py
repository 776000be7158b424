"""Unit tests of the dead-peer watch's rules (``_runtime/liveness/dead_peers.py``) on torch's
in-process ``HashStore``: rank 0's judgement of the ranks of other machines by their
heartbeats, and an announced death read back from a notice. No process group."""

from __future__ import annotations

import torch.distributed as dist

from axolotl_dist._runtime.liveness.dead_peers import DeadPeers
from axolotl_dist._runtime.store import keys, records
from axolotl_dist.errors import RankFailedError

RUN = "r" * 12


def _watch(monkeypatch, rank=0, world=4, local=2):
    monkeypatch.setenv("LOCAL_RANK", str(rank % local))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
    monkeypatch.delenv("AXOLOTL_DIST_SECRET", raising=False)
    monkeypatch.delenv("AXOLOTL_DIST_SECRET_FILE", raising=False)
    return DeadPeers(RUN, rank, world)


def test_rank_0_watches_the_other_machines_ranks_only(monkeypatch):
    watch = _watch(monkeypatch)
    assert watch.local == [1] and watch.remote == [2, 3]
    assert _watch(monkeypatch, rank=3).remote == []  # only global rank 0 judges


def test_a_remote_heartbeat_that_stops_for_the_timeout_is_a_death(monkeypatch):
    monkeypatch.setenv("AXOLOTL_DIST_HEARTBEAT_TIMEOUT", "15")
    store, watch = dist.HashStore(), _watch(monkeypatch)
    for rank in (2, 3):
        store.add(keys.heartbeat(RUN, rank), 1)
    assert watch._remote_death(store, 0.0) is None  # first look
    store.add(keys.heartbeat(RUN, 2), 1)  # rank 2 beats on, rank 3 stops
    assert watch._remote_death(store, 10.0) is None
    store.add(keys.heartbeat(RUN, 2), 1)
    found = watch._remote_death(store, 15.5)
    assert isinstance(found, RankFailedError) and found.rank == 3, found
    assert found.exc_type == "unresponsive" and "for 16 s" in found.exc_message, found


def test_a_request_for_a_snapshot_is_no_notice(monkeypatch):
    store, watch = dist.HashStore(), _watch(monkeypatch, rank=1)
    count = store.add(keys.heartbeat(RUN, 1), keys.REQUEST + 5)
    assert keys.requests_of(count) == 1 and keys.notices_of(count) == 0
    assert watch._announced(store, count) is None


def test_an_announced_death_is_read_once_from_its_notice(monkeypatch):
    store, watch = dist.HashStore(), _watch(monkeypatch, rank=1)
    error = RankFailedError(3, "died", "process 7 on node-b, exited without reporting an error")
    store.set(keys.dead(RUN), records.failure(error))
    count = store.add(keys.heartbeat(RUN, 1), keys.NOTICE + keys.REQUEST + 1)
    assert keys.requests_of(count) == 1 and keys.notices_of(count) == 1
    found = watch._announced(store, count)
    assert found is not None and found.error.rank == 3
    assert watch._announced(store, count) is None  # the same notice again: nothing new
