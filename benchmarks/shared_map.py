"""``shared_map`` against ``with zero_first(): dataset.map(fn)`` (2 ranks) and ``dataset.map`` (1).

Run: ``torchrun --standalone --nproc-per-node 2 benchmarks/shared_map.py`` (gloo on CPU), and
``python benchmarks/shared_map.py`` for the one-process figure.
The function is CPU-bound pure Python, about as costly per row as a tokenizer. Each
measurement starts and ends with a barrier, so it is the time until every rank holds the
whole mapped dataset; each repetition uses fresh fingerprints (nothing is cached), the two
methods alternate, and the median of the paired ratios is reported (robust to a machine
whose load drifts), with the ratio of the medians.
Targets: on 2 ranks shared_map / zero_first <= 0.70 (ideal 0.5); on 1 rank
shared_map / dataset.map <= 1.05.
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

# this checkout's axolotl_dist, not whichever one is installed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import datasets  # noqa: E402
import torch.distributed as dist  # noqa: E402

import axolotl_dist as ad  # noqa: E402


def features(example):
    """Per-row CPU work: a rolling hash over the text, repeated."""
    text = example["text"]
    h = 0
    for _ in range(40):
        for c in text:
            h = (h * 31 + ord(c)) % 1_000_003
    return {"h": h, "n": len(text)}


def _sync() -> None:
    if dist.is_initialized():
        dist.barrier()


def _timed(fn) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    ad.init_distributed()
    datasets.disable_progress_bars()
    ws, rank = ad.get_world_size(), ad.get_rank()
    root = os.path.join(tempfile.gettempdir(), f"axolotl_dist_bench_shared_map_{os.environ.get('MASTER_PORT', 'one')}")
    path = os.path.join(root, "raw")
    with ad.zero_first():
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
            texts = [f"sample {i} " + "lorem ipsum dolor sit amet " * (1 + i % 5) for i in range(args.rows)]
            datasets.Dataset.from_dict({"text": texts}).save_to_disk(path)
    raw = datasets.load_from_disk(path)

    def baseline(i: int) -> None:
        fp = f"bench-base-{i}"
        if ws == 1:
            raw.map(features, new_fingerprint=fp)
            return
        with ad.zero_first():
            raw.map(features, new_fingerprint=fp)

    def ours(i: int) -> None:
        ad.shared_map(raw, features, new_fingerprint=f"bench-shared-{i}")

    base_t, ours_t = [], []
    for i in range(args.repeats):
        base_t.append(_timed(lambda: baseline(i)))
        ours_t.append(_timed(lambda: ours(i)))
    b, o = statistics.median(base_t), statistics.median(ours_t)
    if rank == 0:
        name = "with zero_first(): dataset.map" if ws > 1 else "dataset.map"
        target = "0.70 (ideal 0.50)" if ws > 1 else "1.05"
        print(f"{ws} rank(s), {args.rows} rows, {args.repeats} repeats (median)")
        print(f"{name:32s} {b:7.3f} s   {[round(t, 2) for t in base_t]}")
        print(f"{'shared_map':32s} {o:7.3f} s   {[round(t, 2) for t in ours_t]}")
        paired = statistics.median(x / y for x, y in zip(ours_t, base_t))
        print(f"ratio shared_map / {name}: {paired:.2f} median of paired runs, {o / b:.2f} of "
              f"medians (target <= {target})")
    _sync()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    ad.cleanup_distributed()


if __name__ == "__main__":
    main()
