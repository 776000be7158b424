"""The store room's per-process state (see :mod:`..base.state`) that several of its modules
share: written only by this room. What one module keeps is that module's own (the background
deletion in :mod:`.sweep`, the key waiters in :mod:`.wakeup`).

==========  ==========================================================================
part        fields
==========  ==========================================================================
``store``   :data:`STORE`: ``ignored`` (the keys whose record without this run's seal was
            said, :func:`.access.genuine`);
            ``attempt`` (the number of this attempt the ranks agreed on through the agent's
            store, from 1: :func:`.attempts.attempt_store`; None without that handshake);
            ``groups`` (group -> its :class:`GroupConnections`)
==========  ==========================================================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Set

from ..base.state import PerGroup, RoomState, register

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import Store

__all__ = ["StoreState", "STORE", "GroupConnections"]


class GroupConnections:
    """A group's c10d store and the connections beside its own: ``store`` (the group's
    store, once a block asked for it: :func:`.access.kit_store`), ``cleanup`` (deletes
    finished blocks' keys in the background, :mod:`.sweep`), ``idle`` (the clone a key waiter
    of a group that is not the default one blocks on, kept for its next wait,
    :mod:`.wakeup`)."""

    __slots__ = ("store", "cleanup", "idle")

    def __init__(self) -> None:
        self.store: Optional["Store"] = None
        self.cleanup: Optional["Store"] = None
        self.idle: Optional["Store"] = None


class StoreState(RoomState):
    """See the module docstring."""

    def __init__(self) -> None:
        self.ignored: Set[str] = set()
        self.attempt: Optional[int] = None
        self.groups: PerGroup[GroupConnections] = PerGroup(lambda g: GroupConnections())


STORE = register("store", StoreState())
