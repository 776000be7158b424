"""A start-up failure that repeats stops the restarts (docs/launching.md, "Restarts").

A rank that ends with an uncaught exception before its first collective (an ImportError, a
bad path, a model that does not fit: :func:`startup_failure`, the exception's type and the
line that raised it) fails the same way on the next attempt, and on every one after, each
after the queue's wait. So when an attempt's start-up failure is the one the attempt before
ended with, the restarts stop, with one line saying why:

* under ``axolotl-dist``, its launcher compares the ranks' end records (``launch/_restarts.py``);
* under torch elastic's agent in another process (``torchrun``, ``accelerate launch``), the
  rank itself, at exit: it records the failure beside its error file
  (``TORCHELASTIC_ERROR_FILE``, a directory per attempt and local rank), reads what the same
  local rank recorded in the attempt before, and, where they agree, stops the agent (SIGTERM
  to its parent, the agent: its own lines follow). A script that fails before it imports
  ``axolotl_dist`` is out of reach here.

``AXOLOTL_DIST_RETRY_SAME_FAILURE=1`` (``axolotl-dist --retry-same-failure``) restarts anyway.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import signal
import sys
from types import TracebackType
from typing import Optional

from ..base.callsite import short_path
from ...env.variables import LAUNCHER_PID_ENV_VAR, RETRY_SAME_FAILURE_ENV_VAR, kit_switch, raw
from ..base.kitlog import kit as log
from ...errors import DistributedEnvError
from .startup import starting_up

__all__ = ["startup_failure", "watch"]

_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
_RECORD = "axolotl_dist_startup_failure"
_ATTEMPT_DIR = re.compile(r"^(.*[/\\])attempt_(\d+)([/\\][^/\\]+)$")
#: Words of a torch elastic agent's command line (torchrun, python -m torch.distributed.run,
#: accelerate launch).
_AGENTS = ("torchrun", "torch.distributed.run", "accelerate")


def startup_failure(exc: BaseException, tb: Optional[TracebackType]) -> Optional[str]:
    """``"ModuleNotFoundError at train.py:3"``: the type and the raising line of ``exc`` if
    this process is still starting up (no collective since ``init_distributed``), else None."""
    if not starting_up():
        return None
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    site = "" if tb is None else f" at {short_path(tb.tb_frame.f_code.co_filename)}:{tb.tb_lineno}"
    return f"{type(exc).__name__}{site}"


def watch() -> None:
    """Under an agent in another process with restarts to try, look at this process's end
    (:func:`_at_exit`). Called at import and again at the end of ``init_distributed``, so the
    look comes before the kit's exit hook takes the group down (``atexit`` runs last first)."""
    if raw(_ERROR_FILE) is None or raw(LAUNCHER_PID_ENV_VAR) is not None:
        return  # no agent, or axolotl-dist's own policy
    if os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0").strip() in ("", "0"):
        return
    atexit.unregister(_at_exit)
    atexit.register(_at_exit)


def _previous(record: str) -> Optional[str]:
    """The same local rank's record path in the attempt before, or None for the first."""
    match = _ATTEMPT_DIR.match(os.path.dirname(record))
    if match is None or int(match.group(2)) == 0:
        return None
    return os.path.join(f"{match.group(1)}attempt_{int(match.group(2)) - 1}{match.group(3)}",
                        _RECORD)


def _read(path: Optional[str]) -> Optional[str]:
    try:
        with open(path or "", encoding="utf-8") as fh:
            return fh.read()
    except OSError:
        return None


def _agent_pid() -> Optional[int]:
    """The parent's pid if it is a torch elastic agent (its command line says so)."""
    parent = os.getppid()
    command = (_read(f"/proc/{parent}/cmdline") or "").replace("\0", " ")
    return parent if any(word in command for word in _AGENTS) else None


def _at_exit() -> None:
    """This process ends: if by an uncaught exception at start-up, record it; if the attempt
    before ended the same way, stop the agent (see the module docstring). Never raises."""
    exc = getattr(sys, "last_value", None)
    if exc is None:
        return
    try:
        failure = startup_failure(exc, getattr(sys, "last_traceback", None))
        record = os.path.join(os.path.dirname(os.environ[_ERROR_FILE]), _RECORD)
        if failure is None or not os.path.isdir(os.path.dirname(record)):
            return
        with open(record, "w", encoding="utf-8") as fh:
            fh.write(failure)
        if _read(_previous(record)) != failure or kit_switch(RETRY_SAME_FAILURE_ENV_VAR):
            return
        agent = _agent_pid()
        if agent is None:
            return
        log.emit(logging.ERROR, "this attempt failed as the attempt before did, before its first "
                 "collective (%s): stopping the launcher's restarts (pid %d), the next attempt "
                 "would fail the same way (%s=1 restarts anyway)", failure, agent,
                 RETRY_SAME_FAILURE_ENV_VAR)
        os.kill(agent, signal.SIGTERM)
    except (OSError, KeyError, DistributedEnvError):  # the restarts then go on, as torch's
        return
