"""Exact value helpers: agree on numbers and objects across ranks.

Every helper here moves Python values exactly (docs/design/decisions.md, decision 4): ints (int64 in one
pickle-free collective, larger ones through pickle), float64 bit for bit, bools, None, tensors
(dtype, shape and device type kept) and any picklable object. Scalars cost one small
collective; anything else exactly two. If a rank's ``fn`` raises, that rank re-raises its
exception and every other rank raises :class:`~axolotl_dist.errors.RankFailedError` naming it,
instead of hanging.

Each helper is one function: the decorator (:func:`axolotl_dist._runtime.protocols.helpers.collective`)
resolves the call's group and passes it first (None for one process without a process group,
which the engine, :mod:`axolotl_dist._runtime.protocols.exchange`, serves locally); the public
function has the signature below without it.
"""

from __future__ import annotations

import functools
import operator
from typing import TYPE_CHECKING, Any, Callable, List, Optional, TypeVar, Union

import torch

from ._runtime.base.args import (as_reduce_op, check_src, check_world_size, not_callable,
                                 reduce_name)
from ._runtime.base.groups import Group
from ._runtime.protocols.encoding import encode
from ._runtime.protocols.exchange import all_gather_values, broadcast_value
from ._runtime.protocols.helpers import collective, tensor_signature
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


def _size(g: Optional[Group]) -> int:
    return 1 if g is None else g.size


# --- broadcasts -----------------------------------------------------------------------------

@collective("synchronize_value", lambda a: {"src": a["src"]}, exchanges=True, src="src",
            root="src")
def synchronize_value(
    g: Optional[Group], value: T, device: Optional[Union[str, torch.device]] = None,
    src: int = 0, group: Optional["ProcessGroup"] = None,
) -> T:
    """Return group rank ``src``'s ``value`` on every rank (OLMo-core's ``synchronize_value``).

    ``device``: where a tensor result is placed (default: the device type it had on ``src``).
    """
    if type(src) is not int or not 0 <= src < (1 if g is None else g.size):
        check_src(src, _size(g), group)
    return broadcast_value(g, lambda: value, src, "synchronize_value",  # type: ignore[no-any-return]
                           torch.device(device) if device is not None else None)


@collective("synchronize_flag", src=0)
def synchronize_flag(g: Optional[Group], flag: bool,
                     device: Optional[Union[str, torch.device]] = None,
                     group: Optional["ProcessGroup"] = None) -> bool:
    """Return rank 0's ``flag`` (as a bool) on every rank."""
    if g is None:
        return bool(flag)
    return bool(synchronize_value(bool(flag), device, 0, group))


@collective("compute_and_broadcast", lambda a: {"src": _alias(a, "src")}, exchanges=True,
            src="src", root="src")
def compute_and_broadcast(g: Optional[Group], fn: Callable[[], T], src: int = 0,
                          group: Optional["ProcessGroup"] = None, *,
                          rank: Optional[int] = None) -> T:
    """Run ``fn`` on group rank ``src`` only and return its result, exactly, on every rank.

    ``rank=`` is accepted as axolotl's name for ``src``. If ``fn`` raises on ``src``, ``src``
    re-raises it and every other rank raises :class:`RankFailedError` naming ``src``.
    """
    if not callable(fn):
        raise not_callable("compute_and_broadcast", fn)
    if rank is not None:
        src = rank
    if type(src) is not int or not 0 <= src < (1 if g is None else g.size):
        check_src(src, _size(g), group)
    return broadcast_value(g, fn, src, "compute_and_broadcast")  # type: ignore[no-any-return]


@collective("broadcast_object", lambda a: {"src": a["src"]}, exchanges=True, src="src",
            root="src")
def broadcast_object(g: Optional[Group], obj: T, src: int = 0,
                     group: Optional["ProcessGroup"] = None) -> T:
    """Return group rank ``src``'s ``obj`` on every rank."""
    if type(src) is not int or not 0 <= src < (1 if g is None else g.size):
        check_src(src, _size(g), group)
    return broadcast_value(g, lambda: obj, src, "broadcast_object")  # type: ignore[no-any-return]


@collective("broadcast_object_list", lambda a: {"src": a["src"]}, src="src")
def broadcast_object_list(g: Optional[Group], object_list: List[Any], src: int = 0,
                          group: Optional["ProcessGroup"] = None) -> List[Any]:
    """Replace ``object_list``'s contents on every rank with ``src``'s, in place; returns it."""
    if not isinstance(object_list, list):
        raise TypeError(f"object_list must be a list, got {type(object_list).__name__}")
    if g is None:
        check_src(src, 1, group)
        return object_list
    object_list[:] = broadcast_object(list(object_list), src, group)
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


@collective("all_reduce_value", lambda a: {"op": reduce_name(a["op"]),
                                           "value": _value_kind(a["value"])}, exchanges=True)
def all_reduce_value(
    g: Optional[Group], value: T, device: Optional[Union[str, torch.device]] = None,
    op: Union[str, Any] = "SUM", group: Optional["ProcessGroup"] = None,
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
    values = all_gather_values(g, lambda: value, "all_reduce_value")
    assert values is not None
    return _PY_REDUCE[name](values)  # type: ignore[no-any-return]


def _gather(g: Optional[Group], name: str, fn: Callable[[], Any], world_size: Optional[int],
            dst: int, group: Any) -> Optional[List[Any]]:
    """The body of the gather helpers; ``name`` is the helper named in errors."""
    if not callable(fn):
        raise not_callable(name, fn)
    size = 1 if g is None else g.size
    if world_size is not None and world_size != size:
        check_world_size(world_size, size, name)
    if type(dst) is not int or not 0 <= dst < size:
        check_src(dst, size, group, "dst")
    return all_gather_values(g, fn, name, None, dst)


@collective("gather_from_all_ranks", lambda a: {"dst": _alias(a, "dst")}, exchanges=True,
            root="dst")
def gather_from_all_ranks(
    g: Optional[Group], fn: Callable[[], T], world_size: Optional[int] = None, dst: int = 0,
    group: Optional["ProcessGroup"] = None, *, rank: Optional[int] = None,
) -> Optional[List[T]]:
    """Run ``fn`` on every rank; group rank ``dst`` gets the list of results, others None.

    ``world_size`` is optional and checked: a wrong value raises instead of mis-sizing the list.
    ``rank=`` is accepted as axolotl's name for ``dst``. Single process: ``[fn()]``.
    """
    return _gather(g, "gather_from_all_ranks", fn, world_size, dst if rank is None else rank,
                   group)


@collective("gather_scalar_from_all_ranks", lambda a: {"dst": _alias(a, "dst")},
            exchanges=True, root="dst")
def gather_scalar_from_all_ranks(
    g: Optional[Group], fn: Callable[[], T], world_size: Optional[int] = None, dst: int = 0,
    group: Optional["ProcessGroup"] = None, *, rank: Optional[int] = None,
) -> Optional[List[T]]:
    """Like :func:`gather_from_all_ranks` (scalars come back exactly, not through float32)."""
    return _gather(g, "gather_scalar_from_all_ranks", fn, world_size,
                   dst if rank is None else rank, group)


def _fn2_callable(fn2: Any) -> None:
    if not callable(fn2):
        raise TypeError(
            f"reduce_and_broadcast(fn2={fn2!r}): fn2 must be a function that combines the list "
            "of every rank's value, e.g. sum, min, max or `lambda values: sum(values) / len(values)`")


@collective("reduce_and_broadcast", exchanges=True)
def reduce_and_broadcast(
    g: Optional[Group], fn1: Callable[[], Any], fn2: Callable[[List[Any]], R],
    world_size: Optional[int] = None, group: Optional["ProcessGroup"] = None,
) -> R:
    """Run ``fn1`` on every rank, reduce the list with ``fn2``, return the result everywhere.

    One collective (an all-gather), not a gather + barrier + broadcast: every rank
    applies ``fn2`` to the same list, so ``fn2`` must be deterministic (``sum``, ``min``,
    ``max``...). The result has ``fn2``'s return type (``fn2``'s argument is typed
    ``List[Any]`` so that overloaded builtins like ``sum`` and ``min`` type-check).
    """
    if not callable(fn1):
        raise not_callable("reduce_and_broadcast", fn1, "fn1")
    if not callable(fn2):
        _fn2_callable(fn2)
    size = 1 if g is None else g.size
    if world_size is not None and world_size != size:
        check_world_size(world_size, size, "reduce_and_broadcast")
    values = all_gather_values(g, fn1, "reduce_and_broadcast")
    assert values is not None
    return fn2(values)


@collective("all_gather_object", exchanges=True)
def all_gather_object(g: Optional[Group], obj: T,
                      group: Optional["ProcessGroup"] = None) -> List[T]:
    """Collect ``obj`` from every rank into a list indexed by group rank (exact; scalars unpickled)."""
    if g is None:
        encode(obj, "all_gather_object(obj)")  # the error a group would give unpicklable input
    values = all_gather_values(g, lambda: obj, "all_gather_object")
    assert values is not None
    return values
