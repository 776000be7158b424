"""Log lines that say when, how bad and which rank: ``12:00:00 WARNING axolotl_dist: [rank 1/4]
rank 1 has waited 30 s ...``.

While logging is unconfigured (no handler on the logger, its parents or the root, and no level
set below the root's default), records go to the current ``sys.stderr`` through one fallback
handler in that format; any configuration takes over (``logging.basicConfig``, a handler,
``setLevel``), so nothing is printed twice and nothing global is changed.
``AXOLOTL_DIST_DEFAULT_LOGGING=0`` turns the fallback off. :data:`kit` is the kit's own logger
(every rank logs); :mod:`axolotl_dist.log` builds users' loggers on the same pieces.
"""

from __future__ import annotations

import logging
import sys
import weakref
from typing import Any, Optional, TextIO

from ...env import variables
from .text import rank_tag

__all__ = ["DEFAULT_LOGGING_ENV_VAR", "FORMAT", "StderrHandler", "FALLBACK", "bars_open",
           "bar_write", "add_bar", "BARS", "fallback_level", "rank_prefix", "KitLog", "kit"]

#: Set to ``0`` to turn off the stderr fallback for unconfigured logging.
from ...env.variables import DEFAULT_LOGGING_ENV_VAR  # noqa: E402 - re-exported for log.py
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler writing to whatever ``sys.stderr`` is when a record is emitted."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass  # always the current sys.stderr (redirections and test capture keep working)

    def emit(self, record: logging.LogRecord) -> None:
        if not bars_open():
            super().emit(record)
            return
        try:
            bar_write(self.format(record), sys.stderr)
        except Exception:  # noqa: BLE001 - as logging does: report, never raise
            self.handleError(record)


#: The kit's progress bars on screen (``ad.tqdm``, ``shared_map``'s): lines the kit prints
#: while one is open go above it (:func:`bar_write`), not onto it.
BARS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def add_bar(bar: Any) -> Any:
    """Register ``bar`` (a tqdm bar) unless it is disabled; returns it."""
    if not getattr(bar, "disable", True):
        BARS.add(bar)
    return bar


def bars_open() -> bool:
    """Whether one of the kit's progress bars is on screen in this process."""
    return any(not getattr(bar, "disable", True) for bar in list(BARS)) if BARS else False


def bar_write(text: str, file: Any, end: str = "\n") -> None:
    """Write ``text`` above the open progress bars (``tqdm.write``), so no line is glued onto
    a bar; call when :func:`bars_open`."""
    for bar in list(BARS):
        type(bar).write(text, file=file, end=end)
        return


FALLBACK = StderrHandler()


def _fallback_on() -> bool:
    return variables.kit_switch(DEFAULT_LOGGING_ENV_VAR)


def fallback_level(logger: logging.Logger) -> Optional[int]:
    """The lowest level the stderr fallback shows for ``logger``, or None if logging is set up.

    Logging counts as set up when a handler is reachable from ``logger`` (its own, a parent's,
    the root's). Without one, the first level set on the way to the root decides, except the
    root's untouched default (WARNING), which is taken as INFO.
    """
    if not _fallback_on() or logger.hasHandlers():
        return None
    node: Optional[logging.Logger] = logger
    while node is not None:
        if node.level != logging.NOTSET:
            root_default = node is logging.getLogger() and node.level == logging.WARNING
            return logging.INFO if root_default else node.level
        node = node.parent
    return logging.INFO


def rank_prefix() -> str:
    """``[rank r/n]`` of this process: the process group's once it exists, the launcher's env
    before (never creating anything)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return rank_tag(dist.get_rank(), dist.get_world_size())
    except Exception:  # noqa: BLE001 - a group being torn down
        pass
    rank, size = variables.raw("RANK"), variables.raw("WORLD_SIZE")
    return rank_tag(variables.text(rank) if rank is not None else 0,
                    variables.text(size) if size is not None else 1)


class KitLog:
    """The kit's own logger (``axolotl_dist``): every rank logs, each line with the time, the
    level and ``[rank r/n]``."""

    def __init__(self, name: str) -> None:
        self.logger = logging.getLogger(name)

    def emit(self, level: int, msg: str, *args: Any) -> None:
        self.log(level, f"{rank_prefix()} {msg}", *args)

    def log(self, level: int, msg: str, *args: Any) -> None:
        """``msg % args`` at ``level``, as is (no rank prefix): through the logger once logging
        is set up, else through :data:`FALLBACK`."""
        fallback = fallback_level(self.logger)
        if fallback is None:
            self.logger.log(level, msg, *args)
        elif level >= fallback and self.logger.manager.disable < level:
            FALLBACK.handle(self.logger.makeRecord(self.logger.name, level, "(unknown file)", 0,
                                                   msg, args, None))

    def info(self, msg: str, *args: Any) -> None:
        self.emit(logging.INFO, msg, *args)

    def warning(self, msg: str, *args: Any) -> None:
        self.emit(logging.WARNING, msg, *args)

    def error(self, msg: str, *args: Any) -> None:
        self.emit(logging.ERROR, msg, *args)


#: The kit's own logger.
kit = KitLog("axolotl_dist")
