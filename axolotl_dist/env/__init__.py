"""The launcher environment contract: which env vars say who this process is.

Before a process group exists, every rank query in :mod:`axolotl_dist` reads these variables
(docs/design/decisions.md, decision 1), so a script started by ``torchrun -n 2`` knows it is rank 1 before it
calls :func:`~axolotl_dist.init_distributed`. With none of them set the process is rank 0 of 1.

One launcher is chosen per process, never a mix of two (a torchrun started by ``srun`` sees
both its own and SLURM's variables), first match wins:

1. **torch / composer style** (``torchrun``, ``axolotl-dist``, ``accelerate launch``,
   composer, plain env): chosen when ``RANK`` or ``WORLD_SIZE`` is set. ``RANK``,
   ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``NODE_RANK`` (else torchrun's
   ``GROUP_RANK``), ``NUM_NODES`` (else torchrun's ``GROUP_WORLD_SIZE``).
2. **SLURM** (``srun``): chosen when ``SLURM_PROCID`` is set *inside a job step*, i.e. when
   ``SLURM_STEP_ID`` (or the older ``SLURM_STEPID``) holds a regular step number. An
   ``sbatch`` script or ``salloc`` shell also carries ``SLURM_PROCID=0`` and the job's
   ``SLURM_NTASKS`` but no step id, so a plain ``python train.py`` there is one process, not
   rank 0 of a job that never starts. Rank ``SLURM_PROCID``; world ``SLURM_STEP_NUM_TASKS``
   (else ``SLURM_NTASKS``); local rank ``SLURM_LOCALID``; node ``SLURM_NODEID``; nodes
   ``SLURM_STEP_NUM_NODES`` (else ``SLURM_JOB_NUM_NODES``, ``SLURM_NNODES``); local world size
   this node's entry of ``SLURM_STEP_TASKS_PER_NODE`` / ``SLURM_TASKS_PER_NODE`` /
   ``SLURM_NTASKS_PER_NODE`` (format ``4(x2),1``), else tasks / nodes. ``MASTER_ADDR``
   defaults to the first host of ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``,
   ``SLURM_NODELIST``) and ``MASTER_PORT`` to ``15000 + (SLURM_JOB_ID + SLURM_STEP_ID) % 20000``.
3. **Open MPI** (``mpirun``): chosen when ``OMPI_COMM_WORLD_RANK`` or ``OMPI_COMM_WORLD_SIZE``
   is set. ``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``; the node
   index is rank // local size (by-slot mapping). ``MASTER_ADDR`` defaults to 127.0.0.1 when
   every rank is on this node; ``MASTER_PORT`` must be exported (``mpirun -x MASTER_PORT``).

Values are parsed once per distinct raw string and cached, so a query costs a couple of dict
lookups. Malformed or inconsistent values raise :class:`~axolotl_dist.errors.DistributedEnvError`
naming the variable and the fix.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from . import slurm as _slurm, variables as _variables
from .variables import LAUNCHER_PID_ENV_VAR
from .slurm import expand_nodelist, expand_tasks_per_node
from ..errors import DistributedEnvError

__all__ = [
    "validate_env_vars",
    "launcher_source",
    "LAUNCHER_ENV_VARS",
    "KIT_ENV_VARS",
    "expand_nodelist",
    "expand_tasks_per_node",
]

RANK_ENV_VAR = "RANK"
WORLD_SIZE_ENV_VAR = "WORLD_SIZE"
LOCAL_RANK_ENV_VAR = "LOCAL_RANK"
LOCAL_WORLD_SIZE_ENV_VAR = "LOCAL_WORLD_SIZE"
(NODE_RANK_ENV_VAR, GROUP_RANK_ENV_VAR), (NUM_NODES_ENV_VAR, GROUP_WORLD_SIZE_ENV_VAR) = \
    _variables.TORCHRUN_NODE_ALIASES  # the kit's names, then torchrun's
MASTER_ADDR_ENV_VAR = "MASTER_ADDR"
MASTER_PORT_ENV_VAR = "MASTER_PORT"
FS_LOCAL_RANK_ENV_VAR = "FS_LOCAL_RANK"
SHARED_FS_ENV_VAR = _variables.SHARED_FS_ENV_VAR
#: The kit's own ``AXOLOTL_DIST_*`` variables: name -> (kind, default, the fix a bad value's
#: error suggests). docs/env.md describes each; :func:`validate_env_vars` checks them all.
KIT_ENV_VARS = _variables.KIT_VARS
OLMO_SHARED_FS_ENV_VAR = "OLMO_SHARED_FS"

#: Set by ``srun`` in every task of a job step; absent in ``sbatch`` scripts and ``salloc`` shells.
SLURM_STEP_ID_ENV_VARS: Tuple[str, ...] = ("SLURM_STEP_ID", "SLURM_STEPID")
SLURM_NODELIST_ENV_VARS: Tuple[str, ...] = (
    "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
SLURM_TASKS_PER_NODE_ENV_VARS: Tuple[str, ...] = (
    "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
SLURM_JOB_ID_ENV_VAR = "SLURM_JOB_ID"
#: This node's count of restarts before this attempt: torch elastic's agent's (``torchrun``,
#: ``axolotl-dist``, ``accelerate launch``), else SLURM's for a requeued job.
RESTART_COUNT_ENV_VARS: Tuple[str, ...] = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")

TORCH_SOURCE = "torch"
SLURM_SOURCE = "slurm"
OPENMPI_SOURCE = "openmpi"

#: For each launcher, the env vars carrying each quantity, in precedence order.
LAUNCHER_SOURCES: Dict[str, Dict[str, Tuple[str, ...]]] = {
    TORCH_SOURCE: {
        "rank": (RANK_ENV_VAR,),
        "world_size": (WORLD_SIZE_ENV_VAR,),
        "local_rank": (LOCAL_RANK_ENV_VAR,),
        "local_world_size": (LOCAL_WORLD_SIZE_ENV_VAR,),
        "node_rank": (NODE_RANK_ENV_VAR, GROUP_RANK_ENV_VAR),
        "num_nodes": (NUM_NODES_ENV_VAR, GROUP_WORLD_SIZE_ENV_VAR),
    },
    SLURM_SOURCE: {
        "rank": ("SLURM_PROCID",),
        "world_size": ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
        "local_rank": ("SLURM_LOCALID",),
        "local_world_size": (),  # from SLURM_TASKS_PER_NODE_ENV_VARS, see _slurm_local_world_size
        "node_rank": ("SLURM_NODEID",),
        "num_nodes": ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"),
    },
    OPENMPI_SOURCE: {
        "rank": ("OMPI_COMM_WORLD_RANK",),
        "world_size": ("OMPI_COMM_WORLD_SIZE",),
        "local_rank": ("OMPI_COMM_WORLD_LOCAL_RANK",),
        "local_world_size": ("OMPI_COMM_WORLD_LOCAL_SIZE",),
        "node_rank": (),  # OMPI_COMM_WORLD_NODE_RANK is a per-node rank, not a node index
        "num_nodes": (),
    },
}

#: Every variable that may carry each quantity, launchers in precedence order (documentation
#: and tooling; lookups use :func:`launcher_source` so launchers are never mixed).
RANK_SOURCES: Dict[str, Tuple[str, ...]] = {
    q: tuple(n for src in LAUNCHER_SOURCES.values() for n in src[q])
    for q in LAUNCHER_SOURCES[TORCH_SOURCE]
}

#: Every variable a launcher sets that the kit reads, copies or trusts: what a harness clears
#: so an outer launcher (pytest started under torchrun or srun) cannot leak into its ranks.
LAUNCHER_ENV_VARS: Tuple[str, ...] = tuple(dict.fromkeys((
    *(name for names in RANK_SOURCES.values() for name in names),
    *SLURM_STEP_ID_ENV_VARS, *SLURM_NODELIST_ENV_VARS, *SLURM_TASKS_PER_NODE_ENV_VARS,
    SLURM_JOB_ID_ENV_VAR, MASTER_ADDR_ENV_VAR, MASTER_PORT_ENV_VAR, FS_LOCAL_RANK_ENV_VAR,
    SHARED_FS_ENV_VAR, OLMO_SHARED_FS_ENV_VAR, "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RUN_ID", *RESTART_COUNT_ENV_VARS, LAUNCHER_PID_ENV_VAR)))

_raw = _variables.raw
_text = _variables.text


def _slurm_step() -> bool:
    """Whether this process is a task of an ``srun`` job step (not a batch/salloc shell)."""
    for name in SLURM_STEP_ID_ENV_VARS:
        raw = _raw(name)
        if raw is not None:
            text = _text(raw).strip()
            return _variables.is_decimal(text) and int(text) < _slurm.SPECIAL_STEP
    return False


def launcher_source() -> str:
    """Which launcher's variables describe this process: ``"torch"``, ``"slurm"`` or ``"openmpi"``.

    See the module docstring for the rule; ``"torch"`` also when nothing is set.
    """
    if _raw(RANK_ENV_VAR) is not None or _raw(WORLD_SIZE_ENV_VAR) is not None:
        return TORCH_SOURCE
    if _raw("SLURM_PROCID") is not None and _slurm_step():
        return SLURM_SOURCE
    if _raw("OMPI_COMM_WORLD_RANK") is not None or _raw("OMPI_COMM_WORLD_SIZE") is not None:
        return OPENMPI_SOURCE
    return TORCH_SOURCE


def _lookup(quantity: str) -> Tuple[Optional[str], Optional[object]]:
    """Return ``(var name, raw value)`` of the first variable set for ``quantity``."""
    for name in LAUNCHER_SOURCES[launcher_source()][quantity]:
        raw = _raw(name)
        if raw is not None:
            return name, raw
    return None, None


#: The most ranks torch's c10d store takes (its world size is a C ``int``).
MAX_RANKS = 2**31 - 1
_MAX_IS = "ranks torch's c10d store takes"


def _parse_int(name: str, raw: object, minimum: int, fix: str, maximum: Optional[int] = None) -> int:
    return _variables.parse_int(name, raw, minimum, fix, maximum, _MAX_IS)


_RANK_FIX = "set it to this process's global rank in [0, WORLD_SIZE)"
_WS_FIX = "set it to the total number of processes (>= 1)"


def _names_of(quantity: str) -> str:
    """The variables this process's launcher uses for ``quantity``, for messages."""
    names = LAUNCHER_SOURCES[launcher_source()][quantity]
    return " (or ".join(reversed(names)) + ")" * (len(names) - 1) if names else quantity.upper()


def _launcher_hint() -> str:
    return {SLURM_SOURCE: "srun sets both", OPENMPI_SOURCE: "mpirun sets both"}.get(
        launcher_source(), "a launcher such as torchrun sets both")


def env_world_size() -> int:
    """World size from the environment, 1 when no launcher variable is set."""
    name, raw = _lookup("world_size")
    if raw is None:
        rname, rraw = _lookup("rank")
        if rraw is not None and _parse_int(rname, rraw, 0, _RANK_FIX, MAX_RANKS) != 0:
            wanted = _names_of("world_size")
            raise DistributedEnvError(
                f"{rname}={_text(rraw)} is set but {wanted} is not: set "
                f"{LAUNCHER_SOURCES[launcher_source()]['world_size'][-1]} to the total number of "
                f"processes ({_launcher_hint()})"
            )
        return 1
    return _parse_int(name, raw, 1, _WS_FIX, MAX_RANKS)


def _slow_env_rank() -> int:
    name, raw = _lookup("rank")
    if raw is None:
        ws = env_world_size()
        if ws > 1:
            wname = _lookup("world_size")[0]
            rname = LAUNCHER_SOURCES[launcher_source()]["rank"][0]
            raise DistributedEnvError(
                f"{wname}={ws} is set but {rname} is not: set {rname} to this process's global "
                f"rank in [0, {wname}) ({_launcher_hint()})"
            )
        return 0
    rank = _parse_int(name, raw, 0, _RANK_FIX, MAX_RANKS)
    ws = env_world_size()
    if rank >= ws:
        raise DistributedEnvError(f"{name}={rank} is out of range for WORLD_SIZE={ws}: {_RANK_FIX}")
    return rank


_RANK_CACHE: Dict[Tuple[object, ...], int] = {}
#: Zero-argument getters of the raw RANK / WORLD_SIZE values (the objects os.environ stores).
rank_raw = _variables.raw_getter(RANK_ENV_VAR)
world_size_raw = _variables.raw_getter(WORLD_SIZE_ENV_VAR)
_OTHER_RAW = tuple(_variables.raw_getter(n) for n in RANK_SOURCES["rank"][1:] + RANK_SOURCES["world_size"][1:])


def env_rank() -> int:
    """Global rank from the environment, 0 when no launcher variable is set."""
    raw = rank_raw()
    if raw is not None:  # torch / composer style: cache on (RANK, WORLD_SIZE)
        key = (raw, world_size_raw())
        rank = _RANK_CACHE.get(key)
        if rank is None:
            rank = _slow_env_rank()
            if key[1] is not None:
                _RANK_CACHE[key] = rank
        return rank
    if world_size_raw() is None:
        for get in _OTHER_RAW:
            if get() is not None:
                return _slow_env_rank()
        return 0
    return _slow_env_rank()


def _slurm_local_world_size() -> Optional[int]:
    """This node's task count from SLURM's per-node lists, or None if none is set."""
    for name in SLURM_TASKS_PER_NODE_ENV_VARS:
        raw = _raw(name)
        if raw is None:
            continue
        counts: List[int] = _slurm.expand_tasks_per_node(_text(raw), name)
        if len(counts) == 1:
            return counts[0]
        nname, nraw = _lookup("node_rank")
        node = 0 if nraw is None else _parse_int(nname, nraw, 0, "set it to this node's index")
        if node >= len(counts):
            raise DistributedEnvError(
                f"{name}={_text(raw)!r} lists {len(counts)} node(s) but {nname}={node}: the "
                "SLURM variables disagree; launch with srun, which sets both")
        return counts[node]
    return None


def env_local_world_size(world_size: Optional[int] = None) -> int:
    """Processes on this node: ``LOCAL_WORLD_SIZE`` (or the launcher's equivalent), else
    world size / nodes, else world size.

    :param world_size: the world size to derive from (default: :func:`env_world_size`).
    """
    ws = env_world_size() if world_size is None else world_size
    source = launcher_source()
    name, raw = _lookup("local_world_size")
    lws: Optional[int] = None
    if source == SLURM_SOURCE:
        lws = _slurm_local_world_size()
        name = "SLURM_TASKS_PER_NODE"
    elif raw is not None:
        lws = _parse_int(name, raw, 1, "set it to the number of processes on this node (>= 1)")
    if lws is None:
        nname, nraw = _lookup("num_nodes")
        if nraw is not None:
            nodes = _parse_int(nname, nraw, 1, "set it to the number of nodes (>= 1)")
            return max(1, ws // nodes)
        return ws
    if lws > ws:
        raise DistributedEnvError(
            f"{name}={lws} is larger than the world size {ws}: set it to the number of "
            "processes on this node"
        )
    return lws


def env_local_rank(rank: Optional[int] = None, world_size: Optional[int] = None) -> int:
    """Rank on this node: ``LOCAL_RANK``, else the global rank modulo the local world size."""
    name, raw = _lookup("local_rank")
    lws = env_local_world_size(world_size)
    if raw is None:
        return (env_rank() if rank is None else rank) % lws
    local = _parse_int(name, raw, 0, "set it to this process's rank on its node")
    if local >= lws:
        raise DistributedEnvError(
            f"{name}={local} is out of range for LOCAL_WORLD_SIZE={lws}: set it to this "
            "process's rank on its node, in [0, LOCAL_WORLD_SIZE)"
        )
    return local


def env_num_nodes(world_size: Optional[int] = None) -> int:
    """Number of nodes: ``NUM_NODES``, else ceil(world size / local world size)."""
    name, raw = _lookup("num_nodes")
    if raw is None:
        ws = env_world_size() if world_size is None else world_size
        return -(-ws // env_local_world_size(ws))
    return _parse_int(name, raw, 1, "set it to the number of nodes (>= 1)")


def env_node_rank(rank: Optional[int] = None, world_size: Optional[int] = None) -> int:
    """Node index: ``NODE_RANK``/``GROUP_RANK``, else global rank // local world size."""
    name, raw = _lookup("node_rank")
    if raw is None:
        r = env_rank() if rank is None else rank
        return r // env_local_world_size(world_size)
    node = _parse_int(name, raw, 0, "set it to this node's index in [0, NUM_NODES)")
    nodes = env_num_nodes(world_size)
    if node >= nodes:
        raise DistributedEnvError(
            f"{name}={node} is out of range for {nodes} node(s): set it to this node's index "
            "in [0, NUM_NODES)"
        )
    return node


def env_attempt() -> int:
    """This attempt's number from the launcher's variables (:data:`RESTART_COUNT_ENV_VARS`, the
    first set), else 0: one node's count, which a membership change does not move."""
    for name in RESTART_COUNT_ENV_VARS:
        raw = _raw(name)
        if raw is not None:
            return _parse_int(name, raw, 0, "set it to the number of restarts before this "
                              "attempt (>= 0), or unset it")
    return 0


def env_shared_filesystem() -> bool:
    """Whether all nodes share one filesystem (``AXOLOTL_DIST_SHARED_FS`` or ``OLMO_SHARED_FS``)."""
    if _raw(SHARED_FS_ENV_VAR) is not None:
        return _variables.kit_switch(SHARED_FS_ENV_VAR)
    raw = _raw(OLMO_SHARED_FS_ENV_VAR)  # OLMo-core's name, read the same way
    if raw is not None:
        return _variables.parse_flag(OLMO_SHARED_FS_ENV_VAR, raw,
                                   _variables.KIT_VARS[SHARED_FS_ENV_VAR].fix)
    return False


def env_fs_local_rank() -> Optional[int]:
    """``FS_LOCAL_RANK`` if set (an explicit per-filesystem rank), else None."""
    raw = _raw(FS_LOCAL_RANK_ENV_VAR)
    if raw is None:
        return None
    return _parse_int(FS_LOCAL_RANK_ENV_VAR, raw, 0, "set it to this process's rank among "
                      "the processes sharing its filesystem")


def env_master_addr() -> Optional[str]:
    """``MASTER_ADDR``, or None; a value torch could not use (blank, spaces) raises."""
    raw = _raw(MASTER_ADDR_ENV_VAR)
    if raw is None:
        return None
    text = _text(raw)
    fix = "set it to the host name or IP address of rank 0's node, e.g. MASTER_ADDR=10.0.0.1"
    if not text.strip():
        raise DistributedEnvError(f"MASTER_ADDR={text!r} is empty: {fix}")
    if text != text.strip():
        raise DistributedEnvError(
            f"MASTER_ADDR={text!r} has spaces around the address (torch would wait its whole "
            f"timeout for a host of that name): set MASTER_ADDR={text.strip()}")
    if any(c.isspace() or c in "/\\'\"" for c in text):
        raise DistributedEnvError(f"MASTER_ADDR={text!r} is not a host name or address: {fix}")
    return text


def env_master_port() -> Optional[int]:
    """``MASTER_PORT`` as an int in [0, 65535], or None."""
    raw = _raw(MASTER_PORT_ENV_VAR)
    if raw is None:
        return None
    port = _parse_int(MASTER_PORT_ENV_VAR, raw, 0, "set it to a free TCP port on MASTER_ADDR")
    if port > 65535:
        raise DistributedEnvError(
            f"MASTER_PORT={port} is not a TCP port: set it to a free port in [1, 65535]"
        )
    return port


def default_master_addr() -> Optional[str]:
    """The rendezvous host the launcher implies when ``MASTER_ADDR`` is unset, or None.

    SLURM: the first host of the step's node list (a malformed list raises). Open MPI with
    every rank on this node: ``127.0.0.1``.
    """
    source = launcher_source()
    if source == SLURM_SOURCE:
        for name in SLURM_NODELIST_ENV_VARS:
            raw = _raw(name)
            if raw is not None:
                return _slurm.first_host(_text(raw), name)
    elif source == OPENMPI_SOURCE and env_local_world_size() == env_world_size():
        return "127.0.0.1"
    return None


def default_master_port() -> Optional[int]:
    """The rendezvous port the launcher implies when ``MASTER_PORT`` is unset, or None.

    SLURM: ``15000 + (SLURM_JOB_ID + SLURM_STEP_ID) % 20000``, the same in every task of a step.
    """
    if launcher_source() != SLURM_SOURCE:
        return None
    job = _raw(SLURM_JOB_ID_ENV_VAR)
    step = next((_raw(n) for n in SLURM_STEP_ID_ENV_VARS if _raw(n) is not None), None)
    return _slurm.default_master_port(None if job is None else _text(job),
                                      None if step is None else _text(step))


def is_set(name: str) -> bool:
    """Whether environment variable ``name`` is set (a dict lookup)."""
    return _raw(name) is not None


def validate_env_vars() -> None:
    """Check every launcher variable that is set; raise :class:`DistributedEnvError` if any is bad.

    A no-op (beyond parsing) for a single process with no variables set.
    """
    env_rank()
    env_world_size()
    env_local_world_size()
    env_local_rank()
    env_num_nodes()
    env_node_rank()
    env_fs_local_rank()
    env_shared_filesystem()
    env_master_port()
    _variables.validate_kit_vars()
    if env_master_addr() is None:
        default_master_addr()
