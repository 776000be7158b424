"""axolotl_dist: the distributed helpers PyTorch training scripts keep rewriting.

Every public name is importable from here; :mod:`axolotl_dist.distributed` holds the
functional layer, :mod:`axolotl_dist.hf_data` ``shared_map`` (a Hugging Face ``datasets.map``
split across ranks), :mod:`axolotl_dist.parallel` device meshes, :mod:`axolotl_dist.tensors`
sharded flat tensors, :mod:`axolotl_dist.launch` the launcher and :mod:`axolotl_dist.testing`
a multi-process test harness. Importing this package never creates a process group, and never
imports ``datasets`` (only calling ``shared_map`` does).

Under the public modules, the private package :mod:`axolotl_dist._runtime` holds the machinery
they share, one concern per module; its docstring is the map, and docs/design/README.md the design.
"""

from __future__ import annotations

import gc as _gc
import warnings as _warnings

# The kit needs torch alone: NumPy is optional, and torch's import-time notice that it is
# missing ("Failed to initialize NumPy") says nothing a user of the kit must act on.
_warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

# Importing torch and the kit makes ~260,000 objects that live as long as the process; the
# cyclic collector would walk them again and again during the import and at every full
# collection after it (89 ms each). So: paused for the import, what exists then frozen (moved
# to the permanent generation, which collections skip; reference counting still frees it), the
# collector left on or off as it was (docs/performance.md, "Import").
_collecting = _gc.isenabled()
_gc.disable()
try:
    from .distributed import *  # noqa: F401,F403
    from .distributed import __all__ as _functional
    from .distributed import print  # noqa: F401,A004 - ad.print, kept out of __all__
finally:
    _gc.freeze()
    if _collecting:
        _gc.enable()
from .errors import (
    AxolotlDistError,
    CollectiveMismatchError,
    DistributedOperationException,
    TensorMismatchError,
    ThreadConflictError,
    DistributedConfigError,
    DistributedEnvError,
    RankFailedError,
    RankTimeoutError,
)

__version__ = "0.1.0"

__all__ = list(_functional) + [
    "AxolotlDistError",
    "CollectiveMismatchError",
    "DistributedOperationException",
    "TensorMismatchError",
    "ThreadConflictError",
    "DistributedConfigError",
    "DistributedEnvError",
    "RankFailedError",
    "RankTimeoutError",
    "__version__",
]

# --- device meshes, parallel configs, sharded tensors -----------------------------------------
# Everything public in axolotl_dist.parallel and axolotl_dist.tensors except a few internals
# (StrEnum, MeshUsageError, default_device_type and the dtensor_utils module stay there).
from . import parallel as _parallel  # noqa: E402
from . import tensors as _tensors  # noqa: E402
from .parallel import *  # noqa: E402,F401,F403
from .tensors import ShardedFlatParameter, ShardedFlatTensor, ShardingSpec  # noqa: E402,F401

_KEPT_IN_SUBPACKAGES = {"StrEnum", "MeshUsageError", "default_device_type", "dtensor_utils"}
__all__ += [n for n in (*_parallel.__all__, *_tensors.__all__) if n not in _KEPT_IN_SUBPACKAGES]
for _hidden in _KEPT_IN_SUBPACKAGES:
    globals().pop(_hidden, None)  # pulled in by the star import; reach them via the subpackage

# --- pickled by name ------------------------------------------------------------------------
# A map function that mentions the kit hashes the same in every process and install mode, so
# `datasets` reuses zero_first's cache (docs/design/machine.md, "Installs").
from ._runtime.base.pickling import by_name as _by_name  # noqa: E402

_by_name(__name__)

# --- Python warnings folded across ranks ------------------------------------------------------
# Under torchrun, srun or env vars, rank 0 prints a warning several ranks raised once, naming
# them (docs/launching.md, "Under other launchers"); one process, or AXOLOTL_DIST_FOLD=0: off.
from ._runtime.lifecycle.warnfold import install as _fold_warnings  # noqa: E402

_fold_warnings()

# --- a start-up failure that repeats stops torchrun's restarts ---------------------------------
# (docs/launching.md, "Restarts"; axolotl-dist's launcher applies the same policy itself)
from ._runtime.lifecycle.repeat_failure import watch as _watch_restarts  # noqa: E402

_watch_restarts()
