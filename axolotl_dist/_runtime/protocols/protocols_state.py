"""The protocols room's per-process state that several of its modules share (see
:mod:`..base.state`): written only by this room. What one module keeps is that module's own:
the blocks' (:data:`.blocks.BLOCKS`), the recording's (:data:`.timeline.TIMELINE`), the
checkpoint saves' (:data:`.checkpointing.SAVES`), the header buffers
(:data:`.headers.HEADERS`).

=========  ==================================================================================
part       fields
=========  ==================================================================================
``debug``  :data:`DEBUG`: debug mode's switches: ``on`` (the one flag every checked helper
           reads per call; True also while a bad env value waits to raise, ``env_error``),
           ``timeout`` (``enable_debug(timeout=)``; None: env or default), ``explicit`` (a
           function call decided: the env no longer does); ``logs`` (group -> this rank's
           :class:`DebugLog` of its checks there)
``calls``  :data:`CALLS`: ``inside`` (per thread: a checked helper is running, so helpers it
           calls are not checked again); ``calls`` (thread id -> the innermost kit helper call
           in flight on that thread); ``conflicts`` (thread id -> why its call in flight must
           not return: :mod:`.threads`); ``open_blocks`` (group -> thread id -> its
           innermost open block there)
``notes``  :data:`NOTES`: ``fs_answers`` ((run, directory) -> whether the nodes share it, as
           probed: :mod:`.shared_fs`); ``map_cache_said`` (this process said that a
           ``datasets`` map in a ``zero_first`` block wrote no cache file the other ranks load:
           :mod:`.map_cache`)
=========  ==================================================================================
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Optional, Tuple

from ..base.state import PerGroup, RoomState, register

__all__ = ["DebugLog", "DebugState", "CallsState", "NotesState", "DEBUG", "CALLS", "NOTES"]


class _Inside(threading.local):
    def __init__(self) -> None:
        self.helper = False


def _new_dict(_: Any) -> Dict[Any, Any]:
    return {}


class DebugLog:
    """This rank's memory of its debug checks on one group (:mod:`.debug_checks`)."""

    __slots__ = ("posted", "last_seq", "pending", "first_depth")

    def __init__(self) -> None:
        self.posted: Dict[int, str] = {}  # call number -> my digest (to delete the keys later)
        self.last_seq = 0  # the last call every rank was seen to reach
        self.pending: Dict[int, Any] = {}  # calls posted without waiting, not yet confirmed
        self.first_depth = 0  # zero_first blocks this rank is running first, nested


class DebugState(RoomState):
    """See the module docstring."""

    def __init__(self) -> None:
        self.logs: PerGroup[DebugLog] = PerGroup(lambda g: DebugLog())
        self.on = False
        self.timeout: Optional[float] = None
        self.explicit = False
        self.env_error: Optional[str] = None


class CallsState(RoomState):
    """See the module docstring."""

    def __init__(self) -> None:
        self.inside = _Inside()
        #: thread id -> (helper name, its call's record, the call it is inside or None)
        self.calls: Dict[int, Tuple[str, Any, Any]] = {}
        self.conflicts: Dict[int, str] = {}
        #: group -> thread id -> its innermost open block there (:mod:`.threads`)
        self.open_blocks: PerGroup[Dict[int, Any]] = PerGroup(_new_dict)


class NotesState(RoomState):
    """See the module docstring."""

    def __init__(self) -> None:
        self.fs_answers: Dict[Tuple[Any, ...], Optional[bool]] = {}
        self.map_cache_said = False


DEBUG = register("debug", DebugState())
CALLS = register("calls", CallsState())
NOTES = register("notes", NotesState())
