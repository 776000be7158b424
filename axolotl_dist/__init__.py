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

# --- sharded tensors (issue 5) -------------------------------------------------------------
from .tensors import ShardedFlatParameter, ShardedFlatTensor, ShardingSpec  # noqa: E402

__all__ += ["ShardingSpec", "ShardedFlatTensor", "ShardedFlatParameter"]
