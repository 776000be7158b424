"""Per-process-group state, in one place.

Everything the kit remembers about a process group lives in one :class:`GroupState`, found by
:func:`state_of` in :data:`.state.STATE` and keyed by the group object **weakly**: a group
kept alive by a cache past ``destroy_process_group()`` would be destroyed during interpreter
shutdown, where gloo's threads abort the process. ``group=None`` means the default group, everywhere
(:func:`resolve`). What it holds:

* ``seq``: per-kind call counters (``zero_first`` blocks, debug-mode checks...), which line up
  across ranks as long as every rank calls the same helpers in the same order;
* ``device``: the device collectives on the group use (see :mod:`.backends`);
* ``helpers``: the value helpers' cached ranks and buffers;
* ``debug``: this rank's debug-mode log of checked calls;
* ``world_mesh``: on the default group, the mesh ``build_world_mesh`` stored;
* ``cleanup_store``, ``blocks_done``: the store connection the background cleanup of blocks
  uses, and (on group rank 0) the blocks seen complete whose keys it deletes next;
* ``abandoned``: a collective's wait ended on an exception (Ctrl-C) with the collective still
  pending; the exit keeps the group instead of joining its workers (:mod:`.works`);
* ``open_blocks``: thread id -> the innermost ``zero_first`` / ``do_n_at_a_time`` block that
  thread has open on the group (:mod:`.threads`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch.distributed as dist

from .backends import device_type
from .state import STATE

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = ["world", "resolve", "GroupState", "state_of", "next_sequence", "global_ranks",
           "global_rank", "is_cpu"]

#: torch's holder of the default group; reading it has no side effects.
world: Any = dist.distributed_c10d._world if dist.is_available() else None


def resolve(group: Optional["ProcessGroup"]) -> Any:
    """``group``, or the default group (None before init) when ``group`` is None."""
    if group is not None:
        return group
    return world.default_pg if world is not None else None


class GroupState:
    """What the kit remembers about one process group (see the module docstring)."""

    __slots__ = ("seq", "device", "helpers", "debug", "world_mesh", "cleanup_store",
                 "blocks_done", "abandoned", "open_blocks", "__weakref__")

    def __init__(self) -> None:
        self.seq: Dict[str, int] = {}
        self.device: Any = None
        self.helpers: Any = None
        self.debug: Any = None
        self.world_mesh: Any = None
        self.cleanup_store: Any = None
        self.blocks_done: Dict[str, List[Any]] = {}
        self.abandoned = False  # a collective left pending (Ctrl-C in its wait): kept at exit
        self.open_blocks: Dict[int, Any] = {}


def state_of(group: Optional["ProcessGroup"]) -> Optional[GroupState]:
    """The :class:`GroupState` of ``group`` (created on first use); None without a group.

    torch's "not a member" sentinel cannot be weakly referenced: it gets a fresh state that is
    not kept (its users raise "not a member" anyway).
    """
    pg = resolve(group)
    if pg is None:
        return None
    try:
        state = STATE.groups.get(pg)
    except TypeError:
        return GroupState()
    if state is None:
        state = STATE.groups[pg] = GroupState()
    return state


def next_sequence(group: Optional["ProcessGroup"], kind: str,
                  state: Optional[GroupState] = None) -> int:
    """The next number of this rank's per-group, per-kind call counter (1, 2, ...);
    ``state``: the group's :class:`GroupState`, when the caller holds it already."""
    if state is None:
        state = state_of(group)
    assert state is not None, "next_sequence needs a process group"
    seq = state.seq[kind] = state.seq.get(kind, 0) + 1
    return seq


def global_ranks(group: Optional["ProcessGroup"]) -> List[int]:
    """The global rank of every group rank, in group-rank order."""
    if group is None:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def global_rank(group: Optional["ProcessGroup"], group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (itself for the default group)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


def is_cpu(group: Optional["ProcessGroup"]) -> bool:
    """Whether collectives on ``group`` run on the CPU (gloo), as :mod:`.works` waits for them."""
    state = state_of(group)
    if state is not None and state.device is not None:
        return bool(state.device.type == "cpu")
    return device_type(str(dist.get_backend(group))) == "cpu"
