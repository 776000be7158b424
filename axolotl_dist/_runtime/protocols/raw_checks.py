"""Debug mode's check of torch's own collectives called from Python: ``dist.all_reduce`` and
its kind, checked like the kit's helpers.

While debug mode is on (:mod:`axolotl_dist.debug`), the collectives of ``torch.distributed``
named in :data:`CHECKED` are replaced on that module by wrappers that first run debug mode's
check (:func:`.helpers.call_checked`: every rank of the group at the same call number, with
the same op and the arguments that must agree) and then torch's own function, unchanged. A
``broadcast`` where the others ``all_reduce``, or an ``all_reduce`` of another shape, raises
:class:`~axolotl_dist.errors.CollectiveMismatchError` on every rank before torch issues
anything; torch's functions called inside a kit helper or inside another checked call
(``all_gather_object``'s ``all_gather``) are not checked again. Collectives torch issues from
C++ (DDP's bucket all-reduce) pass no wrapper: a check waiting for a rank stuck in one finds
it through the flight recorder instead (:mod:`.unchecked`).

Turned off, the wrappers are taken out again, so ``torch.distributed``'s functions are torch's
own (``torch.compile`` recognises them by identity). Names imported before debug mode came on
(``from torch.distributed import all_reduce``) keep torch's function and are not checked.
"""

from __future__ import annotations

import functools
import inspect
import sys
from types import MappingProxyType
from typing import Any, Callable, Dict, Mapping

import torch.distributed as dist

from ..base.callsite import PACKAGE_DIR
from .helpers import call_checked, tensor_signature
from .protocols_state import CALLS, DEBUG

__all__ = ["CHECKED", "sync"]

Describe = Callable[[Dict[str, Any]], Dict[str, Any]]


def _op(arguments: Dict[str, Any]) -> str:
    """The reduction as a word (``SUM``), whatever torch's enum prints."""
    op = arguments.get("op")
    return str(getattr(op, "name", op)).rsplit(".", 1)[-1]


def _root(arguments: Dict[str, Any], name: str) -> str:
    """``src``/``dst``: the global rank, or ``group_src=1`` where the call gave a group rank."""
    value = arguments.get(name)
    group_value = arguments.get(f"group_{name}")
    return str(value) if group_value is None else f"group_{name}={group_value}"


def _dtype(value: Any) -> str:
    return str(getattr(value, "dtype", type(value).__name__)).replace("torch.", "")


#: Each checked collective -> what must agree across ranks, from its bound arguments.
CHECKED: Mapping[str, Describe] = MappingProxyType({
    "all_reduce": lambda a: {"tensor": tensor_signature(a["tensor"]), "op": _op(a)},
    "broadcast": lambda a: {"tensor": tensor_signature(a["tensor"]), "src": _root(a, "src")},
    "reduce": lambda a: {"tensor": tensor_signature(a["tensor"]), "dst": _root(a, "dst"),
                         "op": _op(a)},
    "all_gather": lambda a: {"tensor": tensor_signature(a["tensor"])},
    "all_gather_into_tensor": lambda a: {"input_tensor": tensor_signature(a["input_tensor"])},
    "reduce_scatter": lambda a: {"output": tensor_signature(a["output"]), "op": _op(a)},
    "reduce_scatter_tensor": lambda a: {"input": tensor_signature(a["input"]), "op": _op(a)},
    "all_to_all": lambda a: {"tensors": len(a["input_tensor_list"])},
    "all_to_all_single": lambda a: {"dtype": _dtype(a["input"])},
    "gather": lambda a: {"tensor": tensor_signature(a["tensor"]), "dst": _root(a, "dst")},
    "scatter": lambda a: {"tensor": tensor_signature(a["tensor"]), "src": _root(a, "src")},
    "barrier": lambda a: {},
    "monitored_barrier": lambda a: {},
    "all_gather_object": lambda a: {},
    "broadcast_object_list": lambda a: {"src": _root(a, "src"), "objects": len(a["object_list"])},
    "gather_object": lambda a: {"dst": _root(a, "dst")},
    "scatter_object_list": lambda a: {"src": _root(a, "src")},
})


def _wrap(name: str, fn: Callable[..., Any], describe: Describe) -> Callable[..., Any]:
    """``fn`` behind debug mode's check (see the module docstring)."""
    signature = inspect.signature(fn)
    public = f"torch.distributed.{name}"
    inside, debug = CALLS.inside, DEBUG

    def agree(arguments: Dict[str, Any]) -> Dict[str, Any]:
        try:
            return describe(arguments)
        except Exception:  # noqa: BLE001 - a torch whose parameters differ: the op name alone
            return {}

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if (not debug.on or inside.helper or not dist.is_initialized()
                or sys._getframe(1).f_code.co_filename.startswith(PACKAGE_DIR)):
            return fn(*args, **kwargs)  # off, or the kit's own call (it checks its own)
        return call_checked(fn, signature, public, agree, "group", None, args, kwargs)

    functools.update_wrapper(wrapper, fn)
    wrapper.__axolotl_dist_checks__ = fn  # type: ignore[attr-defined]
    return wrapper


def sync() -> None:
    """Put the wrappers on ``torch.distributed`` while debug mode is on, take them off while it
    is off (idempotent)."""
    for name, describe in CHECKED.items():
        current = getattr(dist, name, None)
        if current is None:
            continue  # not in this torch
        original = getattr(current, "__axolotl_dist_checks__", None)
        if DEBUG.on and original is None:
            setattr(dist, name, _wrap(name, current, describe))
        elif not DEBUG.on and original is not None:
            setattr(dist, name, original)
