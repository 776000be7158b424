"""What this process has learnt, in one object with one :func:`reset`.

Everything the kit remembers between calls that is not tied to one process group's lifetime
lives on :data:`STATE`; what belongs to one group lives in that group's
:class:`~.groups.GroupState`, which :data:`STATE` also holds (weakly keyed by the group).

=================  ==========================================================================
field              what it is, who writes it
=================  ==========================================================================
``groups``         per-group state: call counters, comm device, helper buffers, debug log
                   (:mod:`.groups`)
``learnt``         the last failure of another rank this process raised or received, as
                   fields, with the group it was learnt under (:mod:`axolotl_dist.errors`);
                   a rank that exits after it relays it in its exit record
``peers``          global rank -> :class:`~.peers.Peer` record (host, pid, launcher), copied
                   from the store by the heartbeat (:mod:`.peers`)
``exits``          global rank -> ``(failure report or None, time)``: the exit records the
                   heartbeat copied, so a root cause outlives the store (:mod:`.peers`)
``heartbeat``      this rank's heartbeat thread, if running (:mod:`.peers`)
``run``            the id the ranks of the current group agreed on (:mod:`.peers`)
``exit_store``     the heartbeat's store connection, kept for the exit record (:mod:`.peers`)
``helpers``        the value helpers' cache used last: most programs use one group
                   (:mod:`axolotl_dist.values`)
``debug_*``        debug mode's switches (:mod:`axolotl_dist.debug`)
``first_runs``     per thread: the ``zero_first`` blocks this thread is running first, nested,
                   and those finished inside them (:mod:`.blocks`)
``inside_helper``  per thread: a checked helper is running, so helpers it calls are not
                   checked again (:mod:`axolotl_dist.debug`)
``unconfirmed``    ``zero_first`` blocks this rank ran first (as the sole first rank) whose
                   other ranks' arrival it has not confirmed yet (:mod:`.blocks`)
``waits``          thread id -> the kit wait it is in (:mod:`.where`)
``guards``         thread id -> the scopes other ranks cannot join a collective in: the
                   ``zero_first`` blocks it runs first, ``zero_only`` code (:mod:`.guards`)
``guarded``        how many such scopes are open (0: helpers skip the check)
``calls``          thread id -> the innermost kit helper call in flight on that thread, and
``crossed``        thread id -> why its call in flight must not return (:mod:`.threads`)
``store_spy``      a test's wrapper around the store a block uses (None: none), see
                   :func:`axolotl_dist.testing.count_store_calls`
``trace``          the recorder of this rank's kit calls while tracing is on, else None
                   (:mod:`.trace`)
=================  ==========================================================================

:func:`reset` forgets all of it (or the named parts). The test harness calls it in every
forked rank, so a rank starts as a fresh process would; tests call it through
:func:`axolotl_dist.testing.reset_process_state`. It stops no thread: ``cleanup_distributed()``
does that.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = ["ProcessState", "FirstRuns", "STATE", "PARTS", "reset"]


class FirstRuns(threading.local):
    """The ``zero_first`` blocks this thread runs first: how deeply nested, and the blocks
    that finished inside the outermost one (their arrivals are awaited when it ends)."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending: List[Any] = []


class _Inside(threading.local):
    def __init__(self) -> None:
        self.helper = False


class ProcessState:
    """See the module docstring for each field."""

    __slots__ = ("groups", "learnt", "peers", "exits", "heartbeat", "run", "exit_store", "helpers",
                 "debug_on", "debug_timeout", "debug_explicit", "debug_env_error",
                 "first_runs", "inside", "unconfirmed", "waits", "guards", "guarded",
                 "calls", "crossed", "store_spy", "trace")

    def __init__(self) -> None:
        self.groups: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
        self.learnt: Optional[Tuple[Callable[[], Any], tuple]] = None
        self.peers: Dict[int, Any] = {}
        self.exits: Dict[int, Tuple[Optional[bytes], float]] = {}
        self.heartbeat: Any = None
        self.run: Optional[str] = None
        self.exit_store: Optional[Tuple[Any, int, Any]] = None
        self.helpers: Any = None
        #: the one flag every checked helper reads per call; True also while a bad env value
        #: waits to raise (``debug_env_error``)
        self.debug_on = False
        self.debug_timeout: Optional[float] = None  # enable_debug(timeout=); None: env/default
        self.debug_explicit = False  # a function call decided: the env no longer does
        self.debug_env_error: Optional[str] = None
        self.first_runs = FirstRuns()
        self.inside = _Inside()
        self.unconfirmed: List[Any] = []
        self.waits: Dict[int, Any] = {}
        self.guards: Dict[int, List[Any]] = {}
        self.guarded = 0
        self.calls: Dict[int, Any] = {}
        self.crossed: Dict[int, str] = {}
        self.store_spy: Optional[Callable[[Any], Any]] = None
        self.trace: Any = None


STATE = ProcessState()

#: The parts :func:`reset` can forget one by one.
PARTS: Dict[str, Tuple[str, ...]] = {
    "groups": ("groups",),
    "failures": ("learnt",),
    "peers": ("peers", "exits"),
    "heartbeat": ("heartbeat", "run", "exit_store"),
    "helpers": ("helpers",),
    "debug": ("debug_on", "debug_timeout", "debug_explicit", "debug_env_error"),
    "blocks": ("first_runs", "inside", "unconfirmed", "waits", "guards", "guarded", "store_spy"),
    "threads": ("calls", "crossed"),
    "trace": ("trace",),
}


def reset(*parts: str) -> None:
    """Forget what this process has learnt: everything, or only the named :data:`PARTS`.

    Debug mode goes back to off and undecided; :func:`axolotl_dist.testing.reset_process_state`
    then reads ``AXOLOTL_DIST_DEBUG`` again.
    """
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"reset({', '.join(map(repr, unknown))}): unknown part(s); "
                         f"choose from {sorted(PARTS)}")
    fresh = ProcessState()
    for part in parts or tuple(PARTS):
        for field in PARTS[part]:
            setattr(STATE, field, getattr(fresh, field))
