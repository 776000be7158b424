"""Rank-aware logging: log on the main process only, with the rank in every record.

``get_logger(__name__).info("step %d", step)`` logs once (on rank 0) with ``[rank 0/4]`` in
front; pass ``main_process_only=False`` to log on every rank. Reading the rank never creates a
process group (docs/design/decisions.md, decision 2), so it is safe at import time.

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
from typing import Any, MutableMapping, Tuple

from ._runtime.base import kitlog as _kitlog
from ._runtime.base.text import rank_tag
from .ranks import get_rank, get_world_size

__all__ = ["RankLoggerAdapter", "get_logger", "DEFAULT_LOGGING_ENV_VAR"]

#: Set to ``0`` to turn off the stderr fallback for unconfigured logging.
DEFAULT_LOGGING_ENV_VAR = _kitlog.DEFAULT_LOGGING_ENV_VAR


_FALLBACK = _kitlog.FALLBACK
_fallback_level = _kitlog.fallback_level


class RankLoggerAdapter(logging.LoggerAdapter):
    """A logger adapter that prefixes ``[rank r/n]`` and logs on rank 0 unless told otherwise."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> Tuple[Any, MutableMapping[str, Any]]:
        return f"{rank_tag(get_rank(), get_world_size())} {msg}", kwargs

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
