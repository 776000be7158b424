"""Exact value helpers: agree on numbers and objects across ranks.

Every helper here moves Python values exactly (docs/design.md, decision 4): ints (int64 in one
pickle-free collective, larger ones through pickle), float64 bit for bit, bools, None, tensors
(dtype, shape and device type kept) and any picklable object. Scalars cost one small
collective; anything else exactly two. If a rank's ``fn`` raises, that rank re-raises its
exception and every other rank raises :class:`~axolotl_dist.errors.RankFailedError` naming it,
instead of hanging.

Each helper is two functions: the public one, whose body is the single-process behaviour (no
process group), and the body on a group (``_on_group``), which the wrapper
(:func:`axolotl_dist._runtime.protocols.helpers.checked`) calls with the group it resolved. The engine is
:mod:`axolotl_dist._runtime.protocols.exchange`.
"""

from __future__ import annotations

import functools
import operator
from typing import TYPE_CHECKING, Any, Callable, List, Optional, TypeVar, Union

import torch

from ._runtime.base.args import as_reduce_op, check_src, check_world_size, not_callable, reduce_name
from ._runtime.protocols.helpers import checked, tensor_signature
from ._runtime.protocols.exchange import all_gather_values, broadcast_value, encode
from ._runtime.base.groups import Group
from .collectives import all_reduce

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = [
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


def _alias(arguments: dict, name: str) -> Any:
    """The rank argument of a helper that also takes axolotl's ``rank=`` for it (debug mode)."""
    return arguments["rank"] if arguments.get("rank") is not None else arguments[name]


def _value_kind(value: Any) -> str:
    """How :func:`all_reduce_value` moves ``value``: which collective, so ranks must agree."""
    return f"tensor {tensor_signature(value)}" if isinstance(value, torch.Tensor) else "number"


# --- broadcasts -----------------------------------------------------------------------------

def _synchronize_value(g: Group, value: Any, device: Any = None, src: int = 0,
                       group: Any = None) -> Any:
    if type(src) is not int or not 0 <= src < g.size:  # check_src then raises
        check_src(src, g.size, group)
    return broadcast_value(g, lambda: value, src, "synchronize_value",
                           torch.device(device) if device is not None else None)


@checked("synchronize_value", lambda a: {"src": a["src"]}, on_group=_synchronize_value,
         confirm_in_wait=True)
def synchronize_value(
    value: T, device: Optional[Union[str, torch.device]] = None, src: int = 0,
    group: Optional["ProcessGroup"] = None,
) -> T:
    """Return group rank ``src``'s ``value`` on every rank (OLMo-core's ``synchronize_value``).

    ``device``: where a tensor result is placed (default: the device type it had on ``src``).
    """
    check_src(src, 1, group)
    return value.to(device) if device is not None and isinstance(value, torch.Tensor) else value  # type: ignore[return-value]


def _synchronize_flag(g: Group, flag: bool, device: Any = None, group: Any = None) -> bool:
    return bool(synchronize_value(bool(flag), device, 0, group))


@checked("synchronize_flag", on_group=_synchronize_flag, confirm_in_wait=True)
def synchronize_flag(flag: bool, device: Optional[Union[str, torch.device]] = None,
                     group: Optional["ProcessGroup"] = None) -> bool:
    """Return rank 0's ``flag`` (as a bool) on every rank."""
    return bool(flag)


def _compute_and_broadcast(g: Group, fn: Callable[[], Any], src: int = 0, group: Any = None, *,
                           rank: Optional[int] = None) -> Any:
    if not callable(fn):
        raise not_callable("compute_and_broadcast", fn)
    if rank is not None:
        src = rank
    if type(src) is not int or not 0 <= src < g.size:  # check_src then raises
        check_src(src, g.size, group)
    return broadcast_value(g, fn, src, "compute_and_broadcast")


@checked("compute_and_broadcast", lambda a: {"src": _alias(a, "src")},
         on_group=_compute_and_broadcast, confirm_in_wait=True)
def compute_and_broadcast(fn: Callable[[], T], src: int = 0, group: Optional["ProcessGroup"] = None,
                          *, rank: Optional[int] = None) -> T:
    """Run ``fn`` on group rank ``src`` only and return its result, exactly, on every rank.

    ``rank=`` is accepted as axolotl's name for ``src``. If ``fn`` raises on ``src``, ``src``
    re-raises it and every other rank raises :class:`RankFailedError` naming ``src``.
    """
    if not callable(fn):
        raise not_callable("compute_and_broadcast", fn)
    check_src(src if rank is None else rank, 1, group)
    return fn()


def _broadcast_object(g: Group, obj: Any, src: int = 0, group: Any = None) -> Any:
    if type(src) is not int or not 0 <= src < g.size:  # check_src then raises
        check_src(src, g.size, group)
    return broadcast_value(g, lambda: obj, src, "broadcast_object")


@checked("broadcast_object", lambda a: {"src": a["src"]}, on_group=_broadcast_object,
         confirm_in_wait=True)
def broadcast_object(obj: T, src: int = 0, group: Optional["ProcessGroup"] = None) -> T:
    """Return group rank ``src``'s ``obj`` on every rank."""
    check_src(src, 1, group)
    return obj


def _broadcast_object_list(g: Group, object_list: List[Any], src: int = 0,
                           group: Any = None) -> List[Any]:
    if not isinstance(object_list, list):
        raise TypeError(f"object_list must be a list, got {type(object_list).__name__}")
    object_list[:] = broadcast_object(list(object_list), src, group)
    return object_list


@checked("broadcast_object_list", lambda a: {"src": a["src"]}, on_group=_broadcast_object_list,
         confirm_in_wait=True)
def broadcast_object_list(object_list: List[Any], src: int = 0,
                          group: Optional["ProcessGroup"] = None) -> List[Any]:
    """Replace ``object_list``'s contents on every rank with ``src``'s, in place; returns it."""
    if not isinstance(object_list, list):
        raise TypeError(f"object_list must be a list, got {type(object_list).__name__}")
    check_src(src, 1, group)
    return object_list


# --- gathers and reductions -----------------------------------------------------------------

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


def _reducible(value: Any) -> None:
    if not isinstance(value, (int, float, torch.Tensor)):
        raise TypeError(
            f"all_reduce_value(value={value!r}) needs an int, float, bool or tensor: use "
            "reduce_and_broadcast(fn1, fn2) to combine other objects")


def _reduce_tensor(value: torch.Tensor, device: Any, name: str, group: Any) -> torch.Tensor:
    """:func:`all_reduce_value` of a tensor: one ``all_reduce`` of a copy."""
    out = value.detach().clone()
    if device is not None:
        out = out.to(device)
    return all_reduce(out, name, group)


def _all_reduce_value(g: Group, value: Any, device: Any = None, op: Any = "SUM",
                      group: Any = None) -> Any:
    name = as_reduce_op(op)
    _reducible(value)
    if isinstance(value, torch.Tensor):
        return _reduce_tensor(value, device, name, group)
    values = all_gather_values(g, lambda: value, "all_reduce_value")
    assert values is not None
    return _PY_REDUCE[name](values)


@checked("all_reduce_value", lambda a: {"op": reduce_name(a["op"]), "value": _value_kind(a["value"])},
         on_group=_all_reduce_value, confirm_in_wait=True)
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
    _reducible(value)
    if isinstance(value, torch.Tensor):
        return _reduce_tensor(value, device, name, group)  # type: ignore[return-value]
    return _PY_REDUCE[name]([value])  # type: ignore[no-any-return]


def _gather_to(g: Group, name: str, fn: Callable[[], Any], world_size: Optional[int], dst: int,
               group: Any) -> Optional[List[Any]]:
    """The body of the gather helpers on a group; ``name`` is the helper named in errors."""
    if not callable(fn):
        raise not_callable(name, fn)
    if world_size is not None and world_size != g.size:
        check_world_size(world_size, g.size, name)
    if type(dst) is not int or not 0 <= dst < g.size:
        check_src(dst, g.size, group, "dst")
    return all_gather_values(g, fn, name, None, dst)


def _gather_locally(name: str, fn: Callable[[], T], world_size: Optional[int], dst: int,
                    group: Any) -> List[T]:
    if not callable(fn):
        raise not_callable(name, fn)
    check_world_size(world_size, 1, name)
    check_src(dst, 1, group, "dst")
    return [fn()]


def _gather_from_all_ranks(g: Group, fn: Callable[[], Any], world_size: Optional[int] = None,
                           dst: int = 0, group: Any = None, *, rank: Optional[int] = None
                           ) -> Optional[List[Any]]:
    return _gather_to(g, "gather_from_all_ranks", fn, world_size, dst if rank is None else rank,
                      group)


@checked("gather_from_all_ranks", lambda a: {"dst": _alias(a, "dst")},
         on_group=_gather_from_all_ranks, confirm_in_wait=True)
def gather_from_all_ranks(
    fn: Callable[[], T], world_size: Optional[int] = None, dst: int = 0,
    group: Optional["ProcessGroup"] = None, *, rank: Optional[int] = None,
) -> Optional[List[T]]:
    """Run ``fn`` on every rank; group rank ``dst`` gets the list of results, others None.

    ``world_size`` is optional and checked: a wrong value raises instead of mis-sizing the list.
    ``rank=`` is accepted as axolotl's name for ``dst``. Single process: ``[fn()]``.
    """
    return _gather_locally("gather_from_all_ranks", fn, world_size, dst if rank is None else rank,
                           group)


def _gather_scalar_from_all_ranks(g: Group, fn: Callable[[], Any],
                                  world_size: Optional[int] = None, dst: int = 0,
                                  group: Any = None, *, rank: Optional[int] = None
                                  ) -> Optional[List[Any]]:
    return _gather_to(g, "gather_scalar_from_all_ranks", fn, world_size,
                      dst if rank is None else rank, group)


@checked("gather_scalar_from_all_ranks", lambda a: {"dst": _alias(a, "dst")},
         on_group=_gather_scalar_from_all_ranks, confirm_in_wait=True)
def gather_scalar_from_all_ranks(
    fn: Callable[[], T], world_size: Optional[int] = None, dst: int = 0,
    group: Optional["ProcessGroup"] = None, *, rank: Optional[int] = None,
) -> Optional[List[T]]:
    """Like :func:`gather_from_all_ranks` (scalars come back exactly, not through float32)."""
    return _gather_locally("gather_scalar_from_all_ranks", fn, world_size,
                           dst if rank is None else rank, group)


def _fn2_callable(fn2: Any) -> None:
    if not callable(fn2):
        raise TypeError(
            f"reduce_and_broadcast(fn2={fn2!r}): fn2 must be a function that combines the list "
            "of every rank's value, e.g. sum, min, max or `lambda values: sum(values) / len(values)`")


def _reduce_and_broadcast(g: Group, fn1: Callable[[], Any], fn2: Callable[[List[Any]], Any],
                          world_size: Optional[int] = None, group: Any = None) -> Any:
    if not callable(fn1):
        raise not_callable("reduce_and_broadcast", fn1, "fn1")
    if not callable(fn2):
        _fn2_callable(fn2)
    if world_size is not None and world_size != g.size:
        check_world_size(world_size, g.size, "reduce_and_broadcast")
    values = all_gather_values(g, fn1, "reduce_and_broadcast")
    assert values is not None
    return fn2(values)


@checked("reduce_and_broadcast", on_group=_reduce_and_broadcast, confirm_in_wait=True)
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
    if not callable(fn1):
        raise not_callable("reduce_and_broadcast", fn1, "fn1")
    _fn2_callable(fn2)
    check_world_size(world_size, 1, "reduce_and_broadcast")
    return fn2([fn1()])


def _all_gather_object(g: Group, obj: Any, group: Any = None) -> List[Any]:
    values = all_gather_values(g, lambda: obj, "all_gather_object")
    assert values is not None
    return values


@checked("all_gather_object", on_group=_all_gather_object, confirm_in_wait=True)
def all_gather_object(obj: T, group: Optional["ProcessGroup"] = None) -> List[T]:
    """Collect ``obj`` from every rank into a list indexed by group rank (exact; scalars unpickled)."""
    encode(obj, "all_gather_object(obj)")  # the error a group would give unpicklable input
    return [obj]
