"""A checkpoint through ``checkpoint_dir`` next to what scripts do today, in the same run.

    python benchmarks/checkpoints.py              # 2 forked gloo ranks, 200 MB, 5 rounds
    python benchmarks/checkpoints.py --mb 50 --ranks 3 --rounds 7

Each round, in a fresh random order, on every rank:

* **torch.save + barrier**: group rank 0 writes the model with ``torch.save`` into
  ``<root>/step-N``, fsyncs the file and the directories (the durability the kit gives), and
  every rank calls ``dist.barrier()``;
* **checkpoint_dir**: ``with ad.checkpoint_dir(root, N) as path:`` and the rank whose
  ``path.should_save`` is true writes the same ``torch.save`` into it (the block fsyncs and
  commits by rename).

Both checkpoints are removed after each is timed (a ``keep=`` rotation would remove one inside
the block).

Each is timed from a barrier before it to its end on the slowest rank. It prints the medians,
their ratio (target: <= 1.1, docs/performance.md) and the store calls one ``checkpoint_dir``
costs each rank (the tests' probe, ``tests/probes.py``'s ``count_store_calls``).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from typing import Dict, List

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [_ROOT, os.path.join(_ROOT, "tests")]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import axolotl_dist as ad  # noqa: E402
from axolotl_dist.testing import run_distributed  # noqa: E402
from probes import count_store_calls  # noqa: E402 - the tests' plumbing


def _fsync(*paths: str) -> None:
    """fsync each file or directory, as the kit's commit does."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def _plain(root: str, step: int, model: torch.Tensor) -> None:
    if ad.get_rank() == 0:
        final = os.path.join(root, f"plain-{step}")
        os.makedirs(final)
        torch.save(model, os.path.join(final, "model.pt"))
        _fsync(os.path.join(final, "model.pt"), final, root)
    dist.barrier()


def _kit(root: str, step: int, model: torch.Tensor) -> int:
    with count_store_calls() as calls:
        with ad.checkpoint_dir(root, step) as path:
            if path.should_save:
                torch.save(model, os.path.join(path, "model.pt"))
    return sum(calls.values())


def _rank(root: str, mb: int, rounds: int, seed: int) -> Dict[str, List[float]]:
    model = torch.randn(mb * 2**20 // 4)
    times: Dict[str, List[float]] = {"plain": [], "kit": []}
    store_calls: List[float] = []
    order = random.Random(seed)
    for step in range(rounds):
        for name in order.sample(["plain", "kit"], 2):
            dist.barrier()
            t0 = time.perf_counter()
            if name == "plain":
                _plain(root, step, model)
            else:
                store_calls.append(_kit(root, step, model))
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(float(elapsed))
            if ad.get_rank() == 0:  # removed outside the timing, on both sides
                shutil.rmtree(os.path.join(root, f"plain-{step}" if name == "plain"
                                           else f"step-{step}"))
    times["store_calls"] = store_calls
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=200)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir)
    try:
        results = run_distributed(_rank, args.ranks, args=(root, args.mb, args.rounds, 1),
                                  timeout=600)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    plain, kit = statistics.median(results[0]["plain"]), statistics.median(results[0]["kit"])
    print(f"{args.mb} MB on {args.ranks} ranks, {args.rounds} rounds (slowest rank, median):")
    print(f"  torch.save + fsync + barrier  {plain * 1e3:8.1f} ms  "
          f"{[round(t * 1e3) for t in results[0]['plain']]}")
    print(f"  checkpoint_dir                {kit * 1e3:8.1f} ms  "
          f"{[round(t * 1e3) for t in results[0]['kit']]}")
    print(f"  ratio {kit / plain:.3f} (target <= 1.1)")
    calls = [statistics.median(r["store_calls"]) for r in results]
    print(f"  store calls per checkpoint_dir, by rank: {calls}")


if __name__ == "__main__":
    main()
