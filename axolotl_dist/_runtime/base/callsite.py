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
from types import CodeType, FrameType
from typing import Dict, NamedTuple, Optional, Tuple

__all__ = ["PACKAGE_DIR", "CallSite", "call_site", "frame_site", "is_ours", "short_path"]


def _package_dir() -> str:
    """The whole package's folder: this file's, up as many levels as its name is deep."""
    path = os.path.abspath(__file__)
    for _ in range(__name__.count(".")):
        path = os.path.dirname(path)
    return path + os.sep


#: The folder of the whole package (``axolotl_dist/``), ending in a separator: what lies in
#: it is the kit's code, not the user's.
PACKAGE_DIR = _package_dir()
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


# Both caches key on strings, whose hashes Python keeps: a code object's hash is computed
# anew on every lookup (over its bytecode and constants), which made a lookup cost ~1 us.
#: file name -> whether frames of code from it belong to this package (or contextlib).
_OURS: Dict[str, bool] = {}
#: (file name, line, function name) -> the call site there, built once (a loop of blocks reads
#: it each time).
_SITES: Dict[Tuple[str, int, str], CallSite] = {}
_CACHE_LIMIT = 4096


def is_ours(code: CodeType) -> bool:
    """Whether frames of ``code`` belong to this package (or :mod:`contextlib`)."""
    name = code.co_filename
    ours = _OURS.get(name)
    if ours is None:
        if len(_OURS) >= _CACHE_LIMIT:
            _OURS.clear()
        ours = _OURS[name] = name.startswith(PACKAGE_DIR) or os.path.abspath(name) == _CONTEXTLIB
    return ours


def call_site(depth: int = 1) -> CallSite:
    """The innermost frame, ``depth`` frames above the caller or further out, that is not in
    this package or in :mod:`contextlib`. Cached per code object and line: the path is
    relative to the working directory of the first call from there."""
    frame = sys._getframe(depth)
    while frame is not None:  # is_ours, inline: a block's hot path
        ours = _OURS.get(frame.f_code.co_filename)
        if ours is None:
            ours = is_ours(frame.f_code)
        if not ours:
            break
        frame = frame.f_back
    if frame is None:  # pragma: no cover - called from inside the package only
        return CallSite("<unknown>", 0, "<unknown>", "")
    code = frame.f_code
    key = (code.co_filename, frame.f_lineno, code.co_name)
    site = _SITES.get(key)
    if site is None:
        if len(_SITES) >= _CACHE_LIMIT:  # generated code (exec in a loop): keep memory flat
            _SITES.clear()
        site = _SITES[key] = _build(frame.f_code, frame.f_lineno)
    return site


def frame_site(frame: Optional[FrameType]) -> Optional[CallSite]:
    """Where the thread whose innermost frame is ``frame`` (e.g. from
    ``sys._current_frames()``) called into the package: the caller outside the package of its
    innermost package frame. Frames above that one (code the package called: a user's
    callback, :mod:`linecache`, torch) are skipped. With no package frame on the stack, the
    innermost frame's line; None for no frame."""
    inner = frame
    while inner is not None and not is_ours(inner.f_code):
        inner = inner.f_back
    frame = inner if inner is not None else frame
    while frame is not None and is_ours(frame.f_code):
        frame = frame.f_back
    return None if frame is None else _build(frame.f_code, frame.f_lineno)


def short_path(path: str) -> str:
    """``path`` relative to the working directory where it lies under it, else as given: how
    the kit's messages name the user's files."""
    try:
        rel = os.path.relpath(path)
        return rel if not rel.startswith("..") else path
    except ValueError:  # pragma: no cover - another drive on Windows
        return path


def _build(code: CodeType, line: int) -> CallSite:
    text = linecache.getline(code.co_filename, line).strip()
    return CallSite(short_path(code.co_filename), line, code.co_name, text)
