"""The helpers on CUDA tensors next to the raw torch collectives, measured in the same run.

Run through ``benchmarks/collectives.py --device cuda`` (or this file) on a machine with a
GPU; ``scripts/gpu_check.sh`` does. Two configurations, the ones one GPU allows:

* **NCCL, world size 1**: every collective runs on the GPU; the ratio is what the kit adds to
  NCCL's own call (its checks, its headers, the value encoding).
* **gloo, 2 ranks sharing the GPU**: CUDA tensors over gloo. The kit moves them through the
  CPU itself (its collectives run on the backend's device); raw torch hands them to gloo, which
  does the same inside the backend, where it supports the operation at all (a raw operation
  gloo refuses on CUDA is reported as such, not timed).

Every function is called ``--block`` times after a barrier and timed until the GPU is done
(``torch.cuda.synchronize``), in a fresh random order each round, the same on every rank; the
slower rank's median counts. Tensors are small (``--numel`` float32 values, default 1024):
latency, not bandwidth, is what the helpers add. Without CUDA it prints ``no CUDA device``
and exits 2; ``--dry-run-on-cpu`` runs the same code on 2 CPU ranks (a check of the benchmark
itself where there is no GPU, not a measurement of anything on CUDA).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

# this checkout's axolotl_dist, not whichever one is installed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: (helper, the raw torch call it is compared with)
PAIRS: List[Tuple[str, str]] = [
    ("broadcast", "dist.broadcast"),
    ("all_reduce", "dist.all_reduce"),
    ("all_gather", "dist.all_gather"),
    ("barrier", "dist.barrier"),
    ("synchronize_value (tensor)", "dist.broadcast"),
    ("compute_and_broadcast (tensor)", "dist.broadcast"),
    ("all_reduce_value (tensor)", "dist.all_reduce (of a copy)"),
    ("gather_from_all_ranks (tensor)", "dist.all_gather"),
    ("reduce_and_broadcast (int)", "dist.all_gather_into_tensor (int64)"),
    ("compute_and_broadcast (int)", "dist.broadcast (int64)"),
]
#: (label, backend, world size)
CONFIGS: List[Tuple[str, str, int]] = [("NCCL, 1 rank", "nccl", 1),
                                       ("gloo, 2 ranks on one GPU", "gloo", 2)]


def _rank_body(iters: int, warmup: int, block: int, numel: int,
               device_type: str = "cuda") -> Dict[str, object]:
    """Every rank: each function's per-call microseconds per round, and the raw calls this
    backend refuses on CUDA tensors (``{name: error}``)."""
    import torch
    import torch.distributed as dist

    import axolotl_dist as ad

    rank, ws = ad.get_rank(), ad.get_world_size()
    cuda = device_type == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    nccl = dist.get_backend() == "nccl"

    def raw_barrier() -> None:
        dist.barrier(device_ids=[device.index]) if nccl else dist.barrier()
    data = torch.arange(numel, dtype=torch.float32, device=device) + rank
    work = data.clone()
    parts = [torch.empty_like(data) for _ in range(ws)]
    one = torch.tensor([rank], dtype=torch.int64, device=device)
    ones = torch.empty(ws, dtype=torch.int64, device=device)
    gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    fns: Dict[str, Callable[[], object]] = {
        "broadcast": lambda: ad.broadcast(work),
        "all_reduce": lambda: ad.all_reduce(work),
        "all_gather": lambda: ad.all_gather(data),
        "barrier": ad.barrier,
        "synchronize_value (tensor)": lambda: ad.synchronize_value(data),
        "compute_and_broadcast (tensor)": lambda: ad.compute_and_broadcast(lambda: data),
        "all_reduce_value (tensor)": lambda: ad.all_reduce_value(data),
        "gather_from_all_ranks (tensor)": lambda: ad.gather_from_all_ranks(lambda: data),
        "reduce_and_broadcast (int)": lambda: ad.reduce_and_broadcast(lambda: rank, sum),
        "compute_and_broadcast (int)": lambda: ad.compute_and_broadcast(lambda: 7),
        "dist.broadcast": lambda: dist.broadcast(work, src=0),
        "dist.all_reduce": lambda: dist.all_reduce(work),
        "dist.all_gather": lambda: dist.all_gather(parts, data),
        "dist.barrier": raw_barrier,
        "dist.all_reduce (of a copy)": lambda: dist.all_reduce(data.clone()),
        "dist.all_gather_into_tensor (int64)": lambda: gather_single(ones, one),
        "dist.broadcast (int64)": lambda: dist.broadcast(one, src=0),
    }
    refused: Dict[str, str] = {}
    for name, fn in fns.items():  # sanity, and which raw calls this backend takes on CUDA
        try:
            fn()
            synchronize()
        except Exception as exc:  # noqa: BLE001 - gloo refuses some operations on CUDA
            if not name.startswith("dist."):
                raise
            refused[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    refused = ad.compute_and_broadcast(lambda: refused)  # the same list on every rank
    got = ad.gather_from_all_ranks(lambda: data)
    assert got is None or all(bool((g.cpu() == torch.arange(numel) + r).all())
                              for r, g in enumerate(got)), "gather_from_all_ranks is wrong"
    names = [n for n in fns if n not in refused]
    times: Dict[str, List[float]] = {n: [] for n in names}
    order = random.Random(1234)  # the same sequence on every rank, so the collectives pair up
    for i in range(warmup + iters):
        order.shuffle(names)
        for name in names:
            fn = fns[name]
            raw_barrier()
            synchronize()
            t0 = time.perf_counter_ns()
            for _ in range(block):
                fn()
            synchronize()
            if i >= warmup:
                times[name].append((time.perf_counter_ns() - t0) / 1e3 / block)
    return {"times": times, "refused": refused,
            "gpu": torch.cuda.get_device_name(device) if cuda else "no GPU (dry run on CPU)"}


def _slower_rank(per_rank: Sequence[Dict[str, object]]) -> Dict[str, float]:
    times = [r["times"] for r in per_rank]
    return {n: max(statistics.median(t[n]) for t in times) for n in times[0]}  # type: ignore


Result = Tuple[str, Dict[str, float], Dict[str, str], str]


def measure(iters: int, warmup: int, block: int, numel: int, dry_run: bool) -> List[Result]:
    """``(label, slower-rank medians, refused raw calls, GPU name)`` per configuration."""
    from axolotl_dist.testing import run_distributed

    out: List[Result] = []
    configs = [("gloo, 2 CPU ranks (dry run)", "gloo", 2)] if dry_run else CONFIGS
    for label, backend, ws in configs:
        per_rank = run_distributed(_rank_body, ws, backend=backend, timeout=1800, args=(
            iters, warmup, block, numel, "cpu" if dry_run else "cuda"))
        first = per_rank[0]
        out.append((label, _slower_rank(per_rank), first["refused"], first["gpu"]))
    return out


def report(results: List[Result], iters: int, block: int, numel: int) -> None:
    import torch

    print(f"\n## axolotl_dist on CUDA: {results[0][3]}, torch {torch.__version__}; "
          f"{iters} rounds, {block} call(s) timed per round, tensors of {numel} float32\n")
    print("| configuration | helper | median (us) | raw torch | median (us) | ratio |")
    print("|---|---|---:|---|---:|---:|")
    for label, medians, refused, _ in results:
        for helper, raw in PAIRS:
            if raw in refused:
                print(f"| {label} | `{helper}` | {medians[helper]:.0f} | `{raw}` | "
                      f"refused on CUDA ({refused[raw]}) | - |")
                continue
            print(f"| {label} | `{helper}` | {medians[helper]:.0f} | `{raw}` | "
                  f"{medians[raw]:.0f} | {medians[helper] / medians[raw]:.2f}x |")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=300, help="measured rounds (default 300)")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--block", type=int, default=10, help="calls timed together per round")
    parser.add_argument("--numel", type=int, default=1024, help="float32 values per tensor")
    parser.add_argument("--dry-run-on-cpu", action="store_true",
                        help="run the benchmark's code on 2 CPU ranks (checks it, measures no GPU)")
    args = parser.parse_args(argv)
    import torch

    # NVML's count: CUDA stays uninitialized in this process, which forks the ranks
    if torch.cuda.device_count() == 0 and not args.dry_run_on_cpu:
        print("no CUDA device: nothing measured")
        return 2
    results = measure(args.iters, args.warmup, args.block, args.numel, args.dry_run_on_cpu)
    report(results, args.iters, args.block, args.numel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
