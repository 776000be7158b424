"""The lifecycle room's per-process state (see :mod:`..base.state`): written only by this room.

=============  ==============================================================================
part           fields
=============  ==============================================================================
``lifecycle``  :data:`LIFECYCLE`: ``closed_recorder`` (a recording the exit's teardown closed,
               for its cleanup to end); ``kept`` (groups kept alive at exit because a
               collective was left pending on them); ``ending`` (the exit handlers run again
               for a Ctrl-C exit: :mod:`.teardown`); ``startup`` (this
               process's start-up stamps, by phase: :mod:`.startup`); ``collectives_at_init`` (the
               default group's count of collectives when ``init_distributed`` returned: a
               failure before the next one is a start-up failure); kept by a reset, as
               facts of the process that a fork keeps: ``exit_hook`` (the exit hook is
               registered: :mod:`.services`; the hook is in a forked child's ``atexit`` list
               too). The warnings' folding keeps its own (:data:`.warnfold.FOLD`).
=============  ==============================================================================
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

from ..base.state import RoomState, register

if TYPE_CHECKING:  # pragma: no cover
    from ..protocols.timeline import Recorder

__all__ = ["LifecycleState", "LIFECYCLE"]


class LifecycleState(RoomState):
    """See the module docstring."""

    SURVIVES = ("exit_hook",)

    def __init__(self) -> None:
        self.closed_recorder: Optional["Recorder"] = None
        self.kept: List[Callable[[], Any]] = []
        self.ending = False
        self.startup: Dict[str, float] = {}
        self.collectives_at_init: Optional[int] = None
        self.exit_hook = False


LIFECYCLE = register("lifecycle", LifecycleState())
