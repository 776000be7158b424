"""Unit tests of the launch geometry's checks (``env/geometry.py``) over the launch
lines users paste (``tests/launch_lines.py``); ``tests/test_launch_geometry.py`` starts some of
them for real."""

from __future__ import annotations

import pytest

from axolotl_dist.env.geometry import (bound_per_task, check_geometry, check_launcher,
                                                 is_loopback)
from axolotl_dist.errors import DistributedEnvError
from launch_lines import BAD, GOOD, H2, LAUNCHER_BAD, LAUNCHER_GOOD, sbatch_shell, srun


def test_the_table_has_ten_of_each():
    assert len(BAD) >= 10 and len(GOOD) >= 10


@pytest.mark.parametrize("line", BAD, ids=[line.name for line in BAD])
def test_a_launch_that_would_hang_or_double_raises_naming_it(line):
    with pytest.raises(DistributedEnvError) as info:
        check_geometry(line.env)
    message = str(info.value)
    assert line.says in message
    assert "AXOLOTL_DIST_CHECK_LAUNCH=0" in message  # the way out of a wrong refusal
    assert any(word in message for word in ("srun", "mpirun", "--nnodes", "MASTER_ADDR"))
    check_geometry({**line.env, "AXOLOTL_DIST_CHECK_LAUNCH": "0"})  # switched off: nothing


@pytest.mark.parametrize("line", GOOD, ids=[line.name for line in GOOD])
def test_a_valid_launch_passes_without_a_word(line):
    assert check_geometry(line.env) == []


def test_every_task_of_a_bad_srun_step_raises_and_every_task_of_a_good_one_passes():
    for procid in range(8):
        with pytest.raises(DistributedEnvError, match="started 4 tasks on this node"):
            check_geometry({**srun(procid, [4, 4], H2), "RANK": str(procid % 4),
                            "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                            "TORCHELASTIC_RUN_ID": "x", "GROUP_WORLD_SIZE": "2"})
        assert check_geometry(srun(procid, [4, 4], H2)) == []


def test_python_in_an_sbatch_shell_of_several_tasks_is_warned_once():
    warnings = check_geometry(sbatch_shell(4, H2[:1]))
    assert len(warnings) == 1
    assert "SLURM_NTASKS=4" in warnings[0] and "srun python" in warnings[0]
    assert check_geometry(sbatch_shell(1, H2[:1])) == []


def test_values_another_launcher_set_badly_end_the_check_silently():
    env = {**srun(1, [2], H2[:1]), "SLURM_STEP_TASKS_PER_NODE": "2(x", "RANK": "0",
           "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "x"}
    env.pop("SLURM_TASKS_PER_NODE")
    assert check_geometry(env) == []
    assert check_geometry({**srun(1, [2], H2[:1]), "SLURM_PROCID": "one"}) == []


def test_a_bad_switch_value_names_the_variable():
    with pytest.raises(DistributedEnvError, match="AXOLOTL_DIST_CHECK_LAUNCH"):
        check_geometry({"AXOLOTL_DIST_CHECK_LAUNCH": "maybe"})


@pytest.mark.parametrize("line", LAUNCHER_BAD, ids=[line[0] for line in LAUNCHER_BAD])
def test_axolotl_dist_inside_a_launcher_of_several_tasks_per_node_raises(line):
    _name, env, (nproc, low, high), says = line
    with pytest.raises(DistributedEnvError, match=says):
        check_launcher(env, nproc, low, high)
    check_launcher({**env, "AXOLOTL_DIST_CHECK_LAUNCH": "off"}, nproc, low, high)


@pytest.mark.parametrize("line", LAUNCHER_GOOD, ids=[line[0] for line in LAUNCHER_GOOD])
def test_axolotl_dist_one_per_node_passes(line):
    _name, env, (nproc, low, high) = line
    check_launcher(env, nproc, low, high)


def test_the_multi_node_fix_names_the_first_host_and_the_node_count():
    with pytest.raises(DistributedEnvError) as info:
        check_launcher(srun(0, [1, 1], H2), 4, 1, 1)
    assert "--nnodes 2" in str(info.value) and f"{H2[0]}:29500" in str(info.value)


def test_gpus_bound_per_task_by_slurm():
    four = srun(2, [4], H2[:1])
    assert bound_per_task({**four, "SLURM_GPUS_PER_TASK": "1"}, 1, 4)
    assert bound_per_task({**four, "SLURM_STEP_GPUS": "0,1,2,3"}, 1, 4)
    assert not bound_per_task({**four, "SLURM_STEP_GPUS": "0"}, 1, 4)  # four tasks, one GPU
    assert not bound_per_task(four, 1, 4)  # nothing says so
    assert not bound_per_task({"SLURM_GPUS_PER_TASK": "1"}, 1, 4)  # not a step: torchrun
    assert not bound_per_task({**four, "SLURM_GPUS_PER_TASK": "1"}, 1, 8)  # not srun's ranks


def test_loopback_names():
    for host in ("localhost", "127.0.0.1", "127.0.1.1", "::1", "[::1]", "LOCALHOST"):
        assert is_loopback(host), host
    for host in ("gpu-a01", "10.0.0.1", "::ffff:10.0.0.1", ""):
        assert not is_loopback(host), host
