"""The liveness room's per-process state (see :mod:`..base.state`): written only by this room.

=============  ==============================================================================
part           fields
=============  ==============================================================================
``peers``      :data:`PEERS`: ``peers`` (global rank -> its :class:`Peer` record: host,
               pid, launcher, copied from the store by the heartbeat); ``exits`` (global rank ->
               ``(failure report or None, time)``: the exit records the heartbeat copied, so a
               root cause outlives the store)
``heartbeat``  :data:`HEARTBEAT`: ``beating`` (this rank's heartbeat runs: its thread is
               :data:`.heartbeat.BEAT`'s); ``run`` (the id the ranks of the current group
               agreed on); ``exit_store`` (the heartbeat's store connection, its rank and a
               reference to its group, kept for the exit record)
``waits``      :data:`WAITS`: ``waits`` (thread id -> the kit wait it is in, for the where
               report); ``abandoned`` (collectives whose wait ended on an exception, Ctrl-C,
               while still pending: kept, never released, with their groups at exit);
               ``abandoned_in`` (the groups of those collectives, weakly)
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

import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, List, NamedTuple, Optional, Set, Tuple

from ..base.groups import Group
from ..base.state import RoomState, register

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import Store, Work

__all__ = ["Peer", "ExclusiveScope", "Registered", "PeersState", "HeartbeatState", "WaitsState",
           "RunsState", "ScopesState", "PEERS", "HEARTBEAT", "WAITS", "RUNS", "SCOPES"]


class Peer(NamedTuple):
    """What a rank recorded about itself at init (``axolotl_dist/<run>/who/<rank>``)."""

    host: str
    pid: int
    machine: str  # procs.MACHINE of the peer: whether this process can see ``pid``
    launcher: str
    by_store: bool = False  # procs.beside_store(): it runs on the machine serving the store

    def describe(self) -> str:
        return f"process {self.pid} on {self.host}, started by {self.launcher}"


class ExclusiveScope(NamedTuple):
    """One scope on one thread: ``kind`` is ``"first_run"`` (the sole first rank's block, number
    ``seq`` on its group), ``"shared_first_run"`` (recorded only) or ``"zero_only"``;
    ``describe()`` says where. ``group`` is the block's :class:`~..base.groups.Group`, or the
    ``group=`` argument of ``zero_only`` (which never communicates, so never resolves it
    itself). A tuple: made on every block's entry, it costs no Python frame."""

    kind: str
    group: Any
    describe: Callable[[], str]
    seq: int = 0


class Registered:
    """A kit wait in progress on some thread: what it waits for, since when, and for whom
    (``ranks``: a list the wait keeps up to date)."""

    __slots__ = ("what", "since", "ranks")

    def __init__(self, what: str, ranks: List[int]) -> None:
        self.what, self.since, self.ranks = what, time.time(), ranks


class PeersState(RoomState):
    """See the module docstring."""

    def __init__(self) -> None:
        self.peers: Dict[int, "Peer"] = {}
        self.exits: Dict[int, Tuple[Optional[bytes], float]] = {}


class HeartbeatState(RoomState):
    """See the module docstring."""

    def __init__(self) -> None:
        self.beating = False
        self.run: Optional[str] = None
        self.exit_store: Optional[Tuple["Store", int, Callable[[], Any]]] = None


class WaitsState(RoomState):
    """See the module docstring."""

    def __init__(self) -> None:
        self.waits: Dict[int, "Registered"] = {}
        self.abandoned: List["Work"] = []
        self.abandoned_in: "weakref.WeakSet[Group]" = weakref.WeakSet()


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
