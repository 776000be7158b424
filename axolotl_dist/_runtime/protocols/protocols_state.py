"""The protocols room's per-process state (see :mod:`..base.state`): written only by this room.

=========  ==================================================================================
part       fields
=========  ==================================================================================
``debug``  :data:`DEBUG`: debug mode's switches: ``on`` (the one flag every checked helper
           reads per call; True also while a bad env value waits to raise, ``env_error``),
           ``timeout`` (``enable_debug(timeout=)``; None: env or default), ``explicit`` (a
           function call decided: the env no longer does)
``calls``  :data:`CALLS`: ``inside`` (per thread: a checked helper is running, so helpers it
           calls are not checked again); ``calls`` (thread id -> the innermost kit helper call
           in flight on that thread); ``conflicts`` (thread id -> why its call in flight must
           not return: :mod:`.threads`)
``blocks``  :data:`BLOCKS`: ``first_runs`` (per thread: the ``zero_first`` blocks it runs
           first, nested, those finished inside them, how many as its group's rank 0);
           ``unconfirmed`` (blocks this rank ran first as the sole first rank whose other
           ranks' arrival it has not confirmed yet); ``store_spy`` (a test's
           wrapper around the store a block uses, see
           :func:`axolotl_dist.testing._probes.count_store_calls`)
``trace``  :data:`TIMELINE`: ``recorder`` (the recorder of this rank's kit calls while tracing
           is on, else None: :mod:`.timeline`)
``saves``  :data:`SAVES`: ``pending`` (this rank's ``checkpoint_dir`` calls whose bodies
           handed their writes over to futures, oldest first: committed once they are done,
           at the next ``checkpoint_dir``, ``latest_checkpoint``, cleanup or exit:
           :mod:`.checkpointing`); ``said`` (the exit's wait for them was said); ``hooked``
           (the exit's hook that waits for them is registered); ``saving`` ((root, step) of
           the save this rank is inside, else None); ``term_handler`` (the SIGTERM handler
           that save replaced, to restore at its end; None where it replaced none)
``notes``  :data:`NOTES`: ``fs_answers`` ((run, directory) -> whether the nodes share it, as
           probed: :mod:`.shared_fs`); ``map_cache_said`` (this process said that a
           ``datasets`` map in a ``zero_first`` block wrote no cache file the other ranks load:
           :mod:`.map_cache`)
=========  ==================================================================================
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

from ..base.state import RoomState, register

if TYPE_CHECKING:  # pragma: no cover
    from .blocks import Block
    from .checkpointing import Save
    from .timeline import Recorder

__all__ = ["FirstRuns", "DebugState", "CallsState", "BlocksState", "TimelineState",
           "NotesState", "SavesState", "DEBUG", "CALLS", "BLOCKS", "TIMELINE", "NOTES", "SAVES"]


class FirstRuns(threading.local):
    """The ``zero_first`` blocks this thread runs first: how deeply nested, the blocks that
    finished inside the outermost one (their arrivals are awaited when it ends), and how many
    of them it runs as its group's rank 0 (a ``datasets`` map there is looked at)."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending: List["Block"] = []
        self.main = 0  # of the ``depth`` blocks, those run as the group's rank 0


class _Inside(threading.local):
    def __init__(self) -> None:
        self.helper = False


class DebugState(RoomState):
    """See the module docstring."""

    def __init__(self) -> None:
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


class BlocksState(RoomState):
    """See the module docstring."""

    def __init__(self) -> None:
        self.first_runs = FirstRuns()
        self.unconfirmed: List["Block"] = []
        self.store_spy: Optional[Callable[[Any], Any]] = None


class TimelineState(RoomState):
    """See the module docstring."""

    def __init__(self) -> None:
        self.recorder: Optional["Recorder"] = None


class SavesState(RoomState):
    """See the module docstring."""

    def __init__(self) -> None:
        self.pending: List["Save"] = []
        self.said = False
        self.hooked = False
        self.saving: Optional[Tuple[str, int]] = None
        self.term_handler: Any = None


class NotesState(RoomState):
    """See the module docstring."""

    def __init__(self) -> None:
        self.fs_answers: Dict[Tuple[Any, ...], Optional[bool]] = {}
        self.map_cache_said = False


DEBUG = register("debug", DebugState())
CALLS = register("calls", CallsState())
BLOCKS = register("blocks", BlocksState())
TIMELINE = register("trace", TimelineState())
NOTES = register("notes", NotesState())
SAVES = register("saves", SavesState())
