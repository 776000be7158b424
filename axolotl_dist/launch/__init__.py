"""``axolotl-dist``: run a training script on N local ranks (or N per node), a thin front over torchrun.

Usage::

    axolotl-dist -n 2 train.py --lr 1e-4            # 2 ranks on this machine
    axolotl-dist -n 8 -m my_pkg.train               # a module instead of a script
    axolotl-dist -n 8 --nnodes 2 --node-rank 0 --master-addr host0 --master-port 29500 train.py
    python -m axolotl_dist.launch -n 2 train.py     # same as axolotl-dist

Everything after the script (or module) goes to the script. The process manager is
``torch.distributed`` elastic's (:class:`~torch.distributed.launcher.api.elastic_launch`, what
``torchrun`` runs); this module chooses its configuration, completes the env contract and
reports failures:

* **Env contract** for every rank: ``RANK``, ``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (plus torchrun's own variables).
* **Single node** (``--nnodes 1``, no ``--master-port``): torch's c10d rendezvous on
  127.0.0.1 with port 0, so the OS picks a free port (no race); ranks get
  ``MASTER_ADDR=127.0.0.1`` and gloo uses the loopback interface (``GLOO_SOCKET_IFNAME=lo``
  unless set). torch's TCPStore server itself listens on every interface: torch has no
  option to bind it to one address. Multi-node: the static rendezvous at
  ``--master-addr:--master-port`` hosted by node 0.
* **Failure**: when a rank exits non-zero or is killed, the others get SIGTERM, then SIGKILL
  after a grace period (torch elastic signals each rank's whole process group). The launcher
  prints which rank failed first, pointing to that rank's traceback above, and exits with its
  exit code (128 + signal for a rank killed by a signal).
* **Output**: with several local ranks, what they print alike is printed once with the ranks
  that printed it (``[ranks 0-3] ...``), other lines with their rank, tracebacks whole
  (:mod:`._output`, :mod:`._fold`); ``--log-dir DIR`` keeps each rank's every line;
  ``--no-fold`` prints them as they come.
* **Ctrl-C / SIGTERM** to the launcher: every rank gets the same signal, then SIGKILL after
  ``--grace-period`` seconds; the launcher exits with 128 + signal.
* **No process left behind**: on Linux the launcher is a child subreaper, so anything a rank
  started and left orphaned is re-parented to it and stopped when the ranks are done, and every
  rank dies with the launcher even if the launcher is SIGKILLed.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from typing import List, Optional, Sequence, Tuple

from .._runtime.base import envvars as _envvars, procs as _procs
from .._runtime.base.constants import (END_DIR_ENV_VAR, FOLD_ENV_VAR, LAUNCHER_FOLDS_ENV_VAR,
                                       LOG_DIR_ENV_VAR, TRACE_ENV_VAR)
from ._report import (GUARDS_DIR, PROG, exit_code_of, first_failure, read_ends,
                      report_failures, traceback_of)
from ._output import Output, log_name
from ._watch import Watcher
from ._where import LOOPBACK as _LOOPBACK, plain as _plain, where_main
from .. import tracing as _tracing
from .._runtime.base.pickling import by_name as _by_name
from .._runtime.base.procs import LAUNCHER_PID_ENV_VAR

__all__ = ["main"]

#: Seconds ranks get between SIGTERM and SIGKILL when the launcher is interrupted.
DEFAULT_GRACE_PERIOD = 30.0
#: How long the launcher waits on left-over processes between SIGTERM and SIGKILL at exit.
_SWEEP_GRACE = 3.0
_PR_SET_CHILD_SUBREAPER = 36
_OMP_NUM_THREADS_ENV_VAR = "OMP_NUM_THREADS"
_GLOO_IFNAME_ENV_VAR = "GLOO_SOCKET_IFNAME"
_TORCH_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")


def _default_nproc() -> int:
    try:
        import torch

        return max(1, torch.cuda.device_count())
    except Exception:  # noqa: BLE001 - no torch / broken CUDA: one rank
        return 1


#: The subcommands, as ``--help`` lists them.
_COMMANDS = (
    ("where [--master-addr A] [--master-port P]",
     "where every rank of a running job is (any launcher; torchrun's --rdzv-endpoint too); "
     "without a port, the runs recorded on this host"),
    ("trace DIR", "merge a traced run's rank files into trace.json, summary.txt, timeline.png"),
)


def build_parser() -> argparse.ArgumentParser:
    """The ``axolotl-dist`` argument parser (options first, then the script and its arguments)."""
    import torch

    from .. import __version__

    commands = "\n".join(f"  {PROG} {usage}\n      {what}" for usage, what in _COMMANDS)
    p = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run a PyTorch training script on several ranks (a thin front over torchrun).",
        epilog=f"Every argument after the script or module is passed to it unchanged.\n\n"
               f"Other commands ({PROG} COMMAND --help for theirs):\n{commands}")
    p.add_argument("--version", action="version",
                   version=f"{PROG} {__version__} (torch {torch.__version__})")
    p.add_argument("-n", "--nproc-per-node", "--nproc_per_node", dest="nproc_per_node",
                   metavar="N", default=None,
                   help="ranks on this node (default: the number of GPUs, else 1)")
    p.add_argument("-m", "--module", action="store_true",
                   help="run the target as a module (python -m), not as a script path")
    p.add_argument("--nnodes", default="1", metavar="NODES", help="number of nodes (default 1)")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", default="0", metavar="R",
                   help="index of this node in [0, NODES) (default 0)")
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", default=None,
                   metavar="HOST", help="host of node 0 (required with --nnodes > 1; "
                   "default 127.0.0.1 on one node)")
    p.add_argument("--master-port", "--master_port", dest="master_port", default=None,
                   metavar="PORT", help="rendezvous port on the master host (required with "
                   "--nnodes > 1; default: a free port chosen by the OS on one node)")
    p.add_argument("--grace-period", dest="grace_period", type=float,
                   default=DEFAULT_GRACE_PERIOD, metavar="SECONDS",
                   help="after Ctrl-C or SIGTERM, seconds ranks get before SIGKILL (default 30)")
    p.add_argument("--rdzv-timeout", dest="rdzv_timeout", type=int, default=900,
                   metavar="SECONDS", help="how long nodes wait for each other (default 900)")
    p.add_argument("--log-dir", dest="output_dir", default=_envvars.kit_path(LOG_DIR_ENV_VAR),
                   metavar="DIR", help="write each rank's whole output, unfolded, to "
                   f"DIR/rank<r>.log, each line with its time and stream (env {LOG_DIR_ENV_VAR})")
    p.add_argument("--no-fold", dest="fold", action="store_false",
                   default=_envvars.kit_switch(FOLD_ENV_VAR),
                   help="print every rank's lines as they come, instead of once for all the "
                   f"ranks that print them alike (env {FOLD_ENV_VAR}=0)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show torch elastic's own log messages")
    p.add_argument("target", metavar="script", help="the training script (or module with -m)")
    p.add_argument("target_args", nargs=argparse.REMAINDER, metavar="...",
                   help="arguments for the script")
    return p


def _positive_int(value: str, flag: str, minimum: int = 1) -> int:
    try:
        number = int(str(value).strip())
    except ValueError:
        raise ValueError(f"{flag} must be an integer >= {minimum}, got {value!r}") from None
    if number < minimum:
        raise ValueError(f"{flag} must be an integer >= {minimum}, got {number}")
    return number


def _validate(args: argparse.Namespace) -> Tuple[int, int, int, Optional[int]]:
    """Check the options; return (nproc, nnodes, node_rank, master_port). ValueError if bad."""
    nproc = (_default_nproc() if args.nproc_per_node is None
             else _positive_int(args.nproc_per_node, "-n/--nproc-per-node"))
    nnodes = _positive_int(args.nnodes, "--nnodes")
    node_rank = _positive_int(args.node_rank, "--node-rank", minimum=0)
    if node_rank >= nnodes:
        raise ValueError(f"--node-rank {node_rank} must be smaller than --nnodes {nnodes} "
                         f"(nodes are numbered 0 to {nnodes - 1})")
    port = None
    if args.master_port is not None:
        port = _positive_int(args.master_port, "--master-port", minimum=0)
        if port > 65535:
            raise ValueError(f"--master-port must be a TCP port in [0, 65535], got {port}")
    if nnodes > 1 and (args.master_addr is None or not port):
        raise ValueError(f"--nnodes {nnodes} needs --master-addr and a non-zero --master-port: "
                         "the host and port of node 0, the same on every node")
    if args.grace_period < 0:
        raise ValueError(f"--grace-period must be >= 0 seconds, got {args.grace_period}")
    if args.output_dir is not None and os.path.exists(args.output_dir) \
            and not os.path.isdir(args.output_dir):
        raise ValueError(f"--log-dir {args.output_dir!r} is a file, not a directory: pass a "
                         "directory (created if missing)")
    if not args.module and not os.path.isfile(args.target):
        raise ValueError(f"script {args.target!r} not found (cwd {os.getcwd()}); pass a path to "
                         "a Python file, or -m for a module")
    return nproc, nnodes, node_rank, port


def launch_config(args: argparse.Namespace, nproc: int, nnodes: int, node_rank: int,
                  port: Optional[int]):
    """The :class:`~torch.distributed.launcher.api.LaunchConfig` for validated options."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    if nnodes == 1 and not port:
        # c10d rendezvous on port 0: the agent's store binds a port the OS picks, race-free.
        backend, endpoint, run_id, configs = "c10d", f"{_LOOPBACK}:0", uuid.uuid4().hex, {}
        local_addr: Optional[str] = _LOOPBACK
    else:
        addr = args.master_addr or _LOOPBACK
        backend, endpoint, run_id = "static", f"{addr}:{port}", "none"
        configs = {"rank": node_rank}
        local_addr = _LOOPBACK if nnodes == 1 else None
    configs["timeout"] = args.rdzv_timeout
    return LaunchConfig(
        min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc, run_id=run_id,
        role="default", rdzv_endpoint=endpoint, rdzv_backend=backend, rdzv_configs=configs,
        max_restarts=0, monitor_interval=0.1, start_method="spawn", local_addr=local_addr,
        logs_specs=DefaultLogsSpecs(log_dir=args.log_dir), shutdown_timeout=int(args.grace_period),
    )


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


def _set_thread_default(nproc: int) -> None:
    if _OMP_NUM_THREADS_ENV_VAR not in os.environ and nproc > 1:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        os.environ[_OMP_NUM_THREADS_ENV_VAR] = str(max(1, (cpus or 1) // nproc))


def run(args: argparse.Namespace, nproc: int, nnodes: int, node_rank: int,
        port: Optional[int]) -> int:
    """Launch the ranks and wait for them; return the launcher's exit code."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    _set_thread_default(nproc)
    _set_loopback_gloo(nnodes)
    os.environ[LAUNCHER_PID_ENV_VAR] = str(os.getpid())
    os.environ[END_DIR_ENV_VAR] = os.path.join(args.log_dir, "ends")
    os.makedirs(os.environ[END_DIR_ENV_VAR], exist_ok=True)
    config = launch_config(args, nproc, nnodes, node_rank, port)
    cmd_args = ["-m", "axolotl_dist.launch._rank_main"] + (["-m"] if args.module else [])
    cmd_args += [args.target] + list(args.target_args)
    _quiet_torch_logs(args.verbose)
    waiting_for = None
    if nnodes > 1:
        endpoint = f"{args.master_addr}:{port}"
        waiting_for = (lambda: f"node {node_rank} of {nnodes} is waiting for the other node(s) to "
                       f"join the rendezvous at {endpoint}" + (" (node 0 hosts it)" if node_rank
                                                               else ""))
    watcher = Watcher(PROG, os.environ[END_DIR_ENV_VAR], waiting_for,
                      script=args.target, world=nproc * nnodes)
    output = _start_output(args, nproc)
    try:
        try:
            elastic_launch(config, sys.executable)(*cmd_args)
        finally:
            if output is not None:
                output.close()  # every rank's output is out before the launcher's account
        return 0
    except ChildFailedError as exc:
        return report_failures(exc.failures, nnodes, node_rank, read_ends(os.environ.get(END_DIR_ENV_VAR)),
                               nproc * nnodes, range(node_rank * nproc, (node_rank + 1) * nproc),
                               output=_output_note(args, output))
    except SignalException as exc:
        if watcher.claim():  # else the watcher is saying why it stops the launcher
            print(f"{PROG}: got {signal.Signals(exc.sigval).name}, stopped every rank",
                  file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    finally:
        watcher.close()
        _merge_trace()


def _start_output(args: argparse.Namespace, nproc: int) -> Optional[Output]:
    """Take the ranks' output (docs/launching.md, "Output from N ranks"): folded where
    several ranks print, kept in ``--log-dir``; None where neither applies (one rank, or
    ``--no-fold`` without a log directory): the ranks then write to the launcher's own
    stdout and stderr, as under torchrun."""
    if not args.fold:
        os.environ[FOLD_ENV_VAR] = "0"  # no folding anywhere: the ranks' warnings neither
    if args.output_dir is None and (nproc < 2 or not args.fold):
        return None
    output = Output(nproc, args.fold and nproc > 1, args.output_dir)
    os.environ[LAUNCHER_FOLDS_ENV_VAR] = output.address
    return output


def _output_note(args: argparse.Namespace, output: Optional[Output]):  # type: ignore[no-untyped-def]
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
    directory = _envvars.kit_path(TRACE_ENV_VAR)
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


def _stop_left_behind(log_dir: str) -> None:
    """Stop the processes the ranks left behind (re-parented to the launcher, a subreaper) and
    say which, but for the kit's own guards (their pids are files under ``log_dir``)."""
    left = _sweep(_SWEEP_GRACE)
    guards = os.path.join(log_dir, "ends", GUARDS_DIR)
    ours = set(os.listdir(guards)) if os.path.isdir(guards) else set()
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
        nproc, nnodes, node_rank, port = _validate(args)
    except ValueError as exc:
        parser.error(str(exc))
    handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {sig: signal.getsignal(sig) for sig in handled}  # restored on return
    for sig in handled:
        signal.signal(sig, _raise_signal_exception)  # until torch installs the same handler
    subreaper = _become_subreaper()
    args.log_dir = tempfile.mkdtemp(prefix="axolotl_dist_")
    code = 1
    try:
        code = run(args, nproc, nnodes, node_rank, port)
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
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # the sweep below is bounded; finish it
        if subreaper:
            _stop_left_behind(args.log_dir)
        shutil.rmtree(args.log_dir, ignore_errors=True)
        for sig, handler in previous.items():  # a caller of main() (a test) keeps its Ctrl-C;
            signal.signal(sig, handler)  # an ignored SIGINT would be inherited by its children
    return code


_by_name(__name__)  # pickled by name, as the rest of the kit (docs/design.md, "Installs")
