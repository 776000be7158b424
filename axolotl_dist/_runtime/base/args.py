"""The helpers' arguments: checks with messages that say what to pass instead, and the one
list of reduction names.

The checks are called only when a fast test in the helper already failed (or on the
single-process path), so the messages cost nothing on the hot path. Every ``op`` /
``reduce_operation`` argument (the tensor collectives, the value helpers, debug mode's call
records) goes through :func:`as_reduce_op`, so a string (``"sum"``, ``"MAX"``) and a
``torch.distributed.ReduceOp`` name the same reduction everywhere.
"""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["check_src", "check_world_size", "not_callable", "REDUCE_OPS", "as_reduce_op",
           "reduce_name"]


def check_src(src: Any, size: int, group: Any, name: str = "src") -> int:
    """Validate a group-relative rank argument of a group of ``size`` ranks; returns it."""
    if not isinstance(src, int) or isinstance(src, bool):
        raise TypeError(f"{name}={src!r} must be an int rank")
    if not 0 <= src < size:
        raise ValueError(
            f"{name}={src} is outside the group of {size} rank(s): pass a rank in [0, {size})"
            + (" (ranks are relative to group=)" if group is not None else ""))
    return src


def check_world_size(world_size: Optional[int], actual: int, fn: str) -> int:
    """Return the real world size ``actual``; raise if a caller-supplied ``world_size``
    disagrees."""
    if world_size is not None and world_size != actual:
        raise ValueError(
            f"{fn}(world_size={world_size}) disagrees with the actual world size {actual}: "
            "drop the world_size argument (it is inferred) or pass the real size")
    return actual


def not_callable(helper: str, fn: Any, argument: str = "fn") -> TypeError:
    """The error for a value passed where a function is expected (raise it)."""
    return TypeError(
        f"{helper}({argument}={fn!r}): {argument} must be a function that returns the value, "
        f"not the value itself: pass a function, e.g. `lambda: {fn!r}`")


#: Reduction names accepted wherever an ``op`` / ``reduce_operation`` is taken (any case).
REDUCE_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG")


def as_reduce_op(op: Any) -> str:
    """Normalise a reduction given as a string (``"sum"``, ``"MAX"``) or a ``ReduceOp``."""
    if isinstance(op, str):
        name = op.upper()
    else:
        name = str(getattr(op, "name", op)).split(".")[-1].upper()
    if name == "PROD":
        name = "PRODUCT"
    if name not in REDUCE_OPS:
        raise ValueError(f"unknown reduction {op!r}: use one of {', '.join(REDUCE_OPS)}")
    return name


def reduce_name(op: Any) -> str:
    """The normalised reduction name, or the repr of an invalid one (never raises)."""
    try:
        return as_reduce_op(op)
    except Exception:  # noqa: BLE001 - the helper itself reports bad ops
        return repr(op)
