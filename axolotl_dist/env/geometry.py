"""The launch geometry: the launchers' variables checked against each other before a rank
connects anywhere (docs/launching.md, "Launch geometry").

A job started by two launchers at once (``torchrun`` inside an ``srun`` of several tasks per
node, a launcher inside ``mpirun``), a ``RANK`` exported to every task, a ``torchrun
--standalone`` on each node of a multi-node step, or a loopback ``MASTER_ADDR`` on several hosts
does not fail: it waits in the rendezvous until a timeout, or runs twice the ranks, or each node
trains alone. Each of those leaves a mark in the variables every rank sees, so every rank can
say so at once, before the rendezvous.

* :func:`check_geometry`: a rank's variables (``init_distributed``); raises
  :class:`~axolotl_dist.errors.DistributedEnvError` naming the variables, their values and the
  fix, returns the warnings of a launch that runs but probably not as meant.
* :func:`check_launcher`: ``axolotl-dist``'s own variables before it starts ranks.
* :func:`bound_per_task`: whether SLURM gave each task GPUs of its own.

Every check reads only what is set and never guesses: a value it cannot parse (another
launcher's, which the rank queries do not read) ends that check, silently. A launch these
checks refuse wrongly is switched through with ``AXOLOTL_DIST_CHECK_LAUNCH=0``.
"""

from __future__ import annotations

import ipaddress
from typing import List, Mapping, NamedTuple, Optional, Tuple

from . import slurm
from .variables import CHECK_LAUNCH_ENV_VAR, KIT_VARS, parse_flag, is_decimal
from . import SLURM_NODELIST_ENV_VARS, SLURM_STEP_ID_ENV_VARS, SLURM_TASKS_PER_NODE_ENV_VARS
from ..errors import DistributedEnvError

__all__ = ["check_geometry", "check_launcher", "bound_per_task", "is_loopback"]

#: Set by torch elastic's agent (torchrun, axolotl-dist, accelerate launch) for its workers.
_AGENT_VAR = "TORCHELASTIC_RUN_ID"
_OFF = f"(a launch this check refuses wrongly runs with {CHECK_LAUNCH_ENV_VAR}=0)"


def _int(env: Mapping[str, str], *names: str) -> Optional[int]:
    """The first of ``names`` that is set, as an int >= 0; None if none is, or it is not one."""
    for name in names:
        value = env.get(name)
        if value is not None:
            value = value.strip()
            return int(value) if is_decimal(value) else None
    return None


def _switched_off(env: Mapping[str, str]) -> bool:
    """Whether ``AXOLOTL_DIST_CHECK_LAUNCH`` turns the checks off (a bad value raises)."""
    value = env.get(CHECK_LAUNCH_ENV_VAR)
    return value is not None and value.strip() != "" and \
        not parse_flag(CHECK_LAUNCH_ENV_VAR, value, KIT_VARS[CHECK_LAUNCH_ENV_VAR].fix)


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this host itself whatever host reads it (``localhost``,
    ``127.0.0.1``, ``::1``)."""
    name = host.strip().strip("[]").lower()
    if name in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class _Step(NamedTuple):
    """This task's srun job step."""

    procid: int
    tasks: int
    nodes: int
    node: int
    here: int  #: tasks on this node
    hosts: List[str]
    here_var: str  #: ``SLURM_STEP_TASKS_PER_NODE=4(x2)``, for messages


def _slurm_step(env: Mapping[str, str]) -> Optional[_Step]:
    """This process's srun step, or None (no step, a batch shell, or values that do not parse)."""
    step = _int(env, *SLURM_STEP_ID_ENV_VARS)
    procid = _int(env, "SLURM_PROCID")
    tasks = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    if step is None or step >= slurm.SPECIAL_STEP or procid is None or not tasks:
        return None
    node = _int(env, "SLURM_NODEID") or 0
    nodes = _int(env, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES") or 1
    here = _tasks_here(env, node)
    if here is None:
        return None
    if not here[0]:
        here = (-(-tasks // nodes), f"SLURM_STEP_NUM_TASKS={tasks} on {nodes} node(s)")
    return _Step(procid, tasks, nodes, node, here[0], _hosts(env), here[1])


def _tasks_here(env: Mapping[str, str], node: int) -> Optional[Tuple[int, str]]:
    """``(tasks on node, "NAME=value")`` from SLURM's per-node list; ``(0, "")`` where none is
    set, None where it does not parse."""
    for name in SLURM_TASKS_PER_NODE_ENV_VARS:
        if name in env:
            try:
                counts = slurm.expand_tasks_per_node(env[name], name)
            except DistributedEnvError:
                return None
            return counts[node if node < len(counts) else 0], f"{name}={env[name]}"
    return 0, ""


def _hosts(env: Mapping[str, str]) -> List[str]:
    """The step's hosts (``node[01-04]`` expanded); none where the list does not parse."""
    for name in SLURM_NODELIST_ENV_VARS:
        if name in env:
            try:
                return slurm.expand_nodelist(env[name], name)
            except DistributedEnvError:
                return []
    return []


class _Mpi(NamedTuple):
    rank: int
    size: int
    here: int


def _mpi(env: Mapping[str, str]) -> Optional[_Mpi]:
    rank, size = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
    if rank is None or not size:
        return None
    return _Mpi(rank, size, _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") or 1)


class _Torch(NamedTuple):
    rank: int
    world: int
    local_world: Optional[int]
    nodes: Optional[int]
    agent: bool


def _torch(env: Mapping[str, str]) -> Optional[_Torch]:
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if rank is None or not world:
        return None
    return _Torch(rank, world, _int(env, "LOCAL_WORLD_SIZE"),
                  _int(env, "NUM_NODES", "GROUP_WORLD_SIZE"), _AGENT_VAR in env)


def _who(t: _Torch) -> str:
    if t.agent:
        return f"torchrun (or axolotl-dist, accelerate launch: {_AGENT_VAR} is set)"
    return f"a launcher that sets RANK and WORLD_SIZE (RANK={t.rank}, WORLD_SIZE={t.world})"


def _inside(t: _Torch, launcher: str, rank_var: str, task: int, tasks: int, here: int,
            here_var: str, one_per_node: str) -> None:
    """A torch-style process inside ``launcher`` (srun, mpirun) that started ``tasks`` tasks,
    ``here`` on this node, this one ``task``: refuse a launcher per task, or a ``RANK`` every
    task inherited."""
    if t.world <= 1:
        return
    if t.agent:  # the agent numbers its workers: only how many it starts per task tells
        if here > 1 and (t.local_world or 1) > 1:
            _doubled(t, launcher, here, here_var, one_per_node)
        return
    if (t.rank, t.world) == (task, tasks):
        return  # the task's own numbers, exported by hand (``RANK=$SLURM_PROCID``): fine
    if t.world == tasks:
        raise DistributedEnvError(
            f"RANK={t.rank} but {launcher} started this process as task {task} of {tasks} "
            f"({rank_var}={task}): a RANK exported before {launcher} reaches every task, so "
            f"several ranks claim rank {t.rank} and the rendezvous waits forever. Unset RANK "
            f"and WORLD_SIZE (the kit reads {launcher}'s own variables), or set each task's "
            f"from {rank_var} {_OFF}")
    if here > 1:
        _doubled(t, launcher, here, here_var, one_per_node)


def _doubled(t: _Torch, launcher: str, here: int, here_var: str, one_per_node: str) -> None:
    """Raise for a per-node launcher started by each of ``here`` tasks of this node."""
    per = f"{t.local_world} rank(s)" if t.local_world else "its own ranks"
    raise DistributedEnvError(
        f"{_who(t)} runs inside {launcher}, which started {here} tasks on this node "
        f"({here_var}): each task starts {per}, {here} times over, and the rendezvous "
        f"waits for ranks that never come or joins twice the job. Start one launcher per "
        f"node ({one_per_node}), or drop the launcher and let {launcher} start one task "
        f"per rank {_OFF}")


def check_geometry(env: Mapping[str, str]) -> List[str]:
    """Check a rank's launch variables (see the module docstring); raise
    :class:`~axolotl_dist.errors.DistributedEnvError` for a launch that would hang, double
    its ranks or train apart; return warnings for one that runs, but probably not as meant.
    Nothing is checked with ``AXOLOTL_DIST_CHECK_LAUNCH=0``."""
    if _switched_off(env):
        return []
    t, step, mpi = _torch(env), _slurm_step(env), _mpi(env)
    if t is not None and step is not None and step.tasks > 1:
        _inside(t, "srun", "SLURM_PROCID", step.procid, step.tasks, step.here, step.here_var,
                "srun --ntasks-per-node=1")
    if t is not None and mpi is not None and mpi.size > 1:
        _inside(t, "mpirun", "OMPI_COMM_WORLD_RANK", mpi.rank, mpi.size, mpi.here,
                f"OMPI_COMM_WORLD_LOCAL_SIZE={mpi.here}", "mpirun --map-by ppr:1:node")
    if step is not None:
        _loopback_on_several_hosts(env.get("MASTER_ADDR", "").strip(), step, t)
    return _alone_in_a_batch_shell(env, t is None and mpi is None)


def _loopback_on_several_hosts(master: str, step: _Step, t: Optional[_Torch]) -> None:
    """Refuse a loopback ``MASTER_ADDR`` in a step on several hosts: ``torchrun`` on one node
    run on each (it trains alone), or ranks of several hosts told to find the store on theirs."""
    hosts = sorted(set(step.hosts))
    if len(hosts) < 2 or not master or not is_loopback(master):
        return
    nodes = (f"SLURM_STEP_NUM_NODES={step.nodes}, SLURM_STEP_NODELIST has "
             f"{', '.join(hosts[:4])}" + (", ..." if len(hosts) > 4 else ""))
    if t is not None and t.agent and t.nodes == 1:
        raise DistributedEnvError(
            f"torchrun on one node (--standalone or --nnodes 1: MASTER_ADDR={master}, "
            f"GROUP_WORLD_SIZE=1) runs on each of the {len(hosts)} nodes srun started ({nodes}): "
            f"each node forms a job of its own and trains alone. Drop --standalone and pass "
            f"--nnodes {len(hosts)} --rdzv-backend c10d --rdzv-endpoint {hosts[0]}:29500 "
            f"(axolotl-dist takes the same options) {_OFF}")
    if t is None or (not t.agent and t.world > (t.local_world or t.world)):
        raise DistributedEnvError(
            f"MASTER_ADDR={master} names each host itself, but this job's ranks run on "
            f"{len(hosts)} hosts ({nodes}): the ranks on the other hosts look for rank 0's "
            f"store on their own host and wait forever. Unset MASTER_ADDR (the kit then takes "
            f"the first host of the node list, {hosts[0]}) or set it to {hosts[0]} {_OFF}")


def _alone_in_a_batch_shell(env: Mapping[str, str], no_launcher: bool) -> List[str]:
    """The warning for a ``python`` started alone in an ``sbatch`` shell of several tasks."""
    jobs = _int(env, "SLURM_NTASKS")
    shell = "SLURM_JOB_ID" in env and not any(n in env for n in SLURM_STEP_ID_ENV_VARS)
    if not (shell and no_launcher and jobs and jobs > 1):
        return []
    return [f"this process runs alone, although its SLURM job has {jobs} tasks (SLURM_NTASKS="
            f"{jobs}): it was not started by srun (no SLURM_STEP_ID). For {jobs} ranks start it "
            "with `srun python ...` (or one torchrun per node under srun)"]


def check_launcher(env: Mapping[str, str], nproc: int, min_nodes: int, max_nodes: int) -> None:
    """``axolotl-dist``'s own variables before it starts ``nproc`` ranks per node on
    ``min_nodes``-``max_nodes`` nodes: one launcher per srun or mpirun task is meant, and a
    multi-node step needs ``--nnodes``."""
    if _switched_off(env):
        return
    step, mpi = _slurm_step(env), _mpi(env)
    for launcher, here, here_var, fix in (
            ("srun", step.here if step else 1, step.here_var if step else "",
             "srun --ntasks-per-node=1 axolotl-dist ..."),
            ("mpirun", mpi.here if mpi else 1, f"OMPI_COMM_WORLD_LOCAL_SIZE={mpi.here if mpi else 1}",
             "mpirun --map-by ppr:1:node axolotl-dist ...")):
        if here > 1:
            raise DistributedEnvError(
                f"axolotl-dist runs inside {launcher}, which started {here} tasks on this node "
                f"({here_var}): each would start {nproc} rank(s) and rendezvous on its own. Start "
                f"one axolotl-dist per node ({fix}) {_OFF}")
    if step is not None and step.nodes > 1 and max_nodes < step.nodes:
        raise DistributedEnvError(
            f"srun started axolotl-dist on {step.nodes} nodes (SLURM_STEP_NUM_NODES="
            f"{step.nodes}) but --nnodes is {max_nodes if min_nodes == max_nodes else f'{min_nodes}:{max_nodes}'}: "
            f"each node would form a job of its own and train alone. Pass --nnodes {step.nodes} "
            f"--rdzv-backend c10d --rdzv-endpoint "
            f"{(step.hosts or ['<first node>'])[0]}:29500 {_OFF}")


def bound_per_task(env: Mapping[str, str], visible: int, local_world: int) -> bool:
    """Whether SLURM gave each task of this node GPUs of its own (``--gpus-per-task``,
    ``--gpu-bind``): then a task that sees fewer GPUs than the node has ranks still has one to
    itself (its ``cuda:0``)."""
    step = _slurm_step(env)
    if step is None or visible < 1 or step.here != local_world:
        return False
    if "SLURM_GPUS_PER_TASK" in env:
        return True
    for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        if env.get(name, "").strip():
            return len(env[name].split(",")) >= local_world * visible > visible
    return False
