"""Reduction names: the one list the kit accepts and the one normaliser of them.

Every ``op`` / ``reduce_operation`` argument (the tensor collectives, the value helpers, debug
mode's call records) goes through :func:`as_reduce_op`, so a string (``"sum"``, ``"MAX"``) and a
``torch.distributed.ReduceOp`` name the same reduction everywhere.
"""

from __future__ import annotations

from typing import Any

__all__ = ["REDUCE_OPS", "as_reduce_op", "reduce_name"]

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
