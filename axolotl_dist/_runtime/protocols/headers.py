"""The value helpers' buffers on each process group: what the header exchange
(:mod:`.exchange`) and the tensor packets (:mod:`.packets`) send and receive through, made at a
group's first exchange and kept in this room (:data:`HEADERS`), not on the group.

docs/design/helpers.md, "Value encoding", says what a header and a frame hold.
"""

from __future__ import annotations

import array
from typing import Any, Dict, Tuple

import torch
import torch.distributed as dist

from ..base.groups import Group
from ..base.state import PerGroup, RoomState, register

__all__ = ["HEADER_LEN", "A2A_MAX_RANKS", "CARRY_BYTES", "CARRY_MAX_RANKS", "HeaderBuffers",
           "HEADERS", "HeadersState"]

#: Slots of a value header (docs/design/helpers.md, "Value encoding").
HEADER_LEN = 4
#: Up to this many ranks, the CPU header exchange is an all-to-all, beyond it gloo's ring
#: all-gather (:mod:`.exchange`; docs/design/helpers.md, "Value encoding").
A2A_MAX_RANKS = 64
#: Bytes of small tensors a CPU group's header frame carries (groups of up to
#: :data:`CARRY_MAX_RANKS` ranks): an all-to-all this long costs gloo no more than one of the
#: bare header (docs/performance.md, "Shape checks").
CARRY_BYTES = 2048
#: The largest group whose frames carry tensors (each exchange moves ranks x frame bytes).
CARRY_MAX_RANKS = 16
_I64 = torch.int64


def _options(cls: Any, async_op: bool) -> Any:
    opts = cls()
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = async_op
    return opts


class HeaderBuffers:
    """The value helpers' header exchange on one group (:mod:`.exchange`).

    A scalar is a 32-byte header, so per-call Python work shows directly in their latency. On
    CPU the header goes through preallocated buffers backed by an ``array`` (a Python store
    into it costs nanoseconds, a fresh tensor microseconds), and through the group's own
    collectives with options built once (what torch's functions call after their checks). The
    class's methods, not bound ones (those would keep the group alive); torch before 2.13 names
    the all-gather ``_allgather_base``.

    Each rank's part of an exchange is a *frame* of ``frame`` int64 words: the header, then,
    on a CPU group of 2 to :data:`CARRY_MAX_RANKS` ranks, :data:`CARRY_BYTES` of room for
    small tensors a checked helper sends with its header (:mod:`.packets`). Every
    exchange on the group sends frames of that one size, whichever helper runs it (gloo aborts
    the process when two ranks' sizes differ), so two helpers that meet still read each
    other's header."""

    __slots__ = ("opts", "allgather", "hdr_arr", "hdr", "all_arr", "hdr_all", "a2a", "a2a_opts",
                 "a2a_arr", "a2a_in", "bcast", "bcast_opts", "frame", "views", "gather_slots")

    def __init__(self, pg: Any, size: int, cpu: bool) -> None:
        cls = type(pg)
        c10d = dist.distributed_c10d
        self.opts = _options(c10d.AllgatherOptions, False)
        self.allgather = (getattr(cls, "all_gather_single", None)
                          or getattr(cls, "_allgather_base", None))
        self.a2a = (getattr(cls, "all_to_all_single", None) or getattr(cls, "alltoall_base", None)
                    if cpu and 1 < size <= A2A_MAX_RANKS else None)
        self.a2a_opts = _options(c10d.AllToAllOptions, True)
        self.bcast = cls.broadcast if cpu else None
        self.bcast_opts = _options(c10d.BroadcastOptions, True)
        self.bcast_opts.rootTensor = 0
        carries = self.a2a is not None and size <= CARRY_MAX_RANKS
        self.frame = words = HEADER_LEN + (CARRY_BYTES // 8 if carries else 0)
        self.hdr_arr = array.array("q", bytes(8 * words))
        self.all_arr = array.array("q", bytes(8 * words * size))
        self.a2a_arr = array.array("q", bytes(8 * words * size))
        self.hdr = torch.frombuffer(self.hdr_arr, dtype=_I64) if cpu else None
        self.hdr_all = torch.frombuffer(self.all_arr, dtype=_I64) if cpu else None
        self.a2a_in = torch.frombuffer(self.a2a_arr, dtype=_I64) if self.a2a is not None else None
        #: carried tensors' views of ``all_arr`` by layout (:func:`.packets.carried_parts`)
        self.views: Dict[Tuple[Any, ...], Any] = {}
        #: helper -> bytes per rank of its last structure gather (:mod:`axolotl_dist.operations`):
        #: its next one sends that many in its first all-gather; the same on every rank
        self.gather_slots: Dict[str, int] = {}


def _make(g: Group) -> HeaderBuffers:
    pg = g.pg_ref()
    return HeaderBuffers(pg, g.size, g.cpu)


class HeadersState(RoomState):
    """``buffers``: each group's :class:`HeaderBuffers` (see the module docstring)."""

    def __init__(self) -> None:
        self.buffers: PerGroup[HeaderBuffers] = PerGroup(_make)


HEADERS = register("headers", HeadersState())
