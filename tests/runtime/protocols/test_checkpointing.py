"""Unit tests of ``checkpoint_dir``'s files (``_runtime/protocols/checkpointing.py``): which
directories are committed checkpoints, the commit, rotation and what a commit cleans up. No
process group: plain directories under ``tmp_path``."""

import os

from axolotl_dist._runtime.protocols import checkpointing as ck
from axolotl_dist._runtime.protocols import leases as ls


def _commit(root, step, run="r1", job="j"):
    staging = ls.staging_dir(str(root), step, job, run, step)
    os.makedirs(staging)
    with open(os.path.join(staging, "model"), "w") as fh:
        fh.write(str(step))
    ck.commit(staging, ck.final_dir(str(root), step), ck.commit_record(step, 2, run))
    return staging


def test_only_marked_step_directories_are_committed(tmp_path):
    assert ck.committed_steps(str(tmp_path / "missing")) == []
    _commit(tmp_path, 10)
    _commit(tmp_path, 2)
    (tmp_path / "step-7").mkdir()  # no marker: not the kit's
    (tmp_path / "step-x").mkdir()
    os.makedirs(ls.staging_dir(str(tmp_path), 30, "j", "r1", 9))  # still being written
    assert ck.committed_steps(str(tmp_path)) == [2, 10]  # numeric order, not by name


def test_a_step_committed_again_replaces_the_old_one_whole(tmp_path):
    _commit(tmp_path, 5, run="a")
    staging = _commit(tmp_path, 5, run="b")
    assert not os.path.exists(staging)
    assert sorted(os.listdir(tmp_path)) == ["step-5"]
    assert (tmp_path / "step-5" / "model").read_text() == "5"
    assert '"run": "b"' in (tmp_path / "step-5" / ck.MARKER).read_text()


def test_rotation_keeps_the_newest_and_never_the_one_just_committed(tmp_path):
    for step in (1, 2, 3, 4):
        _commit(tmp_path, step)
    assert ck.rotate(str(tmp_path), 2, 4, "r1") == [1, 2]
    assert ck.committed_steps(str(tmp_path)) == [3, 4]
    _commit(tmp_path, 1)  # an older step saved after newer ones (a resumed run)
    assert ck.rotate(str(tmp_path), 1, 1, "r1") == [3, 4]
    assert ck.committed_steps(str(tmp_path)) == [1]
    assert sorted(os.listdir(tmp_path)) == ["step-1"]  # nothing hidden left behind


def test_a_commit_cleans_up_its_own_runs_leftovers_only(tmp_path):
    root = str(tmp_path)
    mine_failed = ls.staging_dir(root, 3, "job", "run1", 5)
    other_run = ls.staging_dir(root, 3, "job", "run2", 1)  # same job, another run: .leases decides
    current = ls.staging_dir(root, 3, "job", "run1", 9)
    hidden = os.path.join(root, ".step-1.old-run0-ab12")
    for path in (mine_failed, other_run, current, hidden):
        os.makedirs(path)
    ck.remove_staging(root, "run1", keep=current)
    assert sorted(os.listdir(root)) == sorted(os.path.basename(p) for p in (other_run, current))


def test_the_job_id_is_the_launchers_and_safe_in_a_name(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "../run 7/x")
    assert ck.job_id() == "run7x"
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert ck.job_id() == "4242"
    monkeypatch.delenv("SLURM_JOB_ID")
    assert ck.job_id() == "none"
