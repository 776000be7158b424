"""A multi-process test harness for code that uses torch.distributed, usable in your own tests.

:func:`run_distributed` runs ``fn`` on ``world_size`` local ranks and returns each rank's
return value, indexed by rank::

    from axolotl_dist.testing import run_distributed

    def test_sum():
        def body():
            import axolotl_dist as ad
            return ad.all_reduce_value(ad.get_rank() + 1)
        assert run_distributed(body, world_size=3) == [6, 6, 6]

How it works, and why it is fast and never hangs:

* Ranks are **forked** from the test process (no fresh interpreter, no pickling of ``fn``, so
  closures and lambdas work). Each rank runs in its own process group so the whole tree can
  be killed.
* ``store="parent"`` (default): the test process hosts the c10d ``TCPStore`` on ``127.0.0.1``
  with an OS-chosen port (no free-port race) and the ranks join it as clients, exactly as
  under ``torchrun`` (``TORCHELASTIC_USE_AGENT_STORE``). ``store="rank0"``: rank 0's own
  process hosts it, as with bare env vars, ``srun`` or ``mpirun``, so the store dies with
  rank 0 (the port is a socket the test process bound and rank 0 inherits: no race either).
  Every rank gets the launcher env contract (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ...).
* With ``init=True`` (default) each rank calls :func:`axolotl_dist.init_distributed` first (on
  gloo followed by one raw barrier, so every rank is connected before any ``fn`` runs) and
  destroys the group afterwards; with ``init=False`` ``fn`` gets the env and inits itself.
* A wall-clock ``timeout`` bounds the whole run: ranks still alive then are SIGKILLed with
  their children, and the error says which ranks were stuck. When one rank raises, the others
  get ``grace`` seconds to finish before they are killed, and the error shows the failing
  rank's traceback.

Use :func:`run_distributed_outcomes` to inspect failures instead of raising (for tests that
expect a rank to raise or die). POSIX only (fork).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .._runtime.base import backends as _backends
from .._runtime.base.pickling import by_name as _by_name
from .._runtime.base.procs import loopback_interface
from ..env import LAUNCHER_ENV_VARS as _LAUNCHER_ENV_VARS
from ._harness import run_distributed, run_distributed_outcomes
from ._outcomes import STORE_PLACEMENTS, DistributedTestError, RankOutcome

__all__ = [
    "RankOutcome",
    "DistributedTestError",
    "run_distributed",
    "run_distributed_outcomes",
    "loopback_interface",
    "LAUNCHER_ENV_VARS",
    "STORE_PLACEMENTS",
    "requires_gpu",
    "requires_multi_gpu",
    "GPU_MARKS",
]

#: Variables the harness clears in each rank before setting its own, so an outer launcher
#: (pytest itself started under torchrun or srun) cannot leak into the ranks: the library's own
#: list, :data:`axolotl_dist.env.LAUNCHER_ENV_VARS`.
LAUNCHER_ENV_VARS: Sequence[str] = _LAUNCHER_ENV_VARS

#: The pytest markers below are built on first use, so the harness itself runs without pytest.
_MARKERS = ("requires_gpu", "requires_multi_gpu", "GPU_MARKS")


def __getattr__(name: str) -> Any:
    """``requires_gpu``, ``requires_multi_gpu`` and ``GPU_MARKS`` (pytest markers; they need
    pytest, imported here rather than with the module)."""
    if name not in _MARKERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import pytest

    # asked without initializing CUDA in the test process: its forked ranks could not use it
    has_cuda = _backends.cuda_usable()
    markers = {
        "requires_gpu": pytest.mark.skipif(not has_cuda, reason="requires a CUDA GPU"),
        "requires_multi_gpu": pytest.mark.skipif(
            not has_cuda or torch.cuda.device_count() < 2, reason="requires 2 or more CUDA GPUs"),
    }
    #: Apply to GPU tests: ``pytestmark = GPU_MARKS`` or ``parametrize(..., marks=GPU_MARKS)``.
    markers["GPU_MARKS"] = (pytest.mark.gpu, markers["requires_gpu"])
    globals().update(markers)
    return markers[name]


_by_name(__name__)  # pickled by name, as the rest of the kit (docs/design/machine.md, "Installs")
