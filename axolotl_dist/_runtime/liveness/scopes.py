"""Calls the other ranks cannot join: a deadlock the kit can see is an error, not a wait.

Inside the body of a ``zero_first`` block that this rank runs first (the default: group rank 0
only), the other ranks of the group wait for the block to end; inside ``with zero_only():`` or
a ``@zero_only`` function on the main rank, they skip the code. A collective on that group
called there can never complete. The kit knows where it is: each such scope is a
:class:`ExclusiveScope` on the calling thread (``SCOPES.open``), counted in ``SCOPES.exclusive`` so that a
helper's check costs one attribute read while there is none; a checked helper called inside
one raises :class:`~axolotl_dist.errors.CollectiveMismatchError` at once, naming itself, its
call site and the scope's, and saying how to restructure. The rank that raises leaves the
block (or its process) on an error, so the ranks waiting for it are told too.
``zero_first`` itself is not refused: nested blocks are fine, and a block inside ``zero_only``
code is named by the pairing check.

Shared first runs (several first ranks, explicit ``is_main``) are recorded for
:mod:`..liveness.where_report` only: the first ranks may well join each other's collectives.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from ..base.groups import Group, group_of
from .liveness_state import SCOPES, ExclusiveScope
from ...errors import CollectiveMismatchError

__all__ = ["enter", "leave", "check"]


def enter(kind: str, group: Any, describe: Callable[[], str], seq: int = 0) -> ExclusiveScope:
    """This thread enters a scope (see the module docstring); :func:`leave` it after.
    ``seq``: a first-run block's number on its group (what :mod:`..liveness.deadlock` compares)."""
    scope = ExclusiveScope(kind, group, describe, seq)
    SCOPES.open.setdefault(threading.get_ident(), []).append(scope)
    if kind != "shared_first_run":
        SCOPES.exclusive += 1
    return scope


def leave(scope: ExclusiveScope) -> None:
    scopes = SCOPES.open.get(threading.get_ident())
    if not scopes:
        return
    for i in range(len(scopes) - 1, -1, -1):  # this very scope (tuples compare by value)
        if scopes[i] is scope:
            del scopes[i]
            if scope.kind != "shared_first_run":
                SCOPES.exclusive -= 1
            return


def check(helper: str, g: Optional[Group], site: Callable[[], str]) -> None:
    """Raise if ``helper`` on the group ``g`` (None: one process, no group), called at
    ``site()``, cannot complete here."""
    for scope in reversed(SCOPES.open.get(threading.get_ident()) or []):
        if scope.kind == "shared_first_run":
            continue
        group = scope.group if isinstance(scope.group, Group) else group_of(scope.group, helper)
        if group is not g:
            continue
        if scope.kind == "first_run":
            where = (f"inside {scope.describe()}, which this rank runs first while the other "
                     "ranks wait for the block to end")
            fix = ("move the call out of the block (before or after it), or compute the value "
                   "inside and share it after the block")
        else:
            where = (f"inside {scope.describe()}, which runs on the main rank only while the "
                     "other ranks skip it")
            fix = ("call it on every rank, outside the zero_only code (e.g. compute the value "
                   "everywhere, then log it inside)")
        raise CollectiveMismatchError(
            f"{helper}() at {site()} can never complete: it is called {where}, so they cannot "
            f"join it. {fix[0].upper()}{fix[1:]}.")
