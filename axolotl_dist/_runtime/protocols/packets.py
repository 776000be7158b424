"""Tensor packets: a rank's tensors (or only their description) in one all-gather, and the
check that every rank passed tensors a collective can pair.

A rank's structure travels as one *packet*: int64 words ``[packet bytes, description words,
description...]`` (the description: leaf count, then per leaf its dtype code, number of dims
and shape), then each leaf's bytes unless only the description is sent; every part starts on
a 16-byte boundary, so it views as any dtype. All ranks send packets of one size, the *slot*:
the largest packet of the same helper's last call on the group (a batch's shapes rarely change;
kept per helper, so a pad between two gathers does not shrink the gathers' slot), so a call is
one all-gather; a packet that does not fit is cut, every rank sees its length and the ranks
send again with the new slot (two all-gathers).

:func:`check_same` is the tensor operations' shape check (docs/design/helpers.md, "Shape checks"):
every rank hears every rank's description in one small all-gather before a collective whose
buffers must match (``all_reduce``, ``broadcast``, ``reduce``), so ranks that disagree raise
:class:`~axolotl_dist.errors.TensorMismatchError` together, naming each rank's dtype and shape,
instead of an abort in the backend, a wrong value or a hang.
"""

from __future__ import annotations

import ctypes
import math
import struct
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ..base.callsite import call_site
from ..base.groups import Group, channel_of
from .headers import HEADER_LEN, HEADERS
from .timeline import TIMELINE
from . import timeline
from .codes import helper_code, mismatch_error
from .encoding import resolved
from .exchange import all_gather_into, exchange as exchange_headers, run
from ...errors import tensor_mismatch

__all__ = ["DTYPES", "Leaves", "Spec", "Rebuild", "flatten", "exchange", "unpack", "layout", "words", "specs",
           "specs_of", "describe_all", "check_same", "check_alike", "describe_ranks", "spec_text",
           "CARRIED", "carried_parts"]

#: The dtypes the kit's gathers send (their index is the code on the wire).
DTYPES: List[torch.dtype] = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128,
] + [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64")
     if hasattr(torch, n)]

Leaves = List[torch.Tensor]
Rebuild = Callable[[Sequence[Any]], Any]
#: A leaf as a packet describes it: its dtype and shape.
Spec = Tuple[torch.dtype, Tuple[int, ...]]

_ALIGN = 16
_PEEK = 64  # int64 words read at once from a packet's start (its description, usually)
_ITEMSIZE = tuple(torch.empty((), dtype=d).element_size() for d in DTYPES)


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _describe(leaves: Leaves, paths: Sequence[str], what: str) -> Tuple[List[int], List[int]]:
    """A packet's description words and each leaf's size in bytes."""
    desc: List[int] = [len(leaves)]
    sizes: List[int] = []
    for leaf, path in zip(leaves, paths):
        if leaf.dtype not in DTYPES:
            raise TypeError(f"{what}: {path} has dtype {leaf.dtype}, which the kit cannot send")
        if leaf.layout != torch.strided:
            raise TypeError(f"{what}: {path} is a {leaf.layout} tensor, which the kit cannot "
                            f"send: pass it dense ({path}.to_dense())")
        desc += [DTYPES.index(leaf.dtype), leaf.dim(), *leaf.shape]
        sizes.append(leaf.numel() * leaf.element_size())
    return desc, sizes


def _pack(leaves: Leaves, paths: Sequence[str], device: torch.device, room: int, what: str,
          data: bool) -> Tuple[torch.Tensor, int]:
    """``(buffer, packet bytes)``: a uint8 buffer of at least ``room`` bytes starting with the
    packet of ``leaves`` (their description alone unless ``data``). On CPU it is built as
    Python bytes (each torch call costs microseconds, the bytes nanoseconds), elsewhere with
    tensor copies."""
    desc, sizes = _describe(leaves, paths, what)
    at = _padded(8 * (2 + len(desc)))
    total = at + (sum(_padded(n) for n in sizes) if data else 0)
    if device.type == "cpu" and all(leaf.device.type == "cpu" for leaf in leaves):
        buf = bytearray(struct.pack(f"<{2 + len(desc)}q", total, len(desc), *desc))
        if data:
            for leaf, n in zip(leaves, sizes):
                buf += bytes(_padded(len(buf)) - len(buf))
                if n:  # a conjugate or negative view's memory holds the values before it
                    src = resolved(leaf).contiguous()
                    buf += ctypes.string_at(src.data_ptr(), n)
        buf += bytes(max(total, room) - len(buf))
        return torch.frombuffer(buf, dtype=torch.uint8), total
    out = torch.empty(max(total, room), dtype=torch.uint8, device=device)
    head = torch.tensor([total, len(desc)] + desc, dtype=torch.int64)
    out[:8 * head.numel()].copy_(head.view(torch.uint8))
    if data:
        for leaf, n in zip(leaves, sizes):
            if n:
                out[at:at + n].copy_(resolved(leaf.detach()).reshape(-1).view(torch.uint8))
            at += _padded(n)
    return out, total


def words(rows: torch.Tensor, count: int) -> List[List[int]]:
    """The first ``count`` int64 words of every row of ``rows`` (ranks x slot bytes)."""
    if rows.device.type == "cpu":
        slot, base = rows.shape[1], rows.data_ptr()
        fmt = struct.Struct(f"<{count}q")
        return [list(fmt.unpack(ctypes.string_at(base + r * slot, 8 * count)))
                for r in range(rows.shape[0])]
    return rows[:, :8 * count].view(torch.int64).tolist()


def _whole(row: torch.Tensor, head: List[int]) -> List[int]:
    """``head`` (a packet's first words) with its description whole."""
    if 2 + head[1] > len(head):
        return words(row[None], 2 + head[1])[0]
    return head


def layout(head: List[int]) -> Iterator[Tuple[torch.dtype, List[int], int, int]]:
    """``(dtype, shape, offset, bytes)`` of each leaf a packet describes (``head``: its first
    int64 words, the description whole)."""
    desc = head[2:2 + head[1]]
    i, at = 1, _padded(8 * (2 + len(desc)))
    for _ in range(desc[0]):
        ndim = desc[i + 1]
        shape = desc[i + 2:i + 2 + ndim]
        n = math.prod(shape) * _ITEMSIZE[desc[i]]
        yield DTYPES[desc[i]], shape, at, n
        i += 2 + ndim
        at += _padded(n)


def specs(head: List[int]) -> List[Spec]:
    """The ``(dtype, shape)`` of each leaf a packet describes (the description whole)."""
    return [(dtype, tuple(shape)) for dtype, shape, _, _ in layout(head)]


def unpack(packet: torch.Tensor, head: List[int]) -> Leaves:
    """The leaves of one rank's packet (views into it); ``head``: its first int64 words."""
    head = _whole(packet, head)
    return [packet[at:at + n].view(dtype).reshape(shape) if n else
            torch.empty(shape, dtype=dtype, device=packet.device)
            for dtype, shape, at, n in layout(head)]


def exchange(g: Group, leaves: Leaves, paths: Sequence[str], what: str, data: bool = True,
             direct_above: Optional[int] = None) -> Tuple[Optional[torch.Tensor], List[List[int]]]:
    """Every rank's packet (a row of ranks x slot bytes) and its first int64 words: one
    all-gather of the helper's slot, or two. ``data=False``: the description alone (its slot
    is kept apart from the helper's data packets). ``direct_above``: where some rank's packet
    holds at least that many bytes, no data is sent: ``(None, every rank's description,
    whole)``, for the caller to move the data straight into its result (a packet would hold
    the whole result twice more)."""
    if not g.cpu:
        return _exchange_on_device(g, leaves, paths, what, data, direct_above)
    key, slots = what if data else what + " (shapes)", HEADERS.buffers[g].gather_slots
    slot = max(slots.get(key, 0), _ALIGN)
    buf, total = _pack(leaves, paths, g.device, slot, what, data)
    while True:
        out = torch.empty(g.size * slot, dtype=torch.uint8)  # the host's: g is a CPU group
        if TIMELINE.recorder is not None:
            timeline.add_bytes(slot)
        run(g, what, all_gather_into, out, buf[:slot], group=g.arg, async_op=True)
        rows = out.view(g.size, slot)
        heads = words(rows, min(_PEEK, slot // 8))
        need = max(h[0] for h in heads)
        if need <= slot:
            slots[key] = need
            return rows, heads
        if data and direct_above is not None and need >= direct_above:
            return None, _descriptions(g, rows, heads, leaves, paths, what, key)
        slot = need  # a packet was cut: every rank saw its length, every rank sends again
        if buf.numel() < slot:
            grown = torch.empty(slot, dtype=torch.uint8, device=g.device)
            grown[:total].copy_(buf[:total])
            buf = grown


def _descriptions(g: Group, rows: torch.Tensor, heads: List[List[int]], leaves: Leaves,
                  paths: Sequence[str], what: str, key: str) -> List[List[int]]:
    """Every rank's description, whole, after a round whose packets were cut: from that round
    where its slot held them (the next call's first round will: its slot is set to the
    descriptions' size), else from a round of descriptions alone."""
    size = max(_padded(8 * (2 + h[1])) for h in heads)
    if size > rows.shape[1]:
        rows, heads = exchange(g, leaves, paths, what, data=False)
    HEADERS.buffers[g].gather_slots[key] = size
    return [_whole(rows[r], h) for r, h in enumerate(heads)]


def _exchange_on_device(g: Group, leaves: Leaves, paths: Sequence[str], what: str, data: bool,
                        direct_above: Optional[int] = None
                        ) -> Tuple[Optional[torch.Tensor], List[List[int]]]:
    """:func:`exchange` on an accelerator group: every rank's description over the CPU channel
    (its packet's words, whole, known on the host), then, with ``data``, one all-gather of the
    leaves' bytes on the device, each rank's packet laid out as its description says (the
    words themselves are not sent: nothing is read back from the device)."""
    rows, heads = exchange(channel_of(g), leaves, paths, what, data=False)
    heads = [_whole(rows[r], h) for r, h in enumerate(heads)]
    if not data:
        return rows, heads
    for head in heads:
        head[0] = _data_bytes(head)
    slot = max(max(h[0] for h in heads), _ALIGN)
    if direct_above is not None and slot >= direct_above:
        return None, heads
    buf = torch.zeros(slot, dtype=torch.uint8, device=g.device)
    for leaf, (_, _, at, n) in zip(leaves, layout(heads[g.rank])):
        if n:
            buf[at:at + n].copy_(leaf.detach().reshape(-1).view(torch.uint8))
    out = torch.empty(g.size * slot, dtype=torch.uint8, device=g.device)
    if TIMELINE.recorder is not None:
        timeline.add_bytes(slot)
    run(g, what, all_gather_into, out, buf, group=g.arg, async_op=True)
    return out.view(g.size, slot), heads


def _data_bytes(head: List[int]) -> int:
    """The bytes of the packet a description (``head``, whole) lays out, its data included."""
    end = _padded(8 * (2 + head[1]))
    for _, _, at, n in layout(head):
        end = at + _padded(n)
    return end


def specs_of(rows: torch.Tensor, heads: List[List[int]]) -> List[List[Spec]]:
    """Every rank's ``(dtype, shape)`` of each leaf, from :func:`exchange`'s result."""
    return [specs(_whole(rows[r], h)) for r, h in enumerate(heads)]


def describe_all(g: Group, leaves: Leaves, paths: Sequence[str], what: str
                 ) -> List[List[Spec]]:
    """Every rank's ``(dtype, shape)`` of each leaf, in group-rank order: one small
    all-gather, on the group's CPU channel."""
    return specs_of(*exchange(channel_of(g), leaves, paths, what, data=False))


# --------------------------------------------------------------------------- nested data
def _is_namedtuple(data: Any) -> bool:
    return isinstance(data, tuple) and hasattr(data, "_fields")


def flatten(data: Any, what: str, path: str = "data", objects: str = "gather_object"
            ) -> Tuple[List[Any], List[str], Rebuild]:
    """The tensors of a nested ``data`` (lists, tuples, namedtuples, dicts), their paths
    (``data['labels'][0]``) and a function that puts new leaves back in the same structure.

    Anything but a tensor in a leaf's place raises ``TypeError`` naming its path and ``what``
    (and ``objects``, the helper that moves other Python objects).
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
            f"lists, tuples and dicts of tensors; use {objects} for other Python objects")
    parts = [flatten(data[k], what, label, objects) for k, label in zip(keys, labels)]

    def rebuild(leaves: Sequence[Any]) -> Any:
        items, at = [], 0
        for part_leaves, _, part_rebuild in parts:
            items.append(part_rebuild(leaves[at:at + len(part_leaves)]))
            at += len(part_leaves)
        return make(items)
    return [x for p in parts for x in p[0]], [x for p in parts for x in p[1]], rebuild


# --------------------------------------------------------------------------- the check
def spec_text(spec: Spec) -> str:
    """``float32[2, 5]``."""
    return f"{str(spec[0]).replace('torch.', '')}{list(spec[1])}"


def _rank_list(ranks: List[int]) -> str:
    """``rank 1``, ``ranks 0, 2-5``."""
    parts: List[str] = []
    start = prev = ranks[0]
    for r in ranks[1:] + [-2]:
        if r == prev + 1:
            prev = r
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(parts)


def describe_ranks(texts: Sequence[str]) -> str:
    """Each distinct text with the ranks that have it, in the order of their first rank:
    ``float32[1, 5] on ranks 0, 2-63; float32[1, 2, 5] on rank 1``."""
    by: Dict[str, List[int]] = {}
    for r, text in enumerate(texts):
        by.setdefault(text, []).append(r)
    return "; ".join(f"{text} on {_rank_list(ranks)}" for text, ranks in by.items())


def check_same(everyone: List[List[Spec]], paths: Sequence[str], what: str, fix: str,
               key: Optional[Callable[[Spec], object]] = None,
               shown: Callable[[Spec], str] = spec_text) -> None:
    """Raise :class:`~axolotl_dist.errors.TensorMismatchError` on every rank unless every rank
    passed as many tensors as the others and ``key`` of each (default: dtype and shape) is
    the same on every rank. The message names the first tensor that differs, each rank's
    ``shown`` of it, ``fix`` and this rank's call site. Every rank sees the same
    ``everyone``, so every rank raises, or none."""
    counts = [len(mine) for mine in everyone]
    if len(set(counts)) > 1:
        raise tensor_mismatch(
            f"{what}: the ranks passed different numbers of tensors: "
            f"{describe_ranks([f'{c} tensor(s)' for c in counts])}: pass the same structure "
            f"on every rank (called at {call_site()})")
    pick = key or (lambda s: s)
    for i, path in enumerate(paths):
        column = [mine[i] for mine in everyone]
        if len({pick(s) for s in column}) > 1:
            raise tensor_mismatch(
                f"{what}: {path} differs across ranks: "
                f"{describe_ranks([shown(s) for s in column])}: {fix} (called at {call_site()})")


#: The dtypes whose bytes may ride with a checked helper's header (a sum's operands).
CARRIED = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8)
#: Slot 2 of a checked helper's header: whether its tensors ride in this frame.
_APART, _CARRIED = 0, 1


def _carry_bytes(leaves: Leaves, sizes: List[int], room: int) -> Optional[int]:
    """The bytes ``leaves`` (of ``sizes`` bytes each) take in a frame (each padded to 16), or
    None if they cannot ride (another dtype, more than ``room`` bytes)."""
    if any(leaf.dtype not in CARRIED or leaf.layout != torch.strided for leaf in leaves):
        return None
    total = sum(_padded(n) for n in sizes)
    return total if total <= room else None


def _write_frame(g: Group, leaves: Leaves, sizes: List[int]) -> None:
    """This rank's tensors' bytes (``sizes`` each) into its frame, after its header (a
    contiguous CPU tensor's by one ``memmove``: torch's calls cost microseconds each, and this
    is a scalar's path)."""
    arr = HEADERS.buffers[g].hdr_arr
    base = arr.buffer_info()[0]
    at = 8 * HEADER_LEN
    for leaf, n in zip(leaves, sizes):
        if n and leaf.device.type == "cpu" and leaf.is_contiguous() and not leaf.is_neg():
            ctypes.memmove(base + at, leaf.data_ptr(), n)
        elif n:
            frame = torch.frombuffer(arr, dtype=torch.uint8)
            frame[at:at + n].copy_(leaf.detach().reshape(-1).view(torch.uint8))
        at += _padded(n)


def carried_parts(g: Group, leaves: Leaves) -> List[Leaves]:
    """Every rank's tensors (views of ``g``'s frames, valid until its next exchange) after
    :func:`check_alike` said they rode, laid out as this rank's ``leaves`` (the same dtypes
    and shapes on every rank: checked). The views of one layout are made once per group and
    kept (the frames never move): a step's scalar takes the same views every call."""
    key = tuple((leaf.dtype, leaf.shape) for leaf in leaves)
    views = HEADERS.buffers[g].views
    parts = views.get(key)
    if parts is None:
        if len(views) >= _VIEW_LAYOUTS:
            views.clear()
        parts = views[key] = _frame_views(g, leaves)
    return parts


#: Layouts whose frame views a group keeps (a training loop reduces a few).
_VIEW_LAYOUTS = 32


def _frame_views(g: Group, leaves: Leaves) -> List[Leaves]:
    """:func:`carried_parts`' views, made."""
    h = HEADERS.buffers[g]
    frame = 8 * h.frame
    out: List[Leaves] = [[] for _ in range(g.size)]
    at = 8 * HEADER_LEN
    for leaf in leaves:
        numel = leaf.numel()
        for r in range(g.size):
            part = torch.frombuffer(h.all_arr, dtype=leaf.dtype, count=numel,
                                    offset=r * frame + at) if numel else \
                torch.empty(leaf.shape, dtype=leaf.dtype)
            out[r].append(part if part.shape == leaf.shape else part.view(leaf.shape))
        at += _padded(numel * leaf.element_size())
    return out


def check_alike(g: Group, leaves: Leaves, paths: Sequence[str], what: str, fix: str,
                root: int = 0, carry: bool = False) -> Optional[List[Leaves]]:
    """Raise :class:`~axolotl_dist.errors.TensorMismatchError` on every rank of ``g`` unless
    every rank passed the same structure, dtypes and shapes.

    One exchange of headers (the description's length and hash, whether the tensors ride,
    and the helper's code, through the value engine's cheapest collective,
    :func:`.exchange.exchange`, on the group's CPU channel: :func:`~..base.groups.channel_of`):
    equal everywhere, done. Else every rank gathers every description (:func:`describe_all`)
    and :func:`check_same` names the difference; a hash that differed over equal descriptions
    (Pythons hashing differently) passes there. ``what`` must be a registered helper
    (``collective(..., exchanges=True)``); a rank in another helper, or with another ``root``
    (a broadcast's source), is :class:`~axolotl_dist.errors.CollectiveMismatchError`, as in
    the value helpers.

    ``carry``: on a CPU group of at most :data:`~.headers.CARRY_MAX_RANKS` ranks, small
    tensors (:data:`CARRIED` dtypes, at most :data:`~.headers.CARRY_BYTES`) ride in the
    same exchange: the result is then every rank's tensors (:func:`carried_parts`: read them
    before the group's next exchange) and the caller needs no other collective; None where
    some rank's did not ride."""
    if g.size <= 1:
        return None
    desc, sizes = _describe(leaves, paths, what)
    ch = channel_of(g)  # g itself on CPU; an accelerator group's metadata never crosses the device
    h = HEADERS.buffers[ch]
    room = 8 * (h.frame - HEADER_LEN)
    # an accelerator group's tensors stay on its device (its channel may be itself)
    nbytes = _carry_bytes(leaves, sizes, room) if carry and room and g.cpu else None
    state = _APART if nbytes is None else _CARRIED
    if state == _CARRIED:
        _write_frame(ch, leaves, sizes)
    a = h.hdr_arr
    a[0], a[1], a[2], a[3] = len(desc), hash(tuple(desc)), state, helper_code(what, root)
    mine = list(a[:HEADER_LEN])
    flat = exchange_headers(ch, what)
    codes = flat[3::HEADER_LEN]
    if codes.count(mine[3]) != g.size:  # another helper met this one
        raise mismatch_error(dict(enumerate(codes)), g.rank, lambda: str(call_site()))
    if (flat[0::HEADER_LEN].count(mine[0]) != g.size
            or flat[1::HEADER_LEN].count(mine[1]) != g.size):
        check_same(describe_all(ch, leaves, paths, what), paths, what, fix)
    if flat[2::HEADER_LEN].count(_CARRIED) == g.size:
        return carried_parts(ch, leaves)
    return None
