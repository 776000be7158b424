"""Launch lines started for real, two processes each: a misconfigured geometry fails on every
rank before the rendezvous, naming the cause; a valid one starts and runs a barrier. The whole
table (``tests/launch_lines.py``) is checked line by line in ``tests/runtime/base/test_geometry.py``;
here the processes see the variables a launcher would give them on this host."""

from __future__ import annotations

import sys
import time
from typing import Dict, List, Tuple

import pytest

from fixtures import finish, free_port, run, start, subprocess_env
from launch_lines import mpirun, sbatch_shell, srun, torchrun

SCRIPT = """\
import axolotl_dist as ad

ad.init_distributed()
print(f"started {ad.get_rank()}/{ad.get_world_size()}", flush=True)
ad.barrier()
ad.cleanup_distributed()
"""

HOSTS = ["localhost", "127.0.0.2"]  # two "hosts" of a step, both answering here

#: (name, each process's variables, what every rank says)
BAD = [
    ("srun 2 tasks x torchrun",
     lambda r, port: {**srun(r, [2], HOSTS[:1]), **torchrun(r, 2, 1, 0, "localhost", port)},
     "started 2 tasks on this node"),
    ("srun 2 nodes x torchrun --standalone",
     lambda r, port: {**srun(r, [1, 1], HOSTS), **torchrun(0, 1, 1, 0, "localhost", port)},
     "each node forms a job of its own"),
    ("srun 2 nodes, MASTER_ADDR=localhost exported",
     lambda r, port: {**srun(r, [1, 1], HOSTS), "MASTER_ADDR": "localhost",
                      "MASTER_PORT": str(port)},
     "MASTER_ADDR=localhost names each host itself"),
    ("mpirun 2 per node x a per-node launcher",
     lambda r, port: {**mpirun(r, 2, 2), "RANK": str(r), "WORLD_SIZE": "4",
                      "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                      "MASTER_PORT": str(port)},
     "runs inside mpirun, which started 2 tasks on this node"),
]

GOOD = [
    ("srun -n2", lambda r, port: srun(r, [2], HOSTS[:1], MASTER_PORT=str(port))),
    ("srun -n2, RANK=$SLURM_PROCID by hand",
     lambda r, port: {**srun(r, [2], HOSTS[:1]), "RANK": str(r), "WORLD_SIZE": "2",
                      "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}),
    ("srun -n1, the script's own two ranks",
     lambda r, port: {**srun(0, [1], HOSTS[:1]), "RANK": str(r), "WORLD_SIZE": "2",
                      "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}),
    ("mpirun -np 2", lambda r, port: mpirun(r, 2, 2, MASTER_ADDR="127.0.0.1",
                                           MASTER_PORT=str(port))),
]


def _launch(tmp_path, make, ranks: int = 2) -> Tuple[List[Tuple[int, str, str]], float]:
    """Start ``ranks`` processes of :data:`SCRIPT`, each with ``make(rank, port)``'s variables;
    their outcomes and the seconds until the last one ended."""
    (tmp_path / "train.py").write_text(SCRIPT)
    port, began = free_port(), time.monotonic()
    procs = [start([sys.executable, "train.py"], {**subprocess_env(tmp_path), **make(r, port)},
                   cwd=tmp_path) for r in range(ranks)]
    outcomes = [finish(p, timeout=60) for p in procs]
    return outcomes, time.monotonic() - began


@pytest.mark.parametrize("name,make,says", BAD, ids=[b[0] for b in BAD])
def test_a_misconfigured_launch_fails_at_once_on_every_rank(tmp_path, name, make, says):
    outcomes, seconds = _launch(tmp_path, make)
    for rank, (code, out, err) in enumerate(outcomes):
        assert code == 1, (rank, out, err)
        assert "started" not in out
        assert says in err, (rank, err)
        assert err.count("DistributedEnvError") == 1, err  # one account, the user's frame
        assert "train.py" in err and "axolotl_dist/" not in err.replace("axolotl_dist/errors", "")
    print(f"{name}: both ranks failed {seconds:.1f} s after they were started")
    # before any connection: no rendezvous timeout (torch's default is 30 min), only the start
    # of two interpreters and their imports (about 2-3 s each here, 5 s under a loaded suite)
    assert seconds < 30, seconds


@pytest.mark.parametrize("name,make", GOOD, ids=[g[0] for g in GOOD])
def test_a_valid_launch_starts(tmp_path, name, make):
    outcomes, _seconds = _launch(tmp_path, make)
    for rank, (code, out, err) in enumerate(outcomes):
        assert code == 0, (rank, out, err)
        assert f"started {rank}/2" in out
        assert "WARNING" not in err, err


def test_python_alone_in_an_sbatch_shell_of_four_tasks_says_so_and_runs(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    env: Dict[str, str] = {**subprocess_env(tmp_path), **sbatch_shell(4, HOSTS[:1])}
    code, out, err = run([sys.executable, "train.py"], env, timeout=60, cwd=tmp_path)
    assert code == 0, err
    assert "started 0/1" in out
    assert err.count("SLURM_NTASKS=4") == 1, err
    assert "WARNING" in err and "srun python" in err


def test_axolotl_dist_started_by_srun_twice_per_node_fails_before_its_rendezvous(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    cmd = [sys.executable, "-m", "axolotl_dist.launch", "-n", "2", "train.py"]
    began = time.monotonic()
    procs = [start(cmd, {**subprocess_env(tmp_path), **srun(r, [2], HOSTS[:1])}, cwd=tmp_path)
             for r in range(2)]
    for code, out, err in (finish(p, timeout=60) for p in procs):
        assert code == 1, (out, err)
        assert "started" not in out
        assert err.count("axolotl-dist runs inside srun, which started 2 tasks on this node") == 1
        assert "srun --ntasks-per-node=1 axolotl-dist" in err
    assert time.monotonic() - began < 30


def test_axolotl_dist_once_per_node_under_srun_starts(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    env = {**subprocess_env(tmp_path), **srun(0, [1], HOSTS[:1])}
    code, out, err = run([sys.executable, "-m", "axolotl_dist.launch", "-n", "2", "train.py"],
                         env, timeout=120, cwd=tmp_path)
    assert code == 0, err
    assert "started 0/2" in out and "started 1/2" in out
