"""Tensor collectives with composer's names, safe defaults and clear errors.

With no process group and a world size of 1 every collective is a no-op with the multi-rank
return shape (docs/design/decisions.md, decision 3); with ``WORLD_SIZE > 1`` in the env but no group they raise
:class:`~axolotl_dist.errors.DistributedEnvError` telling you to call ``init_distributed()``.
``src`` arguments are ranks *within* ``group`` (the global rank when ``group`` is None).
Tensors on the wrong device for the backend (CPU tensors under NCCL) are moved and moved back.

:func:`all_reduce` and :func:`broadcast` first check, in one exchange of small headers (each
rank's description length and hash), that the ranks passed tensors the collective can pair: ranks that disagree
raise :class:`~axolotl_dist.errors.TensorMismatchError` together, naming each rank's dtype and
shape, where the backend would abort, hang or return a wrong value (docs/design/helpers.md, "Shape
checks").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, TypeVar, Union

import torch
import torch.distributed as dist

from ._runtime.protocols import timeline as _timeline
from ._runtime.protocols.helpers import collective
from ._runtime.protocols.encoding import resolved
from ._runtime.protocols.exchange import all_gather_into, run
from ._runtime.protocols.packets import DTYPES, check_alike, describe_ranks, flatten
from ._runtime.base.groups import Group, channel_of, group_of
from ._runtime.base.args import REDUCE_OPS, as_reduce_op, check_src, reduce_name
from ._runtime.base.callsite import call_site
from ._runtime.protocols.timeline import TIMELINE
from .errors import tensor_mismatch

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = ["REDUCE_OPS", "barrier", "broadcast", "all_reduce", "all_gather", "comm_device"]

T = TypeVar("T")
#: What a shape mismatch's message tells the user to do.
SAME_FIX = "every rank must pass the same dtypes and shapes to this call"


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


def broadcast_into(g: Group, tensor: torch.Tensor, src: int, what: str) -> None:
    """Broadcast ``tensor`` in place from group rank ``src`` of ``g``, unchecked (the caller
    checked the ranks' shapes)."""
    work = _to_comm(tensor, g.device)
    if TIMELINE.recorder is not None:
        _timeline.add_bytes(tensor.nbytes)
    run(g, what, dist.broadcast, work, group=g.arg, group_src=src, async_op=True)
    if work is not tensor:
        tensor.copy_(work)


def all_gather_into_result(g: Group, result: torch.Tensor, tensor: torch.Tensor,
                           what: str) -> None:
    """All-gather ``tensor`` (the same shape on every rank, the caller checked) into
    ``result`` (on ``g``'s device, ranks' parts one after another on dim 0)."""
    work = _to_comm(tensor, g.device).contiguous()
    if TIMELINE.recorder is not None:
        _timeline.add_bytes(tensor.nbytes)
    run(g, what, all_gather_into, result, work, group=g.arg, async_op=True)


def check_ranks_alike(g: Group, leaves: List[torch.Tensor], paths: List[str], what: str,
                      root: int = 0, carry: bool = False) -> Optional[List[List[torch.Tensor]]]:
    """Raise :class:`~axolotl_dist.errors.TensorMismatchError` on every rank of ``g`` unless
    every rank passed the same structure, dtypes and shapes (one exchange of small headers;
    ``what`` is a helper decorated with ``exchanges=True``; ``root``: its source rank, where
    it has one). ``carry``: small tensors on a CPU group ride in that exchange: every rank's
    tensors (views, read them before the group's next collective), else None."""
    return check_alike(g, leaves, paths, what, SAME_FIX, root, carry)


def sum_in_rank_order(parts: List[List[torch.Tensor]], name: str,
                      into: Optional[List[torch.Tensor]] = None) -> List[torch.Tensor]:
    """Each tensor summed over every rank's ``parts`` in rank order (``"AVG"``: then divided
    by the number of ranks, as :func:`all_reduce_into` divides), the same bits on every rank:
    into the tensors ``into`` where given, else new ones."""
    out = []
    for i, first in enumerate(parts[0]):
        total = torch.add(first, parts[1][i], out=into[i]) if into is not None else \
            torch.add(first, parts[1][i])
        for mine in parts[2:]:
            total.add_(mine[i])
        if name == "AVG":
            total.div_(len(parts))
        out.append(total)
    return out


@collective("broadcast", lambda a: {"src": a["src"]}, src="src", exchanges=True, root="src")
def broadcast(g: Optional[Group], tensor: T, src: int = 0,
              group: Optional["ProcessGroup"] = None) -> T:
    """Broadcast ``tensor`` in place from group rank ``src``; returns it.

    ``tensor`` is a tensor or, as accelerate's ``broadcast`` takes, lists, tuples and dicts of
    tensors (each broadcast in place). Every rank must pass the same structure, dtypes and
    shapes, else :class:`~axolotl_dist.errors.TensorMismatchError` on every rank."""
    check_src(src, 1 if g is None else g.size, group)
    leaves, paths, _ = flatten(tensor, "broadcast", objects="broadcast_object")
    if g is None:
        return tensor
    parts = check_ranks_alike(g, leaves, paths, "broadcast", src, carry=True)
    if parts is not None:  # src's tensors came with the headers
        if g.rank != src:
            _copy_carried(leaves, parts[src])
    elif len(leaves) == 1:
        broadcast_into(g, leaves[0], src, "broadcast")
    elif leaves:
        _broadcast_joined(g, leaves, src)
    return tensor


def _copy_carried(leaves: List[torch.Tensor], theirs: List[torch.Tensor]) -> None:
    """Each of ``leaves`` set to the source's tensor that came with the headers (under
    ``no_grad`` only where autograd would see it: its mode costs microseconds)."""
    if any(t.requires_grad for t in leaves):
        with torch.no_grad():
            _copy_carried([t.detach() for t in leaves], theirs)
        return
    for t, x in zip(leaves, theirs):
        t.copy_(x)


def _broadcast_joined(g: Group, leaves: List[torch.Tensor], src: int) -> None:
    """Broadcast several tensors in place from group rank ``src`` as one buffer of their bytes
    (each part on a 16-byte boundary, so that it views as its dtype again): one collective
    where accelerate's ``broadcast`` runs one per tensor."""
    parts = [resolved(t.detach()).reshape(-1).view(torch.uint8).to(g.device) for t in leaves]
    pads = [-p.numel() % 16 for p in parts]
    buf = torch.cat([q for p, pad in zip(parts, pads)
                     for q in (p, p.new_zeros(pad))])
    broadcast_into(g, buf, src, "broadcast")
    if g.rank == src:
        return
    at = 0
    with torch.no_grad():
        for t, p, pad in zip(leaves, parts, pads):
            t.copy_(buf[at:at + p.numel()].view(t.dtype).reshape(t.shape))
            at += p.numel() + pad


def _check_avg(name: str, tensor: torch.Tensor) -> None:
    """AVG takes floating (and complex) tensors on every backend: an integer average is
    not an integer (NCCL's own AVG truncates it; gloo has none)."""
    if name == "AVG" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise ValueError(
            f"all_reduce(reduce_operation='AVG') needs a floating tensor, got {tensor.dtype}: "
            "cast first or use 'SUM' (the same on every backend)"
        )


def all_reduce_into(g: Group, tensor: torch.Tensor, name: str, what: str) -> None:
    """All-reduce ``tensor`` in place over ``g`` with the kit's op ``name`` (``"SUM"``,
    ``"AVG"``...), unchecked (the caller checked the ranks' shapes and the op's dtype). AVG is
    a SUM then a division by the group's size on every backend (NCCL's own AVG scales before
    it sums: other bits than gloo's), the division on the tensor's device."""
    work = _to_comm(tensor, g.device)
    if TIMELINE.recorder is not None:
        _timeline.add_bytes(tensor.nbytes)
    op = dist.ReduceOp.SUM if name == "AVG" else getattr(dist.ReduceOp, name)
    run(g, what, dist.all_reduce, work, op=op, group=g.arg, async_op=True)
    if name == "AVG":
        work.div_(g.size)
    if work is not tensor:
        tensor.copy_(work)


@collective("all_reduce", lambda a: {"reduce_operation": reduce_name(a["reduce_operation"])},
            exchanges=True)
def all_reduce(
    g: Optional[Group],
    tensor: torch.Tensor,
    reduce_operation: Union[str, Any] = "SUM",
    group: Optional["ProcessGroup"] = None,
) -> torch.Tensor:
    """Reduce ``tensor`` in place across ``group`` (``"SUM"``, ``"MAX"``, ``"AVG"``...); returns it.

    Every rank must pass the same dtype and shape, else
    :class:`~axolotl_dist.errors.TensorMismatchError` on every rank. On a CPU group a SUM or
    AVG of up to 2 KiB rides with that check's headers and is added up in rank order (one
    collective; see :func:`~axolotl_dist.operations.reduce`)."""
    name = as_reduce_op(reduce_operation)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"all_reduce(tensor=...) takes a tensor, got {type(tensor).__name__}: "
                        "use all_reduce_value for a number, reduce for a structure")
    if g is None:
        _check_avg(name, tensor)  # checked as on several ranks: one rank fails like N do
        return tensor
    parts = check_ranks_alike(g, [tensor], ["tensor"], "all_reduce",
                              carry=name in ("SUM", "AVG"))
    _check_avg(name, tensor)
    if parts is None:
        all_reduce_into(g, tensor, name, "all_reduce")
        return tensor
    if tensor.requires_grad:  # autograd's grad mode costs microseconds: only where it acts
        with torch.no_grad():
            _sum_carried(parts, name, tensor)
    else:
        _sum_carried(parts, name, tensor)
    return tensor


def _sum_carried(parts: List[List[torch.Tensor]], name: str, tensor: torch.Tensor) -> None:
    """``tensor`` set to the rank-order sum of the ``parts`` that came with the headers:
    straight into it on CPU (any strides), else through a copy."""
    if tensor.device.type == "cpu":
        sum_in_rank_order(parts, name, [tensor])
    else:
        tensor.copy_(sum_in_rank_order(parts, name)[0])


_MAX_NDIM = 12


def _meta_text(meta: List[int]) -> str:
    """``float32[2, 3]`` from an :func:`all_gather` meta row."""
    return f"{str(DTYPES[meta[0]]).replace('torch.', '')}{meta[3:3 + meta[1]]}"


def _check_gatherable(tensor: torch.Tensor) -> None:
    """Raise where :func:`all_gather` cannot send ``tensor``: too many dims, a dtype it has no
    code for, a layout other than dense."""
    if tensor.dim() > _MAX_NDIM:
        raise ValueError(f"all_gather supports tensors of at most {_MAX_NDIM} dims, got "
                         f"{tensor.dim()}")
    if tensor.dtype not in DTYPES:
        raise ValueError(f"all_gather does not support dtype {tensor.dtype}")
    if tensor.layout != torch.strided:
        raise TypeError(f"all_gather: tensor is a {tensor.layout} tensor, which the kit cannot "
                        "send: pass it dense (tensor.to_dense())")


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
    _check_gatherable(tensor)
    ws, device = g.size, g.device
    meta = [DTYPES.index(tensor.dtype), tensor.dim(), tensor.numel()] + list(tensor.shape)
    meta += [0] * (3 + _MAX_NDIM - len(meta))
    metas_t = torch.empty(ws * len(meta), dtype=torch.int64)  # on the host: the CPU channel
    if TIMELINE.recorder is not None:
        _timeline.add_bytes(tensor.nbytes)
    ch = channel_of(g)
    run(ch, "all_gather", all_gather_into, metas_t, torch.tensor(meta, dtype=torch.int64),
        group=ch.arg, async_op=True)
    metas = metas_t.view(ws, len(meta)).tolist()
    if any(m[0] != meta[0] for m in metas):
        raise tensor_mismatch(
            f"all_gather: tensor differs across ranks: "
            f"{describe_ranks([_meta_text(m) for m in metas])}: shapes may differ, dtypes may "
            f"not: cast every rank's tensor to one dtype (called at {call_site()})")
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
