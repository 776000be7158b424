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

from . import config, mesh, pipeline
from .config import *  # noqa: F401,F403
from .mesh import *  # noqa: F401,F403
from .pipeline import *  # noqa: F401,F403

__all__ = [*config.__all__, *mesh.__all__, *pipeline.__all__]
