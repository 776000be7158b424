"""Per-process state, owned room by room, and the one :func:`reset` that forgets it.

Everything the kit remembers between calls lives in small state objects: each is a
:class:`RoomState` subclass defined in its room's state module (``base/state.py`` for the base
room, ``store/store_state.py``, ``liveness/liveness_state.py``, ``protocols/protocols_state.py``,
``lifecycle/lifecycle_state.py``), registered under a part name (:func:`register`), and written
only by the modules of that room (``tests/test_structure.py`` checks it; another room asks
through a function). What a room keeps about one process group lives in that room too, in a
:class:`PerGroup` map on its state object (the group's call counters in ``liveness``, its
header buffers in ``protocols``, its store connections in ``store``...); the kit's
:class:`~.groups.Group`, which :data:`GROUPS` holds (weakly keyed by the group), says only
which group it is.

The base room's own parts:

=============  ==============================================================================
part           fields
=============  ==============================================================================
``groups``     :data:`GROUPS`: ``groups`` (group -> the kit's :class:`~.groups.Group`),
               ``last_group`` (the one used last: :func:`.groups.group_of`'s fast path)
``failures``   :data:`FAILURES`: ``known`` (the last failure of another rank this process
               raised or received, as its report, with the group it was received under:
               :func:`.groups.remember_failure`; a rank that exits after it relays it)
=============  ==============================================================================

What lives outside these objects, and why :func:`reset` may leave it (:data:`SURVIVES_RESET`,
held complete by ``tests/test_structure.py``): tables that never change, caches of pure
functions (the same input gives the same answer in any process), registries filled when a
module is imported (facts of the code), locks, and what mirrors the environment (which reset
does not touch either).

:func:`reset` forgets all of it (or the named parts). The test harness calls it in every
forked rank, so a rank starts as a fresh process would; tests call it through
:func:`axolotl_dist.testing._probes.reset_process_state`. It stops no thread:
``cleanup_distributed()`` does that.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Optional, Tuple, TypeVar

__all__ = ["RoomState", "register", "PARTS", "reset", "SURVIVES_RESET", "GROUPS", "FAILURES",
           "GroupsState", "FailuresState", "PerGroup"]


class RoomState:
    """A room's state object: every field is set in ``__init__``; :meth:`reset` runs it again
    in place (the modules that imported the object see the fresh fields), keeping the fields
    named in :attr:`SURVIVES` (facts of the process that a fork keeps, like a registered exit
    hook)."""

    SURVIVES: Tuple[str, ...] = ()

    def reset(self) -> None:
        kept = {name: getattr(self, name) for name in self.SURVIVES}
        self.__init__()  # type: ignore[misc]
        for name, value in kept.items():
            setattr(self, name, value)


_T = TypeVar("_T")


class PerGroup(Dict[Any, _T]):
    """What one room keeps about each process group: ``per_group[g]`` is the kit's group
    ``g``'s object, made by ``make(g)`` at the first ask (``get``: only if made). An object
    goes with its process group (dropped when the group is garbage); it must not hold the
    group. A plain dict lookup on the hot path: no Python frame once the object exists."""

    def __init__(self, make: Callable[[Any], _T]) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, group: Any) -> _T:
        item = self._make(group)
        self.put(group, item)
        return item

    def put(self, group: Any, item: _T) -> None:
        """Make ``item`` ``group``'s object, forgotten when ``group``'s process group goes."""
        if group not in self:
            pg = group.pg_ref()
            if pg is None:
                return  # its process group is gone: nothing to keep
            weakref.finalize(pg, _drop, weakref.ref(self), group)  # not the map: a reset's
        self[group] = item  # old map, holding what holds the group, must not outlive it


def _drop(per_group: "weakref.ref[PerGroup[Any]]", group: Any) -> None:
    """Forget ``group`` in the map ``per_group`` refers to, if the map is still there."""
    found = per_group()
    if found is not None:
        found.pop(group, None)

#: part name -> its state object, registered when its module is imported.
PARTS: Dict[str, RoomState] = {}

_S = TypeVar("_S", bound=RoomState)


def register(part: str, state: _S) -> _S:
    """Register ``state`` under ``part`` (for :func:`reset`) and return it."""
    if part in PARTS:
        raise ValueError(f"register({part!r}): a state object is registered under it already")
    PARTS[part] = state
    return state


class GroupsState(RoomState):
    """The kit's :class:`~.groups.Group` of each process group (see the module docstring)."""

    def __init__(self) -> None:
        self.groups: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
        self.last_group: Any = None


class FailuresState(RoomState):
    """The failure this process relays if it ends now (see the module docstring)."""

    def __init__(self) -> None:
        self.known: Optional[Tuple[Callable[[], Any], bytes]] = None  # (group ref, report)


GROUPS = register("groups", GroupsState())
FAILURES = register("failures", FailuresState())

#: Module-level values outside :data:`PARTS` (``module: name``), and why :func:`reset` leaves
#: them (see the module docstring).
SURVIVES_RESET: Dict[str, str] = {
    "axolotl_dist._runtime.base.hooks._FIRST_USE": "a registry: hooks registered at import",
    "axolotl_dist._runtime.base.hooks._PEER_FAILURE": "a registry: hooks registered at import",
    "axolotl_dist._runtime.base.hooks._UNCAUGHT": "a registry: hooks registered at import",
    "axolotl_dist._runtime.base.hooks._HEARTBEAT": "a registry: hooks registered at import",
    "axolotl_dist._runtime.base.hooks._CLEANUP": "a registry: hooks registered at import",
    "axolotl_dist._runtime.base.hooks._WHERE_ANSWER": "a registry: hooks registered at import",
    "axolotl_dist._runtime.base.hooks._STUCK_REPORT": "a registry: hooks registered at import",
    "axolotl_dist._runtime.base.hooks._STRAGGLER": "a registry: hooks registered at import",
    "axolotl_dist.errors._WITH_ACCELERATES": "a cache: accelerate's exception class -> the "
                                             "kit's error class that also is it",
    "axolotl_dist.partial_state._MULTI": "a table",
    "axolotl_dist.__init__._KEPT_IN_SUBPACKAGES": "a table",
    "axolotl_dist._runtime.base.callsite._OURS": "a cache: file name -> whether it is the kit's",
    "axolotl_dist._runtime.base.callsite._SITES": "a cache: code object -> its call site",
    "axolotl_dist.env.variables._KEYS": "a cache: variable name -> its interned key",
    "axolotl_dist.env.variables._INT_CACHE": "a cache: raw value -> parsed int",
    "axolotl_dist.env.variables._SECRET_SEEN": "a cache: the secret of the stored values",
    "axolotl_dist.env.variables._SECONDS_SEEN": "a cache: a seconds variable's stored value -> "
                                                "its seconds",
    "axolotl_dist.env.variables._SECONDS_GETTERS": "a cache: variable name -> its raw getter",
    "axolotl_dist.env.variables.KIT_VARS": "a table",
    "axolotl_dist._runtime.base.state.PARTS": "a registry: each part's state object, "
                                              "registered at import",
    "axolotl_dist._runtime.base.state.SURVIVES_RESET": "this table",
    "axolotl_dist._runtime.lifecycle.warnfold._MADE": "a lock",
    "axolotl_dist._runtime.lifecycle.warnfold._INSIDE": "a thread-local flag of a call in "
                                                        "progress",
    "axolotl_dist._runtime.liveness.heartbeat._LOCK": "a lock",
    "axolotl_dist._runtime.liveness.where_report._WRAPPERS": "a table",
    "axolotl_dist._runtime.protocols.codes.HELPERS": "a registry: the helpers' header codes",
    "axolotl_dist._runtime.protocols.codes.CODES": "a registry: the helpers' header codes",
    "axolotl_dist._runtime.protocols.codes.ROOTED": "a registry: the helpers with a root rank",
    "axolotl_dist._runtime.protocols.exchange._NO_SPLITS": "a constant (equal splits)",
    "axolotl_dist._runtime.store.records._DTYPES_BY_NAME": "a table",
    "axolotl_dist._runtime.store.records._NAME_OF_DTYPE": "a table",
    "axolotl_dist._runtime.protocols.map_cache._FIXES": "a table",
    "axolotl_dist._runtime.protocols.timeline._SYNC": "a registry: how each call's ranks "
                                                      "synchronize",
    "axolotl_dist._runtime.protocols.shared_fs._EXPORTED": "mirrors os.environ (what this "
                                                           "process exported there)",
    "axolotl_dist._runtime.store.wakeup._LOCK": "a lock",
    "axolotl_dist.env.__init__.LAUNCHER_SOURCES": "a table",
    "axolotl_dist.env.__init__.RANK_SOURCES": "a table",
    "axolotl_dist.env.__init__._RANK_CACHE": "a cache: raw env values -> parsed ranks",
    "axolotl_dist.ranks._NAME_DEVICE": "a table",
    "axolotl_dist.hf_data._parts.MAP_DEFAULTS": "a table",
    "axolotl_dist.operations.REDUCTIONS": "a table",
    "axolotl_dist.launch._fold._LABELS": "a cache: ranks -> their label (the launcher)",
    "axolotl_dist.launch._rank_logs._STREAMS": "a table",
    "axolotl_dist.parallel.mesh._CONFIG_TYPES": "a table",
    "axolotl_dist.values._PY_REDUCE": "a table",
}


def reset(*parts: str) -> None:
    """Forget what this process has received: everything, or only the named :data:`PARTS`.

    Debug mode goes back to off and undecided;
    :func:`axolotl_dist.testing._probes.reset_process_state` then reads ``AXOLOTL_DIST_DEBUG``
    again.
    """
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"reset({', '.join(map(repr, unknown))}): unknown part(s); "
                         f"choose from {sorted(PARTS)}")
    for part in parts or tuple(PARTS):
        PARTS[part].reset()
