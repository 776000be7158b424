"""Rank-aware logging: log on the main process only, with the rank in every record.

``get_logger(__name__).info("step %d", step)`` logs once (on rank 0) with ``[rank 0/4]`` in
front; pass ``main_process_only=False`` to log on every rank. Reading the rank never creates a
process group (DESIGN.md decision 2), so it is safe at import time.
"""

from __future__ import annotations

import logging
from typing import Any, MutableMapping, Tuple

from .ranks import get_rank, get_world_size

__all__ = ["RankLoggerAdapter", "get_logger"]


class RankLoggerAdapter(logging.LoggerAdapter):
    """A logger adapter that prefixes ``[rank r/n]`` and logs on rank 0 unless told otherwise."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> Tuple[Any, MutableMapping[str, Any]]:
        return f"[rank {get_rank()}/{get_world_size()}] {msg}", kwargs

    def log(self, level: int, msg: Any, *args: Any, main_process_only: bool = True, **kwargs: Any) -> None:
        if not self.isEnabledFor(level):
            return
        if main_process_only and get_rank() != 0:
            return
        msg, kwargs = self.process(msg, kwargs)
        kwargs.setdefault("stacklevel", 1)
        kwargs["stacklevel"] += 2  # report the caller of .info()/.log(), not this module
        self.logger.log(level, msg, *args, **kwargs)

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
    """A :class:`RankLoggerAdapter` around ``logging.getLogger(name)``."""
    return RankLoggerAdapter(logging.getLogger(name), {})
