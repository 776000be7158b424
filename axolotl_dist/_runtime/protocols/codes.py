"""The helpers' codes in slot 3 of a value header (:mod:`.exchange`): which helper sent it.

Each helper that runs the value engine registers here where it is decorated
(:func:`.helpers.collective`), in import order: the same codes on every rank. A code is the
helper's number in its low 8 bits and, for a helper with a root (the gathers' destination, the
broadcasts' source), that rank above them: ranks that disagree on it meet a mismatch, not a
hang.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

from ...errors import CollectiveMismatchError

__all__ = ["HELPERS", "CODES", "ROOTED", "register_helper", "helper_code", "describe_code",
           "mismatch_error"]

#: The helpers that exchange headers, by code (index + 1), in the order they registered
#: (:func:`register_helper`, where each is decorated: the same order on every rank).
HELPERS: List[str] = []
CODES: Dict[str, int] = {}
#: The helpers whose code carries a root rank, with that argument's name (``"src"``, ``"dst"``).
ROOTED: Dict[str, str] = {}


def register_helper(name: str, root: Optional[str] = None) -> int:
    """Give helper ``name`` its header code (``root``: the name of the argument whose rank the
    code carries); the same name keeps its code. Codes fit the slot's low 8 bits."""
    if name not in CODES:
        if len(HELPERS) >= 0xFF:
            raise ValueError(f"register_helper({name!r}): no header code left (255 in use)")
        HELPERS.append(name)
        CODES[name] = len(HELPERS)
    if root is not None:
        ROOTED[name] = root
    return CODES[name]


def helper_code(name: str, root: int = 0) -> int:
    """What slot 3 of a header says: the helper, and its root rank if it has one."""
    return CODES[name] | (root << 8 if name in ROOTED else 0)


def describe_code(code: int) -> str:
    """``gather_from_all_ranks(dst=1)`` for a code made by :func:`helper_code`."""
    index = (code & 0xFF) - 1
    if not 0 <= index < len(HELPERS):
        return f"an unknown helper (code {code})"
    name = HELPERS[index]
    return f"{name}({ROOTED[name]}={code >> 8})" if name in ROOTED else name


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
