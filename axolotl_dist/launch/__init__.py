"""``axolotl-dist``: run a training script on N local ranks (or N per node); torchrun's command
line, with the kit's account of a run.

Usage::

    axolotl-dist -n 2 train.py --lr 1e-4            # 2 ranks on this machine
    axolotl-dist -n 8 -m my_pkg.train               # a module instead of a script
    axolotl-dist -n 8 --nnodes 2 --node-rank 0 --master-addr host0 --master-port 29500 train.py
    axolotl-dist --nproc-per-node 4 --max-restarts 2 --rdzv-backend c10d \\
        --rdzv-endpoint host0:29400 --rdzv-id job7 --nnodes 1:4 train.py   # any torchrun line
    python -m axolotl_dist.launch -n 2 train.py     # same as axolotl-dist

Everything after the script (or module) goes to the script. Every torchrun option is taken,
with torchrun's meaning and default: the parser is torch's own and the configuration comes
from torch's ``config_from_args`` (:mod:`._options`; docs/launching.md, "Options", has the
table and the few places the kit differs). The process manager is ``torch.distributed``
elastic's (:class:`~torch.distributed.launcher.api.elastic_launch`, what ``torchrun`` runs);
this module completes the env contract and reports what happened:

* **Env contract** for every rank: ``RANK``, ``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (plus torchrun's own variables).
* **Single node** (``--nnodes 1``, no ``--master-port``, or ``--standalone``): torch's c10d
  rendezvous on 127.0.0.1 with port 0, so the OS picks a free port (no race); ranks get
  ``MASTER_ADDR=127.0.0.1`` and gloo uses the loopback interface (``GLOO_SOCKET_IFNAME=lo``
  unless set). torch's TCPStore server itself listens on every interface: torch has no
  option to bind it to one address. Otherwise the rendezvous the options name (torchrun's
  static one at ``--master-addr:--master-port`` by default).
* **Failure**: when a rank exits non-zero or is killed, the others get SIGTERM, then SIGKILL
  after the shutdown timeout (torch elastic signals each rank's whole process group). The
  launcher prints which rank failed first, pointing to that rank's traceback above, and exits
  with its exit code (128 + signal for a rank killed by a signal). With ``--max-restarts`` it
  says when a restart begins (:mod:`._restarts`) and the report names the attempt; each
  attempt's ranks record their ends in a directory of its own.
* **Output**: with several local ranks, what they print alike is printed once with the ranks
  that printed it (``[ranks 0-3] ...``), other lines with their rank, tracebacks whole
  (:mod:`._output`, :mod:`._fold`); ``--log-dir DIR`` keeps each rank's every line;
  ``--no-fold`` prints them as they come. A launcher on a terminal gives each rank a
  pseudo-terminal per stream. ``--tee``/``--redirects`` leave the streams to torch.
* **Signals** (``--signals-to-handle``, torchrun's SIGTERM, SIGINT, SIGHUP, SIGQUIT by
  default): every rank gets the same signal, then SIGKILL after ``--shutdown-timeout`` /
  ``--grace-period`` seconds; the launcher exits with 128 + signal. SIGUSR1, unless listed,
  asks for the report of where every rank is (:mod:`._watch`).
* **No process left behind**: on Linux the launcher is a child subreaper, so anything a rank
  started and left orphaned is re-parented to it and stopped when the ranks are done, and every
  rank dies with the launcher even if the launcher is SIGKILLed.
* **Exit**: the command (:func:`cli`) ends the process at once when :func:`main` returns, its
  threads joined, atexit hooks run and streams flushed: the interpreter's teardown of torch's
  modules (about 0.4 CPU-s, a third of the launcher's) does nothing a launcher needs.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Callable, List, Optional, Sequence, Set, Tuple

from .._runtime.base import procs as _procs
from ..env import variables as _variables
from ..env.geometry import check_launcher
from ..env.variables import (END_DIR_ENV_VAR, FOLD_ENV_VAR, LAUNCHER_FOLDS_ENV_VAR,
                             LAUNCHER_TTY_ENV_VAR, SECRET_ENV_VAR, SECRET_FILE_ENV_VAR,
                             TRACE_ENV_VAR, LAUNCHER_PID_ENV_VAR)
from . import _options
from ._restarts import Restarts
from ._report import (GUARDS_DIR, PROG, attempt_dir, attempts, exit_code_of, first_failure,
                      read_ends, report_failures, traceback_of)
from ._output import Output
from ._rank_logs import log_name
from ._watch import Watcher
from ._where import plain as _plain, where_main
from .. import tracing as _tracing
from .._runtime.base.pickling import by_name as _by_name
from .._runtime.protocols.checkpointing import unsaved

__all__ = ["main"]

#: How long the launcher waits on left-over processes between SIGTERM and SIGKILL at exit.
_SWEEP_GRACE = 3.0
_PR_SET_CHILD_SUBREAPER = 36
_OMP_NUM_THREADS_ENV_VAR = "OMP_NUM_THREADS"
_GLOO_IFNAME_ENV_VAR = "GLOO_SOCKET_IFNAME"
_TORCH_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")


def build_parser() -> argparse.ArgumentParser:
    """The ``axolotl-dist`` argument parser: torchrun's, with the kit's options (:mod:`._options`)."""
    return _options.build_parser()


def _become_subreaper() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):  # pragma: no cover
        return False


def _children() -> List[int]:
    """Live (non-zombie) children of this process; zombies are reaped on the way."""
    live = []
    for pid, state in _procs.children(os.getpid()):
        if state == "Z":
            _procs.reap(pid)
        else:
            live.append(pid)
    return live


def _sweep(grace: float) -> List[int]:
    """Stop every process still parented to the launcher: SIGTERM, ``grace``, SIGKILL."""
    stopped: List[int] = []
    deadline = time.monotonic() + grace
    sig = signal.SIGTERM
    while True:
        pids = _children()
        if not pids:
            return stopped
        if time.monotonic() >= deadline:
            if sig == signal.SIGKILL and time.monotonic() >= deadline + grace:
                return stopped  # unkillable (D state): give up rather than hang
            sig, deadline = signal.SIGKILL, time.monotonic() + grace
        for pid in pids:
            if pid not in stopped:
                stopped.append(pid)
            _procs.signal_tree(pid, sig)
        time.sleep(0.05)
        for pid in pids:
            _procs.reap(pid)


def _raise_signal_exception(signum: int, frame) -> None:
    from torch.distributed.elastic.multiprocessing import SignalException

    raise SignalException(f"{PROG} got signal {signum}", sigval=signal.Signals(signum))


def _quiet_torch_logs(verbose: bool) -> None:
    level = logging.INFO if verbose else logging.CRITICAL
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(_TORCH_LOGGERS):
            logging.getLogger(name).setLevel(level)


def _set_loopback_gloo(nnodes: int) -> None:
    """On one node, gloo's pairs use the loopback interface (not whatever the hostname resolves to)."""
    if nnodes != 1 or _GLOO_IFNAME_ENV_VAR in os.environ:
        return
    lo = _procs.loopback_interface()
    if lo is not None:
        os.environ[_GLOO_IFNAME_ENV_VAR] = lo


#: torch's switch that gives each rendezvous round a fresh store for the ranks instead of the
#: agent's (docs/launching.md, "Restarts").
_NO_SHARED_STORE_ENV_VAR = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def _set_elastic_store(min_nodes: int, max_nodes: int) -> None:
    """``--nnodes MIN:MAX``: torch's c10d rendezvous cannot admit a node into a later round
    while the agents share their store with the ranks (the joining agent waits for the round's
    ``MASTER_ADDR``, which only a first round writes): each round then gets a store of its own,
    hosted by rank 0's process, unless the user set the variable."""
    if min_nodes < max_nodes and _NO_SHARED_STORE_ENV_VAR not in os.environ:
        os.environ[_NO_SHARED_STORE_ENV_VAR] = "1"


def _set_thread_default(nproc: int) -> None:
    if _OMP_NUM_THREADS_ENV_VAR not in os.environ and nproc > 1:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        os.environ[_OMP_NUM_THREADS_ENV_VAR] = str(max(1, (cpus or 1) // nproc))


def _set_secret(max_nodes: int) -> None:
    """A one-node run's secret, made here unless the user gave one (or ``off``): it reaches
    the ranks through their environment, this process's ``where`` and the run's record
    (docs/design/store.md, "Trust model"). Several nodes need the user's (each node's launcher would
    make another): without it, the run has none."""
    _variables.kit_secret()  # a bad one is the user's error, said before any rank starts
    if max_nodes == 1 and SECRET_ENV_VAR not in os.environ \
            and SECRET_FILE_ENV_VAR not in os.environ:
        os.environ[SECRET_ENV_VAR] = secrets.token_hex(32)


def run(opts: _options.Options, tmp_dir: str) -> int:
    """Launch the ranks and wait for them; return the launcher's exit code."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    args = opts.args
    check_launcher(os.environ, opts.nproc, opts.min_nodes, opts.max_nodes)  # before any wait
    _quiet_torch_logs(args.verbose)
    _set_thread_default(opts.nproc)
    _set_loopback_gloo(opts.nnodes)
    _set_elastic_store(opts.min_nodes, opts.max_nodes)
    _set_secret(opts.max_nodes)
    os.environ[LAUNCHER_PID_ENV_VAR] = str(os.getpid())
    end_dir = os.environ[END_DIR_ENV_VAR] = os.path.join(tmp_dir, "ends")
    os.makedirs(end_dir, mode=0o700, exist_ok=True)  # in tmp_dir, this user's alone (0700)
    config = _options.launch_config(opts, tmp_dir)
    note = _options.rendezvous_note(opts)
    watcher = Watcher(PROG, end_dir, (lambda: note) if note else None,
                      script=args.training_script, world=opts.nproc * opts.nnodes,
                      stop_signals=tuple(opts.signals), report=True)
    output = _start_output(opts, tmp_dir)
    restarts = Restarts(opts.restarts, end_dir, output.announce if output is not None else None,
                        retry_same=args.retry_same_failure)
    first = opts.node_rank * opts.nproc
    try:
        try:
            elastic_launch(config, sys.executable)(*_options.rank_command(opts))
        finally:
            restarts.close()
            if output is not None:
                output.close()  # every rank's output is out before the launcher's account
        return 0
    except ChildFailedError as exc:
        attempt = attempt_dir(end_dir, restarts.attempt)
        return report_failures(exc.failures, opts.nnodes, opts.node_rank, read_ends(attempt),
                               opts.nproc * opts.nnodes, range(first, first + opts.nproc),
                               output=_output_note(output), attempt=restarts.label(),
                               shown=opts.shown, unsaved=unsaved(attempt))
    except SignalException as exc:
        if watcher.claim():  # else the watcher is saying why it stops the launcher
            print(f"{PROG}: got {signal.Signals(exc.sigval).name}, stopped every rank",
                  file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    finally:
        watcher.close()
        _merge_trace()


def _start_output(opts: _options.Options, tmp_dir: str) -> Optional[Output]:
    """Take the ranks' output (docs/launching.md, "Output from N ranks"): folded where
    several ranks print, kept in ``--log-dir``, on a pseudo-terminal per stream where the
    launcher's is a terminal; None where none of it applies (one rank, ``--no-fold`` without a
    log directory, or ``--tee``/``--redirects``: torch's files take the streams): the ranks
    then write to what torch gives them, as under torchrun. Its socket goes in ``tmp_dir``,
    the launcher's own directory (docs/design/launching.md, "Local channels")."""
    args = opts.args
    if not args.fold:
        os.environ[FOLD_ENV_VAR] = "0"  # no folding anywhere: the ranks' warnings neither
    if opts.torch_streams or (opts.kit_log_dir is None and (opts.nproc < 2 or not args.fold)):
        return None
    output = Output(opts.nproc, args.fold and opts.nproc > 1, opts.kit_log_dir, opts.shown,
                    directory=tmp_dir, fold_cpp=args.fold)
    os.environ[LAUNCHER_FOLDS_ENV_VAR] = output.address
    os.environ[LAUNCHER_TTY_ENV_VAR] = output.ttys  # "" where neither stream is a terminal
    return output


def _output_note(output: Optional[Output]) -> Optional[Callable[[int], str]]:
    """For the failure report: where a rank's own lines are (their mark, their file)."""
    if output is None:
        return None

    def note(rank: int) -> str:
        parts = [f"marked rank {rank}"] if output.folder.fold else []
        if output.log_dir is not None:  # None where it could not be written
            parts.append(os.path.join(output.log_dir, log_name(rank)))
        return ", ".join(parts)
    return note


def _merge_trace() -> None:
    """With ``AXOLOTL_DIST_TRACE`` set, merge this node's rank files once every rank ended."""
    directory = _variables.kit_path(TRACE_ENV_VAR)
    _tracing.merge_after_run(directory)


def trace_main(argv: Sequence[str]) -> int:
    """``axolotl-dist trace DIR``: merge the rank files a traced run left in ``DIR`` into
    ``trace.json`` (Chrome Trace Event format), ``summary.txt`` and, with matplotlib,
    ``timeline.png``; print the summary table."""
    parser = argparse.ArgumentParser(prog=f"{PROG} trace", description=_plain(trace_main.__doc__))
    parser.add_argument("directory", help="the run's AXOLOTL_DIST_TRACE / trace_dir")
    parser.add_argument("--no-png", action="store_true", help="skip timeline.png")
    args = parser.parse_args(argv)
    try:
        merged = _tracing.merge_trace(args.directory, png=not args.no_png)
    except (OSError, ValueError) as exc:
        print(f"{PROG} trace: {exc}", file=sys.stderr)
        return 1
    print(merged.report(), end="")
    return 0


def _stop_left_behind(tmp_dir: str) -> None:
    """Stop the processes the ranks left behind (re-parented to the launcher, a subreaper) and
    say which, but for the kit's own guards (their pids are files under each attempt's end
    directory)."""
    left = _sweep(_SWEEP_GRACE)
    base, ours = os.path.join(tmp_dir, "ends"), set()  # type: Tuple[str, Set[str]]
    for attempt in attempts(base):
        guards = os.path.join(attempt_dir(base, attempt), GUARDS_DIR)
        ours.update(os.listdir(guards) if os.path.isdir(guards) else ())
    left = [pid for pid in left if str(pid) not in ours]  # not the kit's own guards
    if left:
        print(f"{PROG}: stopped {len(left)} process(es) the ranks left behind: {left}",
              file=sys.stderr, flush=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``axolotl-dist`` and ``python -m axolotl_dist.launch``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["where"] and not os.path.isfile("where"):
        return where_main(argv[1:])
    if argv[:1] == ["trace"] and not os.path.isfile("trace"):
        return trace_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        opts = _options.validate(args)
    except ValueError as exc:
        parser.error(str(exc))
    previous = {sig: signal.getsignal(sig) for sig in opts.signals}  # restored on return
    for sig in opts.signals:
        signal.signal(sig, _raise_signal_exception)  # until torch installs the same handler
    subreaper = _become_subreaper()
    tmp_dir = tempfile.mkdtemp(prefix="axolotl_dist_")
    code = 1
    try:
        code = run(opts, tmp_dir)
    except Exception as exc:  # noqa: BLE001 - rendezvous errors, a second Ctrl-C, ...
        sigval = getattr(exc, "sigval", None)
        if sigval is not None:  # a signal while torch was already shutting ranks down
            code = 128 + int(sigval)
        else:
            if args.verbose:
                raise
            print(f"{PROG}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            code = 1
    finally:
        for sig in opts.signals:
            signal.signal(sig, signal.SIG_IGN)  # the sweep below is bounded; finish it
        if subreaper:
            _stop_left_behind(tmp_dir)
        shutil.rmtree(tmp_dir, ignore_errors=True)
        for sig, handler in previous.items():  # a caller of main() (a test) keeps its Ctrl-C;
            signal.signal(sig, handler)  # an ignored SIGINT would be inherited by its children
    return code


_by_name(__name__)  # pickled by name, as the rest of the kit (docs/design/machine.md, "Installs")


def _status(exc: SystemExit) -> int:
    """The exit status ``raise SystemExit(code)`` gives (a message goes to stderr, status 1)."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def cli() -> None:
    """The ``axolotl-dist`` command (and ``python -m axolotl_dist.launch``): :func:`main`, then
    the end of the process without the interpreter's teardown (the module docstring's "Exit")."""
    try:
        code = main()
    except SystemExit as exc:  # argparse: --help, --version, a usage error
        code = _status(exc)
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # what the interpreter runs at exit (logging's flush among them)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can be said there
            pass
    os._exit(code)
