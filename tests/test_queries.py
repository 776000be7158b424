"""Rank and size queries: no group, torchrun-style env before init, after init, composer env,
get_global_rank's two meanings, get_fs_local_rank, and queries never creating a group.

Every case runs in forked ranks with real gloo (axolotl_dist.testing); nothing is mocked.
"""

import os
import threading

import pytest
import torch
import torch.distributed as dist

import axolotl_dist as ad
from axolotl_dist.testing import run_distributed
from fixtures import NO_ENV

#: env for a plain ``python script.py``: no launcher variable at all


def _snapshot():
    """Every query's answer in this process, plus whether a group exists afterwards."""
    return {
        "rank": ad.get_rank(),
        "world_size": ad.get_world_size(),
        "global_rank": ad.get_global_rank(),
        "local_rank": ad.get_local_rank(),
        "local_world_size": ad.get_local_world_size(),
        "node_rank": ad.get_node_rank(),
        "num_nodes": ad.get_num_nodes(),
        "fs_local_rank": ad.get_fs_local_rank(),
        "main": ad.is_main_process(),
        "local_main": ad.is_local_main_process(),
        "distributed": ad.is_distributed(),
        "initialized": ad.is_initialized(),
        "available": ad.is_available(),
        "backend": ad.get_backend(),
        "cpu": ad.backend_supports_cpu(),
        "cuda": ad.backend_supports_cuda(),
        "torch_initialized_after": dist.is_initialized(),
    }


def test_no_group_no_env_is_rank_0_of_1():
    def body():
        before = set(threading.enumerate())
        snap = _snapshot()
        snap["new_threads"] = [t.name for t in set(threading.enumerate()) - before]
        snap["translate"] = ad.get_global_rank(0)
        snap["group_rank"] = ad.get_group_rank(0)
        ad.validate_env_vars()  # nothing set: nothing to complain about
        return snap

    [snap] = run_distributed(body, 1, init=False, env=NO_ENV)
    assert snap == {
        "rank": 0, "world_size": 1, "global_rank": 0, "local_rank": 0, "local_world_size": 1,
        "node_rank": 0, "num_nodes": 1, "fs_local_rank": 0, "main": True, "local_main": True,
        "distributed": False, "initialized": False, "available": True, "backend": None,
        "cpu": True, "cuda": torch.cuda.is_available(), "torch_initialized_after": False,
        "new_threads": [], "translate": 0, "group_rank": 0,
    }


def test_torchrun_env_before_init_knows_its_rank(world_size):
    """A rank started by torchrun -n N knows it is rank r before init, and asking creates nothing."""

    def body():
        before = set(threading.enumerate())
        snap = _snapshot()
        snap["new_threads"] = [t.name for t in set(threading.enumerate()) - before]
        return snap

    snaps = run_distributed(body, world_size, init=False, timeout=60)
    for rank, snap in enumerate(snaps):
        assert snap == {
            "rank": rank, "world_size": world_size, "global_rank": rank, "local_rank": rank,
            "local_world_size": world_size, "node_rank": 0, "num_nodes": 1,
            "fs_local_rank": rank, "main": rank == 0, "local_main": rank == 0,
            "distributed": False, "initialized": False, "available": True, "backend": None,
            "cpu": True, "cuda": torch.cuda.is_available(), "torch_initialized_after": False,
            "new_threads": [],
        }, f"rank {rank}"


def test_queries_after_init_report_the_group(world_size):
    def body():
        snap = _snapshot()
        snap["group_world_size"] = dist.get_world_size()
        snap["translate"] = [ad.get_global_rank(r) for r in range(ad.get_world_size())]
        snap["group_rank"] = [ad.get_group_rank(r) for r in range(ad.get_world_size())]
        snap["world"] = (ad.get_rank(dist.group.WORLD), ad.get_world_size(dist.group.WORLD),
                         ad.is_main_process(dist.group.WORLD))
        return snap

    snaps = run_distributed(body, world_size, timeout=60)
    for rank, snap in enumerate(snaps):
        assert snap["rank"] == snap["global_rank"] == rank
        assert snap["world_size"] == snap["group_world_size"] == world_size
        assert (snap["local_rank"], snap["local_world_size"]) == (rank, world_size)
        assert (snap["node_rank"], snap["num_nodes"]) == (0, 1)
        assert snap["main"] is (rank == 0) and snap["local_main"] is (rank == 0)
        # init_distributed assumes one shared filesystem unless told otherwise
        assert snap["fs_local_rank"] == rank
        assert snap["distributed"] and snap["initialized"] and snap["torch_initialized_after"]
        assert (snap["backend"], snap["cpu"], snap["cuda"]) == ("gloo", True, False)
        assert snap["translate"] == snap["group_rank"] == list(range(world_size))
        assert snap["world"] == (rank, world_size, rank == 0)


@pytest.mark.parametrize("init", [False, True], ids=["before-init", "after-init"])
def test_composer_style_env_two_nodes(init):
    """composer's seven variables, as its launcher sets them for 2 nodes x 2 processes...

    ... simulated with 4 local ranks: global rank r is local rank r % 2 on node r // 2.
    """

    def rank_env(rank):
        return {"RANK": rank, "WORLD_SIZE": 4, "LOCAL_RANK": rank % 2, "LOCAL_WORLD_SIZE": 2,
                "NODE_RANK": rank // 2, "AXOLOTL_DIST_SHARED_FS": "0"}

    def body():
        if init:
            ad.initialize_dist("cpu", timeout=60)
        return (ad.get_rank(), ad.get_global_rank(), ad.get_world_size(), ad.get_local_rank(),
                ad.get_local_world_size(), ad.get_node_rank(), ad.get_num_nodes(),
                ad.is_main_process(), ad.is_local_main_process(), ad.get_fs_local_rank(),
                dist.is_initialized())

    got = run_distributed(body, 4, init=False, rank_env=rank_env, timeout=60)
    for rank, values in enumerate(got):
        local, node = rank % 2, rank // 2
        # not a shared filesystem: one writer per node, i.e. the local rank
        assert values == (rank, rank, 4, local, 2, node, 2, rank == 0, local == 0, local, init)


def test_get_global_rank_both_meanings_on_a_subgroup():
    """No argument: this process's global rank. With group_rank: translate within group=."""

    def body():
        sub = dist.new_group([1, 2])
        me = ad.get_rank()
        out = {"mine": ad.get_global_rank(), "world": [ad.get_global_rank(r) for r in range(3)]}
        if me in (1, 2):
            out["sub_rank"] = ad.get_rank(sub)
            out["sub_size"] = ad.get_world_size(sub)
            out["translate"] = [ad.get_global_rank(r, sub) for r in range(2)]
            out["translate_kw"] = ad.get_global_rank(group_rank=1, group=sub)
            out["back"] = [ad.get_group_rank(g, sub) for g in (1, 2)]
            out["main_of_sub"] = ad.is_main_process(sub)
        else:  # not a member: a clear error, not torch's -1
            for name, call in (("get_rank", lambda: ad.get_rank(sub)),
                               ("get_world_size", lambda: ad.get_world_size(sub)),
                               ("get_global_rank", lambda: ad.get_global_rank(0, sub))):
                with pytest.raises(ValueError, match="not a member of the group"):
                    call()
                out[name] = "raised"
        return out

    got = run_distributed(body, 3, timeout=60)
    for rank in range(3):
        assert got[rank]["mine"] == rank
        assert got[rank]["world"] == [0, 1, 2]
    assert got[0] == {"mine": 0, "world": [0, 1, 2], "get_rank": "raised",
                      "get_world_size": "raised", "get_global_rank": "raised"}
    for rank in (1, 2):
        assert got[rank]["sub_rank"] == rank - 1
        assert got[rank]["sub_size"] == 2
        assert got[rank]["translate"] == [1, 2]
        assert got[rank]["translate_kw"] == 2
        assert got[rank]["back"] == [0, 1]
        assert got[rank]["main_of_sub"] is (rank == 1)


def test_get_fs_local_rank_shared_vs_not():
    """2 nodes x 2 ranks. Shared filesystem: one writer for the job (the global rank);
    node-local filesystems: one writer per node (the local rank); FS_LOCAL_RANK wins over both.
    Before init the env alone answers; init_distributed(shared_filesystem=...) sets the env var."""

    def rank_env(rank):
        return {"LOCAL_RANK": rank % 2, "LOCAL_WORLD_SIZE": 2, "NODE_RANK": rank // 2}

    def body():
        import os

        rank = ad.get_rank()
        cases = {
            "shared": {"AXOLOTL_DIST_SHARED_FS": "1"},
            "olmo-shared": {"OLMO_SHARED_FS": "1"},
            "not-shared": {"AXOLOTL_DIST_SHARED_FS": "0"},
            "not-shared-beats-olmo": {"AXOLOTL_DIST_SHARED_FS": "false", "OLMO_SHARED_FS": "1"},
            "explicit": {"AXOLOTL_DIST_SHARED_FS": "1", "FS_LOCAL_RANK": str(3 - rank)},
        }
        names = ("AXOLOTL_DIST_SHARED_FS", "OLMO_SHARED_FS", "FS_LOCAL_RANK")

        def answers():
            got = {}
            for case, env in cases.items():
                for name in names:
                    os.environ.pop(name, None)
                os.environ.update(env)
                got[case] = ad.get_fs_local_rank()
            for name in names:
                os.environ.pop(name, None)
            return got

        before = answers()
        unset_before = ad.get_fs_local_rank()  # no variable, no group: node-local
        ad.init_distributed(backend="gloo")  # assumes a shared filesystem by default
        default_after_init = (os.environ.get("AXOLOTL_DIST_SHARED_FS"), ad.get_fs_local_rank(),
                              ad.get_fs_local_rank(dist.group.WORLD))
        after = answers()
        ad.init_distributed(shared_filesystem=False)  # idempotent, but applies the setting
        told_not_shared = (os.environ.get("AXOLOTL_DIST_SHARED_FS"), ad.get_fs_local_rank())
        ad.init_distributed(shared_filesytem=True)  # the seed's spelling still works
        told_shared = (os.environ.get("AXOLOTL_DIST_SHARED_FS"), ad.get_fs_local_rank())
        return before, unset_before, default_after_init, after, told_not_shared, told_shared

    got = run_distributed(body, 4, init=False, rank_env=rank_env, timeout=60)
    for rank, (before, unset, default, after, not_shared, shared) in enumerate(got):
        local = rank % 2
        expected = {"shared": rank, "olmo-shared": rank, "not-shared": local,
                    "not-shared-beats-olmo": local, "explicit": 3 - rank}
        assert before == expected, f"rank {rank} before init"
        assert after == expected, f"rank {rank} after init"
        assert unset == local
        assert default == ("1", rank, rank)
        assert not_shared == ("0", local)
        assert shared == ("1", rank)


def test_get_fs_local_rank_rejects_a_non_boolean_shared_fs():
    def body():
        with pytest.raises(ad.DistributedEnvError, match=r"AXOLOTL_DIST_SHARED_FS='maybe'.*set it to 1"):
            ad.get_fs_local_rank()
        return True

    assert run_distributed(body, 1, init=False, env={"AXOLOTL_DIST_SHARED_FS": "maybe"}) == [True]


def test_queries_never_create_a_group_or_touch_the_network():
    """Under a launcher env whose MASTER_PORT has nobody listening, every query answers at once
    and no process group, store connection or thread appears (docs/design/decisions.md, decision 2)."""

    def body():
        import socket
        import time

        with socket.socket() as s:  # a port that is certainly closed
            s.bind(("127.0.0.1", 0))
            closed = s.getsockname()[1]
        import os

        os.environ["MASTER_PORT"] = str(closed)
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        before = set(threading.enumerate())
        t0 = time.monotonic()
        for _ in range(100):
            _snapshot()
            ad.get_global_rank(1)
            ad.get_sampler(list(range(8)))
            ad.validate_env_vars()
        return (time.monotonic() - t0, dist.is_initialized(),
                dist.distributed_c10d._world.default_pg is None,
                [t.name for t in set(threading.enumerate()) - before])

    for elapsed, initialized, no_pg, new_threads in run_distributed(body, 2, init=False):
        assert not initialized and no_pg and new_threads == []
        assert elapsed < 10  # 100 rounds of every query; a rendezvous attempt would block


def test_backend_supports_from_strings():
    assert ad.backend_supports_cuda("nccl") and not ad.backend_supports_cpu("nccl")
    assert ad.backend_supports_cpu("gloo") and not ad.backend_supports_cuda("gloo")
    assert ad.backend_supports_cpu("cuda:nccl,cpu:gloo") and ad.backend_supports_cuda("cuda:nccl,cpu:gloo")
    assert ad.backend_supports_cpu("mpi")
    assert ad.default_backend("cpu") == "gloo"
    assert ad.default_backend(torch.device("cuda")) == "nccl"


def test_get_mesh_coordinates(world_size):
    def body():
        from torch.distributed.device_mesh import DeviceMesh

        flat = DeviceMesh("cpu", torch.arange(world_size))
        # a 2-D layout listing the ranks backwards: rank r sits at row (ws-1-r)
        rev = DeviceMesh("cpu", torch.arange(world_size - 1, -1, -1).view(world_size, 1))
        return (ad.get_mesh_coordinates(flat),
                [ad.get_mesh_coordinates(flat, r) for r in range(world_size + 1)],
                ad.get_mesh_coordinates(rev))

    for rank, (mine, all_, rev) in enumerate(run_distributed(body, world_size, timeout=60)):
        assert mine == [rank]
        assert all_ == [[r] for r in range(world_size)] + [None]  # absent rank -> None
        assert rev == [world_size - 1 - rank, 0]


def test_get_sampler_splits_by_rank_before_and_after_init(world_size):
    def body():
        before = ad.get_sampler(list(range(10)))
        ad.init_distributed()
        after = ad.get_sampler(list(range(10)), shuffle=True, seed=3, drop_last=True)
        return ((before.num_replicas, before.rank, list(before)),
                (after.num_replicas, after.rank, list(after)))

    got = run_distributed(body, world_size, init=False, timeout=60)
    befores = [b for b, _ in got]
    afters = [a for _, a in got]
    total = -(-10 // world_size) * world_size  # padded by repeating from the start
    padded = list(range(10)) + list(range(10))[: total - 10]
    for rank, (replicas, r, idx) in enumerate(befores):
        assert (replicas, r) == (world_size, rank)
        assert idx == padded[rank:total:world_size]
    # drop_last + shuffle: disjoint equal shares covering floor(10/ws)*ws distinct items
    shares = [set(idx) for _, _, idx in afters]
    assert all(len(s) == 10 // world_size for s in shares)
    assert len(set().union(*shares)) == (10 // world_size) * world_size
    assert [(n, r) for n, r, _ in afters] == [(world_size, r) for r in range(world_size)]


def test_rank_queries_see_every_way_the_environment_changes():
    # The queries read os.environ's own storage for speed (the runtime's envvars module says
    # why); whatever way a script or launcher changes the environment, they must agree with
    # os.environ.get.
    from axolotl_dist import env

    original = dict(os.environ)
    try:
        _change_the_environment_every_way(env)
    finally:
        os.environ.clear()
        os.environ.update(original)


def _change_the_environment_every_way(env):
    for name in ("RANK", "WORLD_SIZE"):
        os.environ.pop(name, None)

    def agrees():
        rank, ws = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
        expected = (int(rank) if rank is not None else 0, int(ws) if ws is not None else 1)
        assert (env.env_rank(), env.env_world_size()) == expected
        assert (ad.get_rank(), ad.get_world_size()) == expected
        assert ad.is_main_process() == (expected[0] == 0)

    agrees()
    os.environ["WORLD_SIZE"] = "4"
    os.environ["RANK"] = "1"
    agrees()
    os.environ.update(RANK="2")
    agrees()
    os.environ.setdefault("RANK", "3")  # already set: unchanged
    agrees()
    os.environ["RANK"] = "3"
    agrees()
    del os.environ["RANK"]
    os.environ.pop("WORLD_SIZE")
    agrees()
    saved = dict(os.environ)
    try:
        os.environ.clear()
        agrees()
        os.environ.update(saved, RANK="1", WORLD_SIZE="2")
        agrees()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    os.putenv("RANK", "1")  # below os.environ: neither os.environ.get nor the queries see it
    try:
        agrees()
    finally:
        os.unsetenv("RANK")


def test_get_attempt_from_the_launchers_count_before_init():
    def body():
        out = [ad.get_attempt()]
        os.environ["TORCHELASTIC_RESTART_COUNT"] = "2"
        out.append(ad.get_attempt())
        del os.environ["TORCHELASTIC_RESTART_COUNT"]
        os.environ["SLURM_RESTART_COUNT"] = "1"  # a requeued SLURM job
        out.append(ad.get_attempt())
        os.environ["TORCHELASTIC_RESTART_COUNT"] = "-1"
        with pytest.raises(ad.DistributedEnvError) as info:
            ad.get_attempt()
        out.append(str(info.value))
        return out

    [(none, torch_count, slurm_count, bad)] = run_distributed(body, 1, init=False, env=NO_ENV)
    assert (none, torch_count, slurm_count) == (0, 2, 1)
    assert bad.startswith("TORCHELASTIC_RESTART_COUNT=-1 must be >= 0; set it to the number of "
                          "restarts before this attempt (>= 0), or unset it"), bad


@pytest.mark.parametrize("store", ["parent", "rank0"])
def test_get_attempt_after_init_is_agreed_through_an_agents_store(store):
    # a store in the parent stands for torch elastic's agent's: the ranks agree on the attempt
    # (the first: 0, whatever one node's count says); hosted by rank 0 (bare env vars, srun),
    # nothing is agreed on and the count stays the launcher's
    def body():
        return ad.get_attempt()

    got = run_distributed(body, 2, store=store, env={"SLURM_RESTART_COUNT": "3"})
    assert got == ([0, 0] if store == "parent" else [3, 3])
