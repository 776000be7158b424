"""The launcher's account of restarts (``--max-restarts N``).

torch elastic's agent restarts a failed worker group inside ``elastic_launch``, with no hook
for the caller; what it does publish are its metrics (:mod:`torch.distributed.elastic.metrics`,
group ``torchelastic``): every round of its monitor loop puts
``workers.<role>.remaining_restarts`` and then ``workers.<role>.<state>``. A ``failed`` or
``unhealthy`` state while restarts remain is the moment the agent stops the group and starts
the next attempt (``SimpleElasticAgent._invoke_run``). :class:`Restarts` is a metric handler
that says so then, naming the rank that failed from the attempt's end records
(:func:`._report.read_ends`), and counts the attempts for the final report.

A restart that cannot help is not tried: when the rank that failed first failed before its
first collective (its end record's ``startup``: the exception's type and line) and so did the
first failure of the attempt before, the same way, the handler sets the agent's remaining
restarts to 0 before the agent reads them (the metric comes first, in the same round), so the
agent stops the group and reports the failure as its last (docs/launching.md, "Restarts").
``--retry-same-failure`` turns this off.

A restart line names the rank behind the failure: one the agent saw fail that left no end
record (a signal, ``os._exit``), else the rank an uncaught ``RankFailedError`` blamed (a lost
node's), else the first end record's. A new rendezvous round after a healthy state (torch's
``_rendezvous.success`` metric) is a membership change, said with the new size.
"""

from __future__ import annotations

import signal
import sys
from typing import Any, Callable, Dict, Optional, Tuple

from ._report import PROG, attempt_dir, read_ends

__all__ = ["Restarts"]

_GROUP = "torchelastic"
_FAILED_STATES = ("failed", "unhealthy")


def _handler_base() -> type:
    from torch.distributed.elastic.metrics.api import MetricHandler

    return MetricHandler


class Restarts:
    """See the module docstring. ``max_restarts``: ``--max-restarts``; ``end_dir``: the
    launcher's end directory (each attempt's records in its own sub-directory); ``say``:
    where the line goes (the ranks' output first, so it comes after what they printed)."""

    def __init__(self, max_restarts: int, end_dir: str,
                 say: Optional[Callable[[str], None]] = None, retry_same: bool = False) -> None:
        self.max_restarts, self.end_dir, self.retry_same = max_restarts, end_dir, retry_same
        self.say = say or (lambda text: print(text, file=sys.stderr, flush=True))
        self.attempt = 0  # the attempt running now, 0-based (torch's restart count)
        self._remaining: Optional[int] = None
        self._state = ""  # the worker group's last state the agent reported
        self._previous = None
        self._install()

    def _install(self) -> None:
        from torch.distributed.elastic.metrics import api

        watcher = self

        class _Handler(_handler_base()):  # type: ignore[misc]
            def emit(self, metric_data: Any) -> None:
                watcher.emit(str(metric_data.name), int(metric_data.value))

        self._previous = getattr(api, "_metrics_map", {}).get(_GROUP)
        api.configure(_Handler(), group=_GROUP)

    def close(self) -> None:
        """Give torch's metric group back its handler."""
        from torch.distributed.elastic.metrics import api

        if self._previous is not None:
            api.configure(self._previous, group=_GROUP)
        else:
            getattr(api, "_metrics_map", {}).pop(_GROUP, None)

    def label(self) -> str:
        """``"attempt 2 of 3: "`` for the report (empty without ``--max-restarts``)."""
        if self.max_restarts <= 0:
            return ""
        return f"attempt {self.attempt + 1} of {self.max_restarts + 1}: "

    def emit(self, name: str, value: int) -> None:
        """One of torch's metrics (see the module docstring)."""
        if name.endswith("._rendezvous.success") and self._state == "healthy":
            self._joined()  # a round after a healthy one: the membership changed
        if not name.startswith("workers."):
            return
        if name.endswith(".remaining_restarts"):
            self._remaining = value
            return
        state = name.rsplit(".", 1)[-1]
        if state in _FAILED_STATES + ("healthy", "succeeded"):
            self._state = state
        if state in _FAILED_STATES and (self._remaining or 0) > 0:
            self._restarting()

    def _joined(self) -> None:
        """The agent started a new round while its ranks ran (a node joined, or one left
        without a rank failing here): say so, with the new size."""
        group = getattr(_agent_local("self"), "_worker_group", None)
        workers = getattr(group, "workers", None) or [None]
        nodes, world = getattr(group, "group_world_size", None), getattr(workers[0], "world_size", None)
        size = f" (now {nodes} node(s), {world} rank(s))" if nodes and world else ""
        self.say(f"{PROG}: the membership changed{size}: restarted every rank in a new round "
                 "(torch elastic does not count it as a restart: TORCHELASTIC_RESTART_COUNT "
                 "stays)")

    def _restarting(self) -> None:
        ends = read_ends(attempt_dir(self.end_dir, self.attempt))
        first = _first_failure(ends)
        if first is not None and self._same_start_up_failure(first) and _stop_agent():
            self.say(f"{PROG}: attempt {self.attempt + 1} of {self.max_restarts + 1} failed as "
                     f"attempt {self.attempt} did, before its first collective (rank {first[1]}: "
                     f"{first[3]}): not restarting, the next attempt would fail the same way "
                     "(--retry-same-failure restarts anyway)")
            return
        why = _abrupt(_agent_local("run_result"), ends) or _blamed(first, ends)
        if not why and first:
            why = f": rank {first[1]} exited with code {first[2]}"
        self.attempt += 1
        self.say(f"{PROG}: attempt {self.attempt} of {self.max_restarts + 1} failed{why}; "
                 f"restarting every rank (attempt {self.attempt + 1} of "
                 f"{self.max_restarts + 1}, --max-restarts {self.max_restarts})")

    def _same_start_up_failure(self, first: Tuple[float, int, Any, str]) -> bool:
        """Whether this attempt's first failure is a start-up failure the attempt before ended
        with too."""
        if self.retry_same or self.attempt == 0 or not first[3]:
            return False
        before = _first_failure(read_ends(attempt_dir(self.end_dir, self.attempt - 1)))
        return before is not None and before[3] == first[3]


def _first_failure(ends: Dict[int, Dict[str, Any]]) -> Optional[Tuple[float, int, Any, str]]:
    """``(time, rank, exit code, start-up failure or "")`` of the rank that failed first."""
    failed = sorted((float(e.get("time", 0.0)), rank, e.get("code"), str(e.get("startup") or ""))
                    for rank, e in ends.items() if e.get("code") not in (0, None))
    return failed[0] if failed else None


def _blamed(first: Optional[Tuple[float, int, Any, str]], ends: Dict[int, Dict[str, Any]]) -> str:
    """``": rank 2 failed (...), as rank 0 reported"``: the rank that failed first ended on
    another rank's failure (a lost node's rank, which left no record here); ``""`` otherwise."""
    if first is None:
        return ""
    record = ends.get(first[1], {})
    blamed = record.get("blames")
    if not isinstance(blamed, int) or blamed == first[1] or blamed in ends:
        return ""
    return f": rank {blamed} failed ({record.get('why', '')}), as rank {first[1]} reported"


def _agent_local(name: str) -> Any:
    """Local ``name`` of the torch elastic agent's monitor loop calling this handler
    (``SimpleElasticAgent._invoke_run``, up this thread's stack; ``"self"``: the agent); None
    where there is none."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_invoke_run" and \
                hasattr(frame.f_locals.get("self"), "_remaining_restarts"):
            return frame.f_locals.get(name)
        frame = frame.f_back
    return None


def _stop_agent() -> bool:
    """Set the agent's remaining restarts to 0 (see :func:`_agent_local`); False where no
    agent is calling."""
    agent = _agent_local("self")
    if agent is None:
        return False
    agent._remaining_restarts = 0
    return True


def _abrupt(result: Any, ends: Dict[int, Dict[str, Any]]) -> str:
    """``": rank 2 was killed by SIGKILL"`` for a rank the agent saw fail that wrote no end
    record (killed by a signal, or ``os._exit``; not one the agent's SIGTERM stopped once
    another had failed): the others' failures followed from its death; ``""`` where there is
    none."""
    failures = getattr(result, "failures", None) or {}
    stopped = -int(signal.SIGTERM)  # the agent's own stop of the ranks still running
    gone = sorted((rank, f) for rank, f in failures.items()
                  if rank not in ends and getattr(f, "exitcode", None) != stopped)
    if not gone:
        return ""
    rank, failure = gone[0]
    code = int(getattr(failure, "exitcode", 0) or 0)
    if code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with code {code} without finishing its script (os._exit?)"
    more = f" (ranks {', '.join(str(r) for r, _ in gone[1:])} too)" if len(gone) > 1 else ""
    return f": rank {rank} {how}{more}"
