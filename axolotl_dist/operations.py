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
  last batch); other dimensions must agree: :func:`pad_across_processes` first.
* With one process, :func:`gather` turns a 0-d tensor into a 1-element tensor, as it does on
  several ranks, and :func:`gather_object` returns a list, as it does on several ranks
  (docs/design.md, decision 3); accelerate returns the input unchanged there.
* :func:`gather_object` flattens lists and tuples one level and keeps any other object whole
  (accelerate iterates it: a dict became its keys, accelerate #2188).
"""

from __future__ import annotations

import ctypes
import math
import struct
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Iterator, List, Optional, Sequence, Tuple

import torch

from ._runtime.base.groups import Group
from ._runtime.base.state import STATE
from ._runtime.protocols import recorder as trace
from ._runtime.protocols.exchange import all_gather_into, run
from ._runtime.protocols.helpers import collective
from .collectives import DTYPES, all_reduce
from .values import all_gather_object

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = ["gather", "gather_object", "reduce", "pad_across_processes", "REDUCTIONS"]

#: The reductions :func:`reduce` takes, and the collective op each runs.
REDUCTIONS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}

Leaves = List[torch.Tensor]
Rebuild = Callable[[Sequence[Any]], Any]


# --------------------------------------------------------------------------- nested data
def _is_namedtuple(data: Any) -> bool:
    return isinstance(data, tuple) and hasattr(data, "_fields")


def flatten(data: Any, what: str, path: str = "data") -> Tuple[List[Any], List[str], Rebuild]:
    """The tensors of a nested ``data`` (lists, tuples, namedtuples, dicts), their paths
    (``data['labels'][0]``) and a function that puts new leaves back in the same structure.

    Anything but a tensor in a leaf's place raises ``TypeError`` naming its path and ``what``.
    """
    if isinstance(data, torch.Tensor):
        return [data], [path], lambda leaves: leaves[0]
    kind = type(data)
    make: Callable[[List[Any]], Any]
    if isinstance(data, (list, tuple)):
        keys: List[Any] = list(range(len(data)))
        labels = [f"{path}[{k}]" for k in keys]
        make = (lambda items: kind(*items)) if _is_namedtuple(data) else kind
    elif isinstance(data, Mapping):
        keys = list(data)
        labels = [f"{path}[{k!r}]" for k in keys]
        make = lambda items: kind(dict(zip(keys, items)))  # noqa: E731 - as accelerate builds it
    else:
        raise TypeError(
            f"{what}: {path} is a {type(data).__name__}, not a tensor: {what} takes a tensor or "
            "lists, tuples and dicts of tensors; use gather_object for other Python objects")
    parts = [flatten(data[k], what, label) for k, label in zip(keys, labels)]

    def rebuild(leaves: Sequence[Any]) -> Any:
        items, at = [], 0
        for part_leaves, _, part_rebuild in parts:
            items.append(part_rebuild(leaves[at:at + len(part_leaves)]))
            at += len(part_leaves)
        return make(items)
    return [x for p in parts for x in p[0]], [x for p in parts for x in p[1]], rebuild


# --------------------------------------------------------------------------- gather
# A rank's structure travels as one *packet*: int64 words [packet bytes, description words,
# description...] (the description: leaf count, then per leaf its dtype code, number of dims
# and shape), then each leaf's bytes; every part starts on a 16-byte boundary, so it views as
# any dtype. All ranks send packets of one size, the *slot*: the largest packet of the same
# helper's last call on the group (a batch's shapes rarely change; kept per helper, so a pad
# between two gathers does not shrink the gathers' slot), so a call is one all-gather; a
# packet that does not fit is cut, every rank sees its length and the ranks send again with
# the new slot (two all-gathers).
_ALIGN = 16
_PEEK = 64  # int64 words read at once from a packet's start (its description, usually)
_ITEMSIZE = tuple(torch.empty((), dtype=d).element_size() for d in DTYPES)


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _describe(leaves: Leaves, paths: List[str], what: str) -> Tuple[List[int], List[int]]:
    """A packet's description words and each leaf's size in bytes."""
    desc: List[int] = [len(leaves)]
    sizes: List[int] = []
    for leaf, path in zip(leaves, paths):
        if leaf.dtype not in DTYPES:
            raise TypeError(f"{what}: {path} has dtype {leaf.dtype}, which the kit cannot send")
        desc += [DTYPES.index(leaf.dtype), leaf.dim(), *leaf.shape]
        sizes.append(leaf.numel() * leaf.element_size())
    return desc, sizes


def _pack(leaves: Leaves, paths: List[str], device: torch.device, room: int,
          what: str) -> Tuple[torch.Tensor, int]:
    """``(buffer, packet bytes)``: a uint8 buffer of at least ``room`` bytes starting with the
    packet of ``leaves``. On CPU it is built as Python bytes (each torch call costs
    microseconds, the bytes nanoseconds), elsewhere with tensor copies."""
    desc, sizes = _describe(leaves, paths, what)
    at = _padded(8 * (2 + len(desc)))
    total = at + sum(_padded(n) for n in sizes)
    if device.type == "cpu" and all(leaf.device.type == "cpu" for leaf in leaves):
        data = bytearray(struct.pack(f"<{2 + len(desc)}q", total, len(desc), *desc))
        for leaf, n in zip(leaves, sizes):
            data += bytes(_padded(len(data)) - len(data))
            if n:
                src = leaf if leaf.is_contiguous() else leaf.contiguous()
                data += ctypes.string_at(src.data_ptr(), n)
        data += bytes(max(total, room) - len(data))
        return torch.frombuffer(data, dtype=torch.uint8), total
    buf = torch.empty(max(total, room), dtype=torch.uint8, device=device)
    head = torch.tensor([total, len(desc)] + desc, dtype=torch.int64)
    buf[:8 * head.numel()].copy_(head.view(torch.uint8))
    for leaf, n in zip(leaves, sizes):
        if n:
            buf[at:at + n].copy_(leaf.detach().reshape(-1).view(torch.uint8))
        at += _padded(n)
    return buf, total


def _words(rows: torch.Tensor, count: int) -> List[List[int]]:
    """The first ``count`` int64 words of every row of ``rows`` (ranks x slot bytes)."""
    if rows.device.type == "cpu":
        slot, base = rows.shape[1], rows.data_ptr()
        fmt = struct.Struct(f"<{count}q")
        return [list(fmt.unpack(ctypes.string_at(base + r * slot, 8 * count)))
                for r in range(rows.shape[0])]
    return rows[:, :8 * count].view(torch.int64).tolist()


def _layout(words: List[int]) -> Iterator[Tuple[torch.dtype, List[int], int, int]]:
    """``(dtype, shape, offset, bytes)`` of each leaf a packet describes (``words``: its first
    int64 words, the description whole)."""
    desc = words[2:2 + words[1]]
    i, at = 1, _padded(8 * (2 + len(desc)))
    for _ in range(desc[0]):
        ndim = desc[i + 1]
        shape = desc[i + 2:i + 2 + ndim]
        n = math.prod(shape) * _ITEMSIZE[desc[i]]
        yield DTYPES[desc[i]], shape, at, n
        i += 2 + ndim
        at += _padded(n)


def _unpack(packet: torch.Tensor, words: List[int]) -> Leaves:
    """The leaves of one rank's packet (views into it); ``words``: its first int64 words."""
    if 2 + words[1] > len(words):
        words = _words(packet[None], 2 + words[1])[0]
    return [packet[at:at + n].view(dtype).reshape(shape) if n else
            torch.empty(shape, dtype=dtype, device=packet.device)
            for dtype, shape, at, n in _layout(words)]


def _exchange(g: Group, leaves: Leaves, paths: List[str], what: str
              ) -> Tuple[torch.Tensor, List[List[int]]]:
    """Every rank's packet (a row of ranks x slot bytes) and its first int64 words: one
    all-gather of the helper's slot, or two."""
    slot = max(g.gather_slots.get(what, 0), _ALIGN)
    buf, total = _pack(leaves, paths, g.device, slot, what)
    while True:
        out = torch.empty(g.size * slot, dtype=torch.uint8, device=g.device)
        if STATE.trace is not None:
            trace.add_bytes(slot)
        run(g, what, all_gather_into, out, buf[:slot], group=g.arg, async_op=True)
        rows = out.view(g.size, slot)
        heads = _words(rows, min(_PEEK, slot // 8))
        need = max(h[0] for h in heads)
        if need <= slot:
            g.gather_slots[what] = need
            return rows, heads
        slot = need  # a packet was cut: every rank saw its length, every rank sends again
        if buf.numel() < slot:
            grown = torch.empty(slot, dtype=torch.uint8, device=g.device)
            grown[:total].copy_(buf[:total])
            buf = grown


def _shape(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


def _check_alike(per_rank: List[Leaves], paths: List[str], me: int, what: str,
                 fix: str) -> None:
    """Every rank sent as many tensors as this one, each of the same dtype and dims past the
    first; else ``ValueError`` naming the first tensor that differs and two ranks."""
    mine = per_rank[me]
    for r, theirs in enumerate(per_rank):
        if len(theirs) != len(mine):
            raise ValueError(
                f"{what}: rank {me} passed {len(mine)} tensor(s) but rank {r} passed "
                f"{len(theirs)}: pass the same structure on every rank")
        for path, a, b in zip(paths, mine, theirs):
            if a.dtype != b.dtype or a.shape[1:] != b.shape[1:]:
                raise ValueError(
                    f"{what}: {path} is {_shape(a)} on rank {me} but {_shape(b)} on rank {r}: "
                    f"{fix}")


def _rows_of(data: Any, what: str) -> Tuple[Leaves, List[str], Rebuild]:
    """:func:`flatten` of ``data``, each 0-d tensor as a 1-element one (a row)."""
    leaves, paths, rebuild = flatten(data, what)
    return [t.reshape(1) if t.dim() == 0 else t for t in leaves], paths, rebuild


def gather_parts(g: Optional[Group], data: Any, what: str,
                 group: Optional["ProcessGroup"]) -> Tuple[List[Leaves], List[str], Rebuild]:
    """Every rank's leaves of ``data`` (0-d tensors as 1-element ones), this rank's paths and
    the structure's rebuild function: :func:`gather`'s exchange, before the concatenation."""
    leaves, paths, rebuild = _rows_of(data, what)
    if g is None:
        return [leaves], paths, rebuild
    rows, heads = _exchange(g, leaves, paths, what)
    per_rank = [_unpack(rows[r, :h[0]], h) for r, h in enumerate(heads)]
    _check_alike(per_rank, paths, g.rank, what, _JOIN_FIX)
    return per_rank, paths, rebuild


_JOIN_FIX = ("tensors are joined on dim 0, so every other dim must agree: "
             "pad_across_processes(data, dim=...) first, or use gather_object")


def _joined_alike(rows: torch.Tensor, words: List[int]) -> Leaves:
    """Leaf ``i`` of every rank joined on dim 0, when every rank's packet has ``words`` as its
    description: each leaf sits at the same offset of every row, so one strided copy joins it."""
    joined = []
    for dtype, shape, at, n in _layout(words):
        rows_shape = [rows.shape[0] * shape[0]] + shape[1:]
        joined.append(rows[:, at:at + n].view(dtype).reshape(rows_shape) if n else
                      torch.empty(rows_shape, dtype=dtype, device=rows.device))
    return joined


def join_ranks(per_rank: List[Leaves], originals: Leaves) -> Leaves:
    """Leaf ``i`` of every rank concatenated on dim 0, on the device of this rank's leaf ``i``."""
    if len(per_rank) == 1:
        return [t.to(orig.device) for t, orig in zip(per_rank[0], originals)]
    return [torch.cat([rank[i] for rank in per_rank]).to(orig.device)
            for i, orig in enumerate(originals)]


@collective("gather")
def gather(g: Optional[Group], tensor: Any, group: Optional["ProcessGroup"] = None) -> Any:
    """accelerate's ``gather``: every rank's tensors concatenated on dim 0, on every rank.

    ``tensor`` is a tensor or lists/tuples/dicts of tensors; the result has the same
    structure. A 0-d tensor counts as one row. First dimensions may differ across ranks (an
    uneven last batch); other dimensions and dtypes must agree, else ``ValueError`` names the
    tensor and the ranks. One all-gather for the whole structure (two when it grew since the
    last call). One process: the input (0-d tensors as 1-element ones).
    """
    leaves, paths, rebuild = _rows_of(tensor, "gather")
    if g is None:
        return rebuild(leaves)
    rows, heads = _exchange(g, leaves, paths, "gather")
    mine = heads[g.rank]
    if 2 + mine[1] <= len(mine) and all(h == mine for h in heads):  # the common case
        return rebuild([t.to(orig.device) for t, orig in zip(_joined_alike(rows, mine), leaves)])
    per_rank = [_unpack(rows[r, :h[0]], h) for r, h in enumerate(heads)]
    _check_alike(per_rank, paths, g.rank, "gather", _JOIN_FIX)
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


def _reduce_one(t: torch.Tensor, op: str, mean: bool, size: int, path: str,
                group: Optional["ProcessGroup"]) -> torch.Tensor:
    if mean and not (t.is_floating_point() or t.is_complex()):
        raise ValueError(
            f"reduce(reduction='mean'): {path} is {t.dtype}, and a mean of integers is not "
            "one: cast it to a float dtype first, or pass reduction='sum'")
    out = t.clone()
    if size > 1:
        all_reduce(out, op, group)
    if mean:
        out /= size
    return out


@collective("reduce", lambda a: {"reduction": a["reduction"]})
def reduce(g: Optional[Group], tensor: Any, reduction: str = "mean", scale: float = 1.0,
           group: Optional["ProcessGroup"] = None) -> Any:
    """accelerate's ``reduce``: each tensor summed, averaged, maxed or mined over the ranks.

    ``reduction``: ``"mean"`` (the default of ``accelerate.utils.reduce``; ``Accelerator.reduce``
    defaults to ``"sum"``), ``"sum"``, ``"max"`` or ``"min"``; a mean of an integer tensor
    raises instead of failing inside torch. Returns copies; the inputs are untouched. One
    ``all_reduce`` per tensor, as accelerate's, so the values are the same to the bit.
    """
    op = _check_reduction(reduction, scale)
    leaves, paths, rebuild = flatten(tensor, "reduce")
    size = 1 if g is None else g.size
    return rebuild([_reduce_one(t, op, reduction == "mean", size, p, group)
                    for t, p in zip(leaves, paths)])


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


def _check_pad_sizes(everyone: List[List[int]], me: int, dim: int) -> None:
    """Every rank has as many tensors as this one, with ``dim`` in the same ones."""
    sizes = everyone[me]
    for r, theirs in enumerate(everyone):
        if len(theirs) != len(sizes) or [s < 0 for s in theirs] != [s < 0 for s in sizes]:
            raise ValueError(
                f"pad_across_processes: rank {me} passed {len(sizes)} tensor(s) with "
                f"dim {dim} sizes {sizes} but rank {r} passed {theirs} (-1: no dim {dim}): "
                "pass the same structure, with the same number of dims, on every rank")


@collective("pad_across_processes", lambda a: {"dim": a["dim"]})
def pad_across_processes(g: Optional[Group], tensor: Any, dim: int = 0, pad_index: Any = 0,
                         pad_first: bool = False,
                         group: Optional["ProcessGroup"] = None) -> Any:
    """accelerate's ``pad_across_processes``: pad each tensor along ``dim`` to the largest size
    any rank has there, with ``pad_index``, at the end (or the start: ``pad_first``).

    As accelerate's, a tensor with fewer than ``dim + 1`` dimensions is left as it is (a 1-D
    ``labels`` beside 2-D ``logits`` padded on ``dim=1``). One small collective for the whole
    structure; ranks whose structures differ raise ``ValueError`` naming both. One process:
    the input.
    """
    if type(dim) is not int:
        raise TypeError(f"pad_across_processes(dim={dim!r}) must be an int")
    leaves, paths, rebuild = flatten(tensor, "pad_across_processes")
    if g is None:
        return tensor
    sizes = [t.shape[dim] if -t.dim() <= dim < t.dim() else -1 for t in leaves]
    rows, heads = _exchange(g, [torch.tensor(sizes, dtype=torch.int64)], ["sizes"],
                            "pad_across_processes")
    everyone = [_unpack(rows[r, :h[0]], h)[0].tolist() for r, h in enumerate(heads)]
    _check_pad_sizes(everyone, g.rank, dim)
    return rebuild([t if s < 0 else _pad_one(t, dim, max(e[i] for e in everyone), pad_index,
                                            pad_first)
                    for i, (t, s) in enumerate(zip(leaves, sizes))])
