"""What a test may ask the kit about this process, and the one door to reset it."""

from __future__ import annotations

import collections
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, Optional, Tuple

from .._runtime.base import state as _state
from .._runtime.liveness.liveness_state import PEERS
from .._runtime.protocols import blocks as _blocks
from .._runtime.base.groups import known_failure as _known_failure
from .._runtime.base.procs import kill_tree, proc_state
from .._runtime.store.access import group_store
from .._runtime.store.records import failure as failure_report, read_failure as read_failure_report
from ..debug import refresh_from_env as _refresh_debug

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup, Store

__all__ = ["reset_process_state", "store_of", "known_peers", "known_failure", "process_state",
           "kill_tree", "count_store_calls", "StoreCalls", "failure_report", "read_failure_report"]


def reset_process_state(*parts: str) -> None:
    """Make this process forget what the kit has received, as a fresh process would know nothing:
    everything, or only the named parts (``"groups"``, ``"failures"``, ``"peers"``,
    ``"heartbeat"``, ``"calls"``, ``"debug"``, ``"blocks"``...: every room's state module lists
    its own). Debug mode is then read again
    from ``AXOLOTL_DIST_DEBUG``. The harness calls it in every rank it forks. It stops no
    thread and destroys no group: call :func:`axolotl_dist.cleanup_distributed` for that."""
    _state.reset(*parts)
    if not parts or "debug" in parts:
        _refresh_debug()


def store_of(group: Optional["ProcessGroup"] = None) -> "Store":
    """The c10d store the kit signals through for ``group`` (default: the world), e.g. to
    check that a loop of helpers leaves no keys behind (``store_of().num_keys()``)."""
    return group_store(group)


def known_peers() -> Dict[int, Any]:
    """The peer records this process has seen so far, by global rank: ``(host, pid,
    launcher)`` of each rank, copied from the store by the heartbeat soon after init (a
    snapshot; no store call)."""
    return dict(PEERS.peers)


def known_failure() -> Optional[Any]:
    """The last failure of another rank this process raised or received under the current
    default group (a :class:`~axolotl_dist.errors.RankFailedError`, rebuilt from the report the
    kit keeps), or None: what this rank relays in its exit record if it ends after it."""
    return _known_failure()


#: ``failure_report(error)``: the bytes a rank relays a :class:`~axolotl_dist.errors.RankFailedError`
#: as (in its exit record, a dead peer's note); ``read_failure_report(data)``: the error every
#: rank raises from them (``ValueError`` for bytes the kit did not write).

#: ``process_state(pid)``: ``"running"``, ``"stopped"`` or ``"gone"`` (a zombie counts as
#: gone) for a process on this host, None where ``/proc`` cannot tell.
process_state = proc_state


class StoreCalls(collections.Counter):  # type: ignore[type-arg]
    """``(thread name, store method) -> calls`` made through the stores the kit's blocks use
    while :func:`count_store_calls` is active.

    ``before``, if a test sets it, is called as ``before(store, method, args)`` ahead of each
    counted call (``store``: the block's own, uncounted): a test orders two ranks' calls with
    it (e.g. holds a rank's read until another rank's ``add`` has landed)."""

    before: Optional[Callable[[Any, str, Tuple[Any, ...]], None]] = None

    def on(self, thread: str = "MainThread") -> int:
        """How many calls ``thread`` made (by default the caller's own thread)."""
        return sum(n for (name, _), n in self.items() if name == thread)


class _Counting:
    """Forwards every call to ``store`` and counts it under the calling thread's name."""

    def __init__(self, store: Any, calls: StoreCalls) -> None:
        self._store, self._calls = store, calls

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._store, name)
        if not callable(target):
            return target

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._calls.before is not None:
                self._calls.before(self._store, name, args)
            self._calls[(threading.current_thread().name, name)] += 1
            return target(*args, **kwargs)

        return counted


@contextmanager
def count_store_calls() -> Iterator[StoreCalls]:
    """Count the store calls of the ``zero_first`` / ``do_n_at_a_time`` blocks entered inside
    the ``with``, per thread and method::

        with count_store_calls() as calls:
            with ad.zero_first():
                pass
        assert calls.on("MainThread") <= 2

    Calls the background cleanup makes on its own connection are counted under its thread's
    name (``axolotl-dist-cleanup``)."""
    calls = StoreCalls()
    previous = _blocks.spy_on_stores(lambda store: _Counting(store, calls))
    try:
        yield calls
    finally:
        _blocks.spy_on_stores(previous)
