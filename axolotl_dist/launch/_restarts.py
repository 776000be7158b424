"""The launcher's account of restarts (``--max-restarts N``).

torch elastic's agent restarts a failed worker group inside ``elastic_launch``, with no hook
for the caller; what it does publish are its metrics (:mod:`torch.distributed.elastic.metrics`,
group ``torchelastic``): every round of its monitor loop puts
``workers.<role>.remaining_restarts`` and then ``workers.<role>.<state>``. A ``failed`` or
``unhealthy`` state while restarts remain is the moment the agent stops the group and starts
the next attempt (``SimpleElasticAgent._invoke_run``). :class:`Restarts` is a metric handler
that says so then, naming the rank that failed from the attempt's end records
(:func:`._report.read_ends`), and counts the attempts for the final report.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

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
                 say: Optional[Callable[[str], None]] = None) -> None:
        self.max_restarts, self.end_dir = max_restarts, end_dir
        self.say = say or (lambda text: print(text, file=sys.stderr, flush=True))
        self.attempt = 0  # the attempt running now, 0-based (torch's restart count)
        self._remaining: Optional[int] = None
        self._previous = None
        if max_restarts > 0:
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
        if self.max_restarts <= 0:
            return
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
        if not name.startswith("workers."):
            return
        if name.endswith(".remaining_restarts"):
            self._remaining = value
        elif name.rsplit(".", 1)[-1] in _FAILED_STATES and (self._remaining or 0) > 0:
            self._restarting()

    def _restarting(self) -> None:
        why = self._failed_rank()
        self.attempt += 1
        self.say(f"{PROG}: attempt {self.attempt} of {self.max_restarts + 1} failed{why}; "
                 f"restarting every rank (attempt {self.attempt + 1} of "
                 f"{self.max_restarts + 1}, --max-restarts {self.max_restarts})")

    def _failed_rank(self) -> str:
        """``": rank 1 exited with code 3"`` from the attempt's end records, else ``""``."""
        ends = read_ends(attempt_dir(self.end_dir, self.attempt))
        failed = sorted((float(e.get("time", 0.0)), rank, e.get("code"))
                        for rank, e in ends.items() if e.get("code") not in (0, None))
        if not failed:
            return ""
        _, rank, code = failed[0]
        return f": rank {rank} exited with code {code}"
