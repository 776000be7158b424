"""The ``axolotl-dist`` launcher and the cluster env contract, with real processes.

Launcher tests run ``python -m axolotl_dist.launch`` as a subprocess (the installed console
script would import another checkout); SLURM / Open MPI / accelerate tests use the harness.
Launches are expensive on a shared 2-core machine, so each one checks several things.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

import axolotl_dist as ad
from axolotl_dist import launch
from axolotl_dist.env import expand_nodelist, expand_tasks_per_node
from axolotl_dist.errors import DistributedEnvError
from axolotl_dist.testing import run_distributed
from fixtures import alive, finish, free_port, label_ranks, start, subprocess_env, unfold

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = ("RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
            "MASTER_PORT")
LAUNCH_TIMEOUT = 120

# A rank script: write the env contract and the query results, then act on argv[2].
RANK_SCRIPT = r'''
import json, os, signal, subprocess, sys, time
import axolotl_dist as ad
out, mode = sys.argv[1], sys.argv[2]
rank = ad.get_rank()
info = {k: os.environ.get(k) for k in %r}
info.update(pid=os.getpid(), rank=rank, local=ad.get_local_rank(), node=ad.get_node_rank(),
            nodes=ad.get_num_nodes(), lws=ad.get_local_world_size(), ws=ad.get_world_size())
if mode == "sleep":  # a grandchild in its own session: killpg of the rank cannot reach it
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"],
                             start_new_session=True)
    info["grandchild"] = child.pid
with open(os.path.join(out, f"rank{rank}.json.tmp"), "w") as fh:
    json.dump(info, fh)
os.rename(os.path.join(out, f"rank{rank}.json.tmp"), os.path.join(out, f"rank{rank}.json"))
ws = ad.get_world_size()
deadline = time.time() + 60
while len([f for f in os.listdir(out) if f.endswith(".json")]) < ws and time.time() < deadline:
    time.sleep(0.05)
def fail_here():
    raise ValueError(f"boom from rank {rank}")
if rank == 1 and mode == "raise":
    fail_here()
if rank == 1 and mode == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if mode != "ok":
    time.sleep(120)
''' % (CONTRACT,)

# A two-node rank: init over the static rendezvous, then the node-aware queries.
NODE_SCRIPT = r'''
import json, os, sys
import axolotl_dist as ad
ad.init_distributed(backend="gloo", timeout=60)
res = dict(rank=ad.get_rank(), node=ad.get_node_rank(), nodes=ad.get_num_nodes(),
           local=ad.get_local_rank(), lws=ad.get_local_world_size(), ws=ad.get_world_size(),
           node_env=os.environ.get("NODE_RANK"))
os.environ["AXOLOTL_DIST_SHARED_FS"] = "1"
res["fs_shared"] = ad.get_fs_local_rank()
os.environ["AXOLOTL_DIST_SHARED_FS"] = "0"
res["fs_local"] = ad.get_fs_local_rank()
res["all"] = ad.all_gather_object(res["rank"])
with open(os.path.join(sys.argv[1], "r%d.json" % res["rank"]), "w") as fh:
    json.dump(res, fh)
ad.cleanup_distributed()
'''


def _launcher(args: List[str], env: Optional[Dict[str, str]] = None,
              cwd: Optional[Path] = None) -> subprocess.Popen:
    return start([sys.executable, "-m", "axolotl_dist.launch", *args], env or subprocess_env(), cwd)


def _finish(proc: subprocess.Popen, timeout: float = LAUNCH_TIMEOUT):
    return finish(proc, timeout)


def _results(directory: Path, n: int, pattern: str = "rank{}.json") -> List[dict]:
    return [json.loads((directory / pattern.format(r)).read_text()) for r in range(n)]


def _started_ranks(proc: subprocess.Popen, out: Path, n: int) -> List[dict]:
    """Wait until the ``n`` ranks under ``proc`` wrote their info files to ``out``; read them."""
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while len(list(out.glob("*.json"))) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "ranks did not start"
        time.sleep(0.1)
    return _results(out, n)


@pytest.fixture
def rank_script(tmp_path: Path) -> Path:
    script = tmp_path / "rank_script.py"
    script.write_text(RANK_SCRIPT)
    return script


def _check_contract(infos: List[dict], n: int) -> None:
    ports = {i["MASTER_PORT"] for i in infos}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for r, info in enumerate(infos):
        assert info["RANK"] == str(r) and info["LOCAL_RANK"] == str(r)
        assert info["WORLD_SIZE"] == info["LOCAL_WORLD_SIZE"] == str(n)
        assert info["NODE_RANK"] == "0" and info["MASTER_ADDR"] == "127.0.0.1"
        assert (info["rank"], info["local"], info["node"], info["nodes"], info["ws"]) == (r, r, 0, 1, n)


def test_three_ranks_env_and_a_raising_rank(rank_script: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    start = time.monotonic()
    code, _, err = _finish(_launcher(["-n", "3", str(rank_script), str(out), "raise"]))
    elapsed = time.monotonic() - start
    _check_contract(_results(out, 3), 3)
    assert code == 1, err
    assert elapsed < 30 + 15, elapsed  # 30 s once launched, plus interpreter start-up
    # rank 1's traceback, once, above the summary, which points to it instead of copying it
    summary = err[err.index("axolotl-dist: rank 1"):]
    assert err.count("ValueError: boom from rank 1") == 1 and err.count("in fail_here") == 1, err
    assert err.index("in fail_here") < err.index(summary) and "_rank_main" not in err, err
    assert "failed first: it raised ValueError and exited with code 1; its traceback is " \
        "above" in summary, err
    assert "exit code 1" in summary


def test_two_ranks_env_and_a_sigkilled_rank_run_as_module(rank_script: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    # -m: the target is a module found from the working directory, as with python -m.
    code, _, err = _finish(_launcher(["-n", "2", "-m", rank_script.stem, str(out), "kill"],
                                     cwd=tmp_path))
    _check_contract(_results(out, 2), 2)
    assert code == 137, err
    assert "rank 1 (local rank 1" in err and "SIGKILL" in err


def test_sigterm_to_launcher_leaves_nothing_behind(rank_script: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    proc = _launcher(["-n", "2", "--grace-period", "5", str(rank_script), str(out), "sleep"])
    infos = _started_ranks(proc, out, 2)
    pids = [i["pid"] for i in infos] + [i["grandchild"] for i in infos]
    assert all(alive(p) for p in pids)
    proc.send_signal(signal.SIGTERM)
    code, _, err = _finish(proc, timeout=60)
    assert code == 128 + signal.SIGTERM, err
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in pids if alive(p)] == []


def test_two_nodes_on_loopback(tmp_path: Path) -> None:
    script = tmp_path / "node_script.py"
    script.write_text(NODE_SCRIPT)
    port = str(free_port())
    procs = [_launcher(["-n", "2", "--nnodes", "2", "--node-rank", str(node), "--master-addr",
                        "127.0.0.1", "--master-port", port, str(script), str(tmp_path)])
             for node in (0, 1)]
    for proc in procs:
        code, _, err = _finish(proc)
        assert code == 0, err
    results = _results(tmp_path, 4, "r{}.json")
    for rank, res in enumerate(results):
        node, local = divmod(rank, 2)
        assert (res["node"], res["nodes"], res["local"], res["lws"], res["ws"]) == (node, 2, local, 2, 4)
        assert res["node_env"] == str(node)
        assert res["fs_shared"] == rank and res["fs_local"] == local
        assert res["all"] == [0, 1, 2, 3]


def test_a_node_whose_ranks_ended_says_it_waits_for_the_others(tmp_path: Path) -> None:
    # node 1's rank ends at once, node 0's after 4 s: node 1's launcher waits in torch
    # elastic's exit barrier and says so (it used to say it waited for the rendezvous)
    script = tmp_path / "uneven.py"
    script.write_text("import sys, time\nimport axolotl_dist as ad\nad.init_distributed()\n"
                      "ad.barrier()\nif ad.get_rank() == 0:\n    time.sleep(4)\n")
    port = str(free_port())
    env = subprocess_env(AXOLOTL_DIST_WAIT_LOG_INTERVAL="1")
    procs = [_launcher(["-n", "1", "--nnodes", "2", "--node-rank", str(node), "--master-addr",
                        "127.0.0.1", "--master-port", port, str(script)], env)
             for node in (0, 1)]
    results = [_finish(proc) for proc in procs]
    assert all(code == 0 for code, _, _ in results), results
    err = results[1][2]
    assert "this node's ranks have ended; waiting for the other node(s) to finish" in err, err
    assert "join the rendezvous" not in err.split("this node's ranks have ended")[1], err


def test_finetune_example_through_launcher(tmp_path: Path) -> None:
    start = time.monotonic()
    code, out, err = _finish(_launcher(["-n", "2", "examples/finetune.py", "--output-dir",
                                        str(tmp_path)], subprocess_env(PYTHONWARNINGS="error")))
    elapsed = time.monotonic() - start
    assert code == 0, err
    losses = [float(line.split("loss=")[1].split()[0]) for line in unfold(out).splitlines()
              if line.startswith("step ") and "loss=" in line]
    assert len(losses) >= 4, out
    assert losses[-1] < losses[0] * 0.9, losses
    assert "tokens=" in out and len(list(tmp_path.glob("checkpoints/step-*/checkpoint.pt"))) == 1
    assert elapsed < 90, elapsed


# ---- bad input: clear messages, no ranks started --------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["-n", "0", "x.py"], "-n/--nproc-per-node must be an integer >= 1, got 0"),
    (["-n", "two", "x.py"],
     "-n/--nproc-per-node must be an integer >= 1 or one of auto, cpu, gpu, xpu, got 'two'"),
    (["-n", "1", "no/such/script.py"], "script 'no/such/script.py' not found"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "--master-port", "1", "x.py"],
     "--node-rank 2 must be smaller than --nnodes 2"),
    (["--nnodes", "2", "--master-port", "0", "x.py"], "--nnodes 2 needs a non-zero --master-port"),
    (["--nnodes", "3:2", "x.py"], "--nnodes 3:2: MIN must not be larger than MAX"),
    (["--max-restarts", "-1", "x.py"], "--max-restarts must be an integer >= 0, got -1"),
    (["--signals-to-handle", "SIGTERM,SIGNOPE", "x.py"],
     "--signals-to-handle: 'SIGNOPE' is not a signal a process can handle"),
    (["--signals-to-handle", "SIGKILL", "x.py"],
     "--signals-to-handle: 'SIGKILL' is not a signal a process can handle"),
    (["--tee", "4", "x.py"], "--tee must be 0-3 (0 none, 1 stdout, 2 stderr, 3 both)"),
    (["--redirects", "0:9", "x.py"], "--redirects must be 0-3"),
    (["--local-ranks-filter", "a", "x.py"],
     "--local-ranks-filter must be local ranks separated by commas, e.g. 0,1; got 'a'"),
    (["--no-python", "-m", "x"], "--no-python and -m/--module cannot be used together"),
    (["--no-python", "no-such-program-here"], "--no-python: executable 'no-such-program-here' "
     "not found"),
    (["--shutdown-timeout", "-1", "x.py"], "--shutdown-timeout must be >= 0 seconds, got -1"),
    (["--monitor-interval", "0", "x.py"], "--monitor-interval must be > 0 seconds, got 0.0"),
    (["--master-port", "70000", "x.py"], "--master-port must be a TCP port in [0, 65535]"),
    (["--log-dir", "setup.cfg", "x.py"],
     "--log-dir 'setup.cfg' is a file, not a directory: pass a directory (created if missing)"),
])
def test_bad_launcher_input(argv: List[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        launch.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_script_argument(capsys) -> None:
    with pytest.raises(SystemExit):
        launch.main(["-n", "2"])
    assert "the following arguments are required: script" in capsys.readouterr().err


def test_exit_codes() -> None:
    assert launch.exit_code_of(-9) == 137 and launch.exit_code_of(-15) == 143
    assert launch.exit_code_of(3) == 3


# ---- SLURM node lists ------------------------------------------------------------------------

def test_slurm_nodelist_parsing() -> None:
    assert expand_nodelist("node[01-04,07],gpu5") == [
        "node01", "node02", "node03", "node04", "node07", "gpu5"]
    assert expand_nodelist("r[1-2]n[8-9]") == ["r1n8", "r1n9", "r2n8", "r2n9"]
    assert expand_nodelist("a[098-101]") == ["a098", "a099", "a100", "a101"]
    assert expand_tasks_per_node("4(x2),1") == [4, 4, 1]
    for bad, message in [("node[01-04", "unclosed '['"), ("node01]", "unmatched ']'"),
                         ("a,,b", "empty entry"), ("n[4-1]", "runs backwards"),
                         ("n[x]", "not a number or a range")]:
        with pytest.raises(DistributedEnvError, match=message.replace("[", r"\[")):
            expand_nodelist(bad)
    with pytest.raises(DistributedEnvError, match="not a task count"):
        expand_tasks_per_node("4(y2)")


# ---- SLURM / Open MPI env mapping under init_distributed --------------------------------------

_TORCH_VARS = {k: None for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                 "NODE_RANK")}


def _queries():
    import axolotl_dist.env as env

    before = (env.launcher_source(), ad.get_rank(), ad.get_world_size(), ad.get_local_rank(),
              ad.get_local_world_size(), ad.get_node_rank(), ad.get_num_nodes())
    ad.init_distributed(backend="gloo", timeout=60)
    after = (ad.get_rank(), ad.get_world_size(), ad.get_local_rank(), ad.get_node_rank(),
             ad.get_num_nodes(), os.environ["RANK"], os.environ["MASTER_ADDR"])
    total = ad.reduce_and_broadcast(lambda: ad.get_rank() + 1, sum)
    return before, after, total


def test_slurm_srun_step_mapping() -> None:
    # 4 tasks on 2 "nodes" (block layout, 2 per node); MASTER_ADDR comes from the node list.
    def rank_env(rank: int) -> Dict[str, Optional[str]]:
        return {**_TORCH_VARS, "MASTER_ADDR": None, "SLURM_PROCID": str(rank),
                "SLURM_LOCALID": str(rank % 2), "SLURM_NODEID": str(rank // 2),
                "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_ID": "0",
                "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "2(x2)",
                "SLURM_STEP_NODELIST": "localhost,127.0.0.[2-3]"}

    results = run_distributed(_queries, 4, init=False, rank_env=rank_env, timeout=90)
    for rank, (before, after, total) in enumerate(results):
        assert before == ("slurm", rank, 4, rank % 2, 2, rank // 2, 2)
        assert after == (rank, 4, rank % 2, rank // 2, 2, str(rank), "localhost")
        assert total == 10


def test_openmpi_mapping() -> None:
    def rank_env(rank: int) -> Dict[str, Optional[str]]:
        return {**_TORCH_VARS, "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "3",
                "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}

    results = run_distributed(_queries, 3, init=False, rank_env=rank_env, timeout=90)
    for rank, (before, after, total) in enumerate(results):
        assert before == ("openmpi", rank, 3, rank, 3, 0, 1)
        assert after == (rank, 3, rank, 0, 1, str(rank), "127.0.0.1")
        assert total == 6


def test_plain_python_in_an_sbatch_shell_is_one_process() -> None:
    # A batch script carries SLURM_PROCID=0 and the job's SLURM_NTASKS, but no step id.
    def body():
        return ad.get_rank(), ad.get_world_size(), ad.get_local_world_size()

    env = {**_TORCH_VARS, "SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0",
           "SLURM_NODEID": "0", "SLURM_JOB_ID": "7", "SLURM_NNODES": "2"}
    assert run_distributed(body, 1, init=False, env=env, timeout=60) == [(0, 1, 1)]


def test_malformed_slurm_nodelist_fails_init_clearly() -> None:
    def body():
        with pytest.raises(DistributedEnvError, match=r"SLURM_STEP_NODELIST='node\[01-' has an "
                                                       r"unclosed '\['"):
            ad.init_distributed(backend="gloo")
        return True

    env = {**_TORCH_VARS, "MASTER_ADDR": None, "SLURM_PROCID": "0", "SLURM_NTASKS": "2",
           "SLURM_STEP_ID": "3", "SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[01-"}
    assert run_distributed(body, 1, init=False, env=env, timeout=60) == [True]


# ---- accelerate interop ----------------------------------------------------------------------

def _accelerate_agrees(order: str):
    from accelerate import PartialState

    if order == "ours_first":
        ad.init_distributed(backend="gloo", timeout=60)
        state = PartialState(cpu=True)
    else:
        state = PartialState(cpu=True)
        ad.init_distributed(backend="gloo", timeout=60)  # adopts accelerate's group
    agree = (state.process_index == ad.get_rank(), state.num_processes == ad.get_world_size(),
             state.local_process_index == ad.get_local_rank(),
             state.is_main_process == ad.is_main_process())
    with ad.zero_first():
        pass
    state.wait_for_everyone()
    total = ad.reduce_and_broadcast(lambda: state.process_index + 1, sum)
    return agree, total, str(state.distributed_type)


@pytest.mark.parametrize("order", ["ours_first", "accelerate_first"])
def test_accelerate_partial_state_interop(order: str) -> None:
    pytest.importorskip("accelerate", reason="needs the accelerate (or hf) extra")

    def body():
        try:
            return _accelerate_agrees(order)
        finally:
            from accelerate import PartialState

            PartialState._reset_state()

    results = run_distributed(body, 2, init=False, timeout=90)
    for agree, total, kind in results:
        assert agree == (True, True, True, True)
        assert total == 3 and "MULTI_CPU" in kind


def test_torchrun_inside_srun_uses_torch_vars_only() -> None:
    # One torchrun per node started by srun: SLURM describes the per-node task (rank 0 of 1 on
    # its node), torchrun the ranks. Nothing may be mixed in from SLURM.
    def body():
        import axolotl_dist.env as env

        return (env.launcher_source(), ad.get_rank(), ad.get_local_rank(),
                ad.get_local_world_size(), ad.get_node_rank(), ad.get_num_nodes())

    env = {"SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "1",
           "SLURM_STEP_ID": "0", "SLURM_NNODES": "1", "NODE_RANK": None}
    assert run_distributed(body, 2, init=False, env=env, timeout=60) == [
        ("torch", 0, 0, 2, 0, 1), ("torch", 1, 1, 2, 0, 1)]


def test_first_failure_prefers_root_causes(tmp_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    def failure(local_rank: int, exitcode: int, message: Optional[str], at: float):
        path = tmp_path / f"error{local_rank}.json"
        if message is not None:
            path.write_text(json.dumps({
                "message": {"message": message, "extraInfo": {
                    "py_callstack": f"Traceback ...\n{message}\n", "timestamp": str(int(at))}},
                "axolotl_dist": {"time": at}}))
        return ProcessFailure(local_rank=local_rank, pid=100 + local_rank, exitcode=exitcode,
                              error_file=str(path))

    now = float(int(time.time()))
    failures = {
        0: failure(0, 1, "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1", now + 0.1),
        1: failure(1, 1, "ValueError: the real problem", now + 0.2),
        2: failure(2, -15, None, now),
    }
    rank, first = launch.first_failure(failures)
    assert rank == 1 and "the real problem" in launch.traceback_of(first)
    # Two root causes: the earlier one wins, whatever the rank order.
    failures[0] = failure(0, 1, "KeyError: 'also real'", now + 0.3)
    assert launch.first_failure(failures)[0] == 1


def test_a_root_cause_quoting_a_network_error_beats_a_rank_stopped_in_the_same_second(
        tmp_path: Path) -> None:
    # A forged store record ended a run: rank 0 raised DistributedEnvError, whose message
    # quotes torch's DistNetworkError; the launcher then stopped rank 1 in the same second.
    # The report named rank 1 "killed by signal 15" (the quote read as a lost peer, and a
    # signal death's unknown sub-second time sorted first).
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    now = float(int(time.time()))
    path = tmp_path / "error0.json"
    message = ("DistributedEnvError: the c10d store at 127.0.0.1:1 closed this rank's connection "
               "... (DistNetworkError: Failed to recv, got 0 bytes. Connection was likely closed.)")
    path.write_text(json.dumps({
        "message": {"message": message, "extraInfo": {"py_callstack": message,
                                                      "timestamp": str(int(now))}},
        "axolotl_dist": {"time": now + 0.5, "exc_type": "DistributedEnvError"}}))
    for order in ((0, 1), (1, 0)):
        made = {0: ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file=str(path)),
                1: ProcessFailure(local_rank=1, pid=101, exitcode=-15, error_file="")}
        for failure in made.values():
            failure.timestamp = int(now)  # torch saw both fail in the same second
        assert launch.first_failure({r: made[r] for r in order})[0] == 0
    # a raw collective's lost peer and the kit's relay of another rank's failure stay secondary
    for peer_lost in ("RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1",
                      "RankFailedError: rank 2 failed in barrier: ..."):
        path.write_text(json.dumps({"message": {"message": peer_lost, "extraInfo": {
            "py_callstack": peer_lost, "timestamp": str(int(now))}}, "axolotl_dist": {"time": now}}))
        lost = ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file=str(path))
        root = tmp_path / "error2.json"
        root.write_text(json.dumps({"message": {"message": "ValueError: x", "extraInfo": {
            "py_callstack": "ValueError: x", "timestamp": str(int(now))}},
            "axolotl_dist": {"time": now + 0.9}}))
        real = ProcessFailure(local_rank=2, pid=102, exitcode=1, error_file=str(root))
        assert launch.first_failure({0: lost, 2: real})[0] == 2


def test_rank_stopped_while_exiting_after_raising_reports_its_exception(tmp_path: Path, capsys) -> None:
    # Both ranks raise at about the same time; the launcher SIGTERMs the one still exiting.
    # The report names its exception and exits 1, not 143 ("killed by SIGTERM").
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    now = float(int(time.time()))

    def error_file(rank: int, message: str, at: float) -> str:
        path = tmp_path / f"error{rank}.json"
        path.write_text(json.dumps({
            "message": {"message": message, "extraInfo": {
                "py_callstack": f"Traceback ...\n{message}\n", "timestamp": str(int(at))}},
            "axolotl_dist": {"time": at}}))
        return str(path)

    failures = {
        0: ProcessFailure(local_rank=0, pid=100, exitcode=-15,
                          error_file=error_file(0, "ValueError: first", now + 0.1)),
        1: ProcessFailure(local_rank=1, pid=101, exitcode=1,
                          error_file=error_file(1, "ValueError: second", now + 0.2)),
    }
    assert launch.report_failures(failures, nodes=1, node_rank=0) == 1
    err = capsys.readouterr().err
    assert "rank 0 (local rank 0, pid 100) failed first: it raised ValueError (and was stopped " \
        "by the launcher while exiting)\n" in err, err
    # its error file does not say it printed to this launcher's stderr: the traceback is shown
    assert "--- traceback of rank 0 ---\nTraceback ...\nValueError: first" in err
    assert "exit code 1" in err


def test_an_early_quitter_stopped_during_its_exit_hooks_is_still_reported_first(
        tmp_path: Path, capsys) -> None:
    # Rank 0's script ended (code 0), the others then failed because it had left, and the
    # launcher SIGTERMed rank 0 while its exit hooks still ran (seen on a loaded machine).
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    now = float(int(time.time()))
    message = "RankFailedError: rank 0 failed in barrier"
    path = tmp_path / "error1.json"
    path.write_text(json.dumps({
        "message": {"message": message, "extraInfo": {
            "py_callstack": f"Traceback ...\n{message}\n", "timestamp": str(int(now))}},
        "axolotl_dist": {"time": now + 0.5}}))
    failures = {
        0: ProcessFailure(local_rank=0, pid=100, exitcode=-15, error_file=""),
        1: ProcessFailure(local_rank=1, pid=101, exitcode=1, error_file=str(path)),
    }
    ends = {0: {"rank": 0, "code": 0, "time": now + 0.1, "pid": 100},
            1: {"rank": 1, "code": 1, "time": now + 0.5, "pid": 101}}
    assert launch.report_failures(failures, nodes=1, node_rank=0, ends=ends, world_size=3) == 1
    err = capsys.readouterr().err
    assert "axolotl-dist: rank 0 (pid 100) exited with code 0 while rank(s) [1, 2] were still running" in err
    assert "then rank 1 (local rank 1, pid 101) failed: it raised RankFailedError and exited " \
        "with code 1" in err
    assert "RankFailedError: rank 0 failed in barrier" in err
    # a rank killed by a signal *before* its script ended is a failure, not an early quitter
    del ends[0]
    launch.report_failures(failures, nodes=1, node_rank=0, ends=ends, world_size=3)
    assert "exited with code 0" not in capsys.readouterr().err


def test_a_node_reports_only_its_own_ranks_as_running(capsys) -> None:
    # node 1 of 2 (ranks 2, 3): rank 3 ended early, rank 2 then failed. Ranks 0 and 1 run on
    # node 0, whose state this launcher does not know: they are not "still running" here.
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    now = float(int(time.time()))
    failures = {2: ProcessFailure(local_rank=0, pid=200, exitcode=1, error_file="")}
    ends = {3: {"rank": 3, "code": 0, "time": now + 0.1, "pid": 201},
            2: {"rank": 2, "code": 1, "time": now + 0.5, "pid": 200}}
    launch.report_failures(failures, nodes=2, node_rank=1, ends=ends, world_size=4,
                           local=range(2, 4))
    err = capsys.readouterr().err
    assert "rank 3 (pid 201) exited with code 0 while rank(s) [2] on this node were still running" in err, err


# ---- who ended first, and nothing left behind ------------------------------------------------

EARLY_EXIT_SCRIPT = r'''
import sys
import axolotl_dist as ad
ad.init_distributed()
ad.barrier()
if ad.get_rank() == 0:
    sys.exit(0)  # leaves the others in the next barrier
ad.barrier()
'''


def test_a_rank_that_exits_early_with_code_0_is_reported_first(tmp_path: Path) -> None:
    script = tmp_path / "early.py"
    script.write_text(EARLY_EXIT_SCRIPT)
    code, _, raw = _finish(_launcher(["-n", "3", str(script)]))
    err = unfold(raw)  # each rank's line, folded or not
    assert code == 1, err
    summary = err[err.index("axolotl-dist: rank 0"):]
    assert "axolotl-dist: rank 0 (pid " in summary
    assert "exited with code 0 while rank(s) [1, 2] were still running" in summary
    then = re.search(r"then rank ([12]) \(local rank [12], pid \d+\) failed: it raised "
                     r"RankFailedError .*; its traceback is above( \(marked rank \d+\))?$", summary, re.M)
    assert then, err
    # above: that rank's account, one line (the other may be stopped before it says one)
    accounts = re.finditer(r"^\[(ranks? [\d, -]+)\] axolotl_dist\.errors\.RankFailedError at "
                           r"\S*early\.py:8 in <module>: rank 0 failed in barrier: exited", raw, re.M)
    assert any(int(then.group(1)) in label_ranks(m.group(1)) for m in accounts), raw
    assert "Traceback" not in err, err


GUARDED_SCRIPT = r'''
import json, os, subprocess, sys, time
import axolotl_dist as ad
out = sys.argv[1]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
with open(os.path.join(out, f"rank{ad.get_rank()}.json.tmp"), "w") as fh:
    json.dump({"pid": os.getpid(), "child": child.pid}, fh)
os.rename(os.path.join(out, f"rank{ad.get_rank()}.json.tmp"),
          os.path.join(out, f"rank{ad.get_rank()}.json"))
time.sleep(300)
'''


def test_sigkilled_launcher_leaves_no_rank_or_child_behind(tmp_path: Path) -> None:
    script = tmp_path / "guarded.py"
    script.write_text(GUARDED_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    proc = _launcher(["-n", "2", str(script), str(out)])
    infos = _started_ranks(proc, out, 2)
    pids = [i["pid"] for i in infos] + [i["child"] for i in infos]
    assert all(alive(p) for p in pids)
    os.kill(proc.pid, signal.SIGKILL)  # no handler runs: the ranks and their children must go
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in pids if alive(p)] == []


GUARD_SEEN_SCRIPT = r'''
import json, os, sys
import torch  # a rank as users run them: torch's heap is what a forked guard would share
import axolotl_dist as ad
mine = []
for entry in os.listdir("/proc"):
    try:
        with open(f"/proc/{entry}/stat") as fh:
            ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{entry}/cmdline", "rb") as fh:
            argv = fh.read().split(b"\0")
        with open(f"/proc/{entry}/status") as fh:
            rss = [int(l.split()[1]) for l in fh if l.startswith("VmRSS:")][0]
    except (OSError, ValueError, IndexError):
        continue
    if ppid == os.getpid():
        mine.append({"pid": int(entry), "argv": [a.decode() for a in argv[-5:-1]],
                     "rss_kb": rss, "pgid": os.getpgid(int(entry))})
with open(os.path.join(sys.argv[1], f"rank{ad.get_rank()}.json"), "w") as fh:
    json.dump({"children": mine, "pgid": os.getpgid(0), "pid": os.getpid()}, fh)
'''


def test_each_rank_has_one_small_guard_of_its_own(tmp_path: Path) -> None:
    """The guard is a fresh small Python, not a fork of the rank (which would share, then copy,
    the rank's torch-sized heap), in a process group of its own."""
    script = tmp_path / "guard_seen.py"
    script.write_text(GUARD_SEEN_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    code, _, err = _finish(_launcher(["-n", "2", str(script), str(out)]))
    assert code == 0, err
    for info in _results(out, 2):
        guards = [c for c in info["children"] if c["argv"][:1] == ["axolotl-dist-guard"]]
        assert len(guards) == 1, info
        assert guards[0]["argv"][1] == str(info["pid"]), info  # it watches this rank
        assert guards[0]["pgid"] != info["pgid"], info  # signals to the rank's group miss it
        assert guards[0]["rss_kb"] < 40_000, info  # a rank with torch is ~200 MB


def test_version_and_help_say_what_the_cli_has():
    env = subprocess_env()
    version = subprocess.run([sys.executable, "-m", "axolotl_dist.launch", "--version"],
                             capture_output=True, text=True, env=env, timeout=60)
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"axolotl-dist {ad.__version__} (torch {torch.__version__})"
    helped = subprocess.run([sys.executable, "-m", "axolotl_dist.launch", "--help"],
                            capture_output=True, text=True, env=env, timeout=60)
    assert helped.returncode == 0, helped.stderr
    assert "axolotl-dist where [--master-addr A] [--master-port P]" in helped.stdout
    assert "axolotl-dist trace DIR" in helped.stdout
    # -n and both spellings on one line (3.13's argparse names the metavar once per option)
    assert any(re.search(r"-n\b.*--nproc-per-node.*--nproc_per_node", line)
               for line in helped.stdout.splitlines()), helped.stdout
    for option in ("--max-restarts", "--standalone", "--signals-to-handle", "--no-python",
                   "--local-ranks-filter", "--tee", "--redirects", "--shutdown-timeout",
                   "--grace-period", "--rdzv-timeout", "--no-fold", "--log-dir DIR"):
        assert option in helped.stdout, option  # torchrun's options and the kit's
    for command in ("where", "trace"):
        sub = subprocess.run([sys.executable, "-m", "axolotl_dist.launch", command, "--help"],
                             capture_output=True, text=True, env=env, timeout=60)
        assert sub.returncode == 0 and "``" not in sub.stdout and ":func:" not in sub.stdout, \
            sub.stdout


SLEEPER_SCRIPT = r'''
import os, sys, time
import axolotl_dist as ad
ad.init_distributed()
sys.stdout.write(f"started {ad.get_rank()} {os.getpid()}\n"); sys.stdout.flush()  # one write
time.sleep(120)
'''


def test_ctrl_c_to_a_running_launcher_is_accounted_for_once(tmp_path: Path) -> None:
    # The ranks stop within a second of the forwarded SIGINT. The watcher thread, which takes
    # a signal over when the main thread cannot (in torch's rendezvous, in C++), then found no
    # rank running and said a second, false account ("got SIGINT after this node's ranks
    # ended" / "before any rank started"), racing the main thread's true one.
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER_SCRIPT)
    proc = _launcher(["-n", "2", str(script)], subprocess_env(tmp_path), cwd=tmp_path)
    started = 0
    deadline = time.monotonic() + LAUNCH_TIMEOUT
    while started < 2 and time.monotonic() < deadline:
        line = proc.stdout.readline() if proc.stdout is not None else ""
        if not line:
            break
        started += unfold(line).startswith("started")
    assert started == 2, _finish(proc, 30)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    code, _, err = _finish(proc, timeout=60)
    assert code == 128 + signal.SIGINT, err
    accounts = [line for line in err.splitlines() if "SIGINT" in line]
    assert accounts == ["axolotl-dist: got SIGINT, stopped every rank"], err


FILTERED_FAILURE = r'''
import axolotl_dist as ad
ad.init_distributed()
if ad.get_rank() == 1:
    raise ValueError("FILTERED-" + "OUT")
ad.barrier()
'''


def test_a_filtered_rank_that_fails_has_its_traceback_in_the_summary(tmp_path: Path) -> None:
    """--local-ranks-filter 0 hides rank 1's lines, so the launcher's account cannot say its
    traceback is above: it prints it."""
    script = tmp_path / "filtered.py"
    script.write_text(FILTERED_FAILURE)
    code, out, err = _finish(_launcher(["-n", "2", "--local-ranks-filter", "0", str(script)]))
    assert code == 1, err
    summary = err[err.index("axolotl-dist: rank 1"):]
    assert "failed first: it raised ValueError" in summary, err
    assert "its traceback is above" not in summary, err
    assert "--- traceback of rank 1 ---" in summary, err
    assert re.search(r'File ".*filtered\.py", line 5, in <module>', summary), err
    assert summary.count("FILTERED-OUT") == 1, err  # once there; rank 0's account names it too

