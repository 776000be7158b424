"""The world device mesh and the sub-mesh getters (OLMo-core's ``build_world_mesh`` and friends).

:func:`build_world_mesh` validates every degree before it touches the network, lays the dims
out as ``pp, dp (or dp_replicate, dp_shard), cp, tp`` (row-major: ``tp`` varies fastest) and
creates every process group the getters need right away, so the getters never run a
collective on a mesh built here. The world mesh can be reset (:func:`reset_world_mesh`), and it
is forgotten automatically when the default process group it was built on goes away.

Flattened dims (``dp`` for HSDP, ``dp_cp`` with context parallelism) are kept as their own
meshes instead of being sliced out of the root mesh by name (deprecated since torch 2.11).
"""

from __future__ import annotations

import logging
import warnings
from typing import List, Optional, Sequence, Tuple

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .._runtime.base import backends as _backends
from .._runtime.base import hooks
from .._runtime.base.groups import group_of
from .._runtime.base.state import PerGroup, RoomState, register
from .._runtime.protocols.helpers import call
from ..errors import DistributedConfigError, DistributedEnvError, MeshUsageError
from ..ranks import get_backend, is_initialized
from .config import (
    ContextParallelConfig,
    DataParallelConfig,
    DataParallelType,
    ExpertParallelConfig,
    MeshDimName,
    PipelineParallelConfig,
    TensorParallelConfig,
)

__all__ = [
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

log = logging.getLogger(__name__)

_DP_DIMS = (MeshDimName.dp, MeshDimName.dp_replicate, MeshDimName.dp_shard)
_EP_DIMS = (MeshDimName.ep_replicate, MeshDimName.ep_shard)


class WorldMeshState(RoomState):
    """``world``: the mesh :func:`build_world_mesh` made on each default group (forgotten with
    the group, and at cleanup, before the groups are destroyed: its own groups go with them)."""

    def __init__(self) -> None:
        self.world: PerGroup[Optional[DeviceMesh]] = PerGroup(lambda g: None)


MESHES = register("world_mesh", WorldMeshState())
hooks.at_cleanup(MESHES.reset)


def get_world_mesh() -> Optional[DeviceMesh]:
    """The mesh stored by :func:`build_world_mesh`, or None (also after the group is destroyed:
    it is kept per default group, see :data:`MESHES`)."""
    g = group_of(None, "get_world_mesh", create=False)
    return None if g is None else MESHES.world.get(g)


def reset_world_mesh() -> None:
    """Forget the world mesh so :func:`build_world_mesh` can run again.

    Its process groups stay alive until the default group is destroyed;
    :func:`~axolotl_dist.cleanup_distributed` calls this for you.
    """
    g = group_of(None, "reset_world_mesh", create=False)
    if g is not None:
        MESHES.world.put(g, None)




def default_device_type(backend: Optional[str] = None) -> str:
    """The mesh device type for ``backend`` (default: the current group's).

    ``gloo``, ``mpi`` and ``fake`` give ``"cpu"``; ``nccl`` gives ``"cuda"``; a per-device
    backend such as ``"cuda:nccl,cpu:gloo"`` gives its accelerator when this machine has it,
    else ``"cpu"``: the same answer as every other part of the kit
    (:mod:`axolotl_dist._runtime.base.backends`).
    """
    return _backends.device_type(backend or get_backend() or "gloo")


_CONFIG_TYPES = {"dp": DataParallelConfig, "tp": TensorParallelConfig, "cp": ContextParallelConfig,
                 "pp": PipelineParallelConfig, "ep": ExpertParallelConfig}


def _describe_configs(**configs: object) -> str:
    """``build_world_mesh(dp=..., ...)`` for messages; checks each config's type first."""
    for key, config in configs.items():
        if config is not None and not isinstance(config, _CONFIG_TYPES[key]):
            raise DistributedConfigError(
                f"build_world_mesh({key}={config!r}): {key}= must be a "
                f"{_CONFIG_TYPES[key].__name__} or None")
    parts = [f"{k}={v.describe()}" for k, v in configs.items() if v is not None]  # type: ignore[attr-defined]
    return f"build_world_mesh({', '.join(parts)})"


def _divide_degrees(world_size: int, pp: Optional[PipelineParallelConfig],
                    cp: Optional[ContextParallelConfig], tp: Optional[TensorParallelConfig],
                    where: str) -> int:
    """Divide pp, cp and tp out of the world (in that order); return the DP world size."""
    left = world_size
    for config in (pp, cp, tp):
        if config is None:
            continue
        config.validate()
        if left % config.degree != 0:
            raise DistributedConfigError(
                f"{where}: {config.describe()} needs a degree that divides the {left} rank(s) "
                f"left of the world size {world_size}, but {left} is not divisible by "
                f"{config.degree}")
        left //= config.degree
    return left


def _check_expert_parallel(ep: ExpertParallelConfig, dp: DataParallelConfig,
                           tp: Optional[TensorParallelConfig], dp_world_size: int,
                           where: str) -> None:
    ep.validate()
    if tp is not None:
        raise DistributedConfigError(
            f"{where}: expert parallelism ({ep.describe()}) cannot be combined with tensor "
            f"parallelism ({tp.describe()}) yet: drop one of them")
    if dp.name != DataParallelType.hsdp:
        raise DistributedConfigError(
            f"{where}: expert parallelism ({ep.describe()}) needs data parallel type 'hsdp', "
            f"got {str(dp.name)!r}: use DataParallelConfig(name='hsdp', shard_degree={ep.degree})")
    if dp_world_size % ep.degree != 0:
        raise DistributedConfigError(
            f"{where}: {ep.describe()} must divide the data parallel world size "
            f"({dp_world_size}), but {dp_world_size} is not divisible by {ep.degree}")


def _mesh_layout(world_size: int, *, dp: DataParallelConfig,
                 tp: Optional[TensorParallelConfig], cp: Optional[ContextParallelConfig],
                 pp: Optional[PipelineParallelConfig], ep: Optional[ExpertParallelConfig],
                 where: str) -> List[Tuple[str, int]]:
    """Validate the configs and return the ``(name, size)`` dims of the world mesh."""
    dp.validate()
    dp_world_size = _divide_degrees(world_size, pp, cp, tp, where)
    if ep is not None:
        _check_expert_parallel(ep, dp, tp, dp_world_size, where)
    dims: List[Tuple[str, int]] = []
    if pp is not None:
        dims.append((str(MeshDimName.pp), pp.degree))
    if dp.name == DataParallelType.hsdp:
        replicas, shard = dp.get_replicate_and_shard_degree(dp_world_size)
        if ep is not None and ep.degree != shard:
            raise DistributedConfigError(
                f"{where}: expert parallelism shards over the HSDP shard dimension, so "
                f"{ep.describe()} must equal the shard degree ({shard} = data parallel world size "
                f"{dp_world_size} / {replicas} replicas): set "
                f"DataParallelConfig(shard_degree={ep.degree}) or ExpertParallelConfig(degree={shard})")
        dims += [(str(MeshDimName.dp_replicate), replicas), (str(MeshDimName.dp_shard), shard)]
    else:
        dims.append((str(MeshDimName.dp), dp_world_size))
    if cp is not None:
        dims.append((str(MeshDimName.cp), cp.degree))
    if tp is not None:
        dims.append((str(MeshDimName.tp), tp.degree))
    return dims


def _debug_configs(arguments: dict) -> dict:
    """What every rank must pass to :func:`build_world_mesh` alike (debug mode; never raises)."""
    configs = {k: arguments[k] for k in ("dp", "tp", "cp", "pp", "ep")}
    try:
        text = _describe_configs(**configs)[len("build_world_mesh("):-1]
    except DistributedConfigError:
        text = ", ".join(f"{k}={v!r}" for k, v in configs.items() if v is not None)
    return {"configs": text, "device_type": arguments["device_type"]}


@call("build_world_mesh", _debug_configs)
def build_world_mesh(
    *,
    dp: Optional[DataParallelConfig] = None,
    tp: Optional[TensorParallelConfig] = None,
    cp: Optional[ContextParallelConfig] = None,
    pp: Optional[PipelineParallelConfig] = None,
    ep: Optional[ExpertParallelConfig] = None,
    device_type: Optional[str] = None,
) -> DeviceMesh:
    """Build the world :class:`DeviceMesh` for the given parallel configs, and store it.

    Dims, outermost first: ``pp``, then ``dp`` (or ``dp_replicate, dp_shard`` for HSDP),
    ``cp``, ``tp``; only configured ones appear. ``tp`` varies fastest, so TP groups are
    consecutive ranks. Pass the result to the ``get_*_mesh()`` getters.

    * No config at all: a 1-D ``("dp",)`` mesh of the world, **not** stored (as OLMo-core).
    * ``dp`` is required as soon as any other config is set.
    * ``pp``, ``cp`` and ``tp`` are divided out of the world in that order; each degree must
      divide what is left. The rest is the data parallel world size; for HSDP it splits into
      ``num_replicas * shard_degree``, which must match it exactly.
    * Expert parallelism needs HSDP, no TP, and a degree equal to the shard degree.
    * ``device_type`` defaults from the backend (:func:`default_device_type`).

    All ranks must call this (it creates process groups, including the flattened DP group).

    :raises DistributedConfigError: for any invalid combination, naming configs and numbers.
    :raises MeshUsageError: if a world mesh already exists (call :func:`reset_world_mesh`).
    :raises DistributedEnvError: if torch.distributed is not initialized.
    """
    where = _describe_configs(dp=dp, tp=tp, cp=cp, pp=pp, ep=ep)
    existing = get_world_mesh()
    if existing is not None:
        raise MeshUsageError(
            f"{where}: the world mesh was already built ({get_device_mesh_info(existing)}): "
            "call axolotl_dist.reset_world_mesh() first to build another one")
    if not is_initialized():
        raise DistributedEnvError(
            f"{where} needs torch.distributed: call axolotl_dist.init_distributed() first")
    world_size = dist.get_world_size()
    device_type = device_type or default_device_type()
    if all(c is None for c in (dp, tp, cp, pp, ep)):
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=(str(MeshDimName.dp),))
    if dp is None:
        raise DistributedConfigError(
            f"{where}: a data parallel config is required when any other parallel config is "
            "set: pass dp=DataParallelConfig(name='fsdp') (or 'hsdp', 'ddp')")
    dims = _mesh_layout(world_size, dp=dp, tp=tp, cp=cp, pp=pp, ep=ep, where=where)
    names = tuple(name for name, _ in dims)
    shape = tuple(size for _, size in dims)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    _prepare_groups(mesh)
    log.info("built world mesh: %s", get_device_mesh_info(mesh))
    g = group_of(None, "build_world_mesh")
    assert g is not None  # a mesh needs the default group
    MESHES.world.put(g, mesh)
    return mesh


def _prepare_groups(mesh: DeviceMesh) -> None:
    """Create the flattened groups the getters use now, while every rank is here."""
    get_dp_process_group(mesh)
    get_dp_model_mesh(mesh)


# --- getters ---------------------------------------------------------------------------------


def _names(mesh: DeviceMesh, getter: str) -> Tuple[str, ...]:
    names = mesh.mesh_dim_names
    if not names:
        raise MeshUsageError(
            f"{getter}: the device mesh {mesh!r} has no dim names: build it with "
            "build_world_mesh() or init_device_mesh(..., mesh_dim_names=...)")
    return tuple(names)


def _require_dims(mesh: DeviceMesh, getter: str, *wanted: str) -> Tuple[str, ...]:
    names = _names(mesh, getter)
    missing = [w for w in wanted if w not in names]
    if missing:
        raise MeshUsageError(
            f"{getter}: the device mesh {get_device_mesh_info(mesh)} has no {missing[0]!r} "
            f"dimension (its dims are {names}): build the mesh with the matching parallel "
            "config, or skip this getter")
    return names


def _sub(mesh: DeviceMesh, dims: Sequence[str]) -> DeviceMesh:
    """``mesh[dims]`` (in the mesh's own order); ``mesh`` itself if it has exactly those dims."""
    dims = tuple(dims)
    return mesh if tuple(mesh.mesh_dim_names or ()) == dims else mesh[dims]


def _concat(meshes: Sequence[DeviceMesh], root: DeviceMesh, names: Sequence[str]) -> DeviceMesh:
    """Stack 1-D meshes of one root into one mesh without slicing flattened names from the root."""
    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is not None:
        return concatenate(list(meshes))
    with warnings.catch_warnings():  # pragma: no cover - torch < 2.9
        warnings.simplefilter("ignore")
        return root[tuple(names)]


def flatten_mesh(device_mesh: DeviceMesh, name: Optional[str] = None) -> DeviceMesh:
    """Flatten ``device_mesh`` into a 1-D mesh named ``name`` (default: dim names joined by ``_``).

    Uses torch's ``DeviceMesh._flatten``, which records the result in the root mesh (the root
    is modified in place); flattening the same dims under the same name again is free. A 1-D
    mesh without a new name is returned as is. All ranks must call this the first time.
    """
    names = _names(device_mesh, "flatten_mesh")
    if device_mesh.ndim == 1 and (name is None or name == names[0]):
        return device_mesh
    return device_mesh._flatten(name or "_".join(names))


def _dp_dims(names: Sequence[str]) -> List[str]:
    return [n for n in names if n in _DP_DIMS]


def _required_dp_dims(mesh: DeviceMesh, names: Sequence[str], fn: str) -> List[str]:
    """The DP dims of ``mesh``; raises, naming ``fn``, if it has none."""
    dims = _dp_dims(names)
    if not dims:
        _require_dims(mesh, fn, str(MeshDimName.dp))
    return dims


def _flatten_ep(mesh: DeviceMesh, names: Tuple[str, ...]) -> Optional[DeviceMesh]:
    """An ``ep_replicate, ep_shard`` mesh flattened to ``dp``, or None if there are no EP dims."""
    if all(d in names for d in _EP_DIMS):
        return flatten_mesh(_sub(mesh, [str(d) for d in _EP_DIMS]), str(MeshDimName.dp))
    return None


def get_dp_model_mesh(device_mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D or 2-D sub-mesh for a data-parallel model wrapper (FSDP, HSDP, DDP).

    Context-parallel ranks hold full replicas, so with CP the last DP dim is flattened with
    ``cp`` into ``dp_cp``: FSDP+CP gives ``(dp_cp,)``, HSDP+CP ``(dp_replicate, dp_cp)``.
    Without CP it is the DP dims themselves. Use :func:`get_dp_mesh` for data loaders.
    """
    names = _names(device_mesh, "get_dp_model_mesh")
    ep_flat = _flatten_ep(device_mesh, names)
    if ep_flat is not None:
        return ep_flat
    dp_dims = _required_dp_dims(device_mesh, names, "get_dp_model_mesh")
    if str(MeshDimName.cp) not in names:
        return _sub(device_mesh, dp_dims)
    inner = dp_dims[-1]
    if names.index(str(MeshDimName.cp)) != names.index(inner) + 1:
        raise MeshUsageError(
            f"get_dp_model_mesh: in {get_device_mesh_info(device_mesh)} the 'cp' dim must come "
            f"right after {inner!r} to be flattened with it; build the mesh with build_world_mesh()")
    dp_cp = flatten_mesh(_sub(device_mesh, [inner, str(MeshDimName.cp)]), str(MeshDimName.dp_cp))
    if len(dp_dims) == 1:
        return dp_cp
    outer = [device_mesh[d] for d in dp_dims[:-1]]
    return _concat(outer + [dp_cp], device_mesh, dp_dims[:-1] + [str(MeshDimName.dp_cp)])


def get_dp_mesh(device_mesh: DeviceMesh) -> DeviceMesh:
    """The data-parallel sub-mesh for data loading: ranks with the same DP coordinates share data.

    ``(dp,)`` or ``(dp_replicate, dp_shard)``; CP and TP ranks of one DP rank read the same
    batch. A stand-alone EP mesh is flattened to ``dp``. Use :func:`get_dp_model_mesh` for
    FSDP/DDP.
    """
    names = _names(device_mesh, "get_dp_mesh")
    if str(MeshDimName.dp_cp) in names:
        raise MeshUsageError(
            f"get_dp_mesh: {get_device_mesh_info(device_mesh)} has a flattened 'dp_cp' dim, whose "
            "ranks share data: pass the world mesh from build_world_mesh() instead")
    ep_flat = _flatten_ep(device_mesh, names)
    if ep_flat is not None:
        return ep_flat
    dp_dims = _required_dp_dims(device_mesh, names, "get_dp_mesh")
    return _sub(device_mesh, dp_dims)


def get_dp_process_group(device_mesh: DeviceMesh) -> dist.ProcessGroup:
    """The process group of :func:`get_dp_mesh` (flattened to one ``dp`` dim if it has two).

    Like :func:`get_dp_mesh`, for data loading, not necessarily for model wrappers.
    """
    dp_mesh = get_dp_mesh(device_mesh)
    if dp_mesh.ndim > 1:
        dp_mesh = flatten_mesh(dp_mesh, str(MeshDimName.dp))
    return dp_mesh.get_group()


def _one_dim(device_mesh: DeviceMesh, dim: MeshDimName, getter: str) -> DeviceMesh:
    _require_dims(device_mesh, getter, str(dim))
    return _sub(device_mesh, [str(dim)])


def get_tp_mesh(device_mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D tensor-parallel sub-mesh (``tp``): consecutive ranks."""
    return _one_dim(device_mesh, MeshDimName.tp, "get_tp_mesh")


def get_cp_mesh(device_mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D context-parallel sub-mesh (``cp``)."""
    return _one_dim(device_mesh, MeshDimName.cp, "get_cp_mesh")


def get_pp_mesh(device_mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D pipeline-parallel sub-mesh (``pp``): one rank per stage group."""
    return _one_dim(device_mesh, MeshDimName.pp, "get_pp_mesh")


def get_ep_mesh(device_mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D expert-parallel sub-mesh: the first of ``ep``, ``ep_shard``, ``dp_shard`` present."""
    names = _names(device_mesh, "get_ep_mesh")
    for dim in (MeshDimName.ep, MeshDimName.ep_shard, MeshDimName.dp_shard):
        if str(dim) in names:
            return _sub(device_mesh, [str(dim)])
    raise MeshUsageError(
        f"get_ep_mesh: the device mesh {get_device_mesh_info(device_mesh)} has no 'ep', "
        "'ep_shard' or 'dp_shard' dimension: build it with "
        "build_world_mesh(dp=DataParallelConfig(name='hsdp', ...), ep=ExpertParallelConfig(...))")


def get_pp_stage_mesh(device_mesh: DeviceMesh, pp_mesh: Optional[DeviceMesh] = None) -> DeviceMesh:
    """The sub-mesh of one pipeline stage: every dim of ``device_mesh`` except the PP ones.

    :param pp_mesh: the PP mesh (default: :func:`get_pp_mesh` of ``device_mesh``).
    """
    names = _names(device_mesh, "get_pp_stage_mesh")
    if pp_mesh is None:
        pp_mesh = get_pp_mesh(device_mesh)
    pp_names = set(pp_mesh.mesh_dim_names or ())
    stage_dims = [n for n in names if n not in pp_names]
    if not stage_dims:
        raise MeshUsageError(
            f"get_pp_stage_mesh: {get_device_mesh_info(device_mesh)} has no dims besides the "
            f"pipeline dims {tuple(sorted(pp_names))}")
    return _sub(device_mesh, stage_dims)


def get_device_mesh_info(device_mesh: DeviceMesh) -> str:
    """A readable summary, e.g. ``"2D device mesh with shape (dp_replicate=2, dp_shard=4)"``.

    A 1-D mesh keeps a trailing comma, as a Python tuple does: ``"(dp=8,)"``.
    """
    shape = tuple(device_mesh.shape)
    names = device_mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(len(shape)))
    inner = ", ".join(f"{n}={s}" for n, s in zip(names, shape))
    if len(shape) == 1:
        inner += ","
    return f"{len(shape)}D device mesh with shape ({inner})"
