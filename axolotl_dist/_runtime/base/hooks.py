"""Where a lower room runs code of a higher one: every such hook, typed, in one place.

The rooms import one way (``base``, ``store``, ``liveness``, ``protocols``, ``lifecycle``), so
a lower room cannot import the code it must sometimes run; the higher room (or a public
module) registers it here, once, when it is imported, and the lower room runs what is
registered. Registering the same function twice registers it once. The hooks:

==================  =======================  ============================================
hook                run by                   registered by
==================  =======================  ============================================
``first_use``       ``groups.group_of``      ``lifecycle.services``: start the services
``peer_failure``    ``groups.remember_``     ``liveness.failures``: the store's host keeps
                    ``failure``              the failure readable first
``uncaught``        ``tracebacks``' hook     ``lifecycle.teardown.peer_failure``: the peer
                                             behind a torch collective's error
``heartbeat``       ``liveness.heartbeat``   ``lifecycle.warnfold``: warnings folded across
                                             ranks
``cleanup``         ``lifecycle.teardown``   ``parallel.mesh``: the world mesh goes before
                                             the groups are destroyed
``where_answer``    ``liveness.where_``      ``tracing``: torch's collectives so far onto
                    ``report.answer``        the rank's timeline
``stuck_report``    ``liveness.stuck``       ``tracing``: the timeline so far, merged
``straggler``       ``liveness.stragglers``  ``tracing``: the finding marked on rank 0's
                                             timeline
==================  =======================  ============================================
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Protocol, TypeVar

from ...errors import RankFailedError

__all__ = ["HeartbeatTask", "on_first_use", "on_peer_failure", "on_uncaught", "add_heartbeat_task",
           "at_cleanup", "first_use", "peer_failure", "explain_uncaught", "heartbeat_tasks",
           "cleanup", "on_where_answer", "where_answer", "on_stuck_report", "stuck_report",
           "on_straggler", "straggler"]


class HeartbeatTask(Protocol):
    """Work that runs on global rank 0's heartbeat thread beside the stall detector: the
    Python warnings folded across ranks (``lifecycle/warnfold``). It hears of its work from the
    counter the heartbeat reads anyway (:data:`..store.keys.WAITERS`), so a task costs no store
    call of its own."""

    #: seconds between two reads of the counter while :meth:`pending`
    look: float

    def started(self, beat: Any) -> None:
        """The heartbeat ``beat`` of this process started (any rank)."""

    def read(self, beat: Any, waiters: int) -> None:
        """Rank 0: the counter's value, read this beat."""

    def pending(self) -> bool:
        """Rank 0: whether it waits for something (the heartbeat then reads every look)."""

    def tick(self) -> None:
        """Rank 0: a turn of the heartbeat's loop."""

    def close(self, beat: Any) -> None:
        """The heartbeat ``beat`` stopped."""


#: The registered hooks, filled when their modules are imported: facts of the code, which
#: ``reset()`` keeps.
_FIRST_USE: List[Callable[[], None]] = []
_PEER_FAILURE: List[Callable[[RankFailedError], None]] = []
_UNCAUGHT: List[Callable[[BaseException], Optional[RankFailedError]]] = []
_HEARTBEAT: List[HeartbeatTask] = []
_CLEANUP: List[Callable[[], None]] = []
_WHERE_ANSWER: List[Callable[[], None]] = []
_STUCK_REPORT: List[Callable[[], None]] = []
_STRAGGLER: List[Callable[[Any], None]] = []

_H = TypeVar("_H")


def _add(hooks: List[_H], hook: _H) -> None:
    if hook not in hooks:
        hooks.append(hook)


def on_first_use(hook: Callable[[], None]) -> None:
    """Run ``hook`` whenever a process group is first used (and at ``init_distributed``)."""
    _add(_FIRST_USE, hook)


def on_peer_failure(hook: Callable[[RankFailedError], None]) -> None:
    """Run ``hook`` with each new failure of another rank this process records."""
    _add(_PEER_FAILURE, hook)


def on_uncaught(explain: Callable[[BaseException], Optional[RankFailedError]]) -> None:
    """Ask ``explain`` about each uncaught exception the kit's hook prints: where it returns
    another rank's failure, the hook prints that account instead."""
    _add(_UNCAUGHT, explain)


def add_heartbeat_task(task: HeartbeatTask) -> None:
    """Run ``task`` on every heartbeat of this process from now on."""
    _add(_HEARTBEAT, task)


def at_cleanup(hook: Callable[[], None]) -> None:
    """Run ``hook`` at cleanup (``cleanup_distributed()``, the exit's teardown), before the
    process groups are destroyed."""
    _add(_CLEANUP, hook)


def on_where_answer(hook: Callable[[], None]) -> None:
    """Run ``hook`` on the heartbeat thread before this rank answers a where request."""
    _add(_WHERE_ANSWER, hook)


def on_stuck_report(hook: Callable[[], None]) -> None:
    """Run ``hook`` on the heartbeat thread once this rank reported the run stuck
    (:mod:`..liveness.stuck`)."""
    _add(_STUCK_REPORT, hook)


def on_straggler(hook: Callable[[Any], None]) -> None:
    """Run ``hook(finding)`` on rank 0's heartbeat thread when it logs a straggler
    (:class:`..liveness.stragglers.StragglerReport`)."""
    _add(_STRAGGLER, hook)


def first_use() -> None:
    """Run the :func:`on_first_use` hooks."""
    for hook in _FIRST_USE:
        hook()


def peer_failure(error: RankFailedError) -> None:
    """Run the :func:`on_peer_failure` hooks with ``error``."""
    for hook in _PEER_FAILURE:
        hook(error)


def explain_uncaught(exc: BaseException) -> Optional[RankFailedError]:
    """The first account an :func:`on_uncaught` hook gives of ``exc``, or None (a hook that
    raises gives none: the exception's own traceback is printed then)."""
    for explain in _UNCAUGHT:
        try:
            found = explain(exc)
        except Exception:  # noqa: BLE001 - the exception's own traceback then
            found = None
        if found is not None:
            return found
    return None


def heartbeat_tasks() -> List[HeartbeatTask]:
    """The :func:`add_heartbeat_task` tasks."""
    return _HEARTBEAT


def cleanup() -> None:
    """Run the :func:`at_cleanup` hooks."""
    for hook in _CLEANUP:
        hook()


def where_answer() -> None:
    """Run the :func:`on_where_answer` hooks (one that raises is skipped: the answer goes on)."""
    _run_each(_WHERE_ANSWER)


def stuck_report() -> None:
    """Run the :func:`on_stuck_report` hooks (one that raises is skipped: the report stands)."""
    _run_each(_STUCK_REPORT)


def straggler(found: Any) -> None:
    """Run the :func:`on_straggler` hooks with ``found`` (one that raises is skipped)."""
    _run_each([lambda hook=hook: hook(found) for hook in _STRAGGLER])


def _run_each(hooks: List[Callable[[], None]]) -> None:
    """Run every hook of ``hooks``; one that raises is skipped, never the caller's work."""
    for hook in hooks:
        try:
            hook()
        except Exception:  # noqa: BLE001 - a hook never costs what runs it
            pass
