"""The liveness room's per-process state (see :mod:`..base.state`): written only by this room.

=============  ==============================================================================
part           fields
=============  ==============================================================================
``peers``      :data:`PEERS`: ``peers`` (global rank -> its :class:`~.peers.Peer` record: host,
               pid, launcher, copied from the store by the heartbeat); ``exits`` (global rank ->
               ``(failure report or None, time)``: the exit records the heartbeat copied, so a
               root cause outlives the store)
``heartbeat``  :data:`HEARTBEAT`: ``thread`` (this rank's :class:`~.heartbeat.Heartbeat`, if
               running); ``run`` (the id the ranks of the current group agreed on);
               ``exit_store`` (the heartbeat's store connection, its rank and a reference to
               its group, kept for the exit record); ``dead_peers`` (the watch that ends this
               process when a peer died: :mod:`.dead_peers`)
``waits``      :data:`WAITS`: ``waits`` (thread id -> the kit wait it is in, for the where
               report); ``abandoned`` (collectives whose wait ended on an exception, Ctrl-C,
               while still pending: kept, never released, with their groups at exit)
``runs``       :data:`RUNS`: ``my_run`` (the run file this process recorded last in this
               host's run directory, :mod:`.runs`); ``refused`` (the refusals of a run
               directory this process said, once each); ``answer_keys`` ((run, rank) whose
               snapshot key this process made sure exists, :mod:`.where_report`)
``scopes``     :data:`SCOPES`: ``open`` (thread id -> the scopes the other ranks cannot join a
               collective in: the ``zero_first`` blocks it runs first, ``zero_only`` code:
               :mod:`.scopes`); ``exclusive`` (how many such scopes are open; 0: helpers skip
               the check)
=============  ==============================================================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set, Tuple

from ..base.state import RoomState, register

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import Store, Work

    from .dead_peers import DeadPeers
    from .heartbeat import Heartbeat
    from .peers import Peer
    from .scopes import ExclusiveScope
    from .where_report import Registered

__all__ = ["PeersState", "HeartbeatState", "WaitsState", "RunsState", "ScopesState",
           "PEERS", "HEARTBEAT", "WAITS", "RUNS", "SCOPES"]


class PeersState(RoomState):
    """See the module docstring."""

    def __init__(self) -> None:
        self.peers: Dict[int, "Peer"] = {}
        self.exits: Dict[int, Tuple[Optional[bytes], float]] = {}


class HeartbeatState(RoomState):
    """See the module docstring."""

    def __init__(self) -> None:
        self.thread: Optional["Heartbeat"] = None
        self.run: Optional[str] = None
        self.exit_store: Optional[Tuple["Store", int, Callable[[], Any]]] = None
        self.dead_peers: Optional["DeadPeers"] = None


class WaitsState(RoomState):
    """See the module docstring."""

    def __init__(self) -> None:
        self.waits: Dict[int, "Registered"] = {}
        self.abandoned: List["Work"] = []


class ScopesState(RoomState):
    """See the module docstring."""

    def __init__(self) -> None:
        self.open: Dict[int, List["ExclusiveScope"]] = {}
        self.exclusive = 0


class RunsState(RoomState):
    """See the module docstring."""

    def __init__(self) -> None:
        self.my_run: Dict[str, Any] = {}
        self.refused: Set[str] = set()
        self.answer_keys: Set[Tuple[str, int]] = set()


PEERS = register("peers", PeersState())
HEARTBEAT = register("heartbeat", HeartbeatState())
WAITS = register("waits", WaitsState())
RUNS = register("runs", RunsState())
SCOPES = register("scopes", ScopesState())
