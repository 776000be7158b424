"""Tensor collectives with composer's names, safe defaults and clear errors.

With no process group and a world size of 1 every collective is a no-op with the multi-rank
return shape (docs/design.md, decision 3); with ``WORLD_SIZE > 1`` in the env but no group they raise
:class:`~axolotl_dist.errors.DistributedEnvError` telling you to call ``init_distributed()``.
``src`` arguments are ranks *within* ``group`` (the global rank when ``group`` is None).
Tensors on the wrong device for the backend (CPU tensors under NCCL) are moved and moved back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Union

import torch
import torch.distributed as dist

from ._runtime.base import backends as _backends
from ._runtime.protocols import recorder as _trace
from ._runtime.protocols.helpers import collective, tensor_signature
from ._runtime.protocols.exchange import all_gather_into, resolved, run
from ._runtime.base.groups import Group, group_of
from ._runtime.base.args import REDUCE_OPS, as_reduce_op, check_src, reduce_name
from ._runtime.base.state import STATE as _STATE
from .ranks import get_backend

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = ["REDUCE_OPS", "barrier", "broadcast", "all_reduce", "all_gather", "comm_device"]


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


def comm_device(group: Optional["ProcessGroup"] = None) -> torch.device:
    """The device the kit's collectives on ``group`` (default: the world) use: the backend's
    accelerator where this machine has it, else the CPU (one process without a group: CPU)."""
    g = group_of(group, "comm_device")
    return g.device if g is not None else torch.device("cpu")


@collective("barrier")
def barrier(g: Optional[Group], group: Optional["ProcessGroup"] = None) -> None:
    """Wait until every rank of ``group`` arrives. A no-op for a single process."""
    if g is None:
        return
    if g.device.type == "cuda":
        run(g, "barrier", dist.barrier, g.arg, async_op=True, device_ids=[g.device.index])
        return
    pg = g.pg_ref()
    if type(pg) is dist.ProcessGroup and pg.bound_device_id is None:
        # the group's own barrier, as dist.barrier(async_op=True) calls it on CPU
        run(g, "barrier", _PG_BARRIER, pg, _CPU_BARRIER)
    else:
        run(g, "barrier", dist.barrier, g.arg, async_op=True)


def _to_comm(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The tensor a collective can use in place of ``tensor``: on the backend's device, and a
    plain tensor (not a lazy conjugate or negative view). Copied back afterwards if different."""
    if tensor.device != device:
        return resolved(tensor).to(device)
    return resolved(tensor).clone() if tensor.is_conj() or tensor.is_neg() else tensor


@collective("broadcast", lambda a: {"src": a["src"], "tensor": tensor_signature(a["tensor"])},
            src="src")
def broadcast(g: Optional[Group], tensor: torch.Tensor, src: int = 0,
              group: Optional["ProcessGroup"] = None) -> torch.Tensor:
    """Broadcast ``tensor`` in place from group rank ``src``; returns it."""
    check_src(src, 1 if g is None else g.size, group)
    if g is None:
        return tensor
    work = _to_comm(tensor, g.device)
    if _STATE.trace is not None:
        _trace.add_bytes(tensor.nbytes)
    run(g, "broadcast", dist.broadcast, work, group=g.arg, group_src=src, async_op=True)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def _check_avg(name: str, tensor: torch.Tensor, native_avg: bool) -> None:
    if (name == "AVG" and not (tensor.is_floating_point() or tensor.is_complex())
            and not native_avg):
        raise ValueError(
            f"all_reduce(reduce_operation='AVG') needs a floating tensor, got {tensor.dtype}: "
            "cast first or use 'SUM'"
        )


@collective("all_reduce", lambda a: {"reduce_operation": reduce_name(a["reduce_operation"]),
                                     "tensor": tensor_signature(a["tensor"])})
def all_reduce(
    g: Optional[Group],
    tensor: torch.Tensor,
    reduce_operation: Union[str, Any] = "SUM",
    group: Optional["ProcessGroup"] = None,
) -> torch.Tensor:
    """Reduce ``tensor`` in place across ``group`` (``"SUM"``, ``"MAX"``, ``"AVG"``...); returns it."""
    name = as_reduce_op(reduce_operation)
    if g is None:
        # checked as on several ranks, so one rank fails like N ranks do
        _check_avg(name, tensor, _backends.device_type(get_backend(group) or "gloo") == "cuda")
        return tensor
    native_avg = g.device.type == "cuda"  # NCCL's AVG
    _check_avg(name, tensor, native_avg)
    work = _to_comm(tensor, g.device)
    if _STATE.trace is not None:
        _trace.add_bytes(tensor.nbytes)
    op = dist.ReduceOp.SUM if name == "AVG" and not native_avg else getattr(dist.ReduceOp, name)
    run(g, "all_reduce", dist.all_reduce, work, op=op, group=g.arg, async_op=True)
    if name == "AVG" and not native_avg:
        work.div_(g.size)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


_MAX_NDIM = 12
#: The dtypes the kit's gathers send (their index is the code on the wire).
DTYPES: List[torch.dtype] = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
] + [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64")
     if hasattr(torch, n)]


@collective("all_gather", lambda a: {"dtype": str(getattr(a["tensor"], "dtype",
                                                                type(a["tensor"])))})
def all_gather(g: Optional[Group], tensor: torch.Tensor,
               group: Optional["ProcessGroup"] = None) -> List[torch.Tensor]:
    """Gather ``tensor`` from every rank into a list indexed by group rank.

    Shapes may differ per rank (dtypes must agree). Two collectives: the shapes, then one
    all-gather of the bytes into a single flat buffer. Single process: ``[tensor]``.
    """
    if g is None:
        return [tensor]
    if tensor.dim() > _MAX_NDIM:
        raise ValueError(f"all_gather supports tensors of at most {_MAX_NDIM} dims, got {tensor.dim()}")
    if tensor.dtype not in DTYPES:
        raise ValueError(f"all_gather does not support dtype {tensor.dtype}")
    ws, device = g.size, g.device
    meta = [DTYPES.index(tensor.dtype), tensor.dim(), tensor.numel()] + list(tensor.shape)
    meta += [0] * (3 + _MAX_NDIM - len(meta))
    metas_t = torch.empty(ws * len(meta), dtype=torch.int64, device=device)
    if _STATE.trace is not None:
        _trace.add_bytes(tensor.nbytes)
    run(g, "all_gather", all_gather_into, metas_t,
        torch.tensor(meta, dtype=torch.int64, device=device), group=g.arg, async_op=True)
    metas = metas_t.view(ws, len(meta)).tolist()
    for r, m in enumerate(metas):
        if m[0] != meta[0]:
            raise ValueError(
                f"all_gather: group rank {r} sent dtype {DTYPES[m[0]]} but group rank "
                f"{g.rank} sent {tensor.dtype}: cast every rank's tensor to one dtype"
            )
    elem = tensor.element_size()
    stride = max(m[2] for m in metas) * elem
    mine = _to_comm(resolved(tensor.detach()).reshape(-1), device).contiguous().view(torch.uint8)
    if mine.numel() < stride:
        mine = torch.cat([mine, mine.new_zeros(stride - mine.numel())])
    flat = torch.empty(ws * stride, dtype=torch.uint8, device=device)
    if stride:
        run(g, "all_gather", all_gather_into, flat, mine, group=g.arg, async_op=True)
    out = []
    for r, m in enumerate(metas):
        shape = m[3:3 + m[1]]
        chunk = flat[r * stride:r * stride + m[2] * elem]
        piece = chunk.view(tensor.dtype).reshape(shape) if m[2] else torch.empty(
            shape, dtype=tensor.dtype, device=device)
        out.append(piece if piece.device == tensor.device else piece.to(tensor.device))
    return out
