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
    assert DataParallelConfig("hsdp", num_replicas=2, shard_degree=4).get_replicate_and_shard_degree(8) == (2, 4)


@pytest.mark.parametrize("make, words", [
    (lambda: TensorParallelConfig(degree=0), ["TensorParallelConfig(degree=0)", "degree=0", ">= 1"]),
    (lambda: ContextParallelConfig(degree=-2), ["ContextParallelConfig(degree=-2)", ">= 1"]),
    (lambda: ExpertParallelConfig(degree=0), ["ExpertParallelConfig(degree=0)", ">= 1"]),
    (lambda: PipelineParallelConfig(degree=0), ["PipelineParallelConfig(degree=0)", ">= 1"]),
    (lambda: DataParallelConfig("hsdp", num_replicas=0), ["num_replicas=0", ">= 1"]),
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
