"""Tracebacks a user reads: their own frames, and the kit call they made; not the kit's insides.

A kit helper that raises shows, in a plain traceback, every frame it passed through inside the
package (the debug hook, the helper, the runtime). :func:`format_exception` drops them from
every exception of a chain: the last user frame still shows the line that called the kit
(``n = ad.reduce_and_broadcast(...)``), and the error says the rest. It formats the kit's
failure reports, the launcher's error file, and (:func:`install`) uncaught exceptions, when no
other hook was installed. It never raises: an exception whose ``__str__`` or ``__repr__``
raises is shown with ``<exception str() failed>``. An uncaught failure of another rank is not
a traceback but this rank's one-line account of it (:func:`format_failure`; docs/faults.md,
"One account of a failure").
"""

from __future__ import annotations

import os
import sys
import traceback
from types import TracebackType
from typing import Any, List, Optional, Type

from . import hooks
from .callsite import PACKAGE_DIR, short_path
from .procs import MACHINE
from ...errors import RankFailedError

__all__ = ["kit_frame", "format_exception", "format_failure", "format_uncaught", "safe_str",
           "install", "user_line", "excerpt", "EXCERPT"]

_PACKAGE = PACKAGE_DIR
_TORCH_MARK = os.sep + "torch" + os.sep
#: The most characters of another rank's message that this rank's one-line account quotes
#: where that rank printed the whole of it on this machine.
EXCERPT = 28
def kit_frame(filename: str) -> bool:
    """Whether ``filename`` is a module of this package."""
    return os.path.abspath(filename).startswith(_PACKAGE) if filename else False


def safe_str(exc: BaseException) -> str:
    """``str(exc)``, or ``<exception str() failed>`` (as Python's own tracebacks say) if that raises."""
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the failure itself
        return "<exception str() failed>"


def _trim(te: traceback.TracebackException) -> None:
    seen = set()
    todo: List[Any] = [te]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        frames = [f for f in node.stack if not kit_frame(f.filename)]
        if frames or not node.stack:  # an error raised inside the kit only keeps its last frame
            node.stack = traceback.StackSummary.from_list(frames)
        else:
            node.stack = traceback.StackSummary.from_list(list(node.stack)[-1:])
        todo += [node.__cause__, node.__context__]


def format_exception(exc_type: Optional[Type[BaseException]], exc: BaseException,
                     tb: Optional[TracebackType]) -> str:
    """The traceback of ``exc`` without the kit's frames (never raises)."""
    try:
        te = traceback.TracebackException(type(exc), exc, tb, compact=True)
        _trim(te)
        return "".join(te.format())
    except Exception:  # noqa: BLE001 - __str__/__repr__ raising, or anything else
        try:
            stack = [f for f in traceback.extract_tb(tb) if not kit_frame(f.filename)]
            head = "Traceback (most recent call last):\n" if stack else ""
            name = getattr(exc_type or type(exc), "__qualname__", "Exception")
            return head + "".join(traceback.format_list(stack)) + f"{name}: {safe_str(exc)}\n"
        except Exception:  # noqa: BLE001
            return f"{type(exc).__name__}: <exception str() failed>\n"


def _user_frame(tb: Optional[TracebackType]) -> Optional[traceback.FrameSummary]:
    """The innermost frame of ``tb`` outside the kit and torch (outside the kit where every
    frame is torch's), or None: the user's line that called the kit or torch."""
    frames = [f for f in traceback.extract_tb(tb) if not kit_frame(f.filename)]
    frames = [f for f in frames if _TORCH_MARK not in f.filename] or frames
    return frames[-1] if frames else None


def _site(tb: Optional[TracebackType]) -> str:
    """``path:line in function`` of :func:`_user_frame` ("" if none)."""
    frame = _user_frame(tb)
    return "" if frame is None else f"{short_path(frame.filename)}:{frame.lineno} in {frame.name}"


def user_line(tb: Optional[TracebackType]) -> Optional[str]:
    """``path:line`` of :func:`_user_frame` (None if none): where a failing rank failed, as a
    failure report carries it."""
    frame = _user_frame(tb)
    return None if frame is None else f"{short_path(frame.filename)}:{frame.lineno}"


def excerpt(message: str, limit: int = EXCERPT) -> str:
    """The first words of ``message``: its first line, cut after a word within ``limit``
    characters, ``…`` where anything was left out."""
    lines = message.strip().splitlines() or [""]
    first = lines[0].rstrip()
    if len(first) <= limit and len(lines) == 1:
        return first
    if len(first) > limit:
        head = first[:limit + 1]  # a word that ends at the limit is whole
        cut = head.rsplit(" ", 1)[0] if " " in head else ""
        first = (cut if len(cut) > limit // 2 else first[:limit]).rstrip(" ,;:(")
    return first + "…"


def format_failure(exc: RankFailedError, tb: Optional[TracebackType]) -> str:
    """An uncaught failure of another rank as this rank's account: one line naming this rank's
    own line, the failing rank, where it failed and its exception. Where that rank's output
    is on this machine (it printed its traceback there), its message is only quoted (its
    first words, :func:`excerpt`) and the line says where the rest is; else the whole account
    follows, with the traceback."""
    name = type(exc).__qualname__
    module = type(exc).__module__
    if module not in ("__main__", "builtins"):
        name = f"{module}.{name}"
    site = _site(tb)
    if exc.remote_traceback and exc.machine is not None and exc.machine == MACHINE:
        place = f" in {exc.where}" if exc.where else ""
        if exc.site and " at " not in exc.where:  # its line, where the place names none
            place = f" at {exc.site}"
        quoted = excerpt(exc.exc_message)
        sep = "" if not quoted or quoted[0] in " ;" else ": "
        text = (f"rank {exc.rank} failed{place}: {exc.exc_type}{sep}{quoted} (its traceback is "
                f"in rank {exc.rank}'s output)")
    else:
        text = safe_str(exc)
    return f"{name}{f' at {site}' if site else ''}: {text}\n"


def format_uncaught(exc_type: Type[BaseException], exc: BaseException,
                    tb: Optional[TracebackType]) -> str:
    """What the kit's hook prints for an uncaught exception: :func:`format_failure` for a
    failure relayed from another rank (not chained to another exception), else
    :func:`format_exception`. Never raises."""
    try:
        if isinstance(exc, RankFailedError) and exc.__cause__ is None and (
                exc.__context__ is None or exc.__suppress_context__):
            return format_failure(exc, tb)
    except Exception:  # noqa: BLE001 - fall back to the whole traceback
        pass
    return format_exception(exc_type, exc, tb)


class _Hook:
    """``sys.excepthook`` printing :func:`format_uncaught`, each line after ``prefix``."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix

    def __call__(self, exc_type: Type[BaseException], exc: BaseException,
                 tb: Optional[TracebackType]) -> None:
        failure = hooks.explain_uncaught(exc)  # another rank's failure it stands for
        text = format_failure(failure, tb) if failure is not None else \
            format_uncaught(exc_type, exc, tb)
        if self.prefix:
            text = "".join(f"{self.prefix}: {line}" if line.strip() else line
                           for line in text.splitlines(keepends=True))
        sys.stderr.write(text)
        sys.stderr.flush()


def _torch_prefix(hook: Any) -> Optional[str]:
    """The ``[rankN]`` prefix of the hook ``init_process_group`` wraps the default hook in, or
    ``None`` if ``hook`` is anything else (a user's, IPython's, a wrapper over another hook)."""
    code = getattr(hook, "__code__", None)
    if (getattr(hook, "__name__", "") != "_distributed_excepthook" or code is None
            or not getattr(hook, "__module__", "").startswith("torch.distributed")):
        return None
    cells = dict(zip(code.co_freevars, hook.__closure__ or ()))
    try:
        old, prefix = cells["old_hook"].cell_contents, cells["excepthook_prefix"].cell_contents
    except (KeyError, ValueError):
        return None
    return prefix if old is sys.__excepthook__ and isinstance(prefix, str) else None


def install() -> None:
    """Print uncaught exceptions without the kit's frames, unless another hook (IPython, a
    user's) was installed. torch's own (``init_process_group`` prefixes every line with
    ``[rankN]: ``) is replaced by one that keeps its prefix."""
    current = sys.excepthook
    if current is sys.__excepthook__:
        sys.excepthook = _Hook()
    elif not isinstance(current, _Hook):
        prefix = _torch_prefix(current)
        if prefix is not None:
            sys.excepthook = _Hook(prefix)
