"""The store room's per-process state (see :mod:`..base.state`): written only by this room.

==========  ==========================================================================
part        fields
==========  ==========================================================================
``store``   :data:`STORE`: ``cleanup`` (the background deletion of finished blocks' keys,
            :mod:`.sweep`, made at its first use); ``key_waiters`` (the threads blocked in
            a ``store.wait`` for this process's long waits, :mod:`.wakeup`); ``lendable``
            (the heartbeat's own connection, offered to the default group's key waiters, with
            a reference to that group: :func:`.wakeup.offer_connection`); ``ignored`` (the
            keys whose record without this run's seal was said, :func:`.access.genuine`);
            ``attempt`` (the number of this attempt the ranks agreed on through the agent's
            store, from 1: :func:`.attempts.attempt_store`; None without that handshake)
==========  ==========================================================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, List, Optional, Set, Tuple

from ..base.state import RoomState, register

if TYPE_CHECKING:  # pragma: no cover
    from .sweep import Cleanup
    from .wakeup import KeyWaiter, LentConnection

__all__ = ["StoreState", "STORE"]


class StoreState(RoomState):
    """See the module docstring."""

    def __init__(self) -> None:
        self.cleanup: Optional["Cleanup"] = None
        self.key_waiters: List["KeyWaiter"] = []
        self.lendable: Optional[Tuple[Callable[[], Any], "LentConnection"]] = None
        self.ignored: Set[str] = set()
        self.attempt: Optional[int] = None


STORE = register("store", StoreState())
