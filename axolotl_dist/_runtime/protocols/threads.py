"""One thread at a time on a group: two threads' calls never silently swap values.

A collective pairs with the other ranks' calls by order alone. Two threads of one rank calling
the kit's collectives on one process group at the same time can be ordered differently on each
rank: the values then cross between the threads (one thread's sum gets the other's numbers) or
the ranks wait for calls that never come. So every helper call is recorded while it runs
(``CALLS.calls``: thread id -> that thread's innermost call). A call that finds another
thread's call in flight on the same group raises
:class:`~axolotl_dist.errors.ThreadConflictError` naming both threads and call sites, and marks
the other thread (``CALLS.conflicts``): when its call returns it raises too, instead of
returning a value that may belong to the other call. The check runs in the wrapper every
helper wears (:mod:`.helpers`); while no other thread is in a helper it is
a few dict operations (see ``benchmarks/debug.py``).

The ordering blocks (``zero_first``, ``do_n_at_a_time``) signal through the store, not the
group's collectives, so another thread's helpers may run during a block's body; but a group's
blocks are numbered in the order each rank enters them, so two threads with blocks open on one
group at once could pair with the wrong block on another rank. :func:`enter_block` makes that
an error in the thread that opens the second block, before it is numbered.

Allowed: calls from any one thread (not only the main one), threads on different groups, and
threads that take turns. Turns are safe only if every rank takes them in the same order: the
kit cannot see the order in which another rank's threads took theirs. See
``docs/design/helpers.md, "Threads"``.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Optional, Tuple

from ..base.callsite import call_site, frame_site
from ..base.groups import Group
from .protocols_state import CALLS
from ...errors import ThreadConflictError

__all__ = ["Call", "check", "conflict_error", "enter_block", "leave_block"]

#: A call in flight: (helper name, what finds its group: the arguments of ``call_group`` passed
#: to :func:`check`, the call of this thread it is nested in, or None).
Call = Tuple[str, tuple, Any]

_ADVICE = ("Collectives pair up across ranks by their order alone, so two threads calling them "
           "on one group at once can get each other's values or wait for each other forever. "
           "Call a group's collectives from one thread (hand values to it, e.g. through a "
           "queue.Queue), or give each thread its own group (torch.distributed.new_group(ranks)).")
_BLOCK_ADVICE = ("A group's blocks are numbered in the order each rank enters them, so blocks "
                 "that two threads have open at once can pair with the wrong block on another "
                 "rank. Enter a group's zero_first / do_n_at_a_time blocks from one thread, or "
                 "give each thread its own group (torch.distributed.new_group(ranks)).")


def _thread_name(ident: int) -> str:
    for thread in threading.enumerate():
        if thread.ident == ident:
            return repr(thread.name)
    return f"id {ident}"


def check(name: str, mine: Optional[Group], call_group: Callable[[str, tuple], Any]) -> None:
    """Raise if another thread has a call in flight on the group ``mine`` (``call_group(
    call[0], call[1])`` is a call's group; anything not a group is skipped); mark that thread
    so that its call raises when it returns (see the module docstring)."""
    me = threading.get_ident()
    for ident, other in list(CALLS.calls.items()):
        if ident == me:
            continue
        try:
            theirs = call_group(other[0], other[1])
        except Exception:  # noqa: BLE001 - not a group, or gone meanwhile: no conflict
            continue
        if theirs is not mine:
            continue
        frames, thread = sys._current_frames(), _thread_name(ident)
        if CALLS.calls.get(ident) is not other:
            continue  # its call ended meanwhile: no overlap (a call it enters now sees ours)
        # registered before and after the snapshot: the frame is inside that call
        site = frame_site(frames.get(ident))
        here = f"{name}() at {call_site()} (thread {threading.current_thread().name!r})"
        there = f"{other[0]}() at {site if site is not None else 'an unknown line'} " \
                f"(thread {thread})"
        CALLS.conflicts[ident] = (f"{there} was still running when {here} was called on the same "
                                f"process group, so its result may be the other call's and is "
                                f"not returned. {_ADVICE}")
        raise ThreadConflictError(f"{here} was called while {there} is running on the same "
                                  f"process group. {_ADVICE}")


def conflict_error(ident: int) -> ThreadConflictError:
    """The error a call of thread ``ident`` raises instead of returning (and forget it)."""
    return ThreadConflictError(CALLS.conflicts.pop(ident))


def _block_label(block: Tuple[str, Any, Optional[str], Any]) -> str:
    kind, site, desc, _ = block
    return f"{kind} block" + (f" {desc!r}" if desc else "") + f" at {site}"


def enter_block(state: Group, kind: str, site: Any, desc: Optional[str]) -> Group:
    """This thread opens a ``kind`` block (``site``, ``desc``) on the group ``state``: raise
    :class:`~axolotl_dist.errors.ThreadConflictError` if another thread has a block open
    there. Returns the group, for :func:`leave_block`."""
    me = threading.get_ident()
    opened = CALLS.open_blocks[state]
    mine = (kind, site, desc, opened.get(me))  # the outer block of this thread, if any
    opened[me] = mine  # recorded before the check, as for helper calls
    if len(opened) > 1:
        for ident, theirs in list(opened.items()):
            if ident != me:
                leave_block(state)
                raise ThreadConflictError(
                    f"the {_block_label(mine)} (thread {threading.current_thread().name!r}) was "
                    f"entered while the {_block_label(theirs)} (thread {_thread_name(ident)}) is "
                    f"open on the same process group. {_BLOCK_ADVICE}")
    return state


def leave_block(state: Group) -> None:
    """This thread's innermost open block on ``state``'s group ended."""
    me = threading.get_ident()
    opened = CALLS.open_blocks[state]
    mine = opened.get(me)
    if mine is None:
        return
    if mine[3] is None:
        del opened[me]
    else:
        opened[me] = mine[3]
