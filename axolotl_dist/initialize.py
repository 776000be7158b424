"""Creating and tearing down the default process group.

:func:`init_distributed` (OLMo-core's name) and :func:`initialize_dist` (composer's) are
idempotent, pick the backend from the device when none is given, bootstrap a single process
without any env vars or ports, and check the launcher env before touching the network, so a
bad variable fails fast with a message that names it.
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import Any, Dict, Optional, Tuple, Union

import torch
import torch.distributed as dist

from ._runtime.base import backends as _backends, tracebacks as _tracebacks
from .env import geometry as _geometry
from ._runtime.store import access as _access, attempts as _attempts
from ._runtime.lifecycle import repeat_failure as _repeat_failure, services as _services
from ._runtime.lifecycle import startup as _startup, teardown as _teardown
from ._runtime.base.constants import STARTUP_LATE
from .env.variables import WAIT_LOG_INTERVAL_ENV_VAR, kit_seconds
from ._runtime.protocols import checkpointing as _checkpointing
from ._runtime.protocols import shared_fs as _shared_fs
from ._runtime.protocols import timeline as _timeline
from . import tracing as _tracing
from ._runtime.base.kitlog import kit as _kit_log
from ._runtime.base import torch_messages as _torch_messages
from ._runtime.protocols.timeline import TIMELINE
from . import debug as _debug
from ._runtime.liveness.waits import logged_blocking_call as _logged_blocking_call
from . import env as _env
from .errors import DistributedEnvError
from .ranks import get_backend, get_local_rank, get_rank, get_world_size, is_initialized

__all__ = [
    "DEFAULT_TIMEOUT",
    "default_backend",
    "init_distributed",
    "initialize_dist",
    "validate_env_vars",
    "cleanup_distributed",
    "get_attempt",
]

log = logging.getLogger(__name__)

#: The default collective timeout of the process group (as torch's).
DEFAULT_TIMEOUT = timedelta(minutes=30)

validate_env_vars = _env.validate_env_vars


def get_attempt() -> int:
    """This attempt of a restarted run, from 0 for the first.

    After :func:`~axolotl_dist.init_distributed` under torch elastic's agent (``torchrun``,
    ``axolotl-dist``, ``accelerate launch``), the number the ranks agreed on through the agent's
    store: the same on every node, and it counts every start of the ranks, a membership change
    (a node joining or lost) included. Otherwise the launcher's own count of this node's
    restarts: ``TORCHELASTIC_RESTART_COUNT``, else ``SLURM_RESTART_COUNT`` (a requeued job),
    else 0 (docs/launching.md, "Restarts")."""
    agreed = _attempts.agreed_attempt()
    if agreed is not None and is_initialized():
        return agreed - 1
    return _env.env_attempt()


def _as_timedelta(timeout: Union[timedelta, float, int, None], name: str = "timeout") -> timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, timedelta):
        value = timeout
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        value = timedelta(seconds=float(timeout))
    else:
        raise TypeError(f"{name}={timeout!r} must be a datetime.timedelta or a number of seconds")
    if value.total_seconds() <= 0:
        raise ValueError(f"{name}={timeout!r} must be positive")
    return value


def default_backend(device: Union[str, torch.device, None] = None) -> str:
    """The backend torch recommends for ``device`` (default: this machine's accelerator or CPU).

    ``"gloo"`` for CPU, ``"nccl"`` for CUDA, and whatever torch registers for other devices.
    With no ``device``, an accelerator counts only when it is usable here: PyPI's CUDA build of
    torch on a machine without a GPU gets ``"gloo"`` (docs/design/decisions.md, decision 17).
    """
    if device is None:
        device = _backends.usable_accelerator() or "cpu"
    device_type = torch.device(device).type
    getter = getattr(dist, "get_default_backend_for_device", None)
    if getter is not None:
        return getter(device_type)
    return "nccl" if device_type == "cuda" else "gloo"  # pragma: no cover - torch < 2.6


def _check_backend_usable(backend: Optional[str]) -> None:
    """Fail early, saying what to do, when ``backend`` asks for NCCL only, on a machine without it.

    Mixed strings such as ``"cuda:nccl,cpu:gloo"`` are left to torch (gloo serves CPU tensors).
    """
    if backend is None or not _backends.only(backend, "nccl"):
        return
    if not _backends.cuda_usable():
        why = "this machine has no usable CUDA GPU (torch.cuda.device_count() is 0)"
    elif not dist.is_nccl_available():
        why = "this torch build has no NCCL (torch.distributed.is_nccl_available() is False)"
    else:
        return
    raise DistributedEnvError(
        f"init_distributed(backend={backend!r}): NCCL needs CUDA GPUs, but {why}: drop "
        "backend= (init_distributed() then picks gloo on CPU) or pass backend='gloo'")


def _set_cuda_device(backend: str, asked: Optional[str]) -> Optional[torch.device]:
    """On a backend that serves CUDA, on a machine with a GPU, make ``LOCAL_RANK``'s GPU this
    rank's current device (shared round-robin where the backend allows it) and return it: the
    device the group is bound to (``device_id=``), so that the group's device never depends on
    which device is current at its first use.

    NCCL refuses two ranks of a group on one GPU, with "Duplicate GPU detected" at the first
    collective, or a hang: with more ranks on this node than visible GPUs, raise
    :class:`DistributedEnvError` here instead, on every rank of the node, naming the numbers
    and the ways out. ``asked``: the backend the caller passed (None: the default)."""
    if not _backends.supports(backend, "cuda") or not _backends.cuda_usable():
        return None
    count = torch.cuda.device_count()
    local_rank, local_world_size = _env.env_local_rank(), _env.env_local_world_size()
    if _backends.served(backend)["cuda"] == "nccl" and local_world_size > count and \
            not _geometry.bound_per_task(os.environ, count, local_world_size):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = "unset" if visible is None else repr(visible)
        call = (f"init_distributed(backend={asked!r})" if asked is not None else
                f"init_distributed() (backend {backend!r}, the default where a GPU is)")
        raise DistributedEnvError(
            f"{call}: this node runs {local_world_size} rank(s) "
            f"(LOCAL_WORLD_SIZE={local_world_size}; this is LOCAL_RANK={local_rank}) but sees "
            f"{count} CUDA GPU(s) (CUDA_VISIBLE_DEVICES {shown}), and NCCL needs a GPU of its "
            f"own for each rank: start at most {count} rank(s) per node (axolotl-dist -n "
            f"{count}, torchrun --nproc-per-node {count}), make more GPUs visible "
            "(CUDA_VISIBLE_DEVICES), or pass backend='gloo' (CPU communication; the kit's "
            "helpers move CUDA tensors through the CPU)")
    torch.cuda.set_device(local_rank % count)
    return torch.device("cuda", local_rank % count)


def _bind_cuda_device(backend: str, asked: Optional[str], kwargs: Dict[str, Any]) -> None:
    """:func:`_set_cuda_device`, and the group bound to that device (``device_id=``) unless
    the caller binds it."""
    bound = _set_cuda_device(backend, asked)
    if bound is not None:
        kwargs.setdefault("device_id", bound)


def _apply_shared_filesystem(shared_filesystem: Optional[bool]) -> None:
    """An explicit answer is exported; with none, one node shares its filesystem, and several
    are probed once the group is up (:func:`_probe_shared_filesystem`)."""
    if shared_filesystem is not None:
        os.environ[_env.SHARED_FS_ENV_VAR] = "1" if shared_filesystem else "0"
    elif not _shared_fs.said() and _env.env_num_nodes() <= 1:
        os.environ[_env.SHARED_FS_ENV_VAR] = "1"


def _probe_shared_filesystem() -> None:
    """On several nodes, where nobody said whether they share a filesystem: ask the datasets
    cache's directory (:mod:`axolotl_dist._runtime.protocols.shared_fs`) and export the answer as
    ``AXOLOTL_DIST_SHARED_FS``; undecided (rank 0 could not write there): shared, as
    OLMo-core assumes."""
    if _shared_fs.said() or not is_initialized() or get_world_size() == 1:
        return
    if _env.env_num_nodes(get_world_size()) <= 1:
        return
    path = _shared_fs.default_cache_dir()
    answer = _shared_fs.shares("datasets-cache", path, get_rank(), get_local_rank(),
                                get_world_size())
    _shared_fs.export(answer is not False)
    if answer is False and get_rank() == 0:
        _kit_log.emit(logging.INFO, "the nodes do not share %s (the datasets cache): "
                      "zero_first runs first on each node's local rank 0, get_fs_local_rank() "
                      "is the local rank; set AXOLOTL_DIST_SHARED_FS=1 to run it once for all "
                      "nodes", _shared_fs.probe_dir(path))


def init_distributed(
    backend: Optional[str] = None,
    timeout: Union[timedelta, float, None] = DEFAULT_TIMEOUT,
    shared_filesystem: Optional[bool] = None,
    trace_dir: Optional[str] = None,
    **kwargs: Any,
) -> None:
    """Initialize the default process group from the launcher environment.

    * ``backend`` defaults to :func:`default_backend` (``gloo`` on CPU, ``nccl`` on CUDA).
    * No launcher env vars (or ``WORLD_SIZE=1``): a single-rank group over an in-memory store
      (no port, no network), and ``RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1`` are
      set if missing.
    * Several ranks: ``env://`` rendezvous. Under ``srun`` / ``mpirun`` (see
      :mod:`axolotl_dist.env` for which launcher wins) the SLURM / Open MPI values are exported
      first as ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK``,
      ``NUM_NODES``. ``MASTER_ADDR``/``MASTER_PORT`` must be set unless ``init_method=`` or
      ``store=`` is passed, or the launcher implies them: SLURM's first host of the step's
      node list and a port from the job id, Open MPI on one node 127.0.0.1. On CUDA backends
      the device is set to ``LOCAL_RANK`` first; with NCCL, more ranks on a node than visible
      GPUs raise :class:`DistributedEnvError` (NCCL cannot share a GPU between ranks).
    * Already initialized: nothing is re-created; a different ``backend`` raises
      :class:`DistributedEnvError`.
    * ``shared_filesystem``: whether all nodes share one filesystem (sets
      ``AXOLOTL_DIST_SHARED_FS``, read by :func:`get_fs_local_rank` and :func:`zero_first`).
      ``None`` keeps an existing setting (``OLMO_SHARED_FS`` too); with none, one node shares
      its filesystem, and on several the kit asks the datasets cache's directory (a probe file
      written by rank 0, looked for by each node's first rank: a few store calls, once) and
      exports the answer (shared where it cannot tell, like OLMo-core). The seed's misspelled
      ``shared_filesytem=`` is accepted too.
    * ``timeout``: the collective timeout (timedelta or seconds, default 30 minutes). It does
      not bound :func:`zero_first` waits, which have their own ``timeout``.
    * ``trace_dir``: record every kit call of every rank there for the cross-rank timeline
      (as ``AXOLOTL_DIST_TRACE=<dir>`` does; see :mod:`axolotl_dist.tracing`). Every rank must
      ask for it: the ranks align their clocks here.

    Extra ``kwargs`` go to :func:`torch.distributed.init_process_group`.
    """
    if "shared_filesytem" in kwargs:
        legacy = kwargs.pop("shared_filesytem")
        if shared_filesystem is None:
            shared_filesystem = legacy
    if not dist.is_available():  # pragma: no cover
        raise DistributedEnvError("torch was built without torch.distributed support")
    pg_timeout = _as_timedelta(timeout)
    _debug.refresh_from_env()
    if is_initialized():
        _join_existing(backend, shared_filesystem, trace_dir)
        return

    _startup.begin()
    _tracebacks.install()  # an error of the rendezvous shows the user's frame, not the kit's
    _check_backend_usable(backend)
    validate_env_vars()
    for warning in _geometry.check_geometry(os.environ):  # before any connection: seconds
        _kit_log.warning("%s", warning)
    asked = backend
    if backend is None:
        backend = default_backend()
    world_size = _env.env_world_size()
    rank = _env.env_rank()
    _set_rendezvous(world_size, rank, kwargs)
    _apply_shared_filesystem(shared_filesystem)
    _bind_cuda_device(backend, asked, kwargs)
    _attempts.forget()
    if world_size > 1 and "store" not in kwargs:
        with _logged_blocking_call(_init_wait_message(rank, world_size, kwargs.get("init_method"))):
            try:
                if "init_method" not in kwargs and _access.agent_hosts_store():
                    kwargs.update(store=_attempt_store(rank, world_size, pg_timeout),
                                  rank=rank, world_size=world_size)
                dist.init_process_group(backend=backend, timeout=pg_timeout, **kwargs)
            except RuntimeError as exc:
                if not _torch_messages.address_in_use(exc):
                    raise
                port = os.environ.get(_env.MASTER_PORT_ENV_VAR)
                raise DistributedEnvError(
                    f"MASTER_PORT={port} is taken on this host (EADDRINUSE): rank {rank} hosts "
                    "the c10d store there and another program already listens on it; set "
                    "MASTER_PORT to a free port (the same on every rank), or launch with "
                    "axolotl-dist / torchrun, which pick one") from None
    else:
        dist.init_process_group(backend=backend, timeout=pg_timeout, **kwargs)
    _startup.stamp("bootstrap")
    _after_init(trace_dir)
    if world_size > 1 and _startup.wanted():
        _startup.stamp("services")
        _startup.report()
    _startup.initialized()
    _repeat_failure.watch()  # its look at an uncaught exception comes before the exit hook
    log.debug("initialized %s process group: rank %d of %d", backend, get_rank(), get_world_size())


def _attempt_store(rank: int, world_size: int, timeout: timedelta) -> Any:
    """Under torch elastic's agent store (torchrun, ``axolotl-dist``, ``accelerate launch``):
    this attempt's namespace of it, where the group bootstraps, so a restarted run never reads
    what an earlier attempt wrote (docs/design/launching.md, "Restarts")."""
    addr, port = _env.env_master_addr(), _env.env_master_port()
    if addr is None or port is None:  # the agent sets both; checked by _set_rendezvous
        raise DistributedEnvError("MASTER_ADDR and MASTER_PORT must be set under torchrun")
    root = _attempts.connect(addr, port, world_size, timeout)
    _startup.stamp("store")
    if _startup.wanted():  # the report's: a late rank named early, as information
        late, level = STARTUP_LATE, logging.INFO
    else:
        late, level = kit_seconds(WAIT_LOG_INTERVAL_ENV_VAR), logging.WARNING
    store = _attempts.attempt_store(root, rank, world_size, timeout, late, level)
    _startup.stamp("handshake")
    return store


def _join_existing(backend: Optional[str], shared_filesystem: Optional[bool],
                   trace_dir: Optional[str]) -> None:
    """Take the process group that is already up, as :func:`init_distributed` would have made
    it; raise :class:`DistributedEnvError` if it runs another ``backend`` than the one asked."""
    existing = get_backend() or ""
    if backend is not None and not _backends.matches(backend, existing):
        raise DistributedEnvError(
            f"init_distributed(backend={backend!r}) but the process group is already "
            f"initialized with backend {existing!r}: pass backend={existing!r} (or None), or "
            "destroy the existing group first with axolotl_dist.cleanup_distributed()"
        )
    _apply_shared_filesystem(shared_filesystem)
    get_rank(), get_world_size()  # env vs group consistency
    _after_init(trace_dir)


def _set_rendezvous(world_size: int, rank: int, kwargs: Dict[str, Any]) -> None:
    """Prepare the rendezvous in the env and in ``kwargs`` (updated in place): one rank alone
    gets an in-memory store; several get the torch-style variables and, unless ``init_method=``
    or ``store=`` is passed, ``MASTER_ADDR``/``MASTER_PORT`` (checked, or the launcher's)."""
    explicit_rendezvous = any(k in kwargs for k in ("init_method", "store"))
    if world_size == 1 and not explicit_rendezvous:
        for name, value in ((_env.RANK_ENV_VAR, "0"), (_env.WORLD_SIZE_ENV_VAR, "1"),
                            (_env.LOCAL_RANK_ENV_VAR, "0"), (_env.LOCAL_WORLD_SIZE_ENV_VAR, "1")):
            os.environ.setdefault(name, value)
        kwargs.setdefault("store", dist.HashStore())
        kwargs.setdefault("rank", 0)
        kwargs.setdefault("world_size", 1)
        return
    # Defaults for the rendezvous come from SLURM/MPI variables: read them before exporting.
    master = None if explicit_rendezvous else _master_endpoint(world_size, rank)
    _export_torch_env()
    if master is not None:
        os.environ.setdefault(_env.MASTER_ADDR_ENV_VAR, master[0])
        os.environ.setdefault(_env.MASTER_PORT_ENV_VAR, str(master[1]))


def _export_torch_env() -> None:
    """Export the torch-style names so ``env://``, accelerate and every later query agree,
    whatever launcher (SLURM / Open MPI) spoke. All values are read before any is written:
    writing ``RANK`` switches :func:`~axolotl_dist.env.launcher_source` to torch style."""
    values = (
        (_env.RANK_ENV_VAR, _env.env_rank()),
        (_env.WORLD_SIZE_ENV_VAR, _env.env_world_size()),
        (_env.LOCAL_RANK_ENV_VAR, _env.env_local_rank()),
        (_env.LOCAL_WORLD_SIZE_ENV_VAR, _env.env_local_world_size()),
        (_env.NODE_RANK_ENV_VAR, _env.env_node_rank()),
        (_env.NUM_NODES_ENV_VAR, _env.env_num_nodes()),
    )
    if _env.launcher_source() == _env.TORCH_SOURCE:
        values = values[:4]  # keep torch-style node variables as the launcher set them
    for name, value in values:
        os.environ.setdefault(name, str(value))


def _master_endpoint(world_size: int, rank: int) -> Tuple[str, int]:
    """``MASTER_ADDR``/``MASTER_PORT``, else the launcher's defaults, else a clear error."""
    source = _env.launcher_source()
    addr, port = _env.env_master_addr(), _env.env_master_port()
    if addr is None:
        addr = _env.default_master_addr()
    if port is None:
        port = _env.default_master_port()
    missing = [n for n, v in ((_env.MASTER_ADDR_ENV_VAR, addr), (_env.MASTER_PORT_ENV_VAR, port))
               if v is None]
    if missing or addr is None or port is None:
        hint = {
            _env.SLURM_SOURCE: " (under SLURM they default to the first host of "
                               "SLURM_STEP_NODELIST and a port derived from SLURM_JOB_ID)",
            _env.OPENMPI_SOURCE: " (under Open MPI export them to every rank, e.g. "
                                 "mpirun -x MASTER_ADDR=host0 -x MASTER_PORT=29500)",
        }.get(source, "")
        raise DistributedEnvError(
            f"{' and '.join(missing)} not set for a {world_size}-rank init (rank {rank}): "
            f"set MASTER_ADDR to the host of rank 0 and MASTER_PORT to a free port on it{hint}, "
            "or launch with torchrun / axolotl-dist, or pass init_method="
        )
    _check_resolves(addr, port)
    return addr, port


def _check_resolves(addr: str, port: int) -> None:
    """Fail now, naming ``MASTER_ADDR``, if the rendezvous host does not resolve (torch would
    retry it until its timeout)."""
    try:
        socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise DistributedEnvError(
            f"MASTER_ADDR={addr!r} does not resolve to an address ({type(exc).__name__}: {exc}): "
            "set it to the host name or IP address of rank 0's node") from None


def _init_wait_message(rank: int, world_size: int, init_method: Optional[str]):
    """What a rank waiting in the rendezvous says at each wait interval."""
    address = init_method or (f"{os.environ.get(_env.MASTER_ADDR_ENV_VAR)}:"
                              f"{os.environ.get(_env.MASTER_PORT_ENV_VAR)}")
    agent = _access.agent_hosts_store()
    host = "the launcher's agent (torchrun, axolotl-dist, accelerate launch)" if agent else "rank 0"
    if rank == 0 and not agent:
        ask = (f"the other {world_size - 1} rank(s) have not all joined: are they started, with "
               "the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE?")
    elif agent:
        ask = "is the launcher still running, and every node started?"
    else:
        ask = ("is rank 0 running, and is the port free? (another program listening on it "
               "takes rank 0's place: rank 0 then fails at once, the others wait here)")

    def message(seconds: float) -> str:
        return (f"rank {rank} has waited {seconds:.0f} s in init_distributed for the c10d store "
                f"at {address}, hosted by {host}, and the {world_size} rank(s) to join: {ask}")
    return message


def _after_init(trace_dir: Optional[str]) -> None:
    _services.start_services()
    _probe_shared_filesystem()
    directory = _timeline.trace_dir_requested(trace_dir)
    if directory is None or TIMELINE.recorder is not None:
        return
    try:
        _tracing.start_recording(directory, _access.world_store(), get_rank(), get_world_size())
    except Exception as exc:  # noqa: BLE001 - a trace must never stop a run
        _kit_log.warning("rank %d: tracing to %s is off: %s: %s", get_rank(), directory,
                         type(exc).__name__, exc)


def initialize_dist(device: Union[str, torch.device, None] = None, timeout: float = 300.0) -> None:
    """composer's entry point: init the default group for ``device`` with ``timeout`` seconds.

    ``device`` (``"cpu"``, ``"cuda"``, a :class:`torch.device`) picks the backend; None picks
    this machine's default. Idempotent, like :func:`init_distributed`.
    """
    backend = default_backend(device) if device is not None else None
    init_distributed(backend=backend, timeout=_as_timedelta(timeout))


def cleanup_distributed() -> None:
    """Destroy the default process group (if any) and forget the world mesh.

    Safe to call twice, or never: :func:`init_distributed` also arranges the same teardown at
    interpreter exit (see :mod:`axolotl_dist._runtime.lifecycle.teardown`). A checkpoint whose
    writes were handed to futures (``CheckpointPath.commit_after``) is waited for and committed
    first; if it failed, this raises on every rank (the group is kept).
    """
    _checkpointing.settle()
    _teardown.cleanup()
