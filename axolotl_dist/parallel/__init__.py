"""Device meshes, parallel configs and a pipeline schedule wrapper (OLMo-core's ``distributed.parallel``).

* :mod:`~axolotl_dist.parallel.config`: the enums and config dataclasses;
* :mod:`~axolotl_dist.parallel.mesh`: :func:`build_world_mesh`, the world mesh and the
  ``get_*_mesh`` getters;
* :mod:`~axolotl_dist.parallel.pipeline`: :class:`PipelineSchedule` (imports
  ``torch.distributed.pipelining`` lazily).

Example (8 ranks, 2 nodes)::

    mesh = build_world_mesh(dp=DataParallelConfig(name="hsdp"), tp=TensorParallelConfig(degree=2))
    get_device_mesh_info(mesh)   # '3D device mesh with shape (dp_replicate=2, dp_shard=2, tp=2)'
    fsdp_mesh = get_dp_model_mesh(mesh)
    loader_group = get_dp_process_group(mesh)
"""

from __future__ import annotations

from .config import (
    ContextParallelConfig,
    DataParallelConfig,
    DataParallelType,
    DPMeshDimName,
    ExpertParallelConfig,
    MeshDimName,
    PipelineParallelConfig,
    PipelineScheduleType,
    PipelineSplitStyle,
    StrEnum,
    TensorParallelConfig,
)
from .mesh import (
    MeshUsageError,
    build_world_mesh,
    default_device_type,
    flatten_mesh,
    get_cp_mesh,
    get_device_mesh_info,
    get_dp_mesh,
    get_dp_model_mesh,
    get_dp_process_group,
    get_ep_mesh,
    get_pp_mesh,
    get_pp_stage_mesh,
    get_tp_mesh,
    get_world_mesh,
    reset_world_mesh,
)
from .pipeline import PipelineSchedule

__all__ = [
    "StrEnum",
    "MeshDimName",
    "DPMeshDimName",
    "DataParallelType",
    "DataParallelConfig",
    "TensorParallelConfig",
    "ContextParallelConfig",
    "ExpertParallelConfig",
    "PipelineParallelConfig",
    "PipelineScheduleType",
    "PipelineSplitStyle",
    "PipelineSchedule",
    "MeshUsageError",
    "build_world_mesh",
    "get_world_mesh",
    "reset_world_mesh",
    "default_device_type",
    "get_dp_model_mesh",
    "get_dp_mesh",
    "get_tp_mesh",
    "get_cp_mesh",
    "get_pp_mesh",
    "get_pp_stage_mesh",
    "get_ep_mesh",
    "get_dp_process_group",
    "get_device_mesh_info",
    "flatten_mesh",
]

