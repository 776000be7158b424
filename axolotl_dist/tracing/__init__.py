"""A timeline of the kit's calls on every rank: who waited for whom, and where.

Set ``AXOLOTL_DIST_TRACE=<dir>`` (or call ``init_distributed(trace_dir=...)``) and every rank
records a span for each kit call (helpers, collectives, ``zero_first`` bodies and waits,
``do_n_at_a_time`` rounds, ``shared_map`` parts) and for what you mark with
:func:`trace_span`, in ``<dir>/rank<k>.jsonl`` as it goes. At the end (``cleanup_distributed``
or exit on rank 0, the ``axolotl-dist`` launcher when it ends, or ``axolotl-dist trace <dir>``
afterwards) :func:`merge_trace` writes ``trace.json`` (Chrome Trace Event format: open it in
ui.perfetto.dev or chrome://tracing), ``summary.txt`` and, with matplotlib (the ``trace``
extra), ``timeline.png``. Off by default; off, it costs the helpers one attribute test.
See docs/timeline.md.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any, Callable, Optional, TypeVar

from ..env import variables as _variables
from .._runtime.base import hooks as _hooks
from .._runtime.base.kitlog import kit as _kit
from .._runtime.protocols import timeline as _timeline
from . import _merge
from .._runtime.base.callsite import call_site
from ..env.variables import LAUNCHER_PID_ENV_VAR, TRACE_ENV_VAR
from .._runtime.protocols.timeline import TIMELINE

__all__ = ["trace_span", "is_tracing", "merge_trace", "TRACE_ENV_VAR", "Merged"]

F = TypeVar("F", bound=Callable[..., Any])
Merged = _merge.Merged


def is_tracing() -> bool:
    """Whether this rank records its kit calls now."""
    return TIMELINE.recorder is not None


class trace_span:  # noqa: N801 - used like a function: ``with trace_span("tokenize"):``
    """Mark a span of your own on this rank's timeline: ``with trace_span("tokenize"):`` or
    ``@trace_span("tokenize")``. A no-op while tracing is off (a few hundred nanoseconds)."""

    __slots__ = ("name", "_t0", "_site")

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"trace_span(name={name!r}): pass a non-empty str naming the span")
        self.name = name
        self._t0: Optional[int] = None
        self._site = ""

    def __enter__(self) -> "trace_span":
        if TIMELINE.recorder is not None:
            self._site = str(call_site())
            self._t0 = _timeline.now()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        recorder, t0 = TIMELINE.recorder, self._t0
        self._t0 = None
        if recorder is not None and t0 is not None:
            recorder.span("user", self.name, t0, _timeline.now(), self._site,
                          error=exc_type.__name__ if exc_type is not None else "")

    def __call__(self, fn: F) -> F:
        name = self.name

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with trace_span(name):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]


def start_recording(directory: str, store: Any, rank: int, world_size: int) -> None:
    """Start recording this rank's kit calls into ``directory`` (``init_distributed`` calls
    it on every rank: the clocks are aligned there). At the cleanup that ends the recording,
    rank 0 merges every rank's file, unless the ``axolotl-dist`` launcher will once every
    rank ended (it started this rank with ``AXOLOTL_DIST_TRACE`` naming the directory)."""
    _timeline.start(directory, store, rank, world_size, at_end=_at_end)


def _so_far() -> None:
    """A stuck run's reporting rank, while tracing: its torch collectives so far written, and
    every rank's file here merged on a thread of its own (a large trace takes seconds: the
    heartbeat must go on beating), which logs where the timeline is."""
    recorder = TIMELINE.recorder
    if recorder is not None:
        _timeline.torch_so_far()
        threading.Thread(target=_merge_so_far, args=(recorder.directory,), daemon=True,
                         name="axolotl-dist-trace-merge").start()


def _merge_so_far(directory: str) -> None:
    try:
        merged = _merge.merge(directory)
    except Exception as exc:  # noqa: BLE001 - a trace never fails a run
        _kit.warning("the timeline so far could not be merged in %s: %s: %s", directory,
                     type(exc).__name__, exc)
        return
    picture = f", {merged.timeline_png}" if merged.timeline_png else ""
    _kit.warning("the timeline so far: %s%s", merged.trace_json, picture)


def _straggler(found: object) -> None:
    """Mark a straggler rank 0 found on its timeline: a ``finding`` of no length, on a row of
    the kit's findings (the merge draws it across every rank)."""
    recorder = TIMELINE.recorder
    if recorder is not None:
        at = _timeline.now()
        recorder.span("finding", f"straggler: {found}", at, at,
                      thread=recorder.row(-2, "the kit's findings"))


_hooks.on_where_answer(_timeline.torch_so_far)
_hooks.on_stuck_report(_so_far)
_hooks.on_straggler(_straggler)


def _at_end(recorder: _timeline.Recorder) -> None:
    if recorder.rank == 0 and not _launcher_merges(recorder.directory):
        _merge.merge_at_exit(recorder.directory, recorder.world_size)


def _launcher_merges(directory: str) -> bool:
    """Whether the ``axolotl-dist`` launcher will merge the trace in ``directory`` when every
    rank ended: it started this rank with ``AXOLOTL_DIST_TRACE`` naming it."""
    asked = _variables.kit_path(TRACE_ENV_VAR)
    return bool(os.environ.get(LAUNCHER_PID_ENV_VAR)) and asked is not None and \
        os.path.abspath(asked) == directory


def merge_after_run(directory: Optional[str]) -> None:
    """The ``axolotl-dist`` launcher's merge once every rank ended: if ``directory`` holds rank
    files, merge them and print where the trace is and the summary (never raises)."""
    if directory and os.path.isdir(directory) and _merge.load(directory):
        _merge.merge_at_exit(directory, 0)


def merge_trace(directory: str, png: bool = True) -> Merged:
    """Merge the rank files in ``directory`` into ``trace.json``, ``summary.txt`` and (with
    matplotlib installed and ``png``) ``timeline.png``; returns their paths and the summary
    table. Safe to run again, e.g. after copying other nodes' files in."""
    return _merge.merge(directory, png=png)
