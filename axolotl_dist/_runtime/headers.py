"""The value helpers' header exchange: per-group buffers, one exchange, and the helper's name
in every header so that two different helpers meeting in one exchange are an error.

Every value helper starts by exchanging a 4-slot int64 header per rank (docs/design.md,
"Value encoding"). Slots 0-2 describe the value; slot 3 says which helper sent it
(:func:`helper_code`: the helper, and for the gathers the destination rank). After the
exchange each rank compares the codes it holds, so ``reduce_and_broadcast`` on one rank and
``gather_from_all_ranks`` on another raise :class:`~axolotl_dist.errors.CollectiveMismatchError`
on every rank, naming both, without debug mode and without another collective.

On CPU (gloo) with at most :data:`A2A_MAX_RANKS` ranks the exchange is one all-to-all (each
rank sends its header to every other rank directly: one message per pair and direction, where
gloo's ring all-gather spends several notifications per rank); beyond that many ranks the
all-gather's ``O(ranks)`` messages win, and on accelerators the header goes through the
backend's all-gather. Not point-to-point ``send``/``recv``: a gloo receive whose wait times
out closes every connection of the group ("Application timeout caused pair closure"), so the
kit's sliced, interruptible wait (:mod:`.works`) would kill the group whenever a rank arrives
more than a slice late; a collective's timed-out wait leaves it running.
"""

from __future__ import annotations

import array
import gc
import sys
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from . import works
from .codec import HEADER_LEN
from ..errors import CollectiveMismatchError

__all__ = ["A2A_MAX_RANKS", "HELPERS", "helper_code", "describe_code",
           "HelperCache", "exchange", "broadcast", "mismatch_error", "await_released"]

#: Up to this many ranks, the CPU exchange is an all-to-all.
A2A_MAX_RANKS = 8
#: The helpers that exchange headers, by code (index + 1).
HELPERS = ("gather_from_all_ranks", "gather_scalar_from_all_ranks", "reduce_and_broadcast",
           "all_reduce_value", "all_gather_object", "compute_and_broadcast", "synchronize_value",
           "broadcast_object")
_CODES: Dict[str, int] = {name: i + 1 for i, name in enumerate(HELPERS)}
_GATHERS = ("gather_from_all_ranks", "gather_scalar_from_all_ranks")
_I64 = torch.int64
_AllgatherOptions = dist.distributed_c10d.AllgatherOptions
_AllToAllOptions = dist.distributed_c10d.AllToAllOptions
_BroadcastOptions = dist.distributed_c10d.BroadcastOptions
_NO_SPLITS: List[int] = []  # equal splits
#: The cache's tensors a gloo worker may still hold after a collective's wait returned.
_BUFFERS = ("hdr", "hdr_all", "a2a_in")


def helper_code(name: str, dst: int = 0) -> int:
    """What slot 3 of a header says: the helper, and a gather's destination rank."""
    return _CODES[name] | (dst << 8 if name in _GATHERS else 0)


def describe_code(code: int) -> str:
    """``gather_from_all_ranks(dst=1)`` for a code made by :func:`helper_code`."""
    index = (code & 0xFF) - 1
    if not 0 <= index < len(HELPERS):
        return f"an unknown helper (code {code})"
    name = HELPERS[index]
    return f"{name}(dst={code >> 8})" if name in _GATHERS else name


class HelperCache:
    """What every helper call on one group needs, computed once: ranks, device, buffers.

    The helpers are latency-bound (a scalar is a 32-byte header), so per-call Python work
    shows up directly in their latency. On CPU backends the header goes through preallocated
    buffers backed by an ``array`` (a Python store into it costs nanoseconds, where building a
    fresh tensor costs microseconds). Lives in the group's
    :class:`~.groups.GroupState` and holds only a weak reference to the group; ``env_rank`` /
    ``env_ws`` are the env values it was built under (rebuilt when they change, so an env that
    disagrees with the group still raises). The buffers are reused call after call, so two
    threads must not run helpers on the same group at once.
    """

    __slots__ = ("rank", "ws", "device", "cpu", "env_rank", "env_ws", "pg_ref", "opts",
                 "allgather", "hdr_arr", "hdr", "all_arr", "hdr_all", "a2a", "a2a_opts",
                 "a2a_arr", "a2a_in", "store", "bcast", "bcast_opts", "group_state",
                 "__weakref__")

    def __init__(self, pg: Any, rank: int, ws: int, device: torch.device, env_rank: Any,
                 env_ws: Any) -> None:
        self.rank, self.ws, self.device = rank, ws, device
        self.cpu = device.type == "cpu"
        self.env_rank, self.env_ws = env_rank, env_ws
        self.pg_ref = weakref.ref(pg)
        self.opts = _AllgatherOptions()
        if hasattr(self.opts, "asyncOp"):
            self.opts.asyncOp = False  # as dist.all_gather_single(async_op=False) sets it
        # the class's method, not a bound one (that would keep the group alive); torch before
        # 2.13 names the operation _allgather_base
        cls = type(pg)
        self.allgather = getattr(cls, "all_gather_single", None) or getattr(cls, "_allgather_base")
        self.hdr_arr = array.array("q", bytes(8 * HEADER_LEN))
        self.all_arr = array.array("q", bytes(8 * HEADER_LEN * ws))
        self.hdr = torch.frombuffer(self.hdr_arr, dtype=_I64) if self.cpu else None
        self.hdr_all = torch.frombuffer(self.all_arr, dtype=_I64) if self.cpu else None
        self.store: Any = None  # the group's c10d store, once a block asked for it
        # a weak reference to the group's GroupState, which holds this cache (no cycle)
        self.group_state: Callable[[], Any] = _no_state
        # the all-to-all: this rank's header once per rank in, every rank's header out
        self.a2a = (getattr(cls, "all_to_all_single", None) or getattr(cls, "alltoall_base", None)
                    if self.cpu and 1 < ws <= A2A_MAX_RANKS else None)
        self.a2a_opts = _AllToAllOptions()
        if hasattr(self.a2a_opts, "asyncOp"):
            self.a2a_opts.asyncOp = True
        self.a2a_arr = array.array("q", bytes(8 * HEADER_LEN * ws))
        self.a2a_in = torch.frombuffer(self.a2a_arr, dtype=_I64) if self.a2a is not None else None
        # the group's own broadcast: what dist.broadcast(async_op=True) runs after its checks
        # (its rootRank set per call; int64 and uint8 buffers need none of its conversions)
        self.bcast = cls.broadcast if self.cpu else None
        self.bcast_opts = _BroadcastOptions()
        self.bcast_opts.rootTensor = 0
        if hasattr(self.bcast_opts, "asyncOp"):
            self.bcast_opts.asyncOp = True


def _no_state() -> None:
    return None


def exchange(st: HelperCache, group: Any, what: str) -> List[int]:
    """Every rank's header (this rank's is in ``st.hdr_arr``), flat, in group-rank order. CPU
    only. Raises the backend's ``RuntimeError`` if a peer is gone (or
    :class:`~axolotl_dist.errors.RankFailedError` once one is judged gone, see :mod:`.works`)."""
    pg = st.pg_ref()
    if st.a2a is not None:
        st.a2a_arr[:] = st.hdr_arr * st.ws  # this rank's header for every rank
        works.wait(st.a2a(pg, st.hdr_all, st.a2a_in, _NO_SPLITS, _NO_SPLITS, st.a2a_opts),
                   group, what)
    else:
        # the group's own all_gather_single: what dist.all_gather_single runs after its checks
        works.wait(st.allgather(pg, st.hdr_all, st.hdr, st.opts), group, what)
    return st.all_arr.tolist()


def broadcast(st: HelperCache, buffer: torch.Tensor, src: int, group: Any, what: str) -> None:
    """Broadcast ``buffer`` (an int64 or uint8 tensor on ``st.device``) from group rank
    ``src``, waiting as :func:`.works.wait` does: on CPU through the group's own broadcast,
    on accelerators through ``dist.broadcast``."""
    if st.cpu:
        st.bcast_opts.rootRank = src
        works.wait(st.bcast(st.pg_ref(), [buffer], st.bcast_opts), group, what)
    else:
        works.wait(dist.broadcast(buffer, group=group, group_src=src, async_op=True), group,
                   what, False)


def mismatch_error(codes: Dict[int, int], rank: int, site: Callable[[], str]
                   ) -> CollectiveMismatchError:
    """The error for headers from different helpers: ``codes`` maps group ranks to the code
    each sent (or, for this ``rank``, called); ``site()`` is this rank's call site."""
    calls = {r: describe_code(c) for r, c in sorted(codes.items())}
    listed = ", ".join(f"rank {r}: {c}" for r, c in calls.items())
    return CollectiveMismatchError(
        f"the ranks called different helpers that met in one collective ({listed}): every "
        f"rank must call the same helpers in the same order. This rank (rank {rank}) called "
        f"{calls[rank]} at {site()}; run with AXOLOTL_DIST_DEBUG=1 to see every rank's file "
        "and line.", calls=calls)


#: Seconds after which a buffer still referenced is taken to be held by a reference cycle (a
#: caught exception's frames), not by a gloo worker (which lets go within microseconds).
_COLLECT_AFTER = 0.02


def await_released(caches: Sequence[Optional[HelperCache]], limit: float = 1.0) -> None:
    """Wait (GIL released, at most ``limit`` s) until gloo's worker threads have dropped their
    references to the caches' buffers: a collective's ``wait()`` returns before the worker
    releases it, and releasing needs the GIL (see :func:`.teardown.cleanup`)."""
    def busy(st: HelperCache) -> bool:
        for name in _BUFFERS:  # idle: the cache's slot and getrefcount's argument
            if getattr(st, name) is not None and sys.getrefcount(getattr(st, name)) > 2:
                return True
        return False

    start = time.monotonic()
    collected = False
    for st in caches:
        while st is not None and busy(st) and time.monotonic() < start + limit:
            if not collected and time.monotonic() > start + _COLLECT_AFTER:
                collected = True
                gc.collect()  # not gloo: frames of a dropped traceback, in a reference cycle
                continue
            time.sleep(0.0005)
