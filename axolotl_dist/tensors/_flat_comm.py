"""The collectives behind :class:`~axolotl_dist.tensors.ShardedFlatTensor`.

A functional module of ``tensors`` (it uses the kit's collectives and debug checks); its names are
not exported from the package, since ``ShardedFlatTensor`` is the API.

Every shard travels padded to the largest shard, in one rank-major flat buffer:

* gather: one ``all_gather_single`` (one ``gather`` to group rank 0 for ``rank0_only``),
  in place, so the padded buffer is the only allocation; when the spec's layout matches the
  buffer (even splits, ceil-style splits) the buffer *is* the result, for other rank-ordered
  layouts (uneven balanced splits) the shards are moved left in place (CPU), and only
  out-of-order layouts are assembled by one copy per range into a new tensor;
* shard with ``synchronize`` and reshard with ``writeback``: one ``scatter`` from group rank
  0, so each rank receives only its own shard (a broadcast would send the whole tensor).

Ranks are group ranks everywhere, so subgroups that do not contain global rank 0 work.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional

import torch
import torch.distributed as dist

from .._runtime.base import backends as _backends
from .._runtime.protocols.helpers import call
from .._runtime.protocols.exchange import all_gather_into
from .._runtime.base.groups import group_of
from .sharding_spec import ShardingSpec

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = ["GroupInfo", "group_info", "gather_flat", "scatter_flat", "assemble", "pad_rank_major"]


@dataclass(frozen=True)
class GroupInfo:
    """A process group with this process's rank in it, fixed when a tensor is sharded."""

    group: Optional["ProcessGroup"]
    rank: int
    world_size: int


def group_info(group: Optional["ProcessGroup"], op: str) -> GroupInfo:
    """This process's rank and the size of ``group``; (0, 1) for a lone process without init.

    Raises :class:`~axolotl_dist.errors.DistributedEnvError` when the environment says several
    ranks but no process group exists, and ``ValueError`` when this process is not in ``group``.
    """
    if group is not None and dist.is_initialized() and dist.get_rank(group) < 0:
        raise ValueError(
            f"{op}: this process (global rank {dist.get_rank()}) is not a member of "
            "process_group: pass a group that contains this rank"
        )
    g = group_of(group, op)
    if g is None:
        return GroupInfo(None, 0, 1)
    return GroupInfo(group, g.rank, g.size)


def _device_for(info: GroupInfo, device: torch.device) -> torch.device:
    """``device`` if the group's backend takes tensors there, else the backend's device."""
    if _backends.supports(str(dist.get_backend(info.group)), device.type):
        return device
    g = group_of(info.group, "ShardedFlatTensor")
    assert g is not None
    return g.device


def pad_rank_major(flat: torch.Tensor, spec: ShardingSpec, dtype: torch.dtype) -> torch.Tensor:
    """The rank-major padded buffer ``(world_size, max_shard)`` holding each rank's shard."""
    width = spec.max_sharded_numel
    total = spec.world_size * width
    if spec._aligned and flat.dtype == dtype and flat.numel() == total:
        return flat.view(spec.world_size, width)  # even split: no copy at all
    buf = torch.zeros(total, dtype=dtype, device=flat.device)
    for src, dst, length in spec._plan:
        buf[src:src + length].copy_(flat[dst:dst + length])
    return buf.view(spec.world_size, width)


def _compact_in_place(flat: torch.Tensor, spec: ShardingSpec) -> None:
    """Move each piece left to its place with ``memmove`` (CPU; ``spec._monotone`` layouts).

    In output order each piece moves left and ends before the next piece's source, so no
    piece overwrites data not yet moved; ``memmove`` handles a piece overlapping itself.
    """
    base, size = flat.data_ptr(), flat.element_size()
    for src, dst, length in sorted(spec._plan, key=lambda p: p[1]):
        if src != dst:
            ctypes.memmove(base + dst * size, base + src * size, length * size)


def assemble(buf: torch.Tensor, spec: ShardingSpec) -> torch.Tensor:
    """The flattened full tensor from the rank-major padded buffer ``buf`` (which it may reuse).

    A view of ``buf`` when the layout is aligned (even or ceil-style splits) or can be
    compacted in place (rank-ordered uneven splits, on CPU); otherwise one copy per range
    into a new tensor.
    """
    numel = spec.unsharded_numel
    flat = buf.reshape(-1)
    if spec._aligned:
        return flat[:numel]
    if spec._monotone and flat.device.type == "cpu" and flat.is_contiguous():
        _compact_in_place(flat, spec)
        return flat[:numel]
    out = torch.empty(numel, dtype=buf.dtype, device=buf.device)
    for src, dst, length in spec._plan:
        out[dst:dst + length].copy_(flat[src:src + length])
    return out


def _layout(arguments: dict) -> dict:
    """What must agree across ranks for a flat-tensor collective (debug mode)."""
    spec = arguments["spec"]
    return {"shape": tuple(spec.unsharded_shape), "shard_numels": tuple(spec.sharded_numels),
            "dtype": str(arguments["dtype"]).replace("torch.", "")}


def _send_to_rank0(local: torch.Tensor, info: GroupInfo, width: int, mine: int,
                   dtype: torch.dtype, device: torch.device) -> None:
    """Send this rank's shard, padded to ``width`` and cast where it must be, to group rank 0's
    ``rank0_only`` gather (off rank 0: nothing comes back)."""
    send = local
    if mine != width or local.dtype != dtype or local.device != device \
            or not local.is_contiguous():
        send = torch.zeros(width, dtype=dtype, device=device)
        send[:mine].copy_(local)
    if width:
        dist.gather(send, None, group=info.group, group_dst=0)


@call("ShardedFlatTensor gather (gather/unshard_)",
      lambda a: {**_layout(a), "rank0_only": bool(a["rank0_only"])},
      group_arg=lambda a: a["info"].group)
def gather_flat(
    local: torch.Tensor, spec: ShardingSpec, info: GroupInfo, dtype: torch.dtype, rank0_only: bool
) -> Optional[torch.Tensor]:
    """The flattened full tensor from every rank's ``local`` shard; None off group rank 0
    when ``rank0_only``."""
    width = spec.max_sharded_numel
    device = _device_for(info, local.device)
    mine = spec.sharded_numels[info.rank]
    if rank0_only and info.rank != 0:
        _send_to_rank0(local, info, width, mine, dtype, device)
        return None
    buf = torch.empty(info.world_size * width, dtype=dtype, device=device)
    slot = buf[info.rank * width:(info.rank + 1) * width]
    if mine == width and local.dtype == dtype and local.device == device and local.is_contiguous():
        send = local  # nothing to pad or cast: send the shard itself, as a raw all-gather would
    else:
        slot[:mine].copy_(local)
        slot[mine:].zero_()
        send = slot
    if rank0_only and width:
        dist.gather(send, list(buf.view(info.world_size, width).unbind(0)), group=info.group, group_dst=0)
    elif width:
        all_gather_into(buf, send, group=info.group)
    out = assemble(buf, spec)
    return out if out.device == local.device else out.to(local.device)


@call("ShardedFlatTensor scatter (shard/reshard_(writeback=True))", _layout,
      group_arg=lambda a: a["info"].group)
def scatter_flat(
    flat: Optional[torch.Tensor],
    spec: ShardingSpec,
    info: GroupInfo,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """This rank's shard of group rank 0's flattened full tensor ``flat`` (ignored elsewhere)."""
    width = spec.max_sharded_numel
    mine = spec.sharded_numels[info.rank]
    comm = _device_for(info, device)
    recv = torch.empty(width, dtype=dtype, device=comm)
    scatter_list: Optional[List[torch.Tensor]] = None
    if info.rank == 0:
        assert flat is not None
        source = flat.to(device=comm)
        scatter_list = list(pad_rank_major(source, spec, dtype).unbind(0))
    if width:
        dist.scatter(recv, scatter_list, group=info.group, group_src=0)
    if mine < width:  # an exact-size shard, not a view pinning the padded buffer
        return recv[:mine].to(device=device, copy=True)
    return recv if recv.device == device else recv.to(device)
