"""Tests for axolotl_dist.parallel: configs, world meshes on real gloo and the fake backend, pipelines.

Expected layouts are written out by hand (row-major, ``tp`` fastest), never computed with the
formula the code uses. Fake-backend tests run in one forked process so the pytest process never
holds a process group.
"""

import warnings

import pytest

import axolotl_dist as ad
from axolotl_dist import (
    ContextParallelConfig,
    DataParallelConfig,
    DataParallelType,
    DistributedConfigError,
    DPMeshDimName,
    ExpertParallelConfig,
    MeshDimName,
    PipelineParallelConfig,
    PipelineScheduleType,
    PipelineSplitStyle,
    TensorParallelConfig,
)
from axolotl_dist.testing import run_distributed
from fixtures import fake_group

TIMEOUT = 120
#: Variables cleared in fake-backend processes: the fake group, not the harness env, is the world.
FAKE_ENV = {"RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None, "LOCAL_WORLD_SIZE": None,
            "NODE_RANK": None, "NUM_NODES": None}


def two_nodes(world_size):
    """rank_env for ``world_size`` ranks on 2 simulated nodes."""
    per_node = world_size // 2
    return lambda r: {"LOCAL_RANK": str(r % per_node), "LOCAL_WORLD_SIZE": str(per_node),
                      "NODE_RANK": str(r // per_node), "NUM_NODES": "2"}


# --- enums and configs (no processes) -------------------------------------------------------


def test_enums_are_strings_with_their_value():
    assert str(MeshDimName.dp_replicate) == "dp_replicate" and f"{MeshDimName.tp}" == "tp"
    assert MeshDimName.dp_cp == "dp_cp" and DPMeshDimName.shard == "dp_shard"
    assert [str(t) for t in DataParallelType] == ["fsdp", "hsdp", "ddp"]
    assert [str(s) for s in PipelineSplitStyle] == ["loop", "v"]
    assert [str(s) for s in PipelineScheduleType] == [
        "1F1B", "Interleaved1F1B", "GPipe", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"]
    assert PipelineScheduleType.coerce("gpipe", "x") is PipelineScheduleType.gpipe
    assert PipelineScheduleType.single_1F1B.is_single_stage
    assert PipelineScheduleType.interleaved_1F1B.is_multi_stage
    assert DataParallelConfig(name="hsdp").name is DataParallelType.hsdp
    assert DataParallelConfig(name="fsdp").as_dict()["name"] == "fsdp"
    assert DataParallelConfig("fsdp", param_dtype="bfloat16").param_dtype == "bfloat16"
    import torch

    assert DataParallelConfig("fsdp", reduce_dtype=torch.float32).reduce_dtype is torch.float32


def test_pipeline_styles_and_stage_ids():
    loop = PipelineParallelConfig(degree=4)  # Interleaved1F1B: loop
    v = PipelineParallelConfig(degree=4, schedule="ZBVZeroBubble")
    assert loop.infer_style() == "loop" and v.infer_style() == "v"
    assert PipelineParallelConfig(4, style="v").infer_style() == "v"
    assert loop.final_stage_rank() == 3 and v.final_stage_rank() == 0
    assert list(loop.rank_completion_order()) == [3, 2, 1, 0]
    assert list(v.rank_completion_order()) == [0, 1, 2, 3]
    assert [loop.stage_ids_this_rank(r, 4) for r in range(4)] == [(0,), (1,), (2,), (3,)]
    assert [loop.stage_ids_this_rank(r, 8) for r in range(4)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert [loop.stage_ids_this_rank(r, 12) for r in range(4)] == [
        (0, 4, 8), (1, 5, 9), (2, 6, 10), (3, 7, 11)]
    assert [v.stage_ids_this_rank(r, 8) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert [PipelineParallelConfig(2, style="v").stage_ids_this_rank(r, 4) for r in range(2)] == [
        (0, 3), (1, 2)]


def test_replicate_and_shard_degree(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("NUM_NODES", "2")
    assert DataParallelConfig("hsdp").get_replicate_and_shard_degree(8) == (2, 4)
    assert DataParallelConfig("hsdp", num_replicas=4).get_replicate_and_shard_degree(8) == (4, 2)
    assert DataParallelConfig("hsdp", shard_degree=8).get_replicate_and_shard_degree(8) == (1, 8)
    both = DataParallelConfig("hsdp", num_replicas=2, shard_degree=4)
    assert both.get_replicate_and_shard_degree(8) == (2, 4)


@pytest.mark.parametrize("make, words", [
    (lambda: TensorParallelConfig(degree=0), ["TensorParallelConfig(degree=0)", "degree=0", ">= 1"]),
    (lambda: ContextParallelConfig(degree=-2), ["ContextParallelConfig(degree=-2)", ">= 1"]),
    (lambda: ExpertParallelConfig(degree=0), ["ExpertParallelConfig(degree=0)", ">= 1"]),
    (lambda: PipelineParallelConfig(degree=0), ["PipelineParallelConfig(degree=0)", ">= 1"]),
    (lambda: DataParallelConfig("hsdp", num_replicas=0), ["num_replicas=0", ">= 1"]),
    (lambda: DataParallelConfig("fsdp", param_dtype="bf16"), ["param_dtype='bf16'", "torch dtype"]),
    (lambda: DataParallelConfig("zero3"), ["DataParallelConfig.name='zero3'", "'fsdp', 'hsdp', 'ddp'"]),
    (lambda: PipelineParallelConfig(2, schedule="Nope"), ["schedule='Nope'", "'1F1B'"]),
    (lambda: DataParallelConfig("hsdp", num_replicas=3, shard_degree=2).get_replicate_and_shard_degree(8),
     ["num_replicas=3", "shard_degree=2", "3 * 2 = 6", "world size is 8"]),
    (lambda: DataParallelConfig("hsdp", num_replicas=3).get_replicate_and_shard_degree(8),
     ["num_replicas=3", "(8)", "'num_replicas' (3)"]),
    (lambda: DataParallelConfig("hsdp", shard_degree=5).get_replicate_and_shard_degree(8),
     ["shard_degree=5", "(8)", "'shard_degree' (5)"]),
    (lambda: PipelineParallelConfig(4).stage_ids_this_rank(0, 6),
     ["PipelineParallelConfig(degree=4)", "num_stages (6)", "degree (4)"]),
    (lambda: PipelineParallelConfig(4).stage_ids_this_rank(4, 8), ["pp_rank=4", "[0, 4)"]),
    (lambda: PipelineParallelConfig(2, style="v").stage_ids_this_rank(0, 6),
     ["V-style", "6 stages over 2 ranks is 3", "num_stages=4"]),
])
def test_config_errors_name_the_config_and_numbers(make, words):
    with pytest.raises(DistributedConfigError) as info:
        make()
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_default_device_type_follows_the_backend():
    import torch

    from axolotl_dist.parallel import default_device_type

    # a backend with both: the GPU where there is one, else the CPU (as collectives use)
    mixed = "cuda" if torch.cuda.is_available() else "cpu"
    assert [default_device_type(b) for b in ("gloo", "fake", "mpi", "nccl", "cuda:nccl,cpu:gloo",
                                             "cpu:gloo,cuda:nccl", "xpu:xccl")] == [
        "cpu", "cpu", "cpu", "cuda", mixed, mixed, "xpu"]


def test_build_without_process_group_says_to_init():
    assert not ad.is_initialized()
    with pytest.raises(ad.DistributedEnvError, match="init_distributed"):
        ad.build_world_mesh(dp=DataParallelConfig("fsdp"))
    assert not ad.is_initialized() and ad.get_world_mesh() is None


def test_import_does_not_load_pipelining():
    import subprocess
    import sys

    code = "import sys, axolotl_dist; print('torch.distributed.pipelining' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


# --- helpers run inside ranks ---------------------------------------------------------------


def _ranks(mesh):
    return mesh.mesh.tolist()


def _collect(mesh):
    """Every getter's view of ``mesh`` on this rank, as plain lists."""
    import torch.distributed as dist

    names = mesh.mesh_dim_names
    out = {"info": ad.get_device_mesh_info(mesh), "coord": ad.get_mesh_coordinates(mesh)}
    model = ad.get_dp_model_mesh(mesh)
    out["dp_model"] = (list(model.mesh_dim_names), _ranks(model))
    out["dp"] = _ranks(ad.get_dp_mesh(mesh))
    out["dp_pg"] = dist.get_process_group_ranks(ad.get_dp_process_group(mesh))
    for dim, getter in (("tp", ad.get_tp_mesh), ("cp", ad.get_cp_mesh), ("pp", ad.get_pp_mesh)):
        if dim in names:
            out[dim] = _ranks(getter(mesh))
    if "pp" in names:
        stage = ad.get_pp_stage_mesh(mesh)
        out["stage"] = (list(stage.mesh_dim_names), _ranks(stage))
    if "dp_shard" in names:
        out["ep"] = _ranks(ad.get_ep_mesh(mesh))
    return out


def _build_all(cases):
    """Build each ``(name, kwargs)`` mesh in turn on this rank; return ``{name: _collect}``."""
    warnings.simplefilter("error")  # no warnings from our code or the torch APIs it uses
    results = {}
    for name, kwargs in cases:
        mesh = ad.build_world_mesh(**kwargs)
        assert ad.get_world_mesh() is mesh
        results[name] = _collect(mesh)
        ad.reset_world_mesh()
    return results


def _by_rank(results, case, key):
    return [r[case][key] for r in results]


# --- real gloo: 2, 4 and 8 ranks ------------------------------------------------------------


def test_meshes_on_2_gloo_ranks():
    cases = [
        ("dp", dict(dp=DataParallelConfig("fsdp"))),
        ("pp_dp", dict(dp=DataParallelConfig("ddp"), pp=PipelineParallelConfig(2, schedule="1F1B"))),
        ("hsdp", dict(dp=DataParallelConfig("hsdp"))),  # 2 nodes -> one replica per node
    ]
    res = run_distributed(lambda: _build_all(cases), 2, timeout=TIMEOUT, rank_env=two_nodes(2))
    assert _by_rank(res, "dp", "info") == ["1D device mesh with shape (dp=2,)"] * 2
    assert _by_rank(res, "dp", "coord") == [[0], [1]]
    assert _by_rank(res, "dp", "dp_model") == [(["dp"], [0, 1])] * 2
    assert _by_rank(res, "dp", "dp_pg") == [[0, 1], [0, 1]]

    assert _by_rank(res, "pp_dp", "info") == ["2D device mesh with shape (pp=2, dp=1)"] * 2
    assert _by_rank(res, "pp_dp", "coord") == [[0, 0], [1, 0]]
    assert _by_rank(res, "pp_dp", "pp") == [[0, 1], [0, 1]]
    assert _by_rank(res, "pp_dp", "dp") == [[0], [1]]
    assert _by_rank(res, "pp_dp", "stage") == [(["dp"], [0]), (["dp"], [1])]
    assert _by_rank(res, "pp_dp", "dp_pg") == [[0], [1]]

    assert _by_rank(res, "hsdp", "info") == [
        "2D device mesh with shape (dp_replicate=2, dp_shard=1)"] * 2
    assert _by_rank(res, "hsdp", "coord") == [[0, 0], [1, 0]]
    assert _by_rank(res, "hsdp", "dp_model") == [(["dp_replicate", "dp_shard"], [[0], [1]])] * 2
    assert _by_rank(res, "hsdp", "dp_pg") == [[0, 1], [0, 1]]
    assert _by_rank(res, "hsdp", "ep") == [[0], [1]]


def test_meshes_on_4_gloo_ranks():
    cases = [
        ("hsdp", dict(dp=DataParallelConfig("hsdp"))),
        ("dp_tp", dict(dp=DataParallelConfig("fsdp"), tp=TensorParallelConfig(2))),
        ("pp_dp", dict(dp=DataParallelConfig("fsdp"), pp=PipelineParallelConfig(2))),
    ]
    res = run_distributed(lambda: _build_all(cases), 4, timeout=TIMEOUT, rank_env=two_nodes(4))
    assert _by_rank(res, "hsdp", "info") == [
        "2D device mesh with shape (dp_replicate=2, dp_shard=2)"] * 4
    assert _by_rank(res, "hsdp", "coord") == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert _by_rank(res, "hsdp", "dp_model") == [(["dp_replicate", "dp_shard"], [[0, 1], [2, 3]])] * 4
    assert _by_rank(res, "hsdp", "dp") == [[[0, 1], [2, 3]]] * 4
    assert _by_rank(res, "hsdp", "dp_pg") == [[0, 1, 2, 3]] * 4
    assert _by_rank(res, "hsdp", "ep") == [[0, 1], [0, 1], [2, 3], [2, 3]]

    assert _by_rank(res, "dp_tp", "info") == ["2D device mesh with shape (dp=2, tp=2)"] * 4
    assert _by_rank(res, "dp_tp", "coord") == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert _by_rank(res, "dp_tp", "tp") == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert _by_rank(res, "dp_tp", "dp") == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert _by_rank(res, "dp_tp", "dp_model") == [
        (["dp"], [0, 2]), (["dp"], [1, 3]), (["dp"], [0, 2]), (["dp"], [1, 3])]
    assert _by_rank(res, "dp_tp", "dp_pg") == [[0, 2], [1, 3], [0, 2], [1, 3]]

    assert _by_rank(res, "pp_dp", "info") == ["2D device mesh with shape (pp=2, dp=2)"] * 4
    assert _by_rank(res, "pp_dp", "coord") == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert _by_rank(res, "pp_dp", "pp") == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert _by_rank(res, "pp_dp", "dp") == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert _by_rank(res, "pp_dp", "stage") == [
        (["dp"], [0, 1]), (["dp"], [0, 1]), (["dp"], [2, 3]), (["dp"], [2, 3])]


def test_meshes_on_8_gloo_ranks():
    cases = [
        ("dp", dict(dp=DataParallelConfig("ddp"))),
        ("hsdp_ep", dict(dp=DataParallelConfig("hsdp"), ep=ExpertParallelConfig(4))),
        ("hsdp_cp_tp", dict(dp=DataParallelConfig("hsdp", shard_degree=2),
                            cp=ContextParallelConfig(2), tp=TensorParallelConfig(2))),
        ("pp_dp_tp", dict(dp=DataParallelConfig("fsdp"), tp=TensorParallelConfig(2),
                          pp=PipelineParallelConfig(2))),
    ]
    res = run_distributed(lambda: _build_all(cases), 8, timeout=TIMEOUT, rank_env=two_nodes(8))
    assert _by_rank(res, "dp", "coord") == [[0], [1], [2], [3], [4], [5], [6], [7]]
    assert _by_rank(res, "dp", "dp_pg") == [[0, 1, 2, 3, 4, 5, 6, 7]] * 8

    assert _by_rank(res, "hsdp_ep", "info") == [
        "2D device mesh with shape (dp_replicate=2, dp_shard=4)"] * 8
    assert _by_rank(res, "hsdp_ep", "coord") == [
        [0, 0], [0, 1], [0, 2], [0, 3], [1, 0], [1, 1], [1, 2], [1, 3]]
    assert _by_rank(res, "hsdp_ep", "dp_model") == [
        (["dp_replicate", "dp_shard"], [[0, 1, 2, 3], [4, 5, 6, 7]])] * 8
    assert _by_rank(res, "hsdp_ep", "dp_pg") == [[0, 1, 2, 3, 4, 5, 6, 7]] * 8
    assert _by_rank(res, "hsdp_ep", "ep") == [[0, 1, 2, 3]] * 4 + [[4, 5, 6, 7]] * 4

    case = "hsdp_cp_tp"
    assert _by_rank(res, case, "info") == [
        "4D device mesh with shape (dp_replicate=1, dp_shard=2, cp=2, tp=2)"] * 8
    assert _by_rank(res, case, "coord") == [
        [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0], [0, 0, 1, 1],
        [0, 1, 0, 0], [0, 1, 0, 1], [0, 1, 1, 0], [0, 1, 1, 1]]
    assert _by_rank(res, case, "tp") == [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5], [6, 7], [6, 7]]
    assert _by_rank(res, case, "cp") == [[0, 2], [1, 3], [0, 2], [1, 3], [4, 6], [5, 7], [4, 6], [5, 7]]
    even, odd = (["dp_replicate", "dp_cp"], [[0, 2, 4, 6]]), (["dp_replicate", "dp_cp"], [[1, 3, 5, 7]])
    assert _by_rank(res, case, "dp_model") == [even, odd] * 4
    assert _by_rank(res, case, "dp") == [[[0, 4]], [[1, 5]], [[2, 6]], [[3, 7]]] * 2
    assert _by_rank(res, case, "dp_pg") == [[0, 4], [1, 5], [2, 6], [3, 7]] * 2
    assert _by_rank(res, case, "ep") == [[0, 4], [1, 5], [2, 6], [3, 7]] * 2

    case = "pp_dp_tp"
    assert _by_rank(res, case, "info") == ["3D device mesh with shape (pp=2, dp=2, tp=2)"] * 8
    assert _by_rank(res, case, "coord") == [
        [0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1], [1, 0, 0], [1, 0, 1], [1, 1, 0], [1, 1, 1]]
    assert _by_rank(res, case, "pp") == [[0, 4], [1, 5], [2, 6], [3, 7]] * 2
    assert _by_rank(res, case, "stage") == [(["dp", "tp"], [[0, 1], [2, 3]])] * 4 + [
        (["dp", "tp"], [[4, 5], [6, 7]])] * 4
    assert _by_rank(res, case, "dp") == [[0, 2], [1, 3], [0, 2], [1, 3], [4, 6], [5, 7], [4, 6], [5, 7]]
    assert _by_rank(res, case, "tp") == [[0, 1], [0, 1], [2, 3], [2, 3], [4, 5], [4, 5], [6, 7], [6, 7]]


# --- torch's fake process group: 64, 1,024 and 8,192 ranks in one process --------------------


def _summary(mesh):
    """Shape, first 8 ranks (row-major) and this rank's coordinate of a possibly huge mesh."""
    return {"shape": list(mesh.shape), "head": mesh.mesh.flatten().tolist()[:8],
            "coord": list(mesh.get_coordinate())}


def _fake_layouts(world_size, kwargs, ranks):
    """On the fake backend, build the mesh as each of ``ranks``; summarise every getter."""
    import torch.distributed as dist

    warnings.simplefilter("error")
    out = {}
    for rank in ranks:
        fake_group(rank, world_size)
        mesh = ad.build_world_mesh(**kwargs)
        names = mesh.mesh_dim_names
        got = {"info": ad.get_device_mesh_info(mesh), "coord": list(mesh.get_coordinate()),
               "dp_model": _summary(ad.get_dp_model_mesh(mesh)), "dp": _summary(ad.get_dp_mesh(mesh))}
        pg_ranks = dist.get_process_group_ranks(ad.get_dp_process_group(mesh))
        got["dp_pg"] = (len(pg_ranks), pg_ranks[:8])
        for dim, getter in (("tp", ad.get_tp_mesh), ("cp", ad.get_cp_mesh), ("pp", ad.get_pp_mesh)):
            if dim in names:
                got[dim] = getter(mesh).mesh.tolist()
        if "pp" in names:
            got["stage"] = _summary(ad.get_pp_stage_mesh(mesh))
        if "dp_shard" in names:
            got["ep"] = _summary(ad.get_ep_mesh(mesh))
        out[rank] = got
        ad.cleanup_distributed()
        assert ad.get_world_mesh() is None
    return out


def _run_fake(world_size, kwargs, ranks, env=None):
    fake_env = dict(FAKE_ENV, **(env or {}))
    [out] = run_distributed(lambda: _fake_layouts(world_size, kwargs, ranks), 1, init=False,
                            env=fake_env, timeout=TIMEOUT)
    return out  # the time it takes is measured in benchmarks/mesh.py


def test_fake_64_ranks_pp_hsdp_cp_tp():
    kwargs = dict(pp=PipelineParallelConfig(2), dp=DataParallelConfig("hsdp", num_replicas=2),
                  cp=ContextParallelConfig(2), tp=TensorParallelConfig(2))
    out = _run_fake(64, kwargs, [0, 45, 63])
    assert out[45]["info"] == (
        "5D device mesh with shape (pp=2, dp_replicate=2, dp_shard=4, cp=2, tp=2)")
    assert [out[r]["coord"] for r in (0, 45, 63)] == [[0, 0, 0, 0, 0], [1, 0, 3, 0, 1], [1, 1, 3, 1, 1]]
    r45 = out[45]
    assert (r45["tp"], r45["cp"], r45["pp"]) == ([44, 45], [45, 47], [13, 45])
    assert r45["dp"] == {"shape": [2, 4], "head": [33, 37, 41, 45, 49, 53, 57, 61], "coord": [0, 3]}
    assert r45["dp_model"] == {"shape": [2, 8], "head": [33, 35, 37, 39, 41, 43, 45, 47],
                               "coord": [0, 6]}
    assert r45["dp_pg"] == (8, [33, 37, 41, 45, 49, 53, 57, 61])
    assert r45["ep"] == {"shape": [4], "head": [33, 37, 41, 45], "coord": [3]}
    assert r45["stage"] == {"shape": [2, 4, 2, 2], "head": [32, 33, 34, 35, 36, 37, 38, 39],
                            "coord": [0, 3, 0, 1]}
    r63 = out[63]
    assert (r63["tp"], r63["cp"], r63["pp"]) == ([62, 63], [61, 63], [31, 63])
    assert r63["dp_model"]["head"] == [33, 35, 37, 39, 41, 43, 45, 47]  # row 0 of (2, 8)
    assert r63["dp_model"]["coord"] == [1, 7]


def test_fake_1024_ranks_pp_dp_tp_and_hsdp_ep():
    kwargs = dict(pp=PipelineParallelConfig(4), dp=DataParallelConfig("fsdp"),
                  tp=TensorParallelConfig(8))
    out = _run_fake(1024, kwargs, [0, 777, 1023])
    assert out[0]["info"] == "3D device mesh with shape (pp=4, dp=32, tp=8)"
    assert [out[r]["coord"] for r in (0, 777, 1023)] == [[0, 0, 0], [3, 1, 1], [3, 31, 7]]
    assert out[777]["tp"] == [776, 777, 778, 779, 780, 781, 782, 783]
    assert out[777]["pp"] == [9, 265, 521, 777]
    assert out[1023]["pp"] == [255, 511, 767, 1023]
    assert out[777]["dp"] == {"shape": [32], "head": [769, 777, 785, 793, 801, 809, 817, 825],
                              "coord": [1]}
    assert out[777]["dp_pg"] == (32, [769, 777, 785, 793, 801, 809, 817, 825])
    assert out[777]["stage"] == {"shape": [32, 8], "head": [768, 769, 770, 771, 772, 773, 774, 775],
                                 "coord": [1, 1]}
    # HSDP with one replica per node (8 ranks per node -> 128 nodes) and EP over the node.
    kwargs = dict(dp=DataParallelConfig("hsdp"), ep=ExpertParallelConfig(8))
    out = _run_fake(1024, kwargs, [777], env={"LOCAL_WORLD_SIZE": "8"})
    r777 = out[777]
    assert r777["info"] == "2D device mesh with shape (dp_replicate=128, dp_shard=8)"
    assert r777["coord"] == [97, 1]
    assert r777["ep"] == {"shape": [8], "head": [776, 777, 778, 779, 780, 781, 782, 783], "coord": [1]}
    assert r777["dp_model"] == {"shape": [128, 8], "head": [0, 1, 2, 3, 4, 5, 6, 7], "coord": [97, 1]}
    assert r777["dp_pg"] == (1024, [0, 1, 2, 3, 4, 5, 6, 7])


def test_fake_8192_ranks_pp_hsdp_cp_tp():
    kwargs = dict(pp=PipelineParallelConfig(2), dp=DataParallelConfig("hsdp", num_replicas=16),
                  cp=ContextParallelConfig(2), tp=TensorParallelConfig(2))
    out = _run_fake(8192, kwargs, [0, 5000, 8191])
    assert out[0]["info"] == "5D device mesh with shape (pp=2, dp_replicate=16, dp_shard=64, cp=2, tp=2)"
    assert [out[r]["coord"] for r in (0, 5000, 8191)] == [
        [0, 0, 0, 0, 0], [1, 3, 34, 0, 0], [1, 15, 63, 1, 1]]
    r = out[5000]
    assert (r["tp"], r["cp"], r["pp"]) == ([5000, 5001], [5000, 5002], [904, 5000])
    assert r["dp"] == {"shape": [16, 64], "head": [4096, 4100, 4104, 4108, 4112, 4116, 4120, 4124],
                       "coord": [3, 34]}
    assert r["dp_model"] == {"shape": [16, 128],
                             "head": [4096, 4098, 4100, 4102, 4104, 4106, 4108, 4110],
                             "coord": [3, 68]}
    assert r["dp_pg"] == (1024, [4096, 4100, 4104, 4108, 4112, 4116, 4120, 4124])
    assert r["ep"] == {"shape": [64], "head": [4864, 4868, 4872, 4876, 4880, 4884, 4888, 4892],
                       "coord": [34]}
    assert r["stage"]["shape"] == [16, 64, 2, 2] and r["stage"]["coord"] == [3, 34, 0, 0]
    assert r["stage"]["head"] == [4096, 4097, 4098, 4099, 4100, 4101, 4102, 4103]
    r = out[8191]
    assert (r["tp"], r["cp"], r["pp"]) == ([8190, 8191], [8189, 8191], [4095, 8191])
    assert r["dp_model"]["coord"] == [15, 127]


def test_fake_8192_ranks_hsdp_per_node_tp():
    # 8 ranks per node -> 1,024 nodes; tp=4 leaves 2,048 DP ranks: 1,024 replicas of 2.
    kwargs = dict(dp=DataParallelConfig("hsdp"), tp=TensorParallelConfig(4))
    out = _run_fake(8192, kwargs, [6543], env={"LOCAL_WORLD_SIZE": "8"})
    r = out[6543]
    assert r["info"] == "3D device mesh with shape (dp_replicate=1024, dp_shard=2, tp=4)"
    assert r["coord"] == [817, 1, 3]
    assert r["tp"] == [6540, 6541, 6542, 6543]
    assert r["ep"] == {"shape": [2], "head": [6539, 6543], "coord": [1]}
    assert r["dp_pg"] == (2048, [3, 7, 11, 15, 19, 23, 27, 31])


# --- errors ----------------------------------------------------------------------------------


def _error_messages():
    """Build bad meshes on an 8-rank fake world; return ``{case: (exception type, message)}``."""
    import torch.distributed as dist

    fake_group(0, 8)
    fsdp, hsdp = DataParallelConfig("fsdp"), DataParallelConfig("hsdp", shard_degree=4)
    negative = TensorParallelConfig(2)
    negative.degree = -1  # mutated after construction: checked again at build time
    cases = {
        "no_dp": dict(tp=TensorParallelConfig(2)),
        "wrong_type": dict(dp="fsdp"),
        "tp_not_dividing": dict(dp=fsdp, tp=TensorParallelConfig(3)),
        "cp_not_dividing_rest": dict(dp=fsdp, pp=PipelineParallelConfig(2), cp=ContextParallelConfig(8)),
        "negative_degree": dict(dp=fsdp, tp=negative),
        "replicas_times_shard": dict(dp=DataParallelConfig("hsdp", num_replicas=3, shard_degree=2)),
        "nodes_not_dividing": dict(dp=DataParallelConfig("hsdp")),
        "ep_with_tp": dict(dp=hsdp, tp=TensorParallelConfig(2), ep=ExpertParallelConfig(2)),
        "ep_with_fsdp": dict(dp=fsdp, ep=ExpertParallelConfig(4)),
        "ep_not_shard": dict(dp=hsdp, ep=ExpertParallelConfig(2)),
        "ep_not_dividing": dict(dp=hsdp, ep=ExpertParallelConfig(3)),
    }
    out = {}
    for name, kwargs in cases.items():
        try:
            ad.build_world_mesh(**kwargs)
            out[name] = ("no error", "")
        except Exception as exc:  # noqa: BLE001
            out[name] = (type(exc).__name__, str(exc), isinstance(exc, DistributedConfigError))
    mesh = ad.build_world_mesh(dp=fsdp)
    for name, call in (("twice", lambda: ad.build_world_mesh(dp=fsdp)),
                       ("no_tp", lambda: ad.get_tp_mesh(mesh)),
                       ("no_pp", lambda: ad.get_pp_mesh(mesh)),
                       ("no_cp", lambda: ad.get_cp_mesh(mesh)),
                       ("no_ep", lambda: ad.get_ep_mesh(mesh))):
        try:
            call()
            out[name] = ("no error", "")
        except Exception as exc:  # noqa: BLE001
            out[name] = (type(exc).__name__, str(exc),
                         isinstance(exc, DistributedConfigError) and isinstance(exc, RuntimeError))
    ad.reset_world_mesh()
    cp_mesh = ad.build_world_mesh(dp=fsdp, cp=ContextParallelConfig(2))
    try:
        ad.get_dp_mesh(ad.get_dp_model_mesh(cp_mesh))
        out["dp_cp_to_dp_mesh"] = ("no error", "")
    except Exception as exc:  # noqa: BLE001
        out["dp_cp_to_dp_mesh"] = (type(exc).__name__, str(exc), isinstance(exc, DistributedConfigError))
    dist.destroy_process_group()
    return out


ERRORS = {
    "no_dp": ["TensorParallelConfig(degree=2)", "data parallel config is required"],
    "wrong_type": ["dp='fsdp'", "must be a DataParallelConfig"],
    "tp_not_dividing": ["TensorParallelConfig(degree=3)", "8 rank(s) left of the world size 8",
                        "not divisible by 3"],
    "cp_not_dividing_rest": ["ContextParallelConfig(degree=8)", "4 rank(s) left of the world size 8"],
    "negative_degree": ["TensorParallelConfig(degree=-1)", "degree=-1 must be an integer >= 1"],
    "replicas_times_shard": ["num_replicas=3, shard_degree=2", "3 * 2 = 6",
                             "data parallel world size is 8"],
    "nodes_not_dividing": ["DataParallelConfig(name='hsdp')", "world size (8)", "number of nodes (3)",
                           "set num_replicas or shard_degree"],
    "ep_with_tp": ["ExpertParallelConfig(degree=2)", "TensorParallelConfig(degree=2)",
                   "tensor parallelism"],
    "ep_with_fsdp": ["ExpertParallelConfig(degree=4)", "needs data parallel type 'hsdp'", "'fsdp'"],
    "ep_not_shard": ["ExpertParallelConfig(degree=2)", "must equal the shard degree (4",
                     "/ 2 replicas"],
    "ep_not_dividing": ["ExpertParallelConfig(degree=3)", "data parallel world size (8)",
                        "not divisible by 3"],
    "twice": ["already built", "1D device mesh with shape (dp=8,)", "reset_world_mesh()"],
    "no_tp": ["get_tp_mesh", "(dp=8,)", "no 'tp' dimension"],
    "no_pp": ["get_pp_mesh", "no 'pp' dimension"],
    "no_cp": ["get_cp_mesh", "no 'cp' dimension"],
    "no_ep": ["get_ep_mesh", "no 'ep', 'ep_shard' or 'dp_shard' dimension"],
    "dp_cp_to_dp_mesh": ["get_dp_mesh", "(dp_cp=8,)", "pass the world mesh"],
}


def test_build_errors_name_the_config_and_numbers():
    [out] = run_distributed(_error_messages, 1, init=False, env=dict(FAKE_ENV, NUM_NODES="3"),
                            timeout=TIMEOUT)
    assert set(out) == set(ERRORS)
    for case, words in ERRORS.items():
        kind, message, is_config_error = out[case]
        assert is_config_error, (case, kind, message)
        for word in words:
            assert word in message, (case, word, message)


# --- the world mesh's life cycle --------------------------------------------------------------


def _life_cycle():
    warnings.simplefilter("error")
    seen = {"before": ad.get_world_mesh() is None}
    plain = ad.build_world_mesh()  # no configs: 1-D dp mesh of the world, not stored
    seen["plain"] = (ad.get_device_mesh_info(plain), ad.get_world_mesh() is None)
    mesh = ad.build_world_mesh(dp=DataParallelConfig("fsdp"), tp=TensorParallelConfig(2))
    seen["stored"] = ad.get_world_mesh() is mesh
    flat = ad.flatten_mesh(mesh)
    seen["flat"] = (flat.mesh_dim_names, flat.mesh.tolist(), ad.flatten_mesh(flat) is flat)
    ad.reset_world_mesh()
    seen["reset"] = ad.get_world_mesh() is None
    ad.build_world_mesh(dp=DataParallelConfig("ddp"))
    ad.cleanup_distributed()  # destroys the group and forgets the mesh
    seen["cleanup"] = ad.get_world_mesh() is None
    return seen


def test_world_mesh_life_cycle():
    out = run_distributed(_life_cycle, 2, timeout=TIMEOUT)
    assert out[0] == {"before": True, "plain": ("1D device mesh with shape (dp=2,)", True),
                      "stored": True, "flat": (("dp_tp",), [0, 1], True), "reset": True,
                      "cleanup": True}


def _stale_mesh():
    import torch.distributed as dist

    fake_group(0, 4)
    ad.build_world_mesh(dp=DataParallelConfig("fsdp"))
    dist.destroy_process_group()  # not through cleanup_distributed
    fake_group(0, 4)
    stale = ad.get_world_mesh()
    mesh = ad.build_world_mesh(dp=DataParallelConfig("fsdp"))  # no "already built" error
    dist.destroy_process_group()
    return stale is None, list(mesh.shape)


def test_world_mesh_is_forgotten_with_its_process_group():
    assert run_distributed(_stale_mesh, 1, init=False, env=FAKE_ENV, timeout=TIMEOUT) == [(True, [4])]


# --- pipeline parallel: 2 stages on 2 gloo ranks match the plain model ------------------------


def _make_mlp():
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))


def _pipeline_vs_plain(schedules):
    """Per schedule: this rank's stage ids, loss error and max gradient error vs. the plain MLP."""
    import torch
    from torch import nn
    from torch.distributed.pipelining import PipelineStage

    warnings.simplefilter("error")
    mesh = ad.build_world_mesh(dp=DataParallelConfig("ddp"), pp=PipelineParallelConfig(2))
    pp_mesh = ad.get_pp_mesh(mesh)
    pp_rank = pp_mesh.get_local_rank()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)
    loss_fn = nn.MSELoss()
    plain = _make_mlp()
    plain_loss = loss_fn(plain(x), y)
    plain_loss.backward()
    plain_grads = [p.grad for p in plain.parameters()]
    out = {}
    for schedule, num_stages in schedules:
        config = PipelineParallelConfig(2, schedule=schedule)
        model = _make_mlp()
        layers = list(model)
        cuts = {2: [0, 4, 7], 4: [0, 2, 4, 6, 7]}[num_stages]
        ids = config.stage_ids_this_rank(pp_rank, num_stages)
        parts = [nn.Sequential(*layers[cuts[i]:cuts[i + 1]]) for i in ids]
        stages = [PipelineStage(part, i, num_stages, torch.device("cpu"), group=pp_mesh.get_group())
                  for part, i in zip(parts, ids)]
        pipe = ad.PipelineSchedule(model_parts=parts, stages=stages, pp_mesh=pp_mesh,
                                   schedule_name=schedule, loss_fn=loss_fn, num_microbatches=4)
        output, losses = pipe.step(x, target=y)
        index = {id(p): k for k, p in enumerate(model.parameters())}
        grad_error = max(float((p.grad - plain_grads[index[id(p)]]).abs().max())
                         for part in parts for p in part.parameters())
        loss_error = None if losses is None else float((losses.mean() - plain_loss).abs().detach())
        out_shape = None if output is None else list(output.shape)
        out[str(schedule)] = (list(ids), pipe.has_first_stage, pipe.has_last_stage, loss_error,
                              grad_error, out_shape)
    try:  # a single-stage schedule with two model parts
        ad.PipelineSchedule(model_parts=[nn.Linear(2, 2)] * 2, stages=[object()] * 2,
                            pp_mesh=pp_mesh, schedule_name="1F1B")
        out["error"] = "no error"
    except DistributedConfigError as exc:
        out["error"] = str(exc)
    return out


def test_two_stage_pipeline_matches_the_plain_model():
    pytest.importorskip("numpy", reason="torch's pipelining needs NumPy (test_installs.py "
                        "checks the message without it)")
    import torch.distributed.pipelining  # noqa: F401  (once here, not in each forked rank)

    schedules = [("1F1B", 2), ("GPipe", 2), ("Interleaved1F1B", 4), ("ZBVZeroBubble", 4)]
    res = run_distributed(lambda: _pipeline_vs_plain(schedules), 2, timeout=TIMEOUT)
    expected_ids = {"1F1B": ([0], [1]), "GPipe": ([0], [1]), "Interleaved1F1B": ([0, 2], [1, 3]),
                    "ZBVZeroBubble": ([0, 3], [1, 2])}
    # loop style: the last stage is on pp rank 1; V style: on pp rank 0
    last = {"1F1B": 1, "GPipe": 1, "Interleaved1F1B": 1, "ZBVZeroBubble": 0}
    for schedule, _ in schedules:
        for rank in (0, 1):
            ids, has_first, has_last, loss_error, grad_error, out_shape = res[rank][schedule]
            assert ids == expected_ids[schedule][rank], schedule
            assert has_first == (rank == 0) and has_last == (rank == last[schedule]), schedule
            assert grad_error < 1e-5, (schedule, rank, grad_error)
            if has_last:
                assert loss_error < 1e-5 and out_shape == [8, 4], (schedule, rank, loss_error)
            else:
                assert loss_error is None and out_shape is None, schedule
    for rank in (0, 1):
        assert "single-stage schedule" in res[rank]["error"], res[rank]["error"]
        assert "got 2" in res[rank]["error"]
