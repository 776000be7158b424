"""axolotl_dist: the distributed helpers PyTorch training scripts keep rewriting.

Every public name is importable from here; :mod:`axolotl_dist.distributed` holds the
functional layer, :mod:`axolotl_dist.parallel` device meshes, :mod:`axolotl_dist.tensors`
sharded flat tensors, :mod:`axolotl_dist.launch` the launcher and :mod:`axolotl_dist.testing`
a multi-process test harness. Importing this package never creates a process group.
"""

from __future__ import annotations

from .distributed import *  # noqa: F401,F403
from .distributed import __all__ as _functional
from .errors import (
    AxolotlDistError,
    CollectiveMismatchError,
    DistributedConfigError,
    DistributedEnvError,
    RankFailedError,
    RankTimeoutError,
)

__version__ = "0.1.0"

__all__ = list(_functional) + [
    "AxolotlDistError",
    "CollectiveMismatchError",
    "DistributedConfigError",
    "DistributedEnvError",
    "RankFailedError",
    "RankTimeoutError",
    "__version__",
]

# --- device meshes and parallel configs (issue 4) --------------------------------------------
from .parallel import (  # noqa: E402
    ContextParallelConfig,
    DataParallelConfig,
    DataParallelType,
    DPMeshDimName,
    ExpertParallelConfig,
    MeshDimName,
    PipelineParallelConfig,
    PipelineSchedule,
    PipelineScheduleType,
    PipelineSplitStyle,
    TensorParallelConfig,
    build_world_mesh,
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

__all__ += [
    "MeshDimName", "DPMeshDimName", "DataParallelType", "DataParallelConfig",
    "TensorParallelConfig", "ContextParallelConfig", "ExpertParallelConfig",
    "PipelineParallelConfig", "PipelineScheduleType", "PipelineSplitStyle", "PipelineSchedule",
    "build_world_mesh", "get_world_mesh", "reset_world_mesh", "get_dp_model_mesh", "get_dp_mesh",
    "get_tp_mesh", "get_cp_mesh", "get_pp_mesh", "get_pp_stage_mesh", "get_ep_mesh",
    "get_dp_process_group", "get_device_mesh_info", "flatten_mesh",
]

# --- sharded tensors (issue 5) -------------------------------------------------------------
from .tensors import ShardedFlatParameter, ShardedFlatTensor, ShardingSpec  # noqa: E402

__all__ += ["ShardingSpec", "ShardedFlatTensor", "ShardedFlatParameter"]
