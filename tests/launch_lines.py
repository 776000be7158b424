"""The launch lines users paste, as the variables each process of them sees: SLURM's as
``srun`` sets them in a task of a job step, torchrun's (and ``accelerate launch``'s, which runs
torch elastic's agent) as the agent sets them for its workers, Open MPI's as ``mpirun`` sets
them. The geometry tests (``tests/runtime/base/test_geometry.py``, ``tests/test_launch_geometry.py``)
read this table.

Each row: a name, the launch line, the variables of one process of it, and what the checks
say: ``None`` for a launch that starts, else a piece of the message every rank raises.
"""

from __future__ import annotations

from itertools import groupby
from typing import Dict, List, NamedTuple, Optional

__all__ = ["Line", "srun", "torchrun", "mpirun", "BAD", "GOOD", "LAUNCHER_BAD", "LAUNCHER_GOOD"]


class Line(NamedTuple):
    name: str
    command: str
    env: Dict[str, str]
    says: Optional[str]  #: a piece of the error; None: it starts


def srun(procid: int, tasks_per_node: List[int], hosts: List[str], job: int = 4242,
         step: int = 0, **extra: str) -> Dict[str, str]:
    """A task of ``srun`` (block distribution) over ``hosts`` with ``tasks_per_node`` tasks."""
    node, first = 0, 0
    while procid >= first + tasks_per_node[node]:
        first += tasks_per_node[node]
        node += 1
    tasks, nodes = sum(tasks_per_node), len(hosts)
    groups = [(count, len(list(same))) for count, same in groupby(tasks_per_node)]
    per_node = ",".join(f"{count}(x{times})" if times > 1 else str(count) for count, times in groups)
    nodelist = ",".join(hosts)
    env = {
        "SLURM_JOB_ID": str(job), "SLURM_JOBID": str(job), "SLURM_STEP_ID": str(step),
        "SLURM_STEPID": str(step), "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(procid - first), "SLURM_NODEID": str(node),
        "SLURM_NTASKS": str(tasks), "SLURM_NPROCS": str(tasks),
        "SLURM_STEP_NUM_TASKS": str(tasks), "SLURM_STEP_NUM_NODES": str(nodes),
        "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_NNODES": str(nodes),
        "SLURM_STEP_TASKS_PER_NODE": per_node, "SLURM_TASKS_PER_NODE": per_node,
        "SLURM_STEP_NODELIST": nodelist, "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NODELIST": nodelist, "SLURMD_NODENAME": hosts[node],
        "SLURM_CPUS_ON_NODE": "16", "SLURM_SUBMIT_DIR": "/home/user/run",
    }
    env.update(extra)
    return env


def sbatch_shell(tasks: int, hosts: List[str], job: int = 4242) -> Dict[str, str]:
    """An ``sbatch`` script's own shell (no step): what a ``python`` started there sees."""
    nodelist = ",".join(hosts)
    return {"SLURM_JOB_ID": str(job), "SLURM_JOBID": str(job), "SLURM_PROCID": "0",
            "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": str(tasks),
            "SLURM_NPROCS": str(tasks), "SLURM_JOB_NUM_NODES": str(len(hosts)),
            "SLURM_NNODES": str(len(hosts)), "SLURM_JOB_NODELIST": nodelist,
            "SLURM_NODELIST": nodelist, "SLURM_TASKS_PER_NODE": f"{tasks // len(hosts)}"
            + (f"(x{len(hosts)})" if len(hosts) > 1 else "")}


def torchrun(rank: int, nproc: int, nnodes: int, node: int, master: str, port: int = 29500,
             **extra: str) -> Dict[str, str]:
    """A worker of torch elastic's agent (torchrun, axolotl-dist, accelerate launch)."""
    env = {"RANK": str(rank), "WORLD_SIZE": str(nproc * nnodes), "LOCAL_RANK": str(rank % nproc),
           "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": str(node),
           "GROUP_WORLD_SIZE": str(nnodes), "ROLE_RANK": str(rank), "ROLE_NAME": "default",
           "ROLE_WORLD_SIZE": str(nproc * nnodes), "MASTER_ADDR": master,
           "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0",
           "TORCHELASTIC_MAX_RESTARTS": "0",
           "TORCHELASTIC_RUN_ID": "95b485be-9855-452b-bbc4-c58c2b7292dd",
           "TORCHELASTIC_USE_AGENT_STORE": "True"}
    env.update(extra)
    return env


def mpirun(rank: int, size: int, per_node: int, **extra: str) -> Dict[str, str]:
    """A process of ``mpirun -np size`` with ``per_node`` processes on each node."""
    env = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size),
           "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % per_node),
           "OMPI_COMM_WORLD_LOCAL_SIZE": str(per_node),
           "OMPI_COMM_WORLD_NODE_RANK": str(rank % per_node), "OMPI_UNIVERSE_SIZE": str(size)}
    env.update(extra)
    return env


H2 = ["gpu-a01", "gpu-a02"]
H4 = ["gpu-a01", "gpu-a02", "gpu-a03", "gpu-a04"]
ACCELERATE = {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_DYNAMO_BACKEND": "NO"}

#: Launches that would hang, double their ranks or train apart: every rank raises at once.
BAD: List[Line] = [
    Line("srun 2 tasks x torchrun",
         "srun -N1 --ntasks-per-node=2 torchrun --standalone --nproc-per-node 2 train.py",
         {**srun(1, [2], H2[:1]), **torchrun(1, 2, 1, 0, "localhost")},
         "started 2 tasks on this node"),
    Line("srun 4 per node x torchrun, 2 nodes",
         "srun -N2 --ntasks-per-node=4 torchrun --nnodes 2 --nproc-per-node 4 "
         "--rdzv-backend c10d --rdzv-endpoint gpu-a01:29500 train.py",
         {**srun(5, [4, 4], H2), **torchrun(3, 4, 2, 0, "gpu-a01")},
         "started 4 tasks on this node"),
    Line("srun 8 per node x accelerate launch",
         "srun --ntasks-per-node=8 accelerate launch --num_processes 8 train.py",
         {**srun(6, [8], H2[:1]), **torchrun(2, 8, 1, 0, "127.0.0.1"), **ACCELERATE},
         "started 8 tasks on this node"),
    Line("sbatch exports RANK, srun -n4",
         "export RANK=0 WORLD_SIZE=4; srun -n4 python train.py",
         {**srun(2, [4], H2[:1]), "RANK": "0", "WORLD_SIZE": "4"},
         "RANK=0 but srun started this process as task 2 of 4"),
    Line("sbatch exports RANK, srun on 4 nodes",
         "export RANK=0 WORLD_SIZE=4 MASTER_ADDR=gpu-a01; srun -N4 --ntasks-per-node=1 python train.py",
         {**srun(3, [1, 1, 1, 1], H4), "RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "gpu-a01"},
         "RANK=0 but srun started this process as task 3 of 4"),
    Line("mpirun -x RANK",
         "mpirun -np 4 -x RANK -x WORLD_SIZE -x MASTER_ADDR -x MASTER_PORT python train.py",
         {**mpirun(2, 4, 4), "RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
          "MASTER_PORT": "29500"},
         "RANK=0 but mpirun started this process as task 2 of 4"),
    Line("mpirun 4 per node x torchrun",
         "mpirun -np 8 --map-by ppr:4:node torchrun --nnodes 2 --nproc-per-node 4 train.py",
         {**mpirun(5, 8, 4), **torchrun(1, 4, 2, 0, "gpu-a01")},
         "runs inside mpirun, which started 4 tasks on this node"),
    Line("srun 2 nodes x torchrun --standalone",
         "srun -N2 --ntasks-per-node=1 torchrun --standalone --nproc-per-node 4 train.py",
         {**srun(1, [1, 1], H2), **torchrun(2, 4, 1, 0, "localhost")},
         "each node forms a job of its own"),
    Line("srun 2 nodes x torchrun --nnodes 1",
         "srun -N2 --ntasks-per-node=1 torchrun --nnodes 1 --nproc-per-node 8 "
         "--rdzv-endpoint 127.0.0.1:29400 train.py",
         {**srun(0, [1, 1], H2), **torchrun(5, 8, 1, 0, "127.0.0.1")},
         "each node forms a job of its own"),
    Line("srun 2 nodes, MASTER_ADDR=localhost exported",
         "export MASTER_ADDR=localhost; srun -N2 --ntasks-per-node=4 python train.py",
         {**srun(6, [4, 4], H2), "MASTER_ADDR": "localhost"},
         "MASTER_ADDR=localhost names each host itself"),
    Line("srun 2 nodes, hand-exported RANK, MASTER_ADDR=127.0.0.1",
         "srun -N2 --ntasks-per-node=4 bash -c 'RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS "
         "LOCAL_RANK=$SLURM_LOCALID LOCAL_WORLD_SIZE=4 MASTER_ADDR=127.0.0.1 python train.py'",
         {**srun(1, [4, 4], H2), "RANK": "1", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
          "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
         "MASTER_ADDR=127.0.0.1 names each host itself"),
    Line("srun 2 per node x composer's launcher",
         "srun -N2 --ntasks-per-node=2 composer -n 4 train.py (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE "
         "per rank, no agent)",
         {**srun(3, [2, 2], H2), "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
          "LOCAL_WORLD_SIZE": "4", "NODE_RANK": "1", "MASTER_ADDR": "gpu-a01",
          "MASTER_PORT": "29500"},
         "runs inside srun, which started 2 tasks on this node"),
    Line("sbatch array, srun 2 per node x torchrun",
         "#SBATCH --array=0-3; srun --ntasks-per-node=2 torchrun --standalone "
         "--nproc-per-node 4 train.py",
         {**srun(0, [2], H2[:1], job=9001, SLURM_ARRAY_JOB_ID="9000", SLURM_ARRAY_TASK_ID="1"),
          **torchrun(3, 4, 1, 0, "localhost")},
         "started 2 tasks on this node"),
]

#: Launches that are fine: nothing raises, nothing is warned.
GOOD: List[Line] = [
    Line("srun -n4", "srun -N1 -n4 python train.py", srun(3, [4], H2[:1]), None),
    Line("srun 2 nodes x 4", "srun -N2 --ntasks-per-node=4 python train.py",
         srun(6, [4, 4], H2), None),
    Line("srun uneven", "srun -n6 python train.py (4 + 2 tasks)", srun(5, [4, 2], H2), None),
    Line("srun 1 per node x torchrun, 2 nodes",
         "srun -N2 --ntasks-per-node=1 torchrun --nnodes 2 --nproc-per-node 4 "
         "--rdzv-backend c10d --rdzv-endpoint gpu-a01:29500 train.py",
         {**srun(1, [1, 1], H2), **torchrun(6, 4, 2, 1, "gpu-a01")}, None),
    Line("srun 1 per node x torchrun, node 0 says localhost",
         "srun -N2 --ntasks-per-node=1 bash -c 'torchrun --nnodes 2 --rdzv-endpoint "
         "$([ $SLURM_NODEID = 0 ] && echo localhost || echo gpu-a01):29500 ...'",
         {**srun(0, [1, 1], H2), **torchrun(1, 4, 2, 0, "localhost")}, None),
    Line("srun 8 tasks x torchrun of one worker each",
         "srun -N1 -n8 torchrun --nnodes 8 --nproc-per-node 1 --rdzv-backend c10d "
         "--rdzv-endpoint gpu-a01:29500 train.py",
         {**srun(3, [8], H2[:1]), **torchrun(5, 1, 8, 5, "gpu-a01")}, None),
    Line("srun hand-exported RANK=$SLURM_PROCID",
         "srun -N2 --ntasks-per-node=4 bash -c 'RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS "
         "LOCAL_RANK=$SLURM_LOCALID MASTER_ADDR=gpu-a01 python train.py'",
         {**srun(5, [4, 4], H2), "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
          "MASTER_ADDR": "gpu-a01", "MASTER_PORT": "29500"}, None),
    Line("sbatch array, srun -n2", "#SBATCH --array=0-7; srun -n2 python train.py",
         srun(1, [2], H2[:1], job=9003, SLURM_ARRAY_JOB_ID="9000", SLURM_ARRAY_TASK_ID="3"),
         None),
    Line("sbatch, torchrun --standalone without srun",
         "#SBATCH -N1 -n1; torchrun --standalone --nproc-per-node 4 train.py",
         {**sbatch_shell(1, H2[:1]), **torchrun(2, 4, 1, 0, "localhost")}, None),
    Line("srun -n1, ranks spawned by the script",
         "srun -n1 python spawn_ranks.py (mp.spawn, 4 ranks with RANK/WORLD_SIZE)",
         {**srun(0, [1], H2[:1]), "RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
          "MASTER_PORT": "29500"}, None),
    Line("mpirun -np 4", "mpirun -np 4 -x MASTER_ADDR -x MASTER_PORT python train.py",
         mpirun(3, 4, 4, MASTER_ADDR="127.0.0.1", MASTER_PORT="29500"), None),
    Line("mpirun 1 per node x torchrun",
         "mpirun -np 2 --map-by ppr:1:node torchrun --nnodes 2 --nproc-per-node 4 train.py",
         {**mpirun(1, 2, 1), **torchrun(5, 4, 2, 1, "gpu-a01")}, None),
    Line("accelerate launch", "accelerate launch --num_processes 4 train.py",
         {**torchrun(2, 4, 1, 0, "127.0.0.1"), **ACCELERATE}, None),
    Line("torchrun", "torchrun --nproc-per-node 8 train.py", torchrun(7, 8, 1, 0, "127.0.0.1"),
         None),
    Line("bare env", "RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 python train.py",
         {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
         None),
    Line("checks off", "AXOLOTL_DIST_CHECK_LAUNCH=0 srun -N2 torchrun --standalone ...",
         {**srun(1, [1, 1], H2), **torchrun(2, 4, 1, 0, "localhost"),
          "AXOLOTL_DIST_CHECK_LAUNCH": "0"}, None),
]

#: ``axolotl-dist``'s own variables and options (nproc, min nodes, max nodes).
LAUNCHER_BAD = [
    ("srun --ntasks-per-node=2 axolotl-dist -n 4", srun(1, [2], H2[:1]), (4, 1, 1),
     "axolotl-dist runs inside srun, which started 2 tasks on this node"),
    ("srun -N2 axolotl-dist -n 4 (no --nnodes)", srun(1, [1, 1], H2), (4, 1, 1),
     "srun started axolotl-dist on 2 nodes"),
    ("mpirun -np 4 axolotl-dist -n 2", mpirun(1, 4, 4), (2, 1, 1),
     "axolotl-dist runs inside mpirun, which started 4 tasks on this node"),
]
LAUNCHER_GOOD = [
    ("srun -N2 --ntasks-per-node=1 axolotl-dist --nnodes 2", srun(1, [1, 1], H2), (4, 2, 2)),
    ("srun -N2 axolotl-dist --nnodes 1:2", srun(0, [1, 1], H2), (4, 1, 2)),
    ("axolotl-dist -n 4 under sbatch", sbatch_shell(4, H2[:1]), (4, 1, 1)),
    ("axolotl-dist -n 4", {}, (4, 1, 1)),
]
