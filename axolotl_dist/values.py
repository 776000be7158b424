"""Exact value helpers: agree on numbers and objects across ranks.

Every helper here moves Python values exactly (docs/design.md, decision 4): ints (int64 in one
pickle-free collective, larger ones through pickle), float64 bit for bit, bools, None, tensors
(dtype, shape and device type kept) and any picklable object. Scalars cost one small
collective; anything else exactly two. If a rank's ``fn`` raises, that rank re-raises its
exception and every other rank raises :class:`~axolotl_dist.errors.RankFailedError` naming it,
instead of hanging.
"""

from __future__ import annotations

import functools
import operator
import weakref
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple, TypeVar, Union

import torch

from ._runtime import codec as _codec, headers as _headers, teardown as _teardown
from ._runtime import trace as _trace, works as _works
from ._runtime.callsite import call_site
from . import env as _env
from ._runtime.reduce import reduce_name
from .debug import checked, tensor_signature
from .collectives import (
    all_gather_into,
    raise_lost_peer,
    all_reduce,
    as_reduce_op,
    check_src,
    check_world_size,
    comm_device,
    require_group,
)
from ._runtime.groups import resolve, state_of
from ._runtime.state import STATE as _STATE
from .ranks import get_rank, get_world_size

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = [
    "broadcast_value",
    "all_gather_values",
    "synchronize_value",
    "synchronize_flag",
    "all_reduce_value",
    "compute_and_broadcast",
    "gather_from_all_ranks",
    "gather_scalar_from_all_ranks",
    "reduce_and_broadcast",
    "all_gather_object",
    "broadcast_object",
    "broadcast_object_list",
]

T = TypeVar("T")
R = TypeVar("R")
_I64 = torch.int64
_U8 = torch.uint8
_PICKLE = _codec.PICKLE
_SCALAR_HEADER = _codec.scalar_header
_DECODE_SCALAR = _codec.decode_scalar


def _require_callable(fn: Any, helper: str, argument: str = "fn") -> None:
    """Reject a value passed where a function is expected, before any communication."""
    if not callable(fn):
        raise TypeError(
            f"{helper}({argument}={fn!r}): {argument} must be a function that returns the value, "
            f"not the value itself: pass a function, e.g. `lambda: {fn!r}`")


def _alias(arguments: dict, name: str) -> Any:
    """The rank argument of a helper that also takes axolotl's ``rank=`` for it (debug mode)."""
    return arguments["rank"] if arguments.get("rank") is not None else arguments[name]


def _value_kind(value: Any) -> str:
    """How :func:`all_reduce_value` moves ``value``: which collective, so ranks must agree."""
    return f"tensor {tensor_signature(value)}" if isinstance(value, torch.Tensor) else "number"


def _run(fn: Callable[[], Any], rank: int, where: str
         ) -> Tuple[Sequence[int], Optional[_codec.Encoded], Optional[BaseException]]:
    """Run ``fn`` and encode its result: ``(header, encoded, exception)``.

    ``encoded`` is None for a scalar (its header says everything; no object is built on this
    hot path); otherwise it carries the payload, or the failure report if ``fn`` raised
    ``exception`` (shipped to the other ranks, then re-raised here).
    """
    try:
        value = fn()
        header = _SCALAR_HEADER(value)
        if header is not None:
            return header, None, None
        encoded = _codec.encode(value, f"the value returned by {where}'s fn on rank {rank}")
        return encoded.header, encoded, None
    except Exception as exc:  # noqa: BLE001 - shipped to the other ranks, then re-raised
        encoded = _codec.encode_error(rank, exc, where)
        return encoded.header, encoded, exc


_helper_code, _exchange = _headers.helper_code, _headers.exchange


def _call_site() -> str:
    return str(call_site())


_teardown.on_cleanup(lambda: _headers.await_released(
    [_STATE.helpers, getattr(state_of(None), "helpers", None)]))
_RANK_RAW, _WS_RAW = _env.rank_raw, _env.world_size_raw  # the raw env values (identity-stable)
_HelperCache = _headers.HelperCache


def _new_cache(group: Optional["ProcessGroup"], pg: Any, env_rank: Any, env_ws: Any) -> _HelperCache:
    get_rank(), get_world_size()  # the env must agree with the world group (raises: no group)
    _teardown.start_services()  # first use of a group: exit hook, peer record, heartbeat
    return _HelperCache(pg, get_rank(group), get_world_size(group), comm_device(group),
                        env_rank, env_ws)


def group_cache(group: Optional["ProcessGroup"]) -> _HelperCache:
    """What the kit caches about ``group`` (default group if None) for its helpers and blocks:
    this rank, the size, the comm device, buffers (:class:`~axolotl_dist._runtime.headers.HelperCache`).
    Built on first use (which also starts the kit's services for the group) and again when
    ``RANK``/``WORLD_SIZE`` change; needs a group."""
    pg = resolve(group)
    st = _STATE.helpers  # the cache used last: most programs use one group
    if (st is not None and st.pg_ref() is pg and st.env_rank is _RANK_RAW()
            and st.env_ws is _WS_RAW() and pg is not None):
        return st
    env_rank, env_ws = _RANK_RAW(), _WS_RAW()
    state = state_of(group)
    if pg is None or state is None:
        return _new_cache(group, pg, env_rank, env_ws)  # raises: no group
    st = state.helpers
    if st is None or st.env_rank is not env_rank or st.env_ws is not env_ws:
        st = state.helpers = _new_cache(group, pg, env_rank, env_ws)
        st.group_state = weakref.ref(state)
    _STATE.helpers = st
    return st


def _check_src(src: Any, state: _HelperCache, group: Optional["ProcessGroup"], name: str) -> None:
    if type(src) is not int or not 0 <= src < state.ws:
        check_src(src, group, name)  # raises with the full message


def _check_ws(world_size: Optional[int], state: _HelperCache, group: Optional["ProcessGroup"],
              fn: str) -> None:
    if world_size is not None and world_size != state.ws:
        check_world_size(world_size, group, fn)  # raises with the full message


def broadcast_value(
    fn: Callable[[], T], src: int, group: Optional["ProcessGroup"], where: str,
    device: Optional[torch.device] = None, state: Optional[_HelperCache] = None,
) -> T:
    """Run ``fn`` on group rank ``src`` only and return its result on every rank.

    ``where`` is the public helper's name: its code rides in the header's slot 3, and a rank
    that receives another helper's header raises :class:`CollectiveMismatchError`."""
    st = state if state is not None else group_cache(group)
    cdev = st.device
    code = _helper_code(where)
    mine: Optional[Sequence[int]] = None  # the header, on src only
    own: Optional[BaseException] = None
    encoded: Optional[_codec.Encoded] = None
    if st.rank == src:
        mine, encoded, own = _run(fn, st.rank, where)
    if st.cpu:
        header = st.hdr
        if mine is not None:
            a = st.hdr_arr
            a[0], a[1], a[2] = mine[0], mine[1], mine[2]
            a[3] = code
    elif mine is not None:
        header = torch.tensor([mine[0], mine[1], mine[2], code], dtype=_I64, device=cdev)
    else:
        header = torch.empty(_codec.HEADER_LEN, dtype=_I64, device=cdev)
    try:
        _headers.broadcast(st, header, src, group, where)
    except RuntimeError as exc:  # a peer is gone: name it (see diagnose_lost_peer)
        raise_lost_peer(exc, where, group)
    values = header.tolist()
    if values[3] != code:  # src ran another helper
        del header  # the cached buffer: the traceback keeps this frame
        raise _headers.mismatch_error({src: values[3], st.rank: code}, st.rank, _call_site)
    payload = None
    try:
        if values[0] >= _codec.PICKLE:
            if encoded is not None:
                payload = encoded.payload.to(cdev)
            else:
                payload = torch.empty(_codec.payload_len(values), dtype=_U8, device=cdev)
            _headers.broadcast(st, payload, src, group, where)
    except RuntimeError as exc:  # a peer is gone: name it (see diagnose_lost_peer)
        raise_lost_peer(exc, where, group)
    if own is not None:
        del header  # the cached buffer: the traceback keeps this frame (see _await_released)
        raise own
    if _STATE.trace is not None and st.rank == src:
        _trace.add_bytes(_codec.HEADER_LEN * 8 + (payload.numel() if payload is not None else 0))
    return _codec.decode(values, payload, device)


def all_gather_values(
    fn: Callable[[], Any], group: Optional["ProcessGroup"], where: str,
    device: Optional[torch.device] = None, decode_on: Optional[int] = None,
    state: Optional[_HelperCache] = None,
) -> Optional[List[Any]]:
    """Run ``fn`` on every rank and all-gather the results (exactly).

    Failures anywhere raise on every rank. With ``decode_on`` only that group rank decodes the
    values (others return None after the same collectives).

    This is the latency-critical path of the gather/reduce helpers: when every rank's value is
    a scalar (the usual case) it is one header all-gather, one ``tolist`` and a decode of the
    value slots, with no per-call tensor or list building beyond that.
    """
    st = state if state is not None else group_cache(group)
    code = _helper_code(where, decode_on or 0)
    header, encoded, own = _run(fn, st.rank, where)
    if _STATE.trace is not None:
        _trace.add_bytes(_codec.HEADER_LEN * 8 + (
            encoded.payload.numel() if encoded is not None and encoded.payload is not None else 0))
    try:
        if st.cpu:
            a = st.hdr_arr
            a[0], a[1], a[2] = header[0], header[1], header[2]
            a[3] = code
            flat = _exchange(st, group, where)
        else:
            headers_t = torch.empty(st.ws * _codec.HEADER_LEN, dtype=_I64, device=st.device)
            mine = torch.tensor([header[0], header[1], header[2], code], dtype=_I64,
                                device=st.device)
            all_gather_into(headers_t, mine, group=group)
            flat = headers_t.tolist()
    except RuntimeError as exc:  # a peer is gone: name it (see diagnose_lost_peer)
        raise_lost_peer(exc, where, group)
    if flat[3::_codec.HEADER_LEN].count(code) != st.ws:  # another helper met this one
        raise _headers.mismatch_error(dict(enumerate(flat[3::_codec.HEADER_LEN])), st.rank,
                                      _call_site)
    kinds = flat[0::_codec.HEADER_LEN]
    if max(kinds) < _PICKLE:  # every rank sent a scalar: no payload, nothing failed
        if decode_on is not None and st.rank != decode_on:
            return None
        return [_DECODE_SCALAR(k, v) for k, v in zip(kinds, flat[1::_codec.HEADER_LEN])]
    return _gather_payloads(flat, encoded, own, st, group, device, decode_on, where)


def _gather_payloads(flat: List[int], encoded: Optional[_codec.Encoded], own: Optional[BaseException],
                     st: _HelperCache, group: Optional["ProcessGroup"],
                     device: Optional[torch.device], decode_on: Optional[int],
                     where: str) -> Optional[List[Any]]:
    """Second round of :func:`all_gather_values`: some rank sent a payload or an error report."""
    n, ws, cdev = _codec.HEADER_LEN, st.ws, st.device
    headers = [flat[i:i + n] for i in range(0, ws * n, n)]
    stride = max(_codec.payload_len(h) for h in headers)
    mine = torch.zeros(stride, dtype=_U8, device=cdev)
    if encoded is not None and encoded.payload is not None:
        mine[: encoded.payload.numel()] = encoded.payload.to(cdev)
    flat_payload = torch.empty(ws * stride, dtype=_U8, device=cdev)
    try:
        _works.wait(all_gather_into(flat_payload, mine, group=group, async_op=True), group,
                    where, st.cpu)
    except RuntimeError as exc:  # a peer is gone: name it (see diagnose_lost_peer)
        raise_lost_peer(exc, where, group)
    payloads = _codec.split_payloads(headers, flat_payload, stride)
    failed = _codec.first_error(headers)
    if failed is not None:
        if own is not None:
            raise own
        _codec.decode(headers[failed], payloads[failed])  # raises RankFailedError
    if decode_on is not None and st.rank != decode_on:
        return None
    return [_codec.decode(h, p, device) for h, p in zip(headers, payloads)]


@checked("synchronize_value", lambda a: {"src": a["src"]}, confirm_in_wait=True)
def synchronize_value(
    value: T, device: Optional[Union[str, torch.device]] = None, src: int = 0,
    group: Optional["ProcessGroup"] = None,
) -> T:
    """Return group rank ``src``'s ``value`` on every rank (OLMo-core's ``synchronize_value``).

    ``device``: where a tensor result is placed (default: the device type it had on ``src``).
    """
    if not require_group("synchronize_value", group):
        check_src(src, group)
        return value.to(device) if device is not None and isinstance(value, torch.Tensor) else value
    st = group_cache(group)
    _check_src(src, st, group, "src")
    return broadcast_value(lambda: value, src, group, "synchronize_value",
                           torch.device(device) if device is not None else None, st)


@checked("synchronize_flag", confirm_in_wait=True)
def synchronize_flag(flag: bool, device: Optional[Union[str, torch.device]] = None,
                     group: Optional["ProcessGroup"] = None) -> bool:
    """Return rank 0's ``flag`` (as a bool) on every rank."""
    require_group("synchronize_flag", group)  # so an error names this function
    return synchronize_value(bool(flag), device, 0, group)


_PY_REDUCE = {
    "SUM": lambda xs: functools.reduce(operator.add, xs),
    "PRODUCT": lambda xs: functools.reduce(operator.mul, xs),
    "MIN": min,
    "MAX": max,
    "BAND": lambda xs: functools.reduce(operator.and_, xs),
    "BOR": lambda xs: functools.reduce(operator.or_, xs),
    "BXOR": lambda xs: functools.reduce(operator.xor, xs),
    "AVG": lambda xs: functools.reduce(operator.add, xs) / len(xs),
}


@checked("all_reduce_value", lambda a: {"op": reduce_name(a["op"]), "value": _value_kind(a["value"])},
         confirm_in_wait=True)
def all_reduce_value(
    value: T, device: Optional[Union[str, torch.device]] = None, op: Union[str, Any] = "SUM",
    group: Optional["ProcessGroup"] = None,
) -> T:
    """Reduce ``value`` across ranks and return the result on every rank.

    Tensors go through one ``all_reduce`` (a copy; the input is untouched). Python numbers are
    all-gathered in one pickle-free collective and reduced in rank order in Python, so ints
    never overflow and every rank gets the bit-identical result.
    """
    name = as_reduce_op(op)
    if isinstance(value, torch.Tensor):
        require_group("all_reduce_value", group)  # so an error names this function
        out = value.detach().clone()
        if device is not None:
            out = out.to(device)
        return all_reduce(out, name, group)  # type: ignore[return-value]
    if not isinstance(value, (int, float)):
        raise TypeError(
            f"all_reduce_value(value={value!r}) needs an int, float, bool or tensor: use "
            "reduce_and_broadcast(fn1, fn2) to combine other objects"
        )
    if not require_group("all_reduce_value", group):
        return _PY_REDUCE[name]([value])
    values = all_gather_values(lambda: value, group, "all_reduce_value")
    assert values is not None
    return _PY_REDUCE[name](values)


@checked("compute_and_broadcast", lambda a: {"src": _alias(a, "src")}, confirm_in_wait=True)
def compute_and_broadcast(fn: Callable[[], T], src: int = 0, group: Optional["ProcessGroup"] = None,
                          *, rank: Optional[int] = None) -> T:
    """Run ``fn`` on group rank ``src`` only and return its result, exactly, on every rank.

    ``rank=`` is accepted as axolotl's name for ``src``. If ``fn`` raises on ``src``, ``src``
    re-raises it and every other rank raises :class:`RankFailedError` naming ``src``.
    """
    _require_callable(fn, "compute_and_broadcast")
    if rank is not None:
        src = rank
    if not require_group("compute_and_broadcast", group):
        check_src(src, group)
        return fn()
    st = group_cache(group)
    _check_src(src, st, group, "src")
    return broadcast_value(fn, src, group, "compute_and_broadcast", state=st)


def _gather_to(name: str, fn: Callable[[], T], world_size: Optional[int], dst: int,
               group: Optional["ProcessGroup"]) -> Optional[List[T]]:
    """Shared body of the gather helpers; ``name`` is the helper named in errors."""
    _require_callable(fn, name)
    if resolve(None) is None and not require_group(name, group):
        check_world_size(world_size, group, name)
        check_src(dst, group, "dst")
        return [fn()]
    st = group_cache(group)
    _check_ws(world_size, st, group, name)
    _check_src(dst, st, group, "dst")
    return all_gather_values(fn, group, name, None, dst, st)


@checked("gather_from_all_ranks", lambda a: {"dst": _alias(a, "dst")}, confirm_in_wait=True)
def gather_from_all_ranks(
    fn: Callable[[], T], world_size: Optional[int] = None, dst: int = 0,
    group: Optional["ProcessGroup"] = None, *, rank: Optional[int] = None,
) -> Optional[List[T]]:
    """Run ``fn`` on every rank; group rank ``dst`` gets the list of results, others None.

    ``world_size`` is optional and checked: a wrong value raises instead of mis-sizing the list.
    ``rank=`` is accepted as axolotl's name for ``dst``. Single process: ``[fn()]``.
    """
    return _gather_to("gather_from_all_ranks", fn, world_size, dst if rank is None else rank, group)


@checked("gather_scalar_from_all_ranks", lambda a: {"dst": _alias(a, "dst")}, confirm_in_wait=True)
def gather_scalar_from_all_ranks(
    fn: Callable[[], T], world_size: Optional[int] = None, dst: int = 0,
    group: Optional["ProcessGroup"] = None, *, rank: Optional[int] = None,
) -> Optional[List[T]]:
    """Like :func:`gather_from_all_ranks` (scalars come back exactly, not through float32)."""
    return _gather_to("gather_scalar_from_all_ranks", fn, world_size,
                      dst if rank is None else rank, group)


@checked("reduce_and_broadcast", confirm_in_wait=True)
def reduce_and_broadcast(
    fn1: Callable[[], Any], fn2: Callable[[List[Any]], R], world_size: Optional[int] = None,
    group: Optional["ProcessGroup"] = None,
) -> R:
    """Run ``fn1`` on every rank, reduce the list with ``fn2``, return the result everywhere.

    One collective (an all-gather), not a gather + barrier + broadcast: every rank
    applies ``fn2`` to the same list, so ``fn2`` must be deterministic (``sum``, ``min``,
    ``max``...). The result has ``fn2``'s return type (``fn2``'s argument is typed
    ``List[Any]`` so that overloaded builtins like ``sum`` and ``min`` type-check).
    """
    _require_callable(fn1, "reduce_and_broadcast", "fn1")
    if not callable(fn2):
        raise TypeError(
            f"reduce_and_broadcast(fn2={fn2!r}): fn2 must be a function that combines the list "
            "of every rank's value, e.g. sum, min, max or `lambda values: sum(values) / len(values)`")
    if not require_group("reduce_and_broadcast", group):
        check_world_size(world_size, group, "reduce_and_broadcast")
        return fn2([fn1()])
    st = group_cache(group)
    _check_ws(world_size, st, group, "reduce_and_broadcast")
    values = all_gather_values(fn1, group, "reduce_and_broadcast", state=st)
    assert values is not None
    return fn2(values)


@checked("all_gather_object", confirm_in_wait=True)
def all_gather_object(obj: T, group: Optional["ProcessGroup"] = None) -> List[T]:
    """Collect ``obj`` from every rank into a list indexed by group rank (exact; scalars unpickled)."""
    if not require_group("all_gather_object", group):
        _codec.encode(obj, "all_gather_object(obj)")  # same error for unpicklable input
        return [obj]
    values = all_gather_values(lambda: obj, group, "all_gather_object")
    assert values is not None
    return values


@checked("broadcast_object", lambda a: {"src": a["src"]}, confirm_in_wait=True)
def broadcast_object(obj: T, src: int = 0, group: Optional["ProcessGroup"] = None) -> T:
    """Return group rank ``src``'s ``obj`` on every rank."""
    if not require_group("broadcast_object", group):
        check_src(src, group)
        return obj
    st = group_cache(group)
    _check_src(src, st, group, "src")
    return broadcast_value(lambda: obj, src, group, "broadcast_object", state=st)


@checked("broadcast_object_list", lambda a: {"src": a["src"]}, confirm_in_wait=True)
def broadcast_object_list(object_list: List[Any], src: int = 0,
                          group: Optional["ProcessGroup"] = None) -> List[Any]:
    """Replace ``object_list``'s contents on every rank with ``src``'s, in place; returns it."""
    if not isinstance(object_list, list):
        raise TypeError(f"object_list must be a list, got {type(object_list).__name__}")
    require_group("broadcast_object_list", group)  # so an error names this function
    received = broadcast_object(list(object_list), src, group)
    object_list[:] = received
    return object_list

