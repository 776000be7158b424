"""``checkpoint_dir`` and ``latest_checkpoint`` (#58): a checkpoint is committed only once every
rank's body ended, atomically, and every rank leaves the block with it committed; a rank that
raises or dies inside is named on every rank and nothing is committed; a writer slower than the
group's timeout is waited for; ``keep`` rotates; a new run's ``latest_checkpoint`` is the last
committed checkpoint on every rank, never a partial one.

Real forked ranks on gloo (the harness), the store in the parent and in rank 0.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import axolotl_dist as ad
from axolotl_dist.testing import run_distributed, run_distributed_outcomes
from fixtures import alive, finish, start, subprocess_env

MARKER = ".axolotl_dist_checkpoint.json"
LEASES = ".axolotl_dist_leases"


def _names(root):
    """What ``root`` holds but the runs' leases."""
    return sorted(name for name in os.listdir(root) if name != LEASES)


def _save(root, step, keep=None, fault=None, faulty=1, timeout=None):
    """Every rank: its own shard, the model from the rank that should save; ``fault`` on rank
    ``faulty`` halfway through its shard. Returns what the rank saw, or its RankFailedError."""
    rank = ad.get_rank()
    start = time.monotonic()
    try:
        with ad.checkpoint_dir(root, step, keep=keep, timeout=timeout) as path:
            staging = str(path)
            if path.should_save:
                torch.save({"step": step}, os.path.join(path, "model.pt"))
            with open(os.path.join(path, f"shard-{rank}.bin"), "wb") as fh:
                fh.write(b"x" * 4096)
                if rank == faulty and fault == "raises":
                    raise ValueError(f"disk full on rank {rank}")
                if rank == faulty and fault == "killed":
                    fh.flush()
                    os.kill(os.getpid(), signal.SIGKILL)
                if rank == faulty and fault == "exits":
                    fh.flush()
                    os._exit(3)
                if rank == faulty and fault == "slow":
                    time.sleep(8)
                fh.write(b"y" * 4096)
    except ad.RankFailedError as exc:
        return {"failed": exc.rank, "exc_type": exc.exc_type, "message": str(exc),
                "elapsed": time.monotonic() - start}
    return {"staging": staging, "final": path.final, "should_save": path.should_save,
            "files": sorted(os.listdir(path.final)), "staging_left": os.path.exists(staging),
            "latest": ad.latest_checkpoint(root), "elapsed": time.monotonic() - start}


def _latest(root):
    return ad.latest_checkpoint(root)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_a_checkpoint_is_committed_once_every_rank_wrote_it(world, tmp_path):
    root = str(tmp_path / "ckpt")
    assert run_distributed(_latest, world, args=(root,)) == [None] * world
    results = run_distributed(_save, world, args=(root, 7), timeout=60)
    final = os.path.join(root, "step-7")
    for rank, got in enumerate(results):
        assert got["final"] == final and got["latest"] == final, got
        assert got["should_save"] == (rank == 0), got
        assert got["files"] == sorted([MARKER, "model.pt"] + [f"shard-{r}.bin" for r in range(world)])
        assert not got["staging_left"], got
    assert _names(root) == ["step-7"]
    record = json.loads((tmp_path / "ckpt" / "step-7" / MARKER).read_text())
    assert record["step"] == 7 and record["world_size"] == world
    assert all(os.path.getsize(os.path.join(final, f"shard-{r}.bin")) == 8192 for r in range(world))
    assert run_distributed(_latest, world, args=(root,)) == [final] * world


def _rotate(root):
    for step in range(5):
        with ad.checkpoint_dir(root, step * 10, keep=2) as path:
            with open(os.path.join(path, f"r{ad.get_rank()}"), "w") as fh:
                fh.write(str(step))
    with ad.checkpoint_dir(root, 20) as path:  # a step saved again replaces it, rotation or not
        with open(os.path.join(path, f"again{ad.get_rank()}"), "w") as fh:
            fh.write("again")
    return _names(root), sorted(os.listdir(os.path.join(root, "step-20")))


def test_keep_2_over_5_saves_leaves_the_newest_2_and_a_step_saved_again_is_replaced(tmp_path):
    root = str(tmp_path / "ckpt")
    for names, step20 in run_distributed(_rotate, 3, args=(root,), timeout=60):
        assert names == ["step-20", "step-30", "step-40"], names
        assert step20 == [MARKER, "again0", "again1", "again2"], step20


def _check_failure(got, fault, faulty):
    assert got.get("failed") == faulty, got
    assert got["elapsed"] < 20, got
    if fault == "raises":
        assert got["exc_type"] == "ValueError", got
        assert f"disk full on rank {faulty}" in got["message"], got
        assert "test_checkpoints.py" in got["message"] and "checkpoint_dir" in got["message"], got
    else:
        assert got["exc_type"] in ("died", "exited"), got


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("fault, faulty", [("raises", 1), ("killed", 1), ("exits", 0),
                                           ("raises", 0), ("killed", 0)])
def test_a_rank_that_fails_inside_is_named_and_nothing_is_committed(world, fault, faulty, store,
                                                                     tmp_path):
    root = str(tmp_path / "ckpt")
    first = run_distributed(_save, world, args=(root, 1), store=store, timeout=60)
    assert {got["latest"] for got in first} == {os.path.join(root, "step-1")}
    outcomes = run_distributed_outcomes(_save, world, args=(root, 2, None, fault, faulty),
                                        store=store, timeout=60, pg_timeout=300)
    for outcome in outcomes:
        if outcome.rank == faulty:
            if fault == "raises":
                assert outcome.error and outcome.error.startswith("ValueError"), outcome.describe()
            elif fault == "killed":
                assert outcome.exitcode == -signal.SIGKILL, outcome.describe()
            continue
        assert outcome.ok, outcome.describe()
        _check_failure(outcome.value, fault, faulty)
    assert not os.path.exists(os.path.join(root, "step-2"))
    # a new run resumes from the last committed checkpoint on every rank, never the partial one
    again = run_distributed(_latest, world, args=(root,), store=store)
    assert again == [os.path.join(root, "step-1")] * world


@pytest.mark.parametrize("world", [2, 3])
def test_a_writer_slower_than_the_group_timeout_is_waited_for(world, store, tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_distributed(_save, world, args=(root, 5, None, "slow", world - 1), store=store,
                              timeout=60, pg_timeout=3)
    for got in results:
        assert got["latest"] == os.path.join(root, "step-5"), got
        assert got["elapsed"] > 7.5, got


def test_a_timeout_of_the_block_names_the_slow_rank(tmp_path):
    root = str(tmp_path / "ckpt")
    outcomes = run_distributed_outcomes(_save, 2, args=(root, 5, None, "slow", 1, 2.0),
                                        timeout=60)
    waiter = outcomes[0]
    assert not waiter.ok and waiter.error.startswith("RankTimeoutError"), waiter.describe()
    assert "checkpoint_dir block" in waiter.error and "rank(s) [1]" in waiter.error, waiter.describe()
    assert not os.path.exists(os.path.join(root, "step-5"))


def _main_only(root):
    if ad.is_main_process():  # the mistake the block exists for: a save under a rank guard
        with ad.checkpoint_dir(root, 1) as path:
            open(os.path.join(path, "m"), "w").write("m")
    ad.barrier()


def test_a_block_under_a_main_process_guard_is_an_error_on_every_rank(tmp_path):
    outcomes = run_distributed_outcomes(_main_only, 2, args=(str(tmp_path / "ckpt"),),
                                        timeout=60)
    for outcome in outcomes:
        assert not outcome.ok and outcome.error.startswith("CollectiveMismatchError"), \
            outcome.describe()
        assert "rank 0: checkpoint_dir at tests/test_checkpoints.py:" in outcome.error
        assert "rank 1: barrier at tests/test_checkpoints.py:" in outcome.error
        assert "called on some ranks only" in outcome.error
    assert not (tmp_path / "ckpt" / "step-1").exists()


def test_latest_checkpoint_takes_only_what_the_kit_committed(tmp_path):
    root = tmp_path / "ckpt"
    assert ad.latest_checkpoint(str(root)) is None  # no directory yet
    with ad.checkpoint_dir(root, 3) as path:
        (tmp_path / "ckpt" / "x").write_text("not in the checkpoint")
        with open(os.path.join(path, "w.pt"), "w") as fh:
            fh.write("w")
        assert ad.latest_checkpoint(root) is None  # still staging
    (root / "step-9").mkdir()  # a directory the kit did not commit (no marker)
    (root / ".step-12.staging-dead-1").mkdir()  # a dead run's staging directory
    assert ad.latest_checkpoint(root) == str(root / "step-3")
    assert sorted(os.listdir(root / "step-3")) == [MARKER, "w.pt"]
    with pytest.raises(ValueError, match="failed inside"):
        with ad.checkpoint_dir(root, 4):
            raise ValueError("failed inside")
    assert ad.latest_checkpoint(root) == str(root / "step-3")


@pytest.mark.parametrize("call, message", [
    (lambda r: ad.checkpoint_dir(r, -1), r"checkpoint_dir\(step=-1\) must be an int >= 0"),
    (lambda r: ad.checkpoint_dir(r, True), r"checkpoint_dir\(step=True\) must be an int >= 0"),
    (lambda r: ad.checkpoint_dir(r, 1, keep=0), r"checkpoint_dir\(keep=0\) must be an int >= 1"),
    (lambda r: ad.checkpoint_dir(r, 1, timeout=0), r"checkpoint_dir\(timeout=0\) must be a positive"),
    (lambda r: ad.checkpoint_dir(None, 1), r"checkpoint_dir\(root=None\) must be a directory path"),
    (lambda r: ad.latest_checkpoint(3), r"latest_checkpoint\(root=3\) must be a directory path"),
])
def test_bad_arguments_say_which_and_how_to_fix_them(call, message, tmp_path):
    with pytest.raises((ValueError, TypeError), match=message):
        call(str(tmp_path))


def test_commit_after_refuses_what_is_not_a_future(tmp_path):
    with pytest.raises(TypeError, match=r"commit_after\(42\): not a future: pass what "
                                        r"torch.distributed.checkpoint.async_save"):
        with ad.checkpoint_dir(tmp_path / "ckpt", 1) as path:
            path.commit_after(42)
    assert ad.latest_checkpoint(tmp_path / "ckpt") is None


def _dcp(root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ad.get_world_size(),))
    full = torch.arange(24, dtype=torch.float64).reshape(6, 4)
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": torch.tensor(4)}
    with ad.checkpoint_dir(root, 4) as path:
        dcp.save(state, checkpoint_id=path)  # each rank its shard, rank 0 the metadata
    latest = ad.latest_checkpoint(root)
    loaded = {"w": distribute_tensor(torch.zeros(6, 4, dtype=torch.float64), mesh, [Shard(0)]),
              "step": torch.tensor(0)}
    dcp.load(loaded, checkpoint_id=latest)
    return latest, loaded["w"].full_tensor().tolist(), int(loaded["step"]), \
        sorted(os.listdir(latest))


def test_a_dcp_sharded_save_through_the_block_loads_back_equal(tmp_path):
    root = str(tmp_path / "ckpt")
    want = torch.arange(24, dtype=torch.float64).reshape(6, 4).tolist()
    for latest, w, step, files in run_distributed(_dcp, 2, args=(root,), timeout=60):
        assert latest == os.path.join(root, "step-4")
        assert w == want and step == 4
        assert ".metadata" in files and len([f for f in files if f.endswith(".distcp")]) == 2


# A launched run: commit step 1 (unless there is one), then write step 2 until killed.
_LAUNCHED = r"""
import os, sys, time
import axolotl_dist as ad
root, flags = sys.argv[1], sys.argv[2]
ad.init_distributed()
rank = ad.get_rank()
if ad.latest_checkpoint(root) is None:
    with ad.checkpoint_dir(root, 1) as path:
        open(os.path.join(path, f"r{rank}"), "w").write("1")
with ad.checkpoint_dir(root, 2) as path:
    with open(os.path.join(path, f"r{rank}"), "w") as fh:
        fh.write("partial")
        fh.flush()
        open(os.path.join(flags, f"writing-{rank}-{os.getpid()}"), "w").close()
        time.sleep(60)
"""


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_launcher_sigkilled_mid_save_leaves_the_last_commit_the_latest(ranks, tmp_path):
    root, flags = tmp_path / "ckpt", tmp_path / "flags"
    flags.mkdir()
    script = tmp_path / "train.py"
    script.write_text(_LAUNCHED)
    launcher = start([sys.executable, "-m", "axolotl_dist.launch", "-n", str(ranks), str(script),
                      str(root), str(flags)], subprocess_env(tmp_path), cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while len(os.listdir(flags)) < ranks:
            assert launcher.poll() is None and time.monotonic() < deadline, finish(launcher, 5)
            time.sleep(0.05)
        os.kill(launcher.pid, signal.SIGKILL)
        pids = [int(name.split("-")[2]) for name in os.listdir(flags)]
        deadline = time.monotonic() + 15
        while any(alive(pid) for pid in pids):  # each rank dies with its launcher
            assert time.monotonic() < deadline, pids
            time.sleep(0.05)
    finally:
        finish(launcher, 10)
    assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == ["step-1"]
    for store in ("parent", "rank0"):  # the next run, wherever its store is
        assert run_distributed(_latest, ranks, args=(str(root),), store=store) == \
            [str(root / "step-1")] * ranks


# Attempt 0 commits step 1, then rank 1 fails writing step 2; attempt 1 resumes from step 1.
_RESTARTED = r"""
import os, sys
import axolotl_dist as ad
root = sys.argv[1]
ad.init_distributed()
rank, attempt = ad.get_rank(), os.environ["TORCHELASTIC_RESTART_COUNT"]
latest = ad.latest_checkpoint(root)
start = 0 if latest is None else int(open(os.path.join(latest, "step")).read())
print(f"attempt {attempt} resumes after step {start}", flush=True)
for step in range(start + 1, 4):
    with ad.checkpoint_dir(root, step) as path:
        if path.should_save:
            open(os.path.join(path, "step"), "w").write(str(step))
        if attempt == "0" and step == 2 and rank == 1:
            raise OSError("no space left on device")
print(f"attempt {attempt} done, latest {os.path.basename(ad.latest_checkpoint(root))}", flush=True)
"""


def test_a_restarted_run_resumes_from_the_last_commit(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_RESTARTED)
    root = tmp_path / "ckpt"
    code, out, err = finish(start([sys.executable, "-m", "axolotl_dist.launch", "-n", "2",
                                   "--max-restarts", "1", str(script), str(root)],
                                  subprocess_env(tmp_path), cwd=tmp_path), 120)
    assert code == 0, err
    assert "[ranks 0, 1] attempt 0 resumes after step 0" in out, out
    assert "[ranks 0, 1] attempt 1 resumes after step 1" in out, out
    assert "[ranks 0, 1] attempt 1 done, latest step-3" in out, out
    assert "OSError: no space left on device" in err, err
    assert _names(root) == ["step-1", "step-2", "step-3"]  # attempt 0's staging gone


# ---- writes handed over to futures ---------------------------------------------------------

def _write_later(path, rank, delay, fail):
    time.sleep(delay)
    if fail:
        raise ValueError(f"upload failed on rank {rank}")
    with open(os.path.join(path, f"shard-{rank}.bin"), "wb") as fh:
        fh.write(b"z" * 4096)


def _async(root, faulty, then):
    from concurrent.futures import ThreadPoolExecutor

    rank = ad.get_rank()
    pool = ThreadPoolExecutor(1)
    start = time.monotonic()
    with ad.checkpoint_dir(root, 1) as path:
        path.commit_after(pool.submit(_write_later, str(path), rank, 1.0, rank == faulty))
    returned = time.monotonic() - start
    if then == "exit":
        return returned  # the exit waits for the future and commits
    try:
        if then == "cleanup":
            ad.cleanup_distributed()  # commits it first, or raises its failure
            return {"returned": returned, "latest": "cleaned up"}
        latest = ad.latest_checkpoint(root)  # commits it first, or raises its failure
    except ad.RankFailedError as exc:
        return {"returned": returned, "failed": exc.rank, "message": str(exc)}
    except ValueError as exc:
        return {"returned": returned, "own": str(exc)}
    return {"returned": returned, "latest": latest, "files": sorted(os.listdir(latest))}


@pytest.mark.parametrize("world", [2, 3])
def test_writes_handed_to_futures_are_committed_once_every_rank_is_done(world, store, tmp_path):
    root = str(tmp_path / "ckpt")
    for got in run_distributed(_async, world, args=(root, None, "latest"), store=store,
                               timeout=60):
        assert got["returned"] < 0.9, got  # the block ended before the writes
        assert got["latest"] == os.path.join(root, "step-1"), got
        assert got["files"] == [MARKER] + [f"shard-{r}.bin" for r in range(world)], got


@pytest.mark.parametrize("then", ["latest", "cleanup"])
@pytest.mark.parametrize("world", [2, 3])
def test_a_future_that_fails_is_raised_on_every_rank_and_nothing_is_committed(world, then, store,
                                                                              tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_distributed(_async, world, args=(root, 1, then), store=store, timeout=60)
    assert results[1]["own"] == "upload failed on rank 1", results
    for rank, got in enumerate(results):
        if rank != 1:
            assert got["failed"] == 1 and "upload failed on rank 1" in got["message"], got
    assert not os.path.exists(os.path.join(root, "step-1"))


def test_the_exit_waits_for_a_save_handed_to_futures_and_commits_it(tmp_path):
    root = str(tmp_path / "ckpt")
    returned = run_distributed(_async, 2, args=(root, None, "exit"), timeout=60)
    assert all(r < 0.9 for r in returned), returned
    assert sorted(os.listdir(os.path.join(root, "step-1"))) == [MARKER, "shard-0.bin",
                                                                "shard-1.bin"]


def _dcp_async_failing(root):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    class Failing(FileSystemWriter):
        def write_data(self, plan, planner):
            if ad.get_rank() == 1:
                raise OSError("disk quota exceeded on rank 1")
            return super().write_data(plan, planner)

    state = {"w": torch.arange(8, dtype=torch.float32) + ad.get_rank()}
    with ad.checkpoint_dir(root, 9) as path:
        path.commit_after(dcp.async_save(state, storage_writer=Failing(str(path))))
    try:
        ad.latest_checkpoint(root)
    except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException is one
        return type(exc).__name__, str(exc)
    return "nothing raised", ""


def test_an_async_dcp_save_whose_writer_fails_is_raised_on_every_rank(tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_distributed(_dcp_async_failing, 2, args=(root,), timeout=90)
    for kind, message in results:
        assert kind in ("RankFailedError", "CheckpointException", "OSError"), results
        assert "disk quota exceeded on rank 1" in message, results
    assert not os.path.exists(os.path.join(root, "step-9"))


def _slow_future(root):
    from concurrent.futures import ThreadPoolExecutor

    rank = ad.get_rank()
    pool = ThreadPoolExecutor(1)
    with ad.checkpoint_dir(root, 1, timeout=2) as path:
        path.commit_after(pool.submit(time.sleep, 10 if rank == 1 else 0))
    try:
        ad.latest_checkpoint(root)
    except Exception as exc:  # noqa: BLE001 - what each rank raises is the answer
        return type(exc).__name__, str(exc)
    return "nothing raised", ""


def test_the_blocks_timeout_bounds_the_wait_for_its_futures(tmp_path):
    root = str(tmp_path / "ckpt")
    start = time.monotonic()
    (kind0, message0), (kind1, message1) = run_distributed(_slow_future, 2, args=(root,),
                                                           timeout=60)
    assert kind1 == "TimeoutError" and "handed to futures" in message1, message1
    assert "timeout=2" in message1, message1
    assert kind0 in ("RankFailedError", "RankTimeoutError") and "1" in message0, message0
    assert time.monotonic() - start < 9  # not the future's 10 s
    assert not os.path.exists(os.path.join(root, "step-1"))


# ---- resumes across launches (#79) ----------------------------------------------------------

# One training script launched again and again on one root: resume after the latest committed
# step (``.step``), save five more; the last rank is SIGKILLed inside the save of ``kill_at``.
_RESUMED = r"""
import os, signal, sys
import axolotl_dist as ad
root, kill_at = sys.argv[1], int(sys.argv[2])
ad.init_distributed()
rank, last = ad.get_rank(), ad.get_world_size() - 1
latest = ad.latest_checkpoint(root)
first = 1 if latest is None else latest.step + 1
if rank == 0:
    print(f"resumes after {None if latest is None else latest.step}", flush=True)
for step in range(first, first + 5):
    with ad.checkpoint_dir(root, step) as path:
        with open(os.path.join(path, f"r{rank}"), "w") as fh:
            fh.write(str(step))
        if step == kill_at and rank == last:
            os.kill(os.getpid(), signal.SIGKILL)
    if step == first and rank == 0:
        left = [n for n in os.listdir(root) if ".staging-" in n]
        print(f"saved {path.final}; partial saves left: {len(left)}", flush=True)
"""

_LAUNCH = {"axolotl-dist": ["-m", "axolotl_dist.launch", "-n"],
           "torchrun": ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]}


# each launcher once, on 2 and on 3 ranks (an uneven split): the resume does not change with
# the launcher, the kill and the report of the partial save do with how ranks are started
@pytest.mark.parametrize("launcher,ranks", [("axolotl-dist", 3), ("torchrun", 2)])
def test_three_launches_with_kills_mid_save_resume_from_the_last_commit(launcher, ranks,
                                                                        tmp_path):
    script, root = tmp_path / "train.py", tmp_path / "ckpt"
    script.write_text(_RESUMED)

    def launch(kill_at):
        return finish(start([sys.executable, *_LAUNCH[launcher], str(ranks), str(script),
                             str(root), str(kill_at)], subprocess_env(tmp_path),
                            cwd=tmp_path), 120)

    for kill_at, resumed, latest in ((3, None, 2), (5, 2, 4)):
        code, out, err = launch(kill_at)
        assert code != 0, (out, err)
        assert f"resumes after {resumed}" in out, (out, err)
        said = f"the checkpoint of step {kill_at} under {root} was not committed; the latest "
        assert f"{said}committed is {root / f'step-{latest}'} (resume from it)" in err, err
        assert f".step-{kill_at}.staging-" in " ".join(os.listdir(root))  # left behind
    code, out, err = launch(0)
    assert code == 0, err
    assert "resumes after 4" in out and "partial saves left: 0" in out, (out, err)
    assert "removed 1 partial save(s)" in err and err.count("partial save(s)") == 1, err
    assert _names(root) == [f"step-{s}" for s in range(1, 10)]
    assert (root / "step-9" / f"r{ranks - 1}").read_text() == "9"


def _hold_open(root, flag):
    """One process: enter a save and stay inside it until ``flag`` exists."""
    with ad.checkpoint_dir(root, 1) as path:
        open(os.path.join(path, "w"), "w").write("first")
        open(flag + ".inside", "w").close()
        while not os.path.exists(flag):
            time.sleep(0.02)
    return os.getpid()


def _start_holding(tmp_path, root, flag, prefix=(), **popen):
    """A process (under ``prefix``) inside :func:`_hold_open`'s save; returns it and the name of
    its staging directory once it is inside. Its stdout is its pid."""
    first = subprocess.Popen(
        [*prefix, sys.executable, "-c", "import sys, test_checkpoints as t; "
         "print(t._hold_open(sys.argv[1], sys.argv[2]))", root, flag],
        cwd=os.path.dirname(__file__), env=subprocess_env(tmp_path), **popen)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(flag + ".inside"):
            assert first.poll() is None and time.monotonic() < deadline, first.poll()
            time.sleep(0.05)
        (staging,) = [n for n in os.listdir(root) if ".staging-" in n]
    except BaseException:
        first.kill()
        raise
    return first, staging


def _second_run(root):
    latest = ad.latest_checkpoint(root)  # a resume reads; it removes nothing of a live run
    try:
        with ad.checkpoint_dir(root, 2):
            pass
    except ad.DistributedConfigError as exc:
        return latest, str(exc)
    return latest, None


def test_a_second_live_run_on_one_root_is_told_and_the_first_is_untouched(tmp_path):
    root, flag = str(tmp_path / "ckpt"), str(tmp_path / "done")
    first, staging = _start_holding(tmp_path, root, flag, stdout=subprocess.PIPE, text=True)
    try:
        for latest, error in run_distributed(_second_run, 2, args=(root,), timeout=60):
            assert latest is None and error is not None, error
            assert f"checkpoint_dir(root={root!r}): another run still uses this directory" \
                in error and f"pid {first.pid} on" in error, error
            assert "give this run a root of its own, or stop the other run first" in error
        assert staging in os.listdir(root)  # the live run's save is untouched
        open(flag, "w").close()
        assert first.wait(60) == 0
    finally:
        if first.poll() is None:
            first.kill()
    assert first.stdout.read().strip() == str(first.pid)
    assert _names(root) == ["step-1"]


def _save_beside(root):
    latest = ad.latest_checkpoint(root)
    with ad.checkpoint_dir(root, 2) as path:
        open(os.path.join(path, f"r{ad.get_rank()}"), "w").write("beside")
    return latest, sorted(n for n in os.listdir(root) if ".staging-" in n)


@pytest.mark.skipif(shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="needs root and unshare (a PID namespace: another machine's processes)")
def test_a_live_save_on_a_machine_this_run_cannot_see_is_never_removed(tmp_path):
    # the first run in a PID namespace of its own: to this run, another machine sharing root
    root, flag = str(tmp_path / "ckpt"), str(tmp_path / "done")
    first, staging = _start_holding(tmp_path, root, flag,
                                    prefix=["unshare", "--pid", "--fork", "--mount-proc"])
    try:
        for latest, stagings in run_distributed(_save_beside, 2, args=(root,), timeout=60):
            assert latest is None and stagings == [staging]  # its save goes on, untouched
        open(flag, "w").close()
        assert first.wait(60) == 0
    finally:
        if first.poll() is None:
            first.kill()
    assert _names(root) == ["step-1", "step-2"]


def test_a_resume_makes_no_directory_and_reads_a_root_it_cannot_write(tmp_path):
    missing = tmp_path / "typo"
    assert ad.latest_checkpoint(str(missing)) is None and not missing.exists()
    root = tmp_path / "ckpt"
    with ad.checkpoint_dir(root, 4) as path:
        open(os.path.join(path, "w"), "w").write("4")
    shutil.rmtree(root / LEASES)
    (root / LEASES).write_text("")  # no lease can be written there (as on a read-only copy)
    latest = ad.latest_checkpoint(str(root))
    assert latest == str(root / "step-4") and latest.step == 4
    with pytest.raises(OSError):  # a save needs its lease
        with ad.checkpoint_dir(root, 5):
            pass
