"""accelerate's tensor operations (``accelerate.utils.operations``) with the kit's guarantees.

:func:`gather`, :func:`gather_object`, :func:`reduce` and :func:`pad_across_processes` take
what accelerate's take (a tensor, or lists, tuples, namedtuples and dicts of tensors, nested)
and return what accelerate's return for the same inputs (docs/porting.md lists each
difference), on top of the kit's collectives, so a failing rank is named on every rank instead
of a hang, and a mismatch between ranks is a clear error naming the tensor and the ranks.

What they do differently from accelerate's, on purpose:

* :func:`gather` moves a whole structure in one all-gather, however many tensors it holds
  (accelerate: one per tensor; two when the structure grew since the helper's last call, see
  "gather" below), and takes tensors whose first dimension differs across ranks (an uneven
  last batch); other dimensions must agree: :func:`pad_across_processes` first. A structure
  of :data:`DIRECT_BYTES` or more goes straight into its result instead (a rank's peak
  memory grows by the result's size: 1.01x for 256 MiB a rank on 2 ranks, accelerate's 2.01x).
* With one process, :func:`gather` turns a 0-d tensor into a 1-element tensor, as it does on
  several ranks, and :func:`gather_object` returns a list, as it does on several ranks
  (docs/design/decisions.md, decision 3); accelerate returns the input unchanged there.
* :func:`gather_object` flattens lists and tuples one level and keeps any other object whole
  (accelerate iterates it: a dict became its keys, accelerate #2188).
* The shape checks are always on (accelerate's run in its debug mode only): :func:`reduce`
  checks every rank's dtypes and shapes in one exchange of small headers before its
  collectives, and
  :func:`gather` and :func:`pad_across_processes` check the descriptions their one
  all-gather already carries. A mismatch is :class:`~axolotl_dist.errors.TensorMismatchError`
  (accelerate's ``DistributedOperationException``) on every rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Tuple

import torch

from ._runtime.base.callsite import call_site
from ._runtime.base.groups import Group
from ._runtime.protocols import packets
from ._runtime.protocols.helpers import collective
from ._runtime.protocols.packets import Leaves, Rebuild, Spec, check_same, describe_all, flatten
from .collectives import (all_gather_into_result, all_reduce_into, broadcast_into, check_ranks_alike,
                          sum_in_rank_order)
from .errors import tensor_mismatch
from .values import all_gather_object

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = ["gather", "gather_object", "reduce", "pad_across_processes", "copy_tensor_to_devices",
           "REDUCTIONS"]

#: The reductions :func:`reduce` takes, and the collective op each runs.
REDUCTIONS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}



# --------------------------------------------------------------------------- gather
# A rank's structure travels as one packet (``_runtime/protocols/packets.py``): one all-gather
# of the helper's slot, two when the structure grew since the helper's last call.


_JOIN_FIX = ("tensors are joined on dim 0, so every other dim must agree: "
              "pad_across_processes(data, dim=...) first, or use gather_object")


def _joinable(spec: Spec) -> Tuple[torch.dtype, Tuple[int, ...]]:
    """What must agree across ranks for :func:`gather` to join a tensor: its dtype and dims
    past the first."""
    return spec[0], spec[1][1:]


def _rows_of(data: Any, what: str) -> Tuple[Leaves, List[str], Rebuild]:
    """:func:`flatten` of ``data``, each 0-d tensor as a 1-element one (a row)."""
    leaves, paths, rebuild = flatten(data, what)
    return [t.reshape(1) if t.dim() == 0 else t for t in leaves], paths, rebuild


#: Bytes of a rank's structure from which a gather moves the data straight into its result
#: (each rank's rows broadcast into its place, or one all-gather on an accelerator where every
#: rank's shapes agree): a rank's peak memory then grows by the result's size alone, where a
#: packet of the structure and the all-gather's buffer would add twice as much again.
DIRECT_BYTES = 1 << 20


def _direct(g: Group, leaves: Leaves, everyone: List[List[Spec]], what: str) -> Leaves:
    """Leaf ``i`` of every rank joined on dim 0, each rank's rows written straight into the
    result (``everyone``: every rank's specs, checked joinable)."""
    joined = []
    for i, leaf in enumerate(leaves):
        rows = [mine[i][1][0] for mine in everyone]
        result = torch.empty((sum(rows), *leaf.shape[1:]), dtype=leaf.dtype, device=g.device)
        if not g.cpu and len(set(rows)) == 1:  # NCCL writes into its output: no copy
            all_gather_into_result(g, result, leaf, what)
        else:  # gloo's all-gather holds its output twice: each rank's part broadcast instead
            at = 0
            for r, n in enumerate(rows):
                part = result[at:at + n]
                at += n
                if n == 0:
                    continue
                if r == g.rank:
                    part.copy_(leaf)
                broadcast_into(g, part, r, what)
        joined.append(result)
    return joined


def gather_parts(g: Optional[Group], data: Any, what: str,
                 group: Optional["ProcessGroup"]
                 ) -> Tuple[List[Leaves], Leaves, List[str], Rebuild, Optional[Leaves]]:
    """Every rank's leaves of ``data`` (0-d tensors as 1-element ones, on the device the group
    communicates on), this rank's own leaves, its paths and the structure's rebuild function:
    :func:`gather`'s exchange, before the concatenation. A big structure comes joined
    already (the last item; None otherwise), every rank's leaves views into it."""
    leaves, paths, rebuild = _rows_of(data, what)
    if g is None:
        return [leaves], leaves, paths, rebuild, None
    rows, heads = packets.exchange(g, leaves, paths, what, direct_above=DIRECT_BYTES)
    everyone = [packets.specs(h) for h in heads] if rows is None else \
        packets.specs_of(rows, heads)
    check_same(everyone, paths, what, _JOIN_FIX, key=_joinable)
    if rows is None:
        joined = _direct(g, leaves, everyone, what)
        return _split(joined, everyone), leaves, paths, rebuild, joined
    per_rank = [packets.unpack(rows[r, :h[0]], h) for r, h in enumerate(heads)]
    return per_rank, leaves, paths, rebuild, None


def _split(joined: Leaves, everyone: List[List[Spec]]) -> List[Leaves]:
    """Each rank's rows of each joined leaf (views)."""
    per_rank: List[Leaves] = []
    at = [0] * len(joined)
    for mine in everyone:
        parts = []
        for i, (result, spec) in enumerate(zip(joined, mine)):
            parts.append(result[at[i]:at[i] + spec[1][0]])
            at[i] += spec[1][0]
        per_rank.append(parts)
    return per_rank


def _joined_alike(rows: torch.Tensor, head: List[int]) -> Leaves:
    """Leaf ``i`` of every rank joined on dim 0, when every rank's packet has ``head`` as its
    description: each leaf sits at the same offset of every row, so one strided copy joins it."""
    joined = []
    for dtype, shape, at, n in packets.layout(head):
        rows_shape = [rows.shape[0] * shape[0]] + shape[1:]
        joined.append(rows[:, at:at + n].view(dtype).reshape(rows_shape) if n else
                      torch.empty(rows_shape, dtype=dtype, device=rows.device))
    return joined


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device`` (no call where it is there already)."""
    return t if t.device == device else t.to(device)


def join_ranks(per_rank: List[Leaves], originals: Leaves) -> Leaves:
    """Leaf ``i`` of every rank concatenated on dim 0, on the device of this rank's leaf ``i``."""
    if len(per_rank) == 1:
        return [_on(t, orig.device) for t, orig in zip(per_rank[0], originals)]
    return [_on(torch.cat([rank[i] for rank in per_rank]), orig.device)
            for i, orig in enumerate(originals)]


@collective("gather")
def gather(g: Optional[Group], tensor: Any, group: Optional["ProcessGroup"] = None) -> Any:
    """accelerate's ``gather``: every rank's tensors concatenated on dim 0, on every rank.

    ``tensor`` is a tensor or lists/tuples/dicts of tensors; the result has the same
    structure. A 0-d tensor counts as one row. First dimensions may differ across ranks (an
    uneven last batch); other dimensions and dtypes must agree, else
    :class:`~axolotl_dist.errors.TensorMismatchError` on every rank names each rank's. One
    all-gather for the whole structure (two when it grew since the last call). One process:
    the input (0-d tensors as 1-element ones).
    """
    leaves, paths, rebuild = _rows_of(tensor, "gather")
    if g is None:
        return rebuild(leaves)
    rows, heads = packets.exchange(g, leaves, paths, "gather", direct_above=DIRECT_BYTES)
    if rows is None:  # big: each rank's rows moved straight into the result
        everyone = [packets.specs(h) for h in heads]
        check_same(everyone, paths, "gather", _JOIN_FIX, key=_joinable)
        joined = _direct(g, leaves, everyone, "gather")
        return rebuild([_on(t, orig.device) for t, orig in zip(joined, leaves)])
    mine = heads[g.rank]
    if 2 + mine[1] <= len(mine) and all(h == mine for h in heads):  # the common case
        return rebuild([_on(t, orig.device) for t, orig in zip(_joined_alike(rows, mine), leaves)])
    check_same(packets.specs_of(rows, heads), paths, "gather", _JOIN_FIX, key=_joinable)
    per_rank = [packets.unpack(rows[r, :h[0]], h) for r, h in enumerate(heads)]
    return rebuild(join_ranks(per_rank, leaves))


@collective("gather_object")
def gather_object(g: Optional[Group], object: Any,  # noqa: A002 - accelerate's name
                  group: Optional["ProcessGroup"] = None) -> List[Any]:
    """accelerate's ``gather_object``: every rank's items in one list, in rank order.

    A list or tuple gives its items (accelerate's use: ``gather_object([x])``); any other
    object is one item. The objects are pickled, as accelerate's and torch's are: pass only
    what your ranks trust. One process: the same list.
    """
    parts = [object] if g is None else all_gather_object(object, group)
    out: List[Any] = []
    for part in parts:
        if isinstance(part, (list, tuple)):
            out.extend(part)
        else:
            out.append(part)
    return out


# --------------------------------------------------------------------------- reduce
def _check_reduction(reduction: Any, scale: Any) -> str:
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"reduce(reduction={reduction!r}): pass one of {sorted(REDUCTIONS)} (accelerate's "
            "'none' sums; leave the call out to keep each rank's tensor)")
    if scale != 1.0:
        raise ValueError(
            f"reduce(scale={scale!r}): only accelerate's XLA path applies scale; multiply the "
            "result instead")
    return REDUCTIONS[reduction]


def _check_mean(t: torch.Tensor, path: str) -> None:
    if not (t.is_floating_point() or t.is_complex()):
        raise ValueError(
            f"reduce(reduction='mean'): {path} is {t.dtype}, and a mean of integers is not "
            "one: cast it to a float dtype first, or pass reduction='sum'")


def _reduced(g: Optional[Group], leaves: Leaves, parts: Optional[List[Leaves]], op: str
             ) -> Leaves:
    """Copies of ``leaves`` reduced with ``op`` over ``g``: summed here in rank order where
    every rank's tensors came with the check's headers (``parts``), else one ``all_reduce``
    each."""
    if parts is not None:
        return [t.to(leaf.device) for t, leaf in zip(sum_in_rank_order(parts, "SUM"), leaves)]
    out = [t.clone() for t in leaves]
    if g is not None and g.size > 1:
        for t in out:
            all_reduce_into(g, t, op, "reduce")
    return out


@collective("reduce", lambda a: {"reduction": a["reduction"]}, exchanges=True)
def reduce(g: Optional[Group], tensor: Any, reduction: str = "mean", scale: float = 1.0,
           group: Optional["ProcessGroup"] = None) -> Any:
    """accelerate's ``reduce``: each tensor summed, averaged, maxed or mined over the ranks.

    ``reduction``: ``"mean"`` (the default of ``accelerate.utils.reduce``; ``Accelerator.reduce``
    defaults to ``"sum"``), ``"sum"``, ``"max"`` or ``"min"``; a mean of an integer tensor
    raises instead of failing inside torch. Returns copies; the inputs are untouched. Every
    rank's dtypes and shapes are checked first, in one exchange of small headers (a mismatch:
    :class:`~axolotl_dist.errors.TensorMismatchError` on every rank). On a CPU group of up to
    16 ranks a sum or mean of up to 2 KiB of tensors rides in that exchange and is added up on
    each rank in rank order (one collective, the same bits on every rank; at 2 ranks the bits
    of accelerate's, at 3 or more those of a sum in rank order, not gloo's ring); anything
    else then takes one ``all_reduce`` per tensor, as accelerate's.
    """
    op = _check_reduction(reduction, scale)
    leaves, paths, rebuild = flatten(tensor, "reduce")
    parts = None
    if g is not None:  # before the mean check: every rank
        # autograd's tensors keep accelerate's clone (the result stays in their graph)
        carry = op == "SUM" and not any(t.requires_grad for t in leaves)
        parts = check_ranks_alike(g, leaves, paths, "reduce", carry=carry)
    mean = reduction == "mean"
    if mean:
        for t, path in zip(leaves, paths):
            _check_mean(t, path)
    out = _reduced(g, leaves, parts, op)
    if mean:
        size = 1 if g is None else g.size
        for t in out:
            t /= size
    return rebuild(out)


# --------------------------------------------------------------------------- pad
def _pad_one(t: torch.Tensor, dim: int, size: int, pad_index: Any, pad_first: bool
             ) -> torch.Tensor:
    if t.shape[dim] == size:
        return t
    shape = list(t.shape)
    shape[dim] = size
    out = t.new_full(shape, pad_index)
    start = size - t.shape[dim] if pad_first else 0
    out.narrow(dim, start, t.shape[dim]).copy_(t)
    return out


def _dims(spec: Spec) -> int:
    return len(spec[1])


@collective("pad_across_processes", lambda a: {"dim": a["dim"]})
def pad_across_processes(g: Optional[Group], tensor: Any, dim: int = 0, pad_index: Any = 0,
                         pad_first: bool = False,
                         group: Optional["ProcessGroup"] = None) -> Any:
    """accelerate's ``pad_across_processes``: pad each tensor along ``dim`` to the largest size
    any rank has there, with ``pad_index``, at the end (or the start: ``pad_first``).

    As accelerate's, a tensor with fewer than ``dim + 1`` dimensions is left as it is (a 1-D
    ``labels`` beside 2-D ``logits`` padded on ``dim=1``). One small all-gather of every rank's
    shapes for the whole structure; ranks whose structures or numbers of dims differ raise
    :class:`~axolotl_dist.errors.TensorMismatchError` on every rank, naming each rank's shape.
    One process: the input.
    """
    if type(dim) is not int:
        raise TypeError(f"pad_across_processes(dim={dim!r}) must be an int")
    leaves, paths, rebuild = flatten(tensor, "pad_across_processes")
    if g is None:
        return tensor
    everyone = describe_all(g, leaves, paths, "pad_across_processes")
    check_same(everyone, paths, "pad_across_processes",
               "every rank must pass the same structure, with the same number of dims in each "
               f"tensor (padded on dim {dim})", key=_dims)
    out = []
    for i, t in enumerate(leaves):
        if not -t.dim() <= dim < t.dim():
            out.append(t)
            continue
        out.append(_pad_one(t, dim, max(mine[i][1][dim] for mine in everyone), pad_index,
                            pad_first))
    return rebuild(out)


# --------------------------------------------------------------------------- copy to devices
@collective("copy_tensor_to_devices")
def copy_tensor_to_devices(g: Optional[Group], tensor: Optional[torch.Tensor] = None,
                           group: Optional["ProcessGroup"] = None) -> torch.Tensor:
    """accelerate's ``copy_tensor_to_devices``: the tensor one rank has, on every rank.

    Exactly one rank passes a tensor, the others ``None`` (they need not know its shape or
    dtype): one small all-gather of what each rank holds, then a broadcast from the rank that
    has it (accelerate: any rank, through a sum). Returns a copy on every rank, on the group's
    device (the holder's stays on its own device). No rank or several ranks with a tensor:
    :class:`~axolotl_dist.errors.TensorMismatchError` on every rank.
    """
    if tensor is not None and not isinstance(tensor, torch.Tensor):
        raise TypeError(f"copy_tensor_to_devices(tensor=...) takes a tensor or None, got "
                        f"{type(tensor).__name__}")
    if g is None:
        if tensor is None:
            raise ValueError("copy_tensor_to_devices: the only rank passed None: pass the "
                             "tensor to copy")
        return tensor.clone()
    everyone = describe_all(g, [] if tensor is None else [tensor], ["tensor"],
                            "copy_tensor_to_devices")
    holders = [r for r, mine in enumerate(everyone) if mine]
    if len(holders) != 1:
        held = packets.describe_ranks([packets.spec_text(m[0]) if m else "None" for m in everyone])
        count = f"{len(holders)} ranks" if holders else "no rank"
        raise tensor_mismatch(
            f"copy_tensor_to_devices: {count} passed a tensor ({held}): pass it on exactly one "
            f"rank and None on the others (called at {call_site()})")
    src = holders[0]
    if tensor is not None:
        out = tensor.clone()
    else:
        dtype, shape = everyone[src][0]
        out = torch.empty(shape, dtype=dtype, device=g.device)
    broadcast_into(g, out, src, "copy_tensor_to_devices")
    return out
