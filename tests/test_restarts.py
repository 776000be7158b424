"""A restarted run starts clean: ``torchrun --max-restarts 1`` stops every rank on a failure
and starts them again against the same store (its agent's), and the second attempt must read
nothing the first one wrote (docs/design/launching.md, "Restarts").

Attempt 0 fails three ways (a raise in ``zero_first``, a SIGKILL in a barrier, a helper
raising on 3 ranks); attempt 1 then runs every kind of kit call and must finish with exact
values. Plus elastic membership: a second "node" (a second torchrun on this host) joining a
running one restarts it with the same restart count.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import List

import pytest


from fixtures import free_port, run, start, finish, subprocess_env

pytestmark = pytest.mark.timeout(240)

#: What attempt 1 runs on every rank, and writes to ``ok<rank>.json``: each kind of kit call
#: (a block, the value helpers, a barrier), so a stale key of any protocol would show.
AFTER = """\
with ad.zero_first():
    pass
value = ad.compute_and_broadcast(lambda: 41 + 1)
total = ad.reduce_and_broadcast(lambda: ad.get_rank() + 1, sum)
ranks = ad.gather_from_all_ranks(lambda: ad.get_rank())
ad.barrier()
with open(f"ok{ad.get_rank()}.json", "w") as f:
    json.dump({"attempt": ATTEMPT, "value": value, "total": total, "ranks": ranks,
               "before": BEFORE, "agreed": ad.get_attempt()}, f)
"""

HEAD = """\
import json, os, signal, sys
import axolotl_dist as ad
ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
BEFORE = ad.get_attempt()
ad.init_distributed()
"""

#: Attempt 0 fails: (name, ranks, the failure).
FAILURES = {
    "raise_in_zero_first": (2, """\
with ad.zero_first():
    if ad.get_rank() == 0 and ATTEMPT == 0:
        raise RuntimeError("flaky data server (first attempt)")
"""),
    "sigkill_in_barrier": (2, """\
ad.barrier()
if ad.get_rank() == 1 and ATTEMPT == 0:
    os.kill(os.getpid(), signal.SIGKILL)
ad.barrier()
"""),
    "helper_raises_on_3_ranks": (3, """\
def shard():
    if ATTEMPT == 0:
        raise ValueError("bad shard on rank 0")
    return 1
ad.compute_and_broadcast(shard)
"""),
}


def _torchrun(*args: str) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def _results(directory: Path, ranks: int) -> List[dict]:
    return [json.loads((directory / f"ok{r}.json").read_text()) for r in range(ranks)]


def _check_attempt(directory: Path, ranks: int, out: str, attempt: int = 1) -> None:
    """Every rank of attempt ``attempt`` ran the kit's calls to the end, with exact values."""
    results = _results(directory, ranks)
    assert [r["attempt"] for r in results] == [attempt] * ranks, out
    # get_attempt(): the launcher's count before init, the number agreed through the agent's
    # store after it (here the same: no membership change)
    assert [(r["before"], r["agreed"]) for r in results] == [(attempt, attempt)] * ranks, out
    assert all(r["value"] == 42 and r["total"] == sum(range(1, ranks + 1)) for r in results)
    assert results[0]["ranks"] == list(range(ranks)) and results[1]["ranks"] is None


def _launcher(name: str, *args: str) -> List[str]:
    """A launcher's command line: torchrun, or ``axolotl-dist`` with the same options."""
    if name == "torchrun":
        return _torchrun(*args)
    return [sys.executable, "-m", "axolotl_dist.launch", *args]


#: Each failure once, each launcher on at least one (the 3-rank one under torchrun, whose agent
#: hosts the store the ranks agree their attempt through; the kit's launcher hosts its own).
CLEAN_AFTER = [("helper_raises_on_3_ranks", "torchrun"), ("raise_in_zero_first", "axolotl-dist"),
               ("sigkill_in_barrier", "torchrun"), ("sigkill_in_barrier", "axolotl-dist")]


@pytest.mark.parametrize("failure,launcher", CLEAN_AFTER)
def test_attempt_1_runs_clean_after_attempt_0_failed(tmp_path: Path, failure: str,
                                                     launcher: str) -> None:
    ranks, fail = FAILURES[failure]
    (tmp_path / "job.py").write_text(HEAD + fail + AFTER)
    code, out, err = run(_launcher(launcher, "--standalone", "--max-restarts", "1",
                                   "--nproc-per-node", str(ranks), "job.py"),
                         subprocess_env(tmp_path), 180, cwd=tmp_path)
    assert code == 0, err[-4000:]
    _check_attempt(tmp_path, ranks, err[-4000:])


def test_a_node_joining_restarts_the_run_clean_with_the_same_restart_count(tmp_path: Path) -> None:
    # Two torchrun agents on this host form an elastic job (--nnodes 1:2): the first runs alone
    # (attempt 0, 1 rank, it writes blocks), the second joins, torch elastic restarts the first
    # node's rank with TORCHELASTIC_RESTART_COUNT still 0, and the 2-rank group must not read
    # the 1-rank group's keys. torch 2.13's own rendezvous cannot admit a node into a later
    # round while the agents share their store with the ranks (the joining agent waits for the
    # round's MASTER_ADDR, which only a first round writes: dynamic_rendezvous.py
    # next_rendezvous), so the agents run with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as a user
    # must (docs/launching.md, "Restarts").
    script = """\
import json, os, time
import axolotl_dist as ad
ad.init_distributed()
world = ad.get_world_size()
with open(f"seen{ad.get_rank()}_{world}.txt", "a") as f:
    f.write(os.environ["TORCHELASTIC_RESTART_COUNT"])
if world == 1:
    for _ in range(3):
        with ad.zero_first():
            pass
    time.sleep(120)  # until the second node joins and the agent restarts this rank
with ad.zero_first():
    pass
value = ad.compute_and_broadcast(lambda: 42)
ad.barrier()
with open(f"ok{ad.get_rank()}.json", "w") as f:
    json.dump({"world": world, "value": value, "attempt": ad.get_attempt(),
               "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"])}, f)
"""
    (tmp_path / "elastic.py").write_text(script)
    port = free_port()
    common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "join",
              "--rdzv-conf", "last_call_timeout=1", "--monitor-interval", "0.2"]
    env = subprocess_env(tmp_path, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    first = start(_torchrun(*common, "elastic.py"), env, cwd=tmp_path)
    deadline = time.monotonic() + 90
    while not (tmp_path / "seen0_1.txt").exists():
        assert first.poll() is None and time.monotonic() < deadline, finish(first, 5)
        time.sleep(0.2)
    time.sleep(1.0)  # rank 0 of the 1-rank run is past its blocks, asleep
    second = start(_torchrun(*common, "elastic.py"), env, cwd=tmp_path)
    results = [finish(p, 150) for p in (first, second)]
    assert [r[0] for r in results] == [0, 0], [r[2][-3000:] for r in results]
    oks = _results(tmp_path, 2)
    assert [r["world"] for r in oks] == [2, 2] and [r["value"] for r in oks] == [42, 42]
    # no agent's store is shared with the ranks here: get_attempt() is the agents' count, which
    # the membership change did not move, on both nodes
    assert [(r["attempt"], r["restart"]) for r in oks] == [(0, 0), (0, 0)], oks
    # the first node's rank was restarted, with the restart count torch elastic gave it
    assert (tmp_path / "seen0_2.txt").exists() or (tmp_path / "seen1_2.txt").exists()


def test_attempts_in_one_store_whichever_rank_starts_first(tmp_path: Path) -> None:
    # Three attempts of 3 ranks against one store that outlives them (the test process hosts it,
    # as torchrun's agent does): attempt 0's rank 0 raises in zero_first, leaving its failure
    # records; attempts 1 and 2 start their ranks in other orders and must run clean.
    from datetime import timedelta

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=60))
    (tmp_path / "job.py").write_text(HEAD + FAILURES["raise_in_zero_first"][1] + AFTER)
    for attempt, order in enumerate(([0, 1, 2], [2, 1, 0], [1, 2, 0])):
        procs = {}
        for r in order:
            env = subprocess_env(tmp_path, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="3",
                                 LOCAL_WORLD_SIZE="3", MASTER_ADDR="127.0.0.1",
                                 MASTER_PORT=str(server.port), TORCHELASTIC_RUN_ID="t",
                                 TORCHELASTIC_USE_AGENT_STORE="True",
                                 TORCHELASTIC_RESTART_COUNT=str(attempt))
            procs[r] = start([sys.executable, "job.py"], env, cwd=tmp_path)
            time.sleep(0.3)
        ends = {r: finish(p, 90) for r, p in procs.items()}
        codes = [ends[r][0] for r in range(3)]
        if attempt == 0:
            assert codes == [1, 1, 1], [e[2][-2000:] for e in ends.values()]
            continue
        assert codes == [0, 0, 0], [e[2][-2000:] for e in ends.values()]
        _check_attempt(tmp_path, 3, "", attempt)


@pytest.mark.parametrize("alone, message", [
    (0, r"rank 0 began attempt 1 of this run in init_distributed, but rank\(s\) 1 did not join "
        r"it in time: are they started, with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE\?"),
    (1, r"rank 1 waited 3 s in init_distributed for rank 0 to begin this attempt of the run: "
        r"is rank 0 started, under the same launcher\?"),
])
def test_a_rank_alone_in_an_attempt_says_whom_it_waited_for(tmp_path: Path, alone: int,
                                                           message: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30))
    env = subprocess_env(tmp_path, RANK=str(alone), LOCAL_RANK=str(alone), WORLD_SIZE="2",
                         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(server.port),
                         TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RUN_ID="x",
                         TORCHELASTIC_RESTART_COUNT="0")
    code, out, err = run([sys.executable, "-c", "import axolotl_dist as ad\n"
                          "ad.init_distributed(timeout=3)"], env, 60, cwd=tmp_path)
    assert code == 1, err
    import re

    assert re.search(r"DistributedEnvError: " + message, err), err


def test_a_datasets_cache_an_attempt_finished_is_reused_and_one_it_did_not_is_rebuilt(
        tmp_path: Path) -> None:
    # Attempt 0: rank 0 maps the dataset twice in zero_first; the first map finishes (its cache
    # file is written), the second is SIGKILLed half-way. Attempt 1 must reuse the first map's
    # cache (no row mapped again) and rebuild the second whole (its partial file never read).
    pytest.importorskip("datasets")
    from datasets import Dataset

    Dataset.from_dict({"x": list(range(100))}).save_to_disk(str(tmp_path / "data"))
    script = HEAD + """\
from datasets import load_from_disk
ds = load_from_disk("data")

def double(row, idx):
    with open(f"double-{os.environ['TORCHELASTIC_RESTART_COUNT']}", "a") as f:
        f.write(f"{idx}\\n")
    return {"y": row["x"] * 2}

def square(row, idx):
    with open(f"square-{os.environ['TORCHELASTIC_RESTART_COUNT']}", "a") as f:
        f.write(f"{idx}\\n")
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and idx == 50:
        os.kill(os.getpid(), signal.SIGKILL)
    return {"z": row["x"] ** 2}

with ad.zero_first():
    doubled = ds.map(double, with_indices=True, writer_batch_size=10)
with ad.zero_first():
    squared = ds.map(square, with_indices=True, writer_batch_size=10)
assert doubled["y"] == [2 * x for x in range(100)]
assert squared["z"] == [x * x for x in range(100)]
""" + AFTER
    (tmp_path / "cache.py").write_text(script)
    code, out, err = run(_torchrun("--standalone", "--max-restarts", "1", "--nproc-per-node",
                                   "2", "cache.py"), subprocess_env(tmp_path), 180, cwd=tmp_path)
    assert code == 0, err[-4000:]
    _check_attempt(tmp_path, 2, err[-4000:])

    def rows(name: str) -> List[int]:
        path = tmp_path / name
        return [int(n) for n in path.read_text().split()] if path.exists() else []

    assert rows("double-0") == list(range(100)) and rows("double-1") == []
    assert rows("square-0") == list(range(51)) and rows("square-1") == list(range(100))
