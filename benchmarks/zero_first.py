"""Cost of an empty ``zero_first`` block against one raw ``torch.distributed.barrier``.

Run: ``torchrun --standalone --nproc-per-node 2 benchmarks/zero_first.py`` (gloo on CPU).
Each measurement runs N back-to-back blocks (or barriers) and closes with one barrier, so the
figure is the steady-state cost per block with every rank done; repeated, interleaved, median.
Target: within 1.5x of the raw barrier.
"""

import os
import statistics
import sys
import time

# this checkout's axolotl_dist, not whichever one is installed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

import axolotl_dist as ad  # noqa: E402


def _per_block(fn, n: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    dist.barrier()
    return (time.perf_counter() - start) / n


def _empty_zero_first() -> None:
    with ad.zero_first():
        pass


def main(n: int = 200, repeats: int = 15) -> None:
    ad.init_distributed()
    raw, ours = [], []
    for _ in range(repeats):
        raw.append(_per_block(dist.barrier, n))
        ours.append(_per_block(_empty_zero_first, n))
    r, o = statistics.median(raw), statistics.median(ours)
    if ad.is_main_process():
        print(f"raw dist.barrier       {r * 1e6:8.1f} us")
        print(f"empty zero_first block {o * 1e6:8.1f} us")
        print(f"ratio zero_first / barrier: {o / r:.2f}x (target <= 1.5x)")
    ad.cleanup_distributed()


if __name__ == "__main__":
    main()
