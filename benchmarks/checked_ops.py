"""The checked tensor helpers (``all_reduce``, ``reduce``, ``broadcast``) next to the raw torch
collective and accelerate's equivalent, at three sizes, in one run (issue #75).

Run it from the repository root (it imports this checkout's ``axolotl_dist``)::

    python benchmarks/checked_ops.py                  # 2 and 3 gloo ranks
    python benchmarks/checked_ops.py --worlds 2 --iters 500

Sizes: a scalar (one float32), 1 KiB (256 float32) and 64 MiB (16 Mi float32). Each helper
checks every rank's dtypes and shapes; a small tensor rides with that check's headers (one
collective), a big one follows it. Every function runs after a barrier and is timed on every
rank; the functions of a size are interleaved in a fresh order each round, the same on every
rank; the slower rank's median counts. Targets (docs/performance.md, "Shape checks"): small
sizes at most 1.15x the raw collective and at most 1.0x accelerate's, 64 MiB at most 1.05x raw.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Callable, Dict, List, Tuple

# this checkout's axolotl_dist, not whichever one is installed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: (label, float32 elements, measured rounds divisor: big sizes run fewer rounds)
SIZES: List[Tuple[str, int, int]] = [("scalar", 1, 1), ("1 KiB", 256, 1),
                                     ("64 MiB", 16 << 20, 100)]
#: (helper, what it is compared with, target ratio for small sizes, for 64 MiB)
PAIRS: List[Tuple[str, str, float, float]] = [
    ("ad.all_reduce", "dist.all_reduce", 1.15, 1.05),
    ("ad.all_reduce", "accelerate reduce (sum)", 1.0, 0.0),
    ("ad.reduce (mean)", "accelerate reduce (mean)", 1.0, 0.0),
    ("ad.broadcast", "dist.broadcast", 1.15, 1.05),
    ("ad.broadcast", "accelerate broadcast", 1.0, 0.0),
]


def _fns(numel: int) -> Dict[str, Callable[[], object]]:
    import torch
    import torch.distributed as dist
    from accelerate.utils import broadcast as acc_broadcast
    from accelerate.utils import reduce as acc_reduce

    import axolotl_dist as ad

    rank = ad.get_rank()
    x = torch.full((numel,), float(rank + 1))
    out = torch.empty(numel)

    def fresh() -> "torch.Tensor":
        return out.copy_(x)

    return {
        "ad.all_reduce": lambda: ad.all_reduce(fresh()),
        "dist.all_reduce": lambda: dist.all_reduce(fresh()),
        "accelerate reduce (sum)": lambda: acc_reduce(x, "sum"),
        "ad.reduce (mean)": lambda: ad.reduce(x, "mean"),
        "accelerate reduce (mean)": lambda: acc_reduce(x, "mean"),
        "ad.broadcast": lambda: ad.broadcast(fresh()),
        "dist.broadcast": lambda: dist.broadcast(fresh(), src=0),
        "accelerate broadcast": lambda: acc_broadcast(fresh()),
    }


def _check(numel: int) -> None:
    """A broken helper must not look fast: each gives the raw collective's result."""
    import torch

    import axolotl_dist as ad

    ws = ad.get_world_size()
    total = float(ws * (ws + 1) // 2)
    x = torch.full((numel,), float(ad.get_rank() + 1))
    assert torch.equal(ad.all_reduce(x.clone()), torch.full((numel,), total))
    assert torch.equal(ad.reduce(x, "mean"), torch.full((numel,), total) / ws)
    assert torch.equal(ad.broadcast(x.clone()), torch.ones(numel))


def _rank_body(iters: int, warmup: int) -> Dict[str, Dict[str, float]]:
    import torch.distributed as dist
    from accelerate import PartialState

    PartialState(cpu=True)  # accelerate's state over the kit's group
    medians: Dict[str, Dict[str, float]] = {}
    order = random.Random(1234)
    for label, numel, fewer in SIZES:
        _check(numel)
        fns = _fns(numel)
        names = list(fns)
        times: Dict[str, List[float]] = {n: [] for n in names}
        rounds = max(iters // fewer, 5)
        for i in range(max(warmup // fewer, 2) + rounds):
            order.shuffle(names)
            for name in names:
                dist.barrier()
                t0 = time.perf_counter()
                fns[name]()
                if i >= max(warmup // fewer, 2):
                    times[name].append((time.perf_counter() - t0) * 1e6)
        medians[label] = {n: statistics.median(v) for n, v in times.items()}
    return medians


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="2,3", help="world sizes (default 2,3)")
    parser.add_argument("--iters", type=int, default=1500, help="measured rounds (small sizes)")
    parser.add_argument("--warmup", type=int, default=100)
    args = parser.parse_args()
    from axolotl_dist.testing import run_distributed

    missed = 0
    print("| ranks | size | helper | us | compared with | us | ratio | target | met |")
    print("|---:|---|---|---:|---|---:|---:|---|---|")
    for ws in (int(w) for w in args.worlds.split(",")):
        per_rank = run_distributed(_rank_body, ws, args=(args.iters, args.warmup),
                                   timeout=1800)
        for label, _, fewer in SIZES:
            slower = {n: max(r[label][n] for r in per_rank) for n in per_rank[0][label]}
            for helper, other, small, big in PAIRS:
                target = big if fewer > 1 else small
                ratio = slower[helper] / slower[other]
                met = "" if not target else ("yes" if ratio <= target else "NO")
                missed += met == "NO"
                print(f"| {ws} | {label} | `{helper}` | {slower[helper]:.0f} | `{other}` | "
                      f"{slower[other]:.0f} | {ratio:.2f}x | "
                      f"{f'<= {target}x' if target else '-'} | {met} |")
    print("\nSOME TARGETS MISSED" if missed else "\nevery target met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
