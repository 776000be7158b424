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
from typing import Any, Optional, TextIO

from . import envvars

__all__ = ["DEFAULT_LOGGING_ENV_VAR", "FORMAT", "StderrHandler", "FALLBACK", "fallback_level",
           "rank_prefix", "KitLog", "kit"]

#: Set to ``0`` to turn off the stderr fallback for unconfigured logging.
DEFAULT_LOGGING_ENV_VAR = "AXOLOTL_DIST_DEFAULT_LOGGING"
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


FALLBACK = StderrHandler()


def _fallback_on() -> bool:
    raw = envvars.raw(DEFAULT_LOGGING_ENV_VAR)
    return raw is None or not envvars.text(raw).strip() or envvars.parse_flag(
        DEFAULT_LOGGING_ENV_VAR, raw, f"set {DEFAULT_LOGGING_ENV_VAR}=0 to turn the stderr "
        f"fallback off or {DEFAULT_LOGGING_ENV_VAR}=1 (or unset it) to keep it")


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
            return f"[rank {dist.get_rank()}/{dist.get_world_size()}]"
    except Exception:  # noqa: BLE001 - a group being torn down
        pass
    rank, size = envvars.raw("RANK"), envvars.raw("WORLD_SIZE")
    return f"[rank {envvars.text(rank) if rank is not None else 0}/" \
           f"{envvars.text(size) if size is not None else 1}]"


class KitLog:
    """The kit's own logger (``axolotl_dist``): every rank logs, each line with the time, the
    level and ``[rank r/n]``."""

    def __init__(self, name: str) -> None:
        self.logger = logging.getLogger(name)

    def emit(self, level: int, msg: str, *args: Any) -> None:
        text = f"{rank_prefix()} {msg}"
        fallback = fallback_level(self.logger)
        if fallback is None:
            self.logger.log(level, text, *args)
        elif level >= fallback and self.logger.manager.disable < level:
            FALLBACK.handle(self.logger.makeRecord(self.logger.name, level, "(unknown file)", 0,
                                                   text, args, None))

    def warning(self, msg: str, *args: Any) -> None:
        self.emit(logging.WARNING, msg, *args)

    def error(self, msg: str, *args: Any) -> None:
        self.emit(logging.ERROR, msg, *args)


#: The kit's own logger.
kit = KitLog("axolotl_dist")
