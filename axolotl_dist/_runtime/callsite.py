"""Where in the user's code a helper was called: the innermost frame outside this package.

Errors name call sites (``train.py:41 in evaluate``) so that a user sees their own line, not
ours; ``zero_first`` also pairs blocks across ranks by it. Frames of this package and of
:mod:`contextlib` (a ``with`` block's ``__enter__``) are skipped.
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
from typing import NamedTuple

__all__ = ["CallSite", "call_site"]

#: the whole package (this module lives in its ``_runtime`` folder)
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_CONTEXTLIB = os.path.abspath(contextlib.__file__)


class CallSite(NamedTuple):
    """A frame of the user's code."""

    path: str  #: relative to the working directory when under it
    line: int
    function: str
    code: str  #: the source line, stripped ("" if unavailable)

    @property
    def key(self) -> str:
        """``file.py:41``: what must match on every rank (directories may differ per node)."""
        return f"{os.path.basename(self.path)}:{self.line}"

    def __str__(self) -> str:
        return f"{self.path}:{self.line} in {self.function}"

    def with_code(self) -> str:
        """``path:line in function: code``."""
        return f"{self}: {self.code}" if self.code else str(self)


def _ours(filename: str) -> bool:
    return filename.startswith(_PACKAGE_DIR) or os.path.abspath(filename) == _CONTEXTLIB


def call_site(depth: int = 1) -> CallSite:
    """The innermost frame, ``depth`` frames above the caller or further out, that is not in
    this package or in :mod:`contextlib`."""
    frame = sys._getframe(depth)
    while frame is not None and _ours(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:  # pragma: no cover - called from inside the package only
        return CallSite("<unknown>", 0, "<unknown>", "")
    path = frame.f_code.co_filename
    try:
        rel = os.path.relpath(path)
        path = rel if not rel.startswith("..") else path
    except ValueError:  # pragma: no cover - another drive on Windows
        pass
    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return CallSite(path, frame.f_lineno, frame.f_code.co_name, code)
