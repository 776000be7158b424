"""What this process has received, in one object with one :func:`reset`.

Everything the kit remembers between calls that is not tied to one process group's lifetime
lives on :data:`STATE`; what belongs to one group lives in that group's
:class:`~.groups.Group`, which :data:`STATE` also holds (weakly keyed by the group).

=================  ==========================================================================
field              what it is, who writes it
=================  ==========================================================================
``groups``         group -> the kit's :class:`~.groups.Group` for it: ranks, device, call
                   counters, buffers, debug log (:mod:`.groups`)
``last_group``     the :class:`~.groups.Group` used last: most programs use one
                   (:func:`.groups.group_of`'s fast path)
``known_failure``  the last failure of another rank this process raised or received, as its
                   report, with the group it was received under (:func:`.groups.remember_failure`);
                   a rank that exits after it relays it in its exit record
``peers``          global rank -> :class:`~..liveness.peers.Peer` record (host, pid, launcher), copied
                   from the store by the heartbeat (:mod:`..liveness.peers`)
``exits``          global rank -> ``(failure report or None, time)``: the exit records the
                   heartbeat copied, so a root cause outlives the store (:mod:`..liveness.peers`)
``heartbeat``      this rank's heartbeat thread, if running (:mod:`..liveness.peers`)
``run``            the id the ranks of the current group agreed on (:mod:`..liveness.peers`)
``exit_store``     the heartbeat's store connection, kept for the exit record (:mod:`..liveness.peers`)
``debug_*``        debug mode's switches (:mod:`axolotl_dist.debug`)
``first_runs``     per thread: the ``zero_first`` blocks this thread is running first, nested,
                   those finished inside them (:mod:`..protocols.blocks`), and how many of
                   them it runs as its group's rank 0 (:mod:`..protocols.map_cache`)
``inside_helper``  per thread: a checked helper is running, so helpers it calls are not
                   checked again (:mod:`axolotl_dist.debug`)
``unconfirmed``    ``zero_first`` blocks this rank ran first (as the sole first rank) whose
                   other ranks' arrival it has not confirmed yet (:mod:`..protocols.blocks`)
``waits``          thread id -> the kit wait it is in (:mod:`..liveness.where_report`)
``scopes``         thread id -> the scopes other ranks cannot join a collective in: the
                   ``zero_first`` blocks it runs first, ``zero_only`` code (:mod:`..protocols.scopes`)
``exclusive_scopes``        how many such scopes are open (0: helpers skip the check)
``calls``          thread id -> the innermost kit helper call in flight on that thread, and
``thread_conflicts``        thread id -> why its call in flight must not return (:mod:`..protocols.threads`)
``abandoned``      collectives whose wait ended on an exception (Ctrl-C) while they were still
                   pending: kept, never released, with their groups at exit (:mod:`..liveness.waits`)
``cleanup``        the background deletion of finished blocks' keys (:mod:`..store.sweep`), made at
                   its first use
``exit_hook``      the exit hook is registered (:mod:`..lifecycle.services`); a fact of the process that
                   a fork keeps (the hook is in the child's ``atexit`` list too), so
                   :func:`reset` leaves it
``closed_trace``   a recording the exit's teardown closed, for its cleanup to end
``kept``           groups kept alive at exit because a collective was left pending on them
``ending``         the exit handlers run again for a Ctrl-C exit (:mod:`..lifecycle.teardown`)
``store_spy``      a test's wrapper around the store a block uses (None: none), see
                   :func:`axolotl_dist.testing.count_store_calls`
``trace``          the recorder of this rank's kit calls while tracing is on, else None
                   (:mod:`.timeline`)
``warning_fold``   the Python warnings this process holds for folding (before its heartbeat
                   starts) and, on rank 0, the ones it waits to print (:mod:`..lifecycle.warnfold`),
                   made at the first use
``warn_hook``      the ``warnings.showwarning`` the folding hook replaced (None: no hook); a
                   fact of the process, like ``exit_hook``: :func:`reset` leaves it
``fs_answers``     (run, directory) -> whether the nodes share it, as probed
                   (:mod:`..protocols.shared_fs`)
``my_run``         the run file this process recorded last (path, pid) in this host's run
                   directory (:mod:`..liveness.runs`)
``runs_refused``   the refusals of a run directory this process said (once each:
                   :mod:`..liveness.runs`)
``answer_keys``    (run, rank) whose snapshot key this process made sure exists
                   (:mod:`..liveness.where_report`)
``key_waiters``    the threads blocked in a store wait for this process's long waits (:mod:`..store.wakeup`)
``eval_rows``      (data source, world size) -> rows each rank has sent in the evaluation
                   pass in progress (:mod:`axolotl_dist.metrics`)
``map_cache_said``      this process said that a ``datasets`` map in a ``zero_first`` block wrote
                   no cache file the other ranks load (:mod:`..protocols.map_cache`)
=================  ==========================================================================

What lives outside :data:`STATE`, and why :func:`reset` may leave it (:data:`SURVIVES_RESET`,
held complete by ``tests/test_structure.py``): tables that never change, caches of pure
functions (the same input gives the same answer in any process), registries filled when a
module is imported (facts of the code), locks, and what mirrors the environment (which reset
does not touch either).

:func:`reset` forgets all of it (or the named parts). The test harness calls it in every
forked rank, so a rank starts as a fresh process would; tests call it through
:func:`axolotl_dist.testing.reset_process_state`. It stops no thread: ``cleanup_distributed()``
does that.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

__all__ = ["ProcessState", "FirstRuns", "STATE", "PARTS", "reset", "SURVIVES_RESET"]


class FirstRuns(threading.local):
    """The ``zero_first`` blocks this thread runs first: how deeply nested, the blocks that
    finished inside the outermost one (their arrivals are awaited when it ends), and how many
    of them it runs as its group's rank 0 (a ``datasets`` map there is looked at)."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending: List[Any] = []
        self.main = 0  # of the ``depth`` blocks, those run as the group's rank 0


class _Inside(threading.local):
    def __init__(self) -> None:
        self.helper = False


class ProcessState:
    """See the module docstring for each field."""

    __slots__ = ("groups", "last_group", "known_failure", "peers", "exits", "heartbeat", "run", "exit_store",
                 "debug_on", "debug_timeout", "debug_explicit", "debug_env_error",
                 "first_runs", "inside", "unconfirmed", "waits", "scopes", "exclusive_scopes",
                 "calls", "thread_conflicts", "abandoned", "cleanup", "exit_hook", "closed_trace", "kept",
                 "ending", "store_spy", "trace", "warning_fold", "warn_hook", "fs_answers", "my_run",
                 "runs_refused", "answer_keys", "key_waiters", "eval_rows", "map_cache_said")

    def __init__(self) -> None:
        self.groups: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
        self.last_group: Any = None
        self.known_failure: Optional[Tuple[Callable[[], Any], bytes]] = None  # (group ref, report)
        self.peers: Dict[int, Any] = {}
        self.exits: Dict[int, Tuple[Optional[bytes], float]] = {}
        self.heartbeat: Any = None
        self.run: Optional[str] = None
        self.exit_store: Optional[Tuple[Any, int, Any]] = None
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
        self.scopes: Dict[int, List[Any]] = {}
        self.exclusive_scopes = 0
        self.calls: Dict[int, Any] = {}
        self.thread_conflicts: Dict[int, str] = {}
        self.abandoned: List[Any] = []
        self.cleanup: Any = None
        self.exit_hook = False
        self.closed_trace: Any = None
        self.kept: List[Any] = []
        self.ending = False
        self.store_spy: Optional[Callable[[Any], Any]] = None
        self.trace: Any = None
        self.warning_fold: Any = None
        self.warn_hook: Optional[Callable[..., Any]] = None
        self.fs_answers: Dict[Tuple[Any, ...], Optional[bool]] = {}
        self.my_run: Dict[str, Any] = {}
        self.runs_refused: Set[str] = set()
        self.answer_keys: Set[Tuple[str, int]] = set()
        self.key_waiters: List[Any] = []
        self.eval_rows: Dict[Tuple[Any, int], List[int]] = {}
        self.map_cache_said = False


STATE = ProcessState()

#: The parts :func:`reset` can forget one by one.
PARTS: Dict[str, Tuple[str, ...]] = {
    "groups": ("groups", "last_group"),
    "failures": ("known_failure",),
    "peers": ("peers", "exits"),
    "heartbeat": ("heartbeat", "run", "exit_store"),
    "helpers": ("last_group",),
    "debug": ("debug_on", "debug_timeout", "debug_explicit", "debug_env_error"),
    "blocks": ("first_runs", "inside", "unconfirmed", "waits", "scopes", "exclusive_scopes", "store_spy"),
    "threads": ("calls", "thread_conflicts"),
    "collectives": ("abandoned",),
    "lifecycle": ("cleanup", "closed_trace", "kept", "ending"),
    "trace": ("trace",),
    "warnings": ("warning_fold",),
    "filesystem": ("fs_answers",),
    "runs": ("my_run", "runs_refused", "answer_keys"),
    "key_waiters": ("key_waiters",),
    "metrics": ("eval_rows",),
    "notes": ("map_cache_said",),
}

#: Module-level values outside :data:`STATE` (``module: name``), and why :func:`reset` leaves
#: them (see the module docstring).
SURVIVES_RESET: Dict[str, str] = {
    "axolotl_dist.errors._WITH_ACCELERATES": "a cache: accelerate's exception class -> the "
                                             "kit's error class that also is it",
    "axolotl_dist.partial_state._MULTI": "a table",
    "axolotl_dist.__init__._KEPT_IN_SUBPACKAGES": "a table",
    "axolotl_dist._runtime.base.backends._NAME_DEVICE": "a table",
    "axolotl_dist._runtime.base.callsite._OURS": "a cache: file name -> whether it is the kit's",
    "axolotl_dist._runtime.base.callsite._SITES": "a cache: code object -> its call site",
    "axolotl_dist._runtime.base.envvars._KEYS": "a cache: variable name -> its interned key",
    "axolotl_dist._runtime.base.envvars._INT_CACHE": "a cache: raw value -> parsed int",
    "axolotl_dist._runtime.base.envvars.KIT_VARS": "a table",
    "axolotl_dist._runtime.base.groups._FIRST_USE": "a registry: services to start at a "
                                                    "group's first use",
    "axolotl_dist._runtime.base.state.PARTS": "a table",
    "axolotl_dist._runtime.base.state.SURVIVES_RESET": "this table",
    "axolotl_dist._runtime.lifecycle.warnfold._MADE": "a lock",
    "axolotl_dist._runtime.lifecycle.warnfold._INSIDE": "a thread-local flag of a call in "
                                                        "progress",
    "axolotl_dist._runtime.liveness.heartbeat._TASKS": "a registry: what runs_tasks on heartbeats",
    "axolotl_dist._runtime.liveness.heartbeat._LOCK": "a lock",
    "axolotl_dist._runtime.liveness.where_report._WRAPPERS": "a table",
    "axolotl_dist._runtime.protocols.codes.HELPERS": "a registry: the helpers' header codes",
    "axolotl_dist._runtime.protocols.codes.CODES": "a registry: the helpers' header codes",
    "axolotl_dist._runtime.protocols.codes.GATHERS": "a registry: the gathers among them",
    "axolotl_dist._runtime.protocols.exchange._NO_SPLITS": "a constant (equal splits)",
    "axolotl_dist._runtime.store.records._DTYPES_BY_NAME": "a table",
    "axolotl_dist._runtime.store.records._NAME_OF_DTYPE": "a table",
    "axolotl_dist._runtime.protocols.map_cache._FIXES": "a table",
    "axolotl_dist._runtime.protocols.timeline._SYNC": "a registry: how each call's ranks "
                                                      "synchronize",
    "axolotl_dist._runtime.protocols.shared_fs._EXPORTED": "mirrors os.environ (what this "
                                                           "process exported there)",
    "axolotl_dist._runtime.store.wakeup._LOCK": "a lock",
    "axolotl_dist.env.LAUNCHER_SOURCES": "a table",
    "axolotl_dist.env.RANK_SOURCES": "a table",
    "axolotl_dist.env._RANK_CACHE": "a cache: raw env values -> parsed ranks",
    "axolotl_dist.hf_data._parts.MAP_DEFAULTS": "a table",
    "axolotl_dist.operations.REDUCTIONS": "a table",
    "axolotl_dist.launch._fold._LABELS": "a cache: ranks -> their label (the launcher)",
    "axolotl_dist.launch._rank_logs._STREAMS": "a table",
    "axolotl_dist.parallel.mesh._CONFIG_TYPES": "a table",
    "axolotl_dist.values._PY_REDUCE": "a table",
}


def reset(*parts: str) -> None:
    """Forget what this process has received: everything, or only the named :data:`PARTS`.

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
