"""Tensor collectives with composer's names, safe defaults and clear errors.

With no process group and a world size of 1 every collective is a no-op with the multi-rank
return shape (docs/design.md, decision 3); with ``WORLD_SIZE > 1`` in the env but no group they raise
:class:`~axolotl_dist.errors.DistributedEnvError` telling you to call ``init_distributed()``.
``src`` arguments are ranks *within* ``group`` (the global rank when ``group`` is None).
Tensors on the wrong device for the backend (CPU tensors under NCCL) are moved and moved back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, NoReturn, Optional, Union

import torch
import torch.distributed as dist

from ._runtime import backends as _backends, records as _records, teardown as _teardown
from ._runtime import trace as _trace, works as _works
from ._runtime.state import STATE as _STATE
from ._runtime.groups import resolve, state_of
from . import env as _env
from ._runtime.codec import resolved
from ._runtime.reduce import REDUCE_OPS, as_reduce_op, reduce_name
from .debug import checked, tensor_signature
from .errors import DistributedEnvError
from .ranks import get_backend, get_rank, get_world_size, is_initialized

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = [
    "REDUCE_OPS",
    "barrier",
    "broadcast",
    "all_reduce",
    "all_gather",
    "as_reduce_op",
    "require_group",
    "comm_device",
    "check_src",
    "check_world_size",
    "all_gather_into",
    "raise_lost_peer",
]

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# What dist.barrier(async_op=True) passes a CPU group's barrier, built once (a barrier's
# latency on CPU is a few hundred microseconds; torch's wrapper spends several of them).
def _cpu_barrier_options() -> Any:
    opts = dist.distributed_c10d.BarrierOptions()
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = True
    opts.device = torch.device("cpu")
    return opts


_CPU_BARRIER = _cpu_barrier_options() if dist.is_available() else None
_PG_BARRIER = dist.ProcessGroup.barrier if dist.is_available() else None


def raise_lost_peer(exc: RuntimeError, where: str, group: Optional["ProcessGroup"]) -> NoReturn:
    """Re-raise a failed collective's ``exc`` as a :class:`~axolotl_dist.errors.RankFailedError`
    naming the lost peer and how it was judged, if a peer of ``group`` is gone; else as is.

    Call it in the ``except`` block. Outcomes can differ per rank: a broadcast may reach some
    ranks before the root notices a lost one; those ranks return the value and raise at their
    next collective.
    """
    error = _records.diagnose_lost_peer(exc, where, group)
    try:
        if error is exc:
            raise exc
        # not chained: the backend's socket error says less than the error naming the rank;
        # its first line stays on the error
        error.backend_error = (str(exc).splitlines() or [""])[0]  # type: ignore[union-attr]
        raise error from None
    finally:  # no frame <-> error cycle: the frames (and their tensors) die with the error
        error = exc = None  # type: ignore[assignment]


def require_group(op: str, group: Optional["ProcessGroup"] = None) -> bool:
    """True if ``op`` must communicate; False for a single process with no group.

    Raises :class:`DistributedEnvError` when the env says several ranks but no group exists.
    """
    if is_initialized():
        return True
    ws = _env.env_world_size()
    if group is not None or ws > 1:
        raise DistributedEnvError(
            f"{op}() needs a process group: the environment says WORLD_SIZE={ws} but "
            "torch.distributed is not initialized; call axolotl_dist.init_distributed() first"
        )
    return False


def comm_device(group: Optional["ProcessGroup"] = None) -> torch.device:
    """The device collectives on ``group`` use (see :func:`axolotl_dist._runtime.backends.comm_device`)."""
    state = state_of(group)
    device = state.device if state is not None else None
    if device is None:
        _teardown.start_services()  # first use of a group: exit hook, peer record, heartbeat
        device = _backends.comm_device(get_backend(group) or "gloo")
        if state is not None:
            state.device = device
    return device


def check_src(src: int, group: Optional["ProcessGroup"], name: str = "src") -> int:
    """Validate a group-relative rank argument; returns it."""
    if not isinstance(src, int) or isinstance(src, bool):
        raise TypeError(f"{name}={src!r} must be an int rank")
    size = get_world_size(group)
    if not 0 <= src < size:
        raise ValueError(
            f"{name}={src} is outside the group of {size} rank(s): pass a rank in [0, {size})"
            + (" (ranks are relative to group=)" if group is not None else "")
        )
    return src


def check_world_size(world_size: Optional[int], group: Optional["ProcessGroup"], fn: str) -> int:
    """Return the real world size; raise if a caller-supplied ``world_size`` disagrees."""
    actual = get_world_size(group)
    if world_size is not None and world_size != actual:
        raise ValueError(
            f"{fn}(world_size={world_size}) disagrees with the actual world size {actual}: "
            "drop the world_size argument (it is inferred) or pass the real size"
        )
    return actual


@checked("barrier", confirm_in_wait=True)
def barrier(group: Optional["ProcessGroup"] = None) -> None:
    """Wait until every rank of ``group`` arrives. A no-op for a single process."""
    if not require_group("barrier", group):
        return
    device = comm_device(group)
    try:
        if device.type == "cuda":
            dist.barrier(group, device_ids=[device.index])
            return
        pg = resolve(group)
        if type(pg) is dist.ProcessGroup and pg.bound_device_id is None:
            # the group's own barrier, as dist.barrier(async_op=True) calls it on CPU
            work = _PG_BARRIER(pg, _CPU_BARRIER)
        else:
            work = dist.barrier(group, async_op=True)
        _works.wait(work, group, "barrier")
    except RuntimeError as exc:
        raise_lost_peer(exc, "barrier", group)


def _to_comm(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The tensor a collective can use in place of ``tensor``: on the backend's device, and a
    plain tensor (not a lazy conjugate or negative view). Copied back afterwards if different."""
    if tensor.device != device:
        return resolved(tensor).to(device)
    return resolved(tensor).clone() if tensor.is_conj() or tensor.is_neg() else tensor


@checked("broadcast", lambda a: {"src": a["src"], "tensor": tensor_signature(a["tensor"])},
         confirm_in_wait=True)
def broadcast(tensor: torch.Tensor, src: int = 0, group: Optional["ProcessGroup"] = None) -> torch.Tensor:
    """Broadcast ``tensor`` in place from group rank ``src``; returns it."""
    if not require_group("broadcast", group):
        check_src(src, group)
        return tensor
    check_src(src, group)
    device = comm_device(group)
    work = _to_comm(tensor, device)
    if _STATE.trace is not None:
        _trace.add_bytes(tensor.nbytes)
    try:
        _works.wait(dist.broadcast(work, group=group, group_src=src, async_op=True), group,
                    "broadcast", device.type == "cpu")
    except RuntimeError as exc:
        raise_lost_peer(exc, "broadcast", group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


@checked("all_reduce", lambda a: {"reduce_operation": reduce_name(a["reduce_operation"]),
                                  "tensor": tensor_signature(a["tensor"])}, confirm_in_wait=True)
def all_reduce(
    tensor: torch.Tensor,
    reduce_operation: Union[str, Any] = "SUM",
    group: Optional["ProcessGroup"] = None,
) -> torch.Tensor:
    """Reduce ``tensor`` in place across ``group`` (``"SUM"``, ``"MAX"``, ``"AVG"``...); returns it."""
    name = as_reduce_op(reduce_operation)
    native_avg = _backends.device_type(get_backend(group) or "gloo") == "cuda"  # NCCL's AVG
    if (name == "AVG" and not (tensor.is_floating_point() or tensor.is_complex())
            and not native_avg):
        # checked before the single-process shortcut, so one rank fails like N ranks do
        raise ValueError(
            f"all_reduce(reduce_operation='AVG') needs a floating tensor, got {tensor.dtype}: "
            "cast first or use 'SUM'"
        )
    if not require_group("all_reduce", group):
        return tensor
    device = comm_device(group)
    work = _to_comm(tensor, device)
    if _STATE.trace is not None:
        _trace.add_bytes(tensor.nbytes)
    try:
        op = dist.ReduceOp.SUM if name == "AVG" and not native_avg else getattr(dist.ReduceOp, name)
        _works.wait(dist.all_reduce(work, op=op, group=group, async_op=True), group, "all_reduce",
                    device.type == "cpu")
        if name == "AVG" and not native_avg:
            work.div_(get_world_size(group))
    except RuntimeError as exc:
        raise_lost_peer(exc, "all_reduce", group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


_MAX_NDIM = 12
_DTYPES: List[torch.dtype] = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
] + [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64")
     if hasattr(torch, n)]


@checked("all_gather", lambda a: {"dtype": str(getattr(a["tensor"], "dtype", type(a["tensor"])))},
         confirm_in_wait=True)
def all_gather(tensor: torch.Tensor, group: Optional["ProcessGroup"] = None) -> List[torch.Tensor]:
    """Gather ``tensor`` from every rank into a list indexed by group rank.

    Shapes may differ per rank (dtypes must agree). Two collectives: the shapes, then one
    all-gather of the bytes into a single flat buffer. Single process: ``[tensor]``.
    """
    if not require_group("all_gather", group):
        return [tensor]
    if tensor.dim() > _MAX_NDIM:
        raise ValueError(f"all_gather supports tensors of at most {_MAX_NDIM} dims, got {tensor.dim()}")
    if tensor.dtype not in _DTYPES:
        raise ValueError(f"all_gather does not support dtype {tensor.dtype}")
    ws = get_world_size(group)
    device = comm_device(group)
    meta = [_DTYPES.index(tensor.dtype), tensor.dim(), tensor.numel()] + list(tensor.shape)
    meta += [0] * (3 + _MAX_NDIM - len(meta))
    metas_t = torch.empty(ws * len(meta), dtype=torch.int64, device=device)
    cpu = device.type == "cpu"
    if _STATE.trace is not None:
        _trace.add_bytes(tensor.nbytes)
    try:
        _works.wait(all_gather_into(metas_t, torch.tensor(meta, dtype=torch.int64, device=device),
                                    group=group, async_op=True), group, "all_gather", cpu)
    except RuntimeError as exc:
        raise_lost_peer(exc, "all_gather", group)
    metas = metas_t.view(ws, len(meta)).tolist()
    for r, m in enumerate(metas):
        if m[0] != meta[0]:
            raise ValueError(
                f"all_gather: group rank {r} sent dtype {_DTYPES[m[0]]} but group rank "
                f"{get_rank(group)} sent {tensor.dtype}: cast every rank's tensor to one dtype"
            )
    elem = tensor.element_size()
    stride = max(m[2] for m in metas) * elem
    mine = _to_comm(resolved(tensor.detach()).reshape(-1), device).contiguous().view(torch.uint8)
    if mine.numel() < stride:
        mine = torch.cat([mine, mine.new_zeros(stride - mine.numel())])
    flat = torch.empty(ws * stride, dtype=torch.uint8, device=device)
    if stride:
        try:
            _works.wait(all_gather_into(flat, mine, group=group, async_op=True), group,
                        "all_gather", cpu)
        except RuntimeError as exc:
            raise_lost_peer(exc, "all_gather", group)
    out = []
    for r, m in enumerate(metas):
        shape = m[3:3 + m[1]]
        chunk = flat[r * stride:r * stride + m[2] * elem]
        piece = chunk.view(tensor.dtype).reshape(shape) if m[2] else torch.empty(
            shape, dtype=tensor.dtype, device=device)
        out.append(piece if piece.device == tensor.device else piece.to(tensor.device))
    return out
