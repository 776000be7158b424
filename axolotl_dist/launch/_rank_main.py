"""What every rank started by ``axolotl-dist`` runs: ``python -m axolotl_dist.launch._rank_main``.

It completes the env contract (``NODE_RANK`` from torchrun's ``GROUP_RANK``), makes the rank
die with the launcher even if the launcher is SIGKILLed (Linux ``PR_SET_PDEATHSIG``), and
starts a small guard process that, when the rank dies and the launcher is gone too, kills
whatever the rank left running in its process group (a SIGKILLed launcher leaves nothing
behind). It runs the user's script or module as ``__main__`` (like ``python script.py`` /
``python -m module``) and, if it raises, writes the exception to torch elastic's error file
(``TORCHELASTIC_ERROR_FILE``) so the launcher can show the traceback of the rank that failed
first (or, where the traceback went to the launcher's own output, point to it there).
``SystemExit`` passes through unchanged (exit code kept); ``KeyboardInterrupt`` (the
launcher forwards Ctrl-C) exits with 130 without a traceback. Where the launcher takes the
ranks' output (folding it, keeping it in ``--log-dir``: :mod:`._output`), file descriptors 1
and 2 become connections to it before anything else runs. Output is line-buffered (each
line one write, so the ranks' lines never interleave mid-line). Every way the script ends is
recorded (exit code and time) in its attempt's own directory under ``AXOLOTL_DIST_END_DIR``
(``<dir>/<TORCHELASTIC_RESTART_COUNT>``: the bootstrap points the variable there for the rest
of the process, the kit's runtime included), so the launcher can name the first rank that
ended while the others still ran, even with exit code 0, and a restarted run never reads the
records of the attempt before. ``--exec`` (the launcher's ``--no-python``): after setting the
rank up, the bootstrap ``exec``s the executable instead of running Python; its output, the
parent-death signal and the guard stay, but nothing records how it ended.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
from types import TracebackType
from typing import Dict, List, Optional, Tuple

from ..env.variables import TORCHRUN_NODE_ALIASES, LAUNCHER_PID_ENV_VAR, is_decimal
from .._runtime.base.private import DIR_MODE, create_private, write_private
from .._runtime.base.tracebacks import format_exception, install, safe_str
from ..errors import RankFailedError
from ._output import connect as _connect_output
from ._report import GUARDS_DIR, RESTART_COUNT_ENV_VAR, attempt_dir

__all__ = ["ERROR_FILE_ENV_VAR", "LAUNCHER_PID_ENV_VAR", "END_DIR_ENV_VAR", "GUARDS_DIR", "main"]

ERROR_FILE_ENV_VAR = "TORCHELASTIC_ERROR_FILE"
#: The launcher's pid; a rank whose parent is already gone at start exits at once.
#: Where each rank records how and when its script ended (set by the launcher).
from ..env.variables import END_DIR_ENV_VAR  # noqa: E402 - re-exported for the launcher
_PR_SET_PDEATHSIG = 1
#: ``[device, inode]`` of the launcher's output socket once stderr goes there (:mod:`._output`).
_TO_LAUNCHER: Optional[List[int]] = None


def _prctl_pdeathsig(sig: int) -> bool:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        return False


#: What the guard runs, in a Python of its own (``-I -S``: no site, no user paths, a few
#: megabytes): argv is ``[label, rank pid, launcher pid, rank's process group]``. SIGTERM comes
#: blocked (posix_spawn's mask), so it is only ever taken by ``sigwait``. ``alive`` is
#: ``procs.alive``'s rule and ``prctl(1, ...)`` is :func:`_prctl_pdeathsig`, written out:
#: importing anything of the kit would import torch, the heap the guard must not have.
_GUARD_PROGRAM = """
import ctypes, os, signal, sys
rank, launcher, group = (int(a) for a in sys.argv[2:5])
def alive(pid):
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except ProcessLookupError:
        return False
    except OSError:
        return True
try:
    if ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0) == 0 and os.getppid() == rank:
        signal.sigwait({signal.SIGTERM})
    if not alive(launcher):
        os.killpg(group, signal.SIGKILL)
finally:
    os._exit(0)
"""


def _start_guard() -> None:
    """Start the guard: it waits for this rank to die (parent-death signal) and then, if the
    launcher is gone too, SIGKILLs this rank's process group, where the children it started
    live (they would otherwise run on with parent pid 1). With the launcher alive it just
    exits: the launcher stops leftovers itself. The guard is a fresh small Python
    (``posix_spawn``), not a fork of this rank: a fork would share the rank's torch-sized heap
    copy-on-write, so every page the rank then wrote (each garbage collection, and the whole
    heap at exit) would be copied, and the guard would keep the old copy: at 32 ranks on 2
    cores that made the ranks' exit 5 s slower than under torchrun."""
    launcher = os.environ.get(LAUNCHER_PID_ENV_VAR, "")
    if not sys.platform.startswith("linux") or not is_decimal(launcher):
        return
    quiet = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)]
    try:
        guard = os.posix_spawn(
            sys.executable,
            [sys.executable, "-I", "-S", "-c", _GUARD_PROGRAM, "axolotl-dist-guard",
             str(os.getpid()), launcher, str(os.getpgid(0))],
            os.environ, file_actions=quiet,  # none of the rank's pipes held open
            setpgroup=0,  # out of the rank's group: signals to it must not reach the guard
            setsigmask={signal.SIGTERM})
    except OSError:  # pragma: no cover - no Python to start: the launcher alone stops leftovers
        return
    _note_guard(guard)


def _note_guard(pid: int) -> None:
    directory = os.environ.get(END_DIR_ENV_VAR)
    if not directory:
        return
    try:
        guards = os.path.join(directory, GUARDS_DIR)
        for made in (directory, guards):  # inside the launcher's own 0700 directory
            try:
                os.mkdir(made, DIR_MODE)
            except FileExistsError:
                pass
        os.close(create_private(os.path.join(guards, str(pid))))
    except OSError:  # pragma: no cover - the launcher then reports it if it outlives the rank
        pass


def _own_attempt_dir() -> None:
    """Record this rank's end (and its guard, the store's note) in its attempt's own
    directory under the launcher's (``--max-restarts``: a restarted attempt must not mix with
    the records of the one before): ``AXOLOTL_DIST_END_DIR/<TORCHELASTIC_RESTART_COUNT>``."""
    base, count = os.environ.get(END_DIR_ENV_VAR), os.environ.get(RESTART_COUNT_ENV_VAR, "0")
    if base and is_decimal(count.strip()):
        os.environ[END_DIR_ENV_VAR] = attempt_dir(base, int(count))


def _exec(target: str, args: List[str]) -> None:
    """``--no-python``: become the executable (the output, the parent-death signal and the
    guard stay; nothing is left to record how it ends: the launcher reads its exit code)."""
    from .._runtime.base.procs import flush_standard_streams

    flush_standard_streams()
    try:
        os.execvp(target, [target, *args])
    except OSError as exc:
        print(f"axolotl-dist: cannot run {target!r}: {exc.strerror or exc}", file=sys.stderr)
        os._exit(127)


def _die_with_launcher() -> None:
    """Ask the kernel to SIGKILL this rank when its parent (the launcher) dies (Linux only)."""
    expected = os.environ.get(LAUNCHER_PID_ENV_VAR)
    if not sys.platform.startswith("linux"):
        return
    if not _prctl_pdeathsig(signal.SIGKILL):  # pragma: no cover - exotic libc
        return
    if expected is not None and is_decimal(expected) and os.getppid() != int(expected):
        os._exit(128 + int(signal.SIGKILL))  # the launcher died before we got here


def _set_node_env() -> None:
    """Copy torchrun's node names (``GROUP_RANK``...) to the kit's (``NODE_RANK``...), for user
    code that reads the env itself; the kit reads either."""
    for ours, torchrun in TORCHRUN_NODE_ALIASES:
        value = os.environ.get(torchrun)
        if value is not None:
            os.environ[ours] = value


def _user_traceback(tb: Optional[TracebackType]) -> Optional[TracebackType]:
    """Drop the frames of this bootstrap and of runpy from the front of a traceback."""
    skip = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}
    while tb is not None and (tb.tb_frame.f_code.co_filename in skip
                              or os.path.abspath(tb.tb_frame.f_code.co_filename) in skip):
        tb = tb.tb_next
    return tb


def _stream_id(stream) -> Optional[List[int]]:
    """``[device, inode]`` of the file behind ``stream`` (None if it has none): the launcher
    compares it with its own stderr's to tell whether this rank's traceback went to its output."""
    try:
        st = os.fstat(stream.fileno())
    except (AttributeError, OSError, ValueError):  # replaced by a StringIO, closed
        return None
    return [st.st_dev, st.st_ino]


def _write_error_file(exc: BaseException, formatted: str, now: float, printed_to: object) -> None:
    path = os.environ.get(ERROR_FILE_ENV_VAR)
    if not path:
        return
    data = {
        # The layout torch elastic's ProcessFailure reads ...
        "message": {
            "message": f"{type(exc).__name__}: {safe_str(exc)}",
            "extraInfo": {"py_callstack": formatted, "timestamp": str(int(now))},
        },
        # ... plus a sub-second time, so the launcher can tell which rank failed first.
        # ... and where the excepthook printed the traceback: the launcher's own output
        # already shows it if that is the launcher's stderr.
        "axolotl_dist": {"time": now, "rank": os.environ.get("RANK"),
                         "exc_type": type(exc).__name__, "printed_to": printed_to},
    }
    try:  # whole or absent: torch's agent json-loads the file the moment this process is gone
        write_private(path, json.dumps(data).encode())
    except OSError:  # pragma: no cover - unwritable log dir: the traceback is still on stderr
        pass


def _exit_code(exc: SystemExit) -> int:
    """The process exit status ``sys.exit(code)`` gives."""
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


#: ``"ModuleNotFoundError at train.py:3"``: what this rank raised before its first collective
#: (the launcher's restart policy compares it with the attempt before); None: nothing such.
_STARTUP_FAILURE: Optional[str] = None
#: ``(rank, what it did)``: the other rank whose failure this rank's uncaught
#: ``RankFailedError`` names (a lost node's rank), for the launcher's restart line.
_FIRST_FAILURE: Optional[Tuple[int, str]] = None


def _record_end(code: int) -> None:
    """Tell the launcher how and when this rank's script ended."""
    directory, rank = os.environ.get(END_DIR_ENV_VAR), os.environ.get("RANK")
    if not directory or rank is None:
        return
    end: Dict[str, object] = {"rank": int(rank), "code": code, "time": time.time(),
                              "pid": os.getpid()}
    if _STARTUP_FAILURE is not None:
        end["startup"] = _STARTUP_FAILURE
    if _FIRST_FAILURE is not None:
        end["blames"], end["why"] = _FIRST_FAILURE
    try:
        write_private(os.path.join(directory, f"{rank}.json"), json.dumps(end).encode())
    except (OSError, ValueError):  # pragma: no cover - the launcher then knows less
        pass


def _line_buffered() -> None:
    """Output reaches the launcher line by line, each line in one write, so the ranks' lines
    never interleave mid-line (``python -u`` writes every piece of a ``print`` separately)."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            try:
                reconfigure(line_buffering=True, write_through=False)
            except (ValueError, OSError):  # a closed or replaced stream: leave it
                pass


def _run(target: str, module: bool) -> None:
    if module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


def _mode(argv: List[str]) -> Tuple[bool, bool, List[str]]:
    """``(module, execute, [target, *args])`` of the bootstrap's arguments."""
    module = bool(argv) and argv[0] == "-m"
    execute = bool(argv) and argv[0] == "--exec"
    args = argv[1:] if module or execute else argv
    if not args:
        raise SystemExit("usage: python -m axolotl_dist.launch._rank_main [-m | --exec] target "
                         "[args...]")
    return module, execute, args


def main(argv: Optional[List[str]] = None) -> None:
    """``[-m | --exec] target args...``: run ``target`` as ``__main__`` with ``sys.argv =
    [target, *args]`` (``--exec``: execute it, ``--no-python``)."""
    module, execute, args = _mode(list(sys.argv[1:] if argv is None else argv))
    global _TO_LAUNCHER
    _own_attempt_dir()
    if _connect_output():  # the launcher folds and keeps this rank's output (._output)
        _TO_LAUNCHER = _stream_id(sys.stderr)
    _line_buffered()
    _die_with_launcher()
    _start_guard()
    _set_node_env()
    if execute:
        _exec(args[0], args[1:])
    install()  # uncaught exceptions print the user's frames, not the kit's
    target = args[0]
    sys.argv = [target] + args[1:]
    code = 1
    try:
        _run(target, module)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc)
        raise
    except KeyboardInterrupt:
        # The launcher forwards Ctrl-C to every rank: exit like a SIGINT death, without a
        # traceback per rank (finally blocks and atexit hooks have run / still run).
        code = 128 + int(signal.SIGINT)
        raise SystemExit(code) from None
    except BaseException as exc:  # noqa: BLE001 - recorded, shown, then exit code 1 like python
        _uncaught(exc)
        raise SystemExit(1) from None
    finally:
        _record_end(code)


def _uncaught(exc: BaseException) -> None:
    """What python does with an uncaught exception, with the user's frames only: print it
    (through ``sys.excepthook``), then the error file saying where it was printed, and
    ``sys.last_*`` for the kit's exit hook, which reports it to the peers."""
    global _STARTUP_FAILURE, _FIRST_FAILURE
    now = time.time()
    if isinstance(exc, RankFailedError):
        why = f"{exc.exc_type}: {exc.exc_message}"
        _FIRST_FAILURE = (exc.rank, why if len(why) <= 160 else why[:160].rsplit(" ", 1)[0] + " ...")
    tb = _user_traceback(exc.__traceback__)
    try:
        from .._runtime.lifecycle.repeat_failure import startup_failure

        _STARTUP_FAILURE = startup_failure(exc, tb)
    except Exception:  # noqa: BLE001 - the launcher then restarts as torch would
        _STARTUP_FAILURE = None
    formatted = format_exception(type(exc), exc, tb)
    printed_to: object = _stream_id(sys.stderr)
    if printed_to is not None and printed_to == _TO_LAUNCHER:
        printed_to = "launcher"  # the launcher's socket: it shows it on its own stderr
    try:
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        sys.stderr.flush()
    except Exception:  # noqa: BLE001 - a user's hook that raised: the launcher shows it
        printed_to = None
    # after printing: a file that says "printed" is never written before the traceback is
    _write_error_file(exc, formatted, now, printed_to)
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
    if sys.version_info >= (3, 12):  # pragma: no cover - 3.12 reads sys.last_exc
        sys.last_exc = exc


if __name__ == "__main__":
    main()
