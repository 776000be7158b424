"""What every rank started by ``axolotl-dist`` runs: ``python -m axolotl_dist._rank_main``.

It completes the env contract (``NODE_RANK`` from torchrun's ``GROUP_RANK``), makes the rank
die with the launcher even if the launcher is SIGKILLed (Linux ``PR_SET_PDEATHSIG``), runs the
user's script or module as ``__main__`` (like ``python script.py`` / ``python -m module``) and,
if it raises, writes the exception to torch elastic's error file
(``TORCHELASTIC_ERROR_FILE``) so the launcher can show the traceback of the rank that failed
first. ``SystemExit`` passes through unchanged (exit code kept); ``KeyboardInterrupt`` (the
launcher forwards Ctrl-C) exits with 130 without a traceback.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
import traceback
from types import TracebackType
from typing import List, Optional

__all__ = ["ERROR_FILE_ENV_VAR", "LAUNCHER_PID_ENV_VAR", "main"]

ERROR_FILE_ENV_VAR = "TORCHELASTIC_ERROR_FILE"
#: The launcher's pid; a rank whose parent is already gone at start exits at once.
LAUNCHER_PID_ENV_VAR = "AXOLOTL_DIST_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1


def _die_with_launcher() -> None:
    """Ask the kernel to SIGKILL this rank when its parent (the launcher) dies (Linux only)."""
    expected = os.environ.get(LAUNCHER_PID_ENV_VAR)
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        return
    if expected is not None and expected.isdigit() and os.getppid() != int(expected):
        os._exit(128 + int(signal.SIGKILL))  # the launcher died before we got here


def _set_node_env() -> None:
    group_rank = os.environ.get("GROUP_RANK")
    if group_rank is not None:
        os.environ["NODE_RANK"] = group_rank
    group_size = os.environ.get("GROUP_WORLD_SIZE")
    if group_size is not None:
        os.environ["NUM_NODES"] = group_size


def _user_traceback(tb: Optional[TracebackType]) -> Optional[TracebackType]:
    """Drop the frames of this bootstrap and of runpy from the front of a traceback."""
    skip = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}
    while tb is not None and (tb.tb_frame.f_code.co_filename in skip
                              or os.path.abspath(tb.tb_frame.f_code.co_filename) in skip):
        tb = tb.tb_next
    return tb


def _write_error_file(exc: BaseException, formatted: str) -> None:
    path = os.environ.get(ERROR_FILE_ENV_VAR)
    if not path:
        return
    now = time.time()
    data = {
        # The layout torch elastic's ProcessFailure reads ...
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {"py_callstack": formatted, "timestamp": str(int(now))},
        },
        # ... plus a sub-second time, so the launcher can tell which rank failed first.
        "axolotl_dist": {"time": now, "rank": os.environ.get("RANK"),
                         "exc_type": type(exc).__name__},
    }
    try:
        with open(path, "w") as fh:
            json.dump(data, fh)
    except OSError:  # pragma: no cover - unwritable log dir: the traceback is still on stderr
        pass


def _run(target: str, module: bool) -> None:
    if module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


def main(argv: Optional[List[str]] = None) -> None:
    """``[-m] target args...``: run ``target`` as ``__main__`` with ``sys.argv = [target, *args]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    module = bool(args) and args[0] == "-m"
    if module:
        args = args[1:]
    if not args:
        raise SystemExit("usage: python -m axolotl_dist._rank_main [-m] target [args...]")
    _die_with_launcher()
    _set_node_env()
    target = args[0]
    sys.argv = [target] + args[1:]
    try:
        _run(target, module)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        # The launcher forwards Ctrl-C to every rank: exit like a SIGINT death, without a
        # traceback per rank (finally blocks and atexit hooks have run / still run).
        raise SystemExit(128 + int(signal.SIGINT)) from None
    except BaseException as exc:  # noqa: BLE001 - recorded, shown, then exit code 1 like python
        tb = _user_traceback(exc.__traceback__)
        formatted = "".join(traceback.format_exception(type(exc), exc, tb))
        _write_error_file(exc, formatted)
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        sys.stderr.flush()
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
