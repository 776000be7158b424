"""Rank and size queries that work before and after the process group exists.

Before :func:`~axolotl_dist.init_distributed` they read the launcher's env vars (see
:mod:`axolotl_dist.env`); after it they report the process group and raise
:class:`~axolotl_dist.errors.DistributedEnvError` if the env disagrees with it. No query ever
creates a process group or any other state (docs/design/decisions.md, decisions 1 and 2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional

import torch
import torch.distributed as dist

from . import env as _env
from .errors import DistributedEnvError

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "is_available",
    "is_initialized",
    "is_distributed",
    "get_rank",
    "get_world_size",
    "get_global_rank",
    "get_group_rank",
    "get_local_rank",
    "get_local_world_size",
    "get_node_rank",
    "get_num_nodes",
    "get_fs_local_rank",
    "is_main_process",
    "is_local_main_process",
    "is_last_process",
    "backend_supports_cuda",
    "backend_supports_cpu",
    "backend_devices",
    "cuda_usable",
    "get_backend",
    "get_mesh_coordinates",
]

_AVAILABLE = dist.is_available()
if _AVAILABLE:
    from torch.distributed import distributed_c10d as _c10d

    _world = _c10d._world  # the holder of the default group; reading it is side-effect free

    def is_initialized() -> bool:
        """Whether the default process group exists (a read, side-effect free: this is on the
        rank queries' hot path, where ``dist.is_initialized()`` costs two more calls)."""
        return _world.default_pg is not None

else:  # pragma: no cover - torch built without distributed

    def is_initialized() -> bool:
        """Whether the default process group exists."""
        return False


def is_available() -> bool:
    """Whether torch was built with ``torch.distributed`` support."""
    return _AVAILABLE


def is_distributed() -> bool:
    """True once a default process group exists (of any size). Never creates one."""
    return _AVAILABLE and is_initialized()


def _check_env_agrees(name: str, env_value: int, group_value: int) -> None:
    raise DistributedEnvError(
        f"{name}={env_value} in the environment disagrees with the initialized process group "
        f"(which says {group_value}): unset {name} or launch every process with the same "
        "launcher that created the group"
    )


def get_rank(group: Optional["ProcessGroup"] = None) -> int:
    """This process's rank in ``group`` (default: the global rank).

    Before init: from ``RANK`` (or SLURM/Open MPI), 0 if unset. After init: from the group,
    and an env ``RANK`` that disagrees raises :class:`DistributedEnvError`.
    """
    if group is None:
        if not is_initialized():
            return _env.env_rank()
        rank = dist.get_rank()
        if _env.is_set(_env.RANK_ENV_VAR) and _env.env_rank() != rank:
            _check_env_agrees(_env.RANK_ENV_VAR, _env.env_rank(), rank)
        return rank
    _require_group_arg(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of the group passed "
            "as group=: pass a group this rank belongs to"
        )
    return rank


def get_world_size(group: Optional["ProcessGroup"] = None) -> int:
    """Number of ranks in ``group`` (default: the world). Before init: ``WORLD_SIZE``, else 1."""
    if group is None:
        if not is_initialized():
            return _env.env_world_size()
        ws = dist.get_world_size()
        if _env.is_set(_env.WORLD_SIZE_ENV_VAR) and _env.env_world_size() != ws:
            _check_env_agrees(_env.WORLD_SIZE_ENV_VAR, _env.env_world_size(), ws)
        return ws
    _require_group_arg(group)
    ws = dist.get_world_size(group)
    if ws < 0:  # torch answers -1 on a rank that is not a member of ``group``
        raise ValueError(
            f"this process (global rank {dist.get_rank()}) is not a member of the group passed "
            "as group=: pass a group this rank belongs to (only members may use it)"
        )
    return ws


def _require_group_arg(group: "ProcessGroup") -> None:
    if not is_initialized():
        raise DistributedEnvError(
            "a process group was passed as group= but torch.distributed is not initialized: "
            "call axolotl_dist.init_distributed() first"
        )


def get_global_rank(group_rank: Optional[int] = None, group: Optional["ProcessGroup"] = None) -> int:
    """The global rank of this process, or of ``group_rank`` within ``group``.

    * ``get_global_rank()``: this process's global rank (composer's meaning).
    * ``get_global_rank(r, group)``: translate group rank ``r`` to a global rank (OLMo's
      meaning); with ``group=None`` the group is the world and ``r`` is returned after a range
      check.
    """
    if group_rank is None:
        if group is not None:
            raise ValueError(
                "get_global_rank(group=...) needs group_rank=: pass the rank within the group "
                "to translate, or no arguments for this process's global rank"
            )
        return get_rank()
    if not isinstance(group_rank, int) or isinstance(group_rank, bool):
        raise TypeError(f"group_rank={group_rank!r} must be an int")
    size = get_world_size(group)
    if not 0 <= group_rank < size:
        raise ValueError(
            f"group_rank={group_rank} is out of range for a group of {size} rank(s): pass a "
            f"rank in [0, {size})"
        )
    if group is None or group is getattr(_c10d.GroupMember, "WORLD", None):
        return group_rank
    return dist.get_global_rank(group, group_rank)


def get_group_rank(global_rank: int, group: Optional["ProcessGroup"] = None) -> int:
    """Translate a global rank to its rank within ``group`` (ValueError if not a member)."""
    if group is None:
        size = get_world_size()
        if not 0 <= global_rank < size:
            raise ValueError(f"global_rank={global_rank} is out of range for world size {size}")
        return global_rank
    _require_group_arg(group)
    if group is getattr(dist.GroupMember, "NON_GROUP_MEMBER", None):
        get_world_size(group)  # raises: torch keeps no reliable rank list for a non-member
    ranks = dist.get_process_group_ranks(group)
    if global_rank not in ranks:
        raise ValueError(f"global rank {global_rank} is not in the group (ranks {ranks})")
    return ranks.index(global_rank)


def get_local_rank() -> int:
    """This process's rank on its node: ``LOCAL_RANK``, else global rank mod local world size."""
    if not is_initialized():
        return _env.env_local_rank()
    return _env.env_local_rank(get_rank(), get_world_size())


def get_local_world_size() -> int:
    """Processes on this node: ``LOCAL_WORLD_SIZE``, else world size / ``NUM_NODES``, else world size."""
    if not is_initialized():
        return _env.env_local_world_size()
    return _env.env_local_world_size(get_world_size())


def get_node_rank() -> int:
    """Index of this node: ``NODE_RANK`` (or torchrun's ``GROUP_RANK``), else rank // local world size."""
    if not is_initialized():
        return _env.env_node_rank()
    return _env.env_node_rank(get_rank(), get_world_size())


def get_num_nodes() -> int:
    """Number of nodes: ``NUM_NODES``, else world size / local world size (rounded up)."""
    if not is_initialized():
        return _env.env_num_nodes()
    return _env.env_num_nodes(get_world_size())


def get_fs_local_rank(group: Optional["ProcessGroup"] = None) -> int:
    """This process's rank among the processes that share its filesystem.

    ``FS_LOCAL_RANK`` wins if set. Otherwise, if all nodes share one filesystem
    (``AXOLOTL_DIST_SHARED_FS=1``, or OLMo's ``OLMO_SHARED_FS=1``; ``init_distributed`` sets it
    by default), this is the rank in ``group``; if not, it is the local rank on the node. So
    ``get_fs_local_rank() == 0`` picks exactly one writer per filesystem.
    """
    explicit = _env.env_fs_local_rank()
    if explicit is not None:
        return explicit
    if _env.env_shared_filesystem():
        return get_rank(group)
    return get_local_rank()


def is_main_process(group: Optional["ProcessGroup"] = None) -> bool:
    """True on global rank 0 (or rank 0 of ``group``), and in a single process."""
    return get_rank(group) == 0


def is_local_main_process() -> bool:
    """True on local rank 0 of each node, and in a single process."""
    return get_local_rank() == 0


def is_last_process(group: Optional["ProcessGroup"] = None) -> bool:
    """True on the last global rank (world size - 1; of ``group`` if given), and in a single
    process (accelerate's ``is_last_process``)."""
    return get_rank(group) == get_world_size(group) - 1


def get_backend(group: Optional["ProcessGroup"] = None) -> Optional[str]:
    """The backend string of ``group`` (default: the world), or None before init."""
    if not is_initialized():
        return None
    return str(dist.get_backend(group))


#: The device type each single backend name serves (unknown names: the CPU).
_NAME_DEVICE = {"nccl": "cuda", "xccl": "xpu", "hccl": "hpu", "gloo": "cpu", "mpi": "cpu",
                "fake": "cpu", "ucc": "cpu"}


def backend_devices(backend: str) -> Dict[str, str]:
    """Device type -> backend name for every device ``backend`` takes tensors on:
    ``"cuda:nccl,cpu:gloo"`` gives ``{"cuda": "nccl", "cpu": "gloo"}``, ``"nccl"``
    ``{"cuda": "nccl"}``, a name the kit does not know the CPU."""
    out: Dict[str, str] = {}
    for part in backend.lower().replace(" ", "").split(","):
        if not part:
            continue
        if ":" in part:
            device, name = part.split(":", 1)
            out[device] = name
        else:
            out[_NAME_DEVICE.get(part, "cpu")] = part
    return out


def cuda_usable() -> bool:
    """Whether a CUDA GPU is usable here, asked without initializing CUDA in this process.

    ``torch.cuda.is_available()`` initializes the CUDA driver (unless
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1``), and a process forked after that cannot use CUDA:
    the ranks of :func:`axolotl_dist.testing.run_distributed`, forked data loader workers. So
    this counts devices the way torch does under that variable (NVML first, the CUDA runtime
    only where NVML cannot answer), unless CUDA is initialized here already.
    """
    cuda = torch.cuda
    if cuda.is_initialized():
        return bool(cuda.is_available())
    return cuda.device_count() > 0


def backend_supports_cuda(backend: Optional[str] = None) -> bool:
    """Whether ``backend`` (default: the current group's) handles CUDA tensors.

    With no backend and no group: whether CUDA is available. ``"cuda:nccl,cpu:gloo"`` counts.
    """
    if backend is None:
        backend = get_backend()
        if backend is None:
            return cuda_usable()  # asked without initializing CUDA here
    return "cuda" in backend_devices(backend)


def backend_supports_cpu(backend: Optional[str] = None) -> bool:
    """Whether ``backend`` (default: the current group's) handles CPU tensors.

    With no backend and no group: True. ``"gloo"``, ``"mpi"`` and ``"cpu:..."`` count.
    """
    if backend is None:
        backend = get_backend()
        if backend is None:
            return True
    return "cpu" in backend_devices(backend)


def get_mesh_coordinates(mesh: "DeviceMesh", rank: Optional[int] = None) -> Optional[List[int]]:
    """The coordinates of global ``rank`` (default: this process) in ``mesh``, or None if absent."""
    if rank is None:
        rank = get_rank()
    hits = (mesh.mesh == rank).nonzero()
    if hits.shape[0] == 0:
        return None
    if hits.shape[0] > 1:
        raise ValueError(f"rank {rank} appears {hits.shape[0]} times in the mesh {mesh.mesh.tolist()}")
    return [int(c) for c in hits[0].tolist()]
