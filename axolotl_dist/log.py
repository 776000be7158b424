"""Rank-aware logging: log on the main process only, with the rank in every record.

``get_logger(__name__).info("step %d", step)`` logs once (on rank 0) with ``[rank 0/4]`` in
front; pass ``main_process_only=False`` to log on every rank. Reading the rank never creates a
process group (docs/design.md, decision 2), so it is safe at import time.

Records show up without any logging setup: while logging is unconfigured (no handler on the
logger, its parents or the root, and no level set below the root's default), INFO and above
go to stderr as ``12:00:00 INFO name: [rank 0/2] message``. Any configuration takes over
(``logging.basicConfig``, a handler, ``setLevel``), so nothing is printed twice; nothing global
is changed. ``AXOLOTL_DIST_DEFAULT_LOGGING=0`` turns the fallback off (then Python's own rules
apply: WARNING and above, message only).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, MutableMapping, Optional, TextIO, Tuple

from ._runtime import envvars as _envvars
from .ranks import get_rank, get_world_size

__all__ = ["RankLoggerAdapter", "get_logger", "DEFAULT_LOGGING_ENV_VAR"]

#: Set to ``0`` to turn off the stderr fallback for unconfigured logging.
DEFAULT_LOGGING_ENV_VAR = "AXOLOTL_DIST_DEFAULT_LOGGING"


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler writing to whatever ``sys.stderr`` is when a record is emitted."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s",
                                            datefmt="%H:%M:%S"))

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass  # always the current sys.stderr (redirections and test capture keep working)


_FALLBACK = _StderrHandler()


def _default_logging_on() -> bool:
    """:data:`DEFAULT_LOGGING_ENV_VAR` as a switch (unset or blank: on); a value that is not a
    switch raises :class:`~axolotl_dist.errors.DistributedEnvError` naming it."""
    raw = _envvars.raw(DEFAULT_LOGGING_ENV_VAR)
    return raw is None or not _envvars.text(raw).strip() or _envvars.parse_flag(
        DEFAULT_LOGGING_ENV_VAR, raw, f"set {DEFAULT_LOGGING_ENV_VAR}=0 to turn the stderr "
        f"fallback off or {DEFAULT_LOGGING_ENV_VAR}=1 (or unset it) to keep it")


def _fallback_level(logger: logging.Logger) -> Optional[int]:
    """The lowest level the stderr fallback shows for ``logger``, or None if logging is set up.

    Logging counts as set up when a handler is reachable from ``logger`` (its own, a parent's,
    the root's). Without one, the first level set on the way to the root decides, except the
    root's untouched default (WARNING), which is taken as INFO.
    """
    if not _default_logging_on() or logger.hasHandlers():
        return None
    node: Optional[logging.Logger] = logger
    while node is not None:
        if node.level != logging.NOTSET:
            root_default = node is logging.getLogger() and node.level == logging.WARNING
            return logging.INFO if root_default else node.level
        node = node.parent
    return logging.INFO


class RankLoggerAdapter(logging.LoggerAdapter):
    """A logger adapter that prefixes ``[rank r/n]`` and logs on rank 0 unless told otherwise."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> Tuple[Any, MutableMapping[str, Any]]:
        return f"[rank {get_rank()}/{get_world_size()}] {msg}", kwargs

    def log(self, level: int, msg: Any, *args: Any, main_process_only: bool = True,  # type: ignore[override]
            **kwargs: Any) -> None:
        fallback = _fallback_level(self.logger)
        if fallback is None:
            if not self.isEnabledFor(level):
                return
        elif level < fallback or self.logger.manager.disable >= level:
            return
        if main_process_only and get_rank() != 0:
            return
        msg, fields = self.process(msg, kwargs)
        if fallback is not None:
            self._to_stderr(level, msg, args, fields)
            return
        fields.setdefault("stacklevel", 1)
        fields["stacklevel"] += 2  # report the caller of .info()/.log(), not this module
        self.logger.log(level, msg, *args, **fields)

    def _to_stderr(self, level: int, msg: Any, args: Tuple[Any, ...], kwargs: MutableMapping[str, Any]) -> None:
        """Emit through the stderr fallback (logging is unconfigured)."""
        exc_info = kwargs.get("exc_info")
        if isinstance(exc_info, BaseException):
            exc_info = (type(exc_info), exc_info, exc_info.__traceback__)
        elif exc_info and not isinstance(exc_info, tuple):
            exc_info = sys.exc_info()
        record = self.logger.makeRecord(self.logger.name, level, "(unknown file)", 0, msg, args,
                                        exc_info or None, extra=kwargs.get("extra"))
        _FALLBACK.handle(record)

    def debug(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.DEBUG, msg, *args, **kwargs)

    def info(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.INFO, msg, *args, **kwargs)

    def warning(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.WARNING, msg, *args, **kwargs)

    def error(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.ERROR, msg, *args, **kwargs)

    def critical(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        self.log(logging.CRITICAL, msg, *args, **kwargs)

    def exception(self, msg: Any, *args: Any, exc_info: Any = True, **kwargs: Any) -> None:
        self.log(logging.ERROR, msg, *args, exc_info=exc_info, **kwargs)


def get_logger(name: str) -> RankLoggerAdapter:
    """A :class:`RankLoggerAdapter` around ``logging.getLogger(name)``.

    While logging is unconfigured, its INFO records (and above) on the main process go to
    stderr; see the module docstring.
    """
    return RankLoggerAdapter(logging.getLogger(name), {})
