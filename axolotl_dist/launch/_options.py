"""``axolotl-dist``'s command line: torchrun's own parser, plus the kit's options.

The parser is :func:`torch.distributed.run.get_args_parser` (every torchrun option, both
spellings, torchrun's defaults and ``PET_*`` variables), with ``-n`` as an alias and the kit's
own options in a group of their own (:func:`build_parser`; docs/launching.md, "Options",
lists them, and a test keeps that table and the parser alike); the
:class:`~torch.distributed.launcher.api.LaunchConfig` comes from torch's own
:func:`~torch.distributed.run.config_from_args`, so an option means what it means under
torchrun by construction. Where the kit differs, :func:`launch_config` says so in a comment
(docs/launching.md, "Options" has the table):

* one node (``--standalone`` too) on this machine's own address: c10d rendezvous whose stores
  listen on 127.0.0.1 only (:mod:`._loopback`; torchrun's listen on every interface), the
  ranks' store on ``--master-port`` if given, else on a port the OS picks; the ranks' address
  127.0.0.1;
* ``-n`` defaults to the number of GPUs, else 1 (torchrun: 1);
* ``--log-dir DIR`` keeps each rank's whole output in ``DIR/rank<r>.log``; with ``--tee`` or
  ``--redirects`` it is torchrun's directory (their files), and the kit then leaves the
  ranks' streams to torch (no folding, as under torchrun).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import uuid
from typing import Any, List, Optional, Set, Tuple

from ..env import variables as _variables
from ..env.variables import FOLD_ENV_VAR, LOG_DIR_ENV_VAR, RETRY_SAME_FAILURE_ENV_VAR, is_decimal
from ._report import PROG
from . import _loopback
from ._where import LOOPBACK

#: ``--master-addr`` values that mean this machine (torchrun's default is 127.0.0.1).
_LOCAL_NAMES = (LOOPBACK, "localhost")

__all__ = ["Options", "COMMANDS", "build_parser", "validate", "launch_config", "rank_command",
           "rendezvous_note"]

#: The subcommands, as ``--help`` lists them.
COMMANDS = (
    ("where [--master-addr A] [--master-port P]",
     "where every rank of a running job is (any launcher; torchrun's --rdzv-endpoint too); "
     "without a port, the runs recorded on this host"),
    ("trace DIR", "merge a traced run's rank files into trace.json, summary.txt, timeline.png"),
)
#: torchrun's ``--nproc-per-node`` words (besides a number).
_NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")
_STD = re.compile(r"^[0-3]$|^(\d+:[0-3])(,\d+:[0-3])*$")
_PET_NPROC = "PET_NPROC_PER_NODE"
_UNCATCHABLE = ("SIGKILL", "SIGSTOP")


def _alias(parser: argparse.ArgumentParser, dest: str, flag: str, help: str) -> None:
    """Give torch's option ``dest`` one more spelling (``-n`` for ``--nproc-per-node``)."""
    action = next(a for a in parser._actions if a.dest == dest)
    action.option_strings = [flag, *action.option_strings]
    parser._option_string_actions[flag] = action
    action.help = help


def build_parser() -> argparse.ArgumentParser:
    """torchrun's parser with the kit's options and texts (see the module docstring)."""
    import torch
    from torch.distributed.run import get_args_parser

    from .. import __version__

    p = get_args_parser()
    p.prog, p.allow_abbrev = PROG, False
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = ("Run a PyTorch training script on several ranks: every torchrun option, "
                     "with torchrun's meaning, plus the kit's own (docs/launching.md).")
    commands = "\n".join(f"  {PROG} {usage}\n      {what}" for usage, what in COMMANDS)
    p.epilog = (f"Every argument after the script or module is passed to it unchanged.\n\n"
                f"Other commands ({PROG} COMMAND --help for theirs):\n{commands}")
    _alias(p, "nproc_per_node", "-n", "ranks on this node: a number, or gpu, cpu, auto, xpu "
           "(default: the number of GPUs, else 1; torchrun's is 1)")
    nproc = next(a for a in p._actions if a.dest == "nproc_per_node")
    if _PET_NPROC not in os.environ:
        nproc.default = None
    log_dir = next(a for a in p._actions if a.dest == "log_dir")
    log_dir.metavar = "DIR"
    log_dir.default = log_dir.default or _variables.kit_path(LOG_DIR_ENV_VAR)
    log_dir.help = ("keep each rank's whole output, unfolded, in DIR/rank<r>.log, each line with "
                    f"its time and stream (env {LOG_DIR_ENV_VAR}); with --tee or --redirects: "
                    "torchrun's directory for their files")
    for action in p._actions:
        if action.dest == "training_script":
            action.metavar, action.help = "script", ("the training script (a module with -m, an "
                                                     "executable with --no-python)")
        elif action.dest == "training_script_args":
            action.metavar, action.help = "...", "arguments for the script"
    kit = p.add_argument_group("axolotl-dist's own options")
    kit.add_argument("--version", action="version",
                     version=f"{PROG} {__version__} (torch {torch.__version__})")
    kit.add_argument("--grace-period", dest="grace_period", type=float, default=None,
                     metavar="SECONDS", help="seconds ranks get between the stop signal and "
                     "SIGKILL: the same as --shutdown-timeout (default 30)")
    kit.add_argument("--rdzv-timeout", dest="rdzv_timeout", type=int, default=None,
                     metavar="SECONDS", help="how long nodes wait for each other: the "
                     "rendezvous' timeout / join_timeout (default: torch's, 600)")
    kit.add_argument("--no-fold", dest="fold", action="store_false",
                     default=_variables.kit_switch(FOLD_ENV_VAR),
                     help="print every rank's lines as they come, instead of once for all the "
                     f"ranks that print them alike (env {FOLD_ENV_VAR}=0)")
    kit.add_argument("--retry-same-failure", dest="retry_same_failure", action="store_true",
                     default=_variables.kit_switch(RETRY_SAME_FAILURE_ENV_VAR),
                     help="with --max-restarts: restart also when an attempt fails before its "
                     "first collective the way the attempt before did (default: stop then; "
                     f"env {RETRY_SAME_FAILURE_ENV_VAR}=1)")
    kit.add_argument("-v", "--verbose", action="store_true",
                     help="show torch elastic's own log messages")
    return p


class Options:
    """The checked command line: ``args`` (torch's names) and what the launcher derives."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.nproc = 1
        self.min_nodes = self.max_nodes = 1
        self.node_rank = 0
        #: The signals the launcher forwards to the ranks (``--signals-to-handle``).
        self.signals: Tuple[signal.Signals, ...] = ()
        #: The kit's per-rank log files (``--log-dir`` without ``--tee``/``--redirects``).
        self.kit_log_dir: Optional[str] = None
        #: torch's log directory (``--log-dir`` with ``--tee``/``--redirects``).
        self.torch_log_dir: Optional[str] = None
        #: Whether torch's files take the ranks' streams (``--tee``/``--redirects``).
        self.torch_streams = False
        #: The local ranks whose output is shown (``--local-ranks-filter``; None: all).
        self.shown: Optional[Set[int]] = None

    @property
    def nnodes(self) -> int:
        """The most nodes this run has."""
        return self.max_nodes

    @property
    def restarts(self) -> int:
        """``--max-restarts``."""
        return int(self.args.max_restarts)


def _int(value: object, flag: str, minimum: int = 1) -> int:
    try:
        number = int(str(value).strip())
    except ValueError:
        raise ValueError(f"{flag} must be an integer >= {minimum}, got {value!r}") from None
    if number < minimum:
        raise ValueError(f"{flag} must be an integer >= {minimum}, got {number}")
    return number


def _nproc(value: Optional[str]) -> int:
    """``--nproc-per-node``: a number, torchrun's words, or (unset) the kit's default."""
    if value is None:
        try:
            import torch

            return max(1, torch.cuda.device_count())
        except Exception:  # noqa: BLE001 - no torch / broken CUDA: one rank
            return 1
    text = str(value).strip()
    if text in _NPROC_WORDS:
        from torch.distributed.run import determine_local_world_size

        try:
            return int(determine_local_world_size(text))
        except ValueError as exc:
            raise ValueError(f"-n/--nproc-per-node {text}: {exc} Pass a number, or cpu") from None
    if not is_decimal(text.lstrip("-")):
        raise ValueError(f"-n/--nproc-per-node must be an integer >= 1 or one of "
                         f"{', '.join(_NPROC_WORDS)}, got {text!r}")
    return _int(text, "-n/--nproc-per-node")


def _nodes(value: str) -> Tuple[int, int]:
    """``--nnodes N`` or ``MIN:MAX``."""
    parts = str(value).split(":")
    if len(parts) > 2:
        raise ValueError(f"--nnodes must be N or MIN:MAX, got {value!r}")
    low = _int(parts[0], "--nnodes")
    high = _int(parts[-1], "--nnodes")
    if low > high:
        raise ValueError(f"--nnodes {value}: MIN must not be larger than MAX")
    return low, high


def _signals(text: str) -> Tuple[signal.Signals, ...]:
    found: List[signal.Signals] = []
    for name in (n.strip() for n in str(text).split(",")):
        sig = getattr(signal, name, None) if name.startswith("SIG") else None
        if not isinstance(sig, signal.Signals) or name in _UNCATCHABLE:
            raise ValueError(f"--signals-to-handle: {name!r} is not a signal a process can "
                             "handle; pass names like SIGTERM,SIGINT,SIGUSR1")
        found.append(sig)
    return tuple(found)


def _streams(args: argparse.Namespace) -> bool:
    """Check ``--tee``/``--redirects``; whether either sends a stream to torch's files."""
    used = False
    for flag, value in (("--tee", args.tee), ("--redirects", args.redirects)):
        if not _STD.match(str(value)):
            raise ValueError(f"{flag} must be 0-3 (0 none, 1 stdout, 2 stderr, 3 both) or "
                             f"local_rank:0-3,... (e.g. 0:3,1:1), got {value!r}")
        used = used or str(value) != "0"
    return used


def _target(args: argparse.Namespace) -> None:
    script = args.training_script
    if args.no_python and args.module:
        raise ValueError("--no-python and -m/--module cannot be used together: --no-python runs "
                         "an executable, -m a Python module")
    if args.no_python and not args.run_path:
        if not (os.path.isfile(script) or shutil.which(script)):
            raise ValueError(f"--no-python: executable {script!r} not found (cwd "
                             f"{os.getcwd()}, nor on PATH)")
    elif not args.module and not os.path.isfile(script):
        raise ValueError(f"script {script!r} not found (cwd {os.getcwd()}); pass a path to "
                         "a Python file, or -m for a module")


def validate(args: argparse.Namespace) -> Options:
    """Check the options; :class:`Options` or a ValueError naming the option and the fix."""
    opts = Options(args)
    opts.nproc = _nproc(args.nproc_per_node)
    opts.min_nodes, opts.max_nodes = _nodes(args.nnodes)
    opts.node_rank = _int(args.node_rank, "--node-rank", minimum=0)
    _check_nodes(args, opts)
    _check_times(args)
    opts.shown = _shown(args.local_ranks_filter)
    opts.signals = _signals(args.signals_to_handle)
    opts.torch_streams = _streams(args)
    if opts.torch_streams:
        opts.torch_log_dir = args.log_dir
    else:
        opts.kit_log_dir = _log_dir(args.log_dir)
    _target(args)
    return opts


def _check_nodes(args: argparse.Namespace, opts: Options) -> None:
    """``--node-rank`` and ``--master-port`` against ``--nnodes`` (static rendezvous)."""
    static = args.rdzv_backend == "static" and not args.standalone
    if static and opts.node_rank >= opts.max_nodes:
        raise ValueError(f"--node-rank {opts.node_rank} must be smaller than --nnodes "
                         f"{opts.max_nodes} (nodes are numbered 0 to {opts.max_nodes - 1})")
    if args.master_port is not None and not 0 <= args.master_port <= 65535:
        raise ValueError(f"--master-port must be a TCP port in [0, 65535], got {args.master_port}")
    if static and opts.max_nodes > 1 and args.master_port == 0:
        raise ValueError(f"--nnodes {args.nnodes} needs a non-zero --master-port: the port of "
                         "node 0, the same on every node")


def _check_times(args: argparse.Namespace) -> None:
    """The restart count and the seconds options."""
    _int(args.max_restarts, "--max-restarts", minimum=0)
    if args.monitor_interval <= 0:
        raise ValueError(f"--monitor-interval must be > 0 seconds, got {args.monitor_interval}")
    for flag, value in (("--grace-period", args.grace_period),
                        ("--shutdown-timeout", args.shutdown_timeout)):
        if value is not None and value < 0:
            raise ValueError(f"{flag} must be >= 0 seconds, got {value}")
    if args.rdzv_timeout is not None:
        _int(args.rdzv_timeout, "--rdzv-timeout")


def _shown(text: Optional[str]) -> Optional[Set[int]]:
    """``--local-ranks-filter``: the local ranks whose output is shown (None: all)."""
    if not text:
        return None
    try:
        return {int(r) for r in str(text).split(",")}
    except ValueError:
        raise ValueError("--local-ranks-filter must be local ranks separated by commas, "
                         f"e.g. 0,1; got {text!r}") from None


def _log_dir(path: Optional[str]) -> Optional[str]:
    """The kit's ``--log-dir``: a directory (made if missing), never a file."""
    if path is not None and os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--log-dir {path!r} is a file, not a directory: pass a "
                         "directory (created if missing)")
    return path


def _rendezvous(args: argparse.Namespace, opts: Options) -> argparse.Namespace:
    """torchrun's ``run()`` choices before ``config_from_args``, on a copy of ``args``."""
    args = argparse.Namespace(**vars(args))
    single = opts.max_nodes == 1
    local = args.master_addr in _LOCAL_NAMES and args.local_addr in (None, *_LOCAL_NAMES)
    if args.standalone or (args.rdzv_backend == "static" and not args.rdzv_endpoint
                           and single and local):
        # torchrun: c10d on localhost:0, its stores on every interface. The kit: both stores
        # listen on 127.0.0.1 only (:mod:`._loopback`), on --master-port if given, else on a
        # port the OS picks (no race); the ranks' MASTER_ADDR is 127.0.0.1.
        _loopback.register()
        args.rdzv_backend, args.rdzv_endpoint = _loopback.BACKEND, f"{LOOPBACK}:0"
        # torchrun draws a new id here whatever --rdzv-id says; the kit keeps the user's (or
        # the SLURM job's): the run's checkpoints are that job's across launches
        if args.rdzv_id in (None, "", "none"):
            args.rdzv_id = os.environ.get("SLURM_JOB_ID") or uuid.uuid4().hex
        args.local_addr = LOOPBACK
        return args
    if single and args.local_addr is None and args.rdzv_backend == "static":
        args.local_addr = LOOPBACK
    if args.master_port is None:
        args.master_port = 29500  # torchrun's default
    return args


def launch_config(opts: Options, error_dir: str) -> Any:
    """The :class:`~torch.distributed.launcher.api.LaunchConfig`, from torch's own
    ``config_from_args``; ``error_dir``: torch's log directory where the user gave none
    (its error files, which the launcher's report reads)."""
    from torch.distributed.run import config_from_args

    args = _rendezvous(opts.args, opts)
    args.nproc_per_node = str(opts.nproc)
    args.log_dir = opts.torch_log_dir or error_dir
    config, _, _ = config_from_args(args)
    if config.rdzv_backend == _loopback.BACKEND and args.master_port:
        config.rdzv_configs[_loopback.PORT_CONF] = args.master_port  # the ranks' store
    if opts.args.rdzv_timeout is not None:  # the kit's --rdzv-timeout: both backends' names
        key = "timeout" if config.rdzv_backend == "static" else "join_timeout"
        config.rdzv_configs.setdefault(key, opts.args.rdzv_timeout)
    if opts.args.shutdown_timeout is None and opts.args.grace_period is not None:
        config.shutdown_timeout = int(opts.args.grace_period)
    return config


def rank_command(opts: Options) -> List[str]:
    """The arguments of ``python`` for each rank: the kit's bootstrap, then the target.

    A script (``--run-path`` too: the bootstrap always runs a script with ``runpy.run_path``
    in the rank's interpreter) or ``-m`` module; ``--no-python``: the bootstrap sets the rank
    up, then ``exec``s the executable (it keeps the output, the parent-death signal and the
    guard; there is no Python left to record how it ended)."""
    args = opts.args
    mode: List[str] = []
    if args.module:
        mode = ["-m"]
    elif args.no_python and not args.run_path:
        mode = ["--exec"]
    return ["-m", "axolotl_dist.launch._rank_main", *mode, args.training_script,
            *args.training_script_args]


def rendezvous_note(opts: Options) -> Optional[str]:
    """What a node waits for in the rendezvous (None on one node: nothing to wait for)."""
    if opts.max_nodes == 1:
        return None
    args = opts.args
    if args.rdzv_backend == "static" and not args.rdzv_endpoint:
        endpoint = f"{args.master_addr}:{args.master_port or 29500}"
        host = " (node 0 hosts it)" if opts.node_rank else ""
        return (f"node {opts.node_rank} of {opts.max_nodes} is waiting for the other node(s) to "
                f"join the rendezvous at {endpoint}{host}")
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import DEFAULT_PORT
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=DEFAULT_PORT)
    endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if not (args.rdzv_endpoint or "").strip():
        endpoint += " (torch's default: no --rdzv-endpoint given)"
    nodes = (f"{opts.max_nodes} nodes" if opts.min_nodes == opts.max_nodes else
             f"{opts.min_nodes} to {opts.max_nodes} nodes: it starts once {opts.min_nodes} "
             "joined and no other joined for the rendezvous's last-call time")
    return (f"this node is waiting for the other node(s) to join the {args.rdzv_backend} "
            f"rendezvous at {endpoint}, run id {args.rdzv_id!r} ({nodes})")
