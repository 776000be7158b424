"""Benchmark: ``ShardedFlatTensor.gather`` against one raw all-gather of the same bytes.

Run from the repository root::

    python benchmarks/sharded.py [--mib 64] [--ranks 2] [--iters 10]

Two gloo ranks (forked by :func:`axolotl_dist.testing.run_distributed`) shard a 64 MiB
float32 tensor. In the same run, alternating, each rank times

* ``raw``: ``torch.empty`` of the output plus one ``dist.all_gather_single`` of its shard
  (padded to the largest shard when the split is uneven, as raw all-gathers require);
* ``gather``: ``ShardedFlatTensor.gather()`` with the default (balanced) spec;
* ``gather (uneven)``: rank-ordered shards of unequal size (rank 0 holds one element less),
  compacted in place after the all-gather;
* ``gather (copy path)``: a spec with two ranges per rank, listed last-first, so the shards
  arrive out of order and are assembled by one copy per range into a new tensor (the
  slowest layout).

The figures are medians; the ratio is raw time / gather time (1.0 = as fast as raw).

Peak memory is the growth of the resident set while one gather runs: the kernel's peak-RSS
counter (``VmHWM``) is reset through ``/proc/self/clear_refs`` just before the call and read
just after it, minus the RSS before (Linux only; large CPU tensors are ``mmap``-ed and freed
back to the kernel, so the counter sees every buffer, including any gloo allocates). The
limit is the gathered tensor plus one padded buffer (``world_size * max_shard`` elements).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from axolotl_dist.tensors import ShardedFlatTensor, ShardingSpec  # noqa: E402
from axolotl_dist.testing import run_distributed  # noqa: E402

MIB = 2 ** 20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_growth_mib(fn: Callable[[], torch.Tensor]) -> float:
    """MiB the resident set grew to at most while ``fn`` ran (its result kept alive)."""
    before = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # reset VmHWM to the current RSS
    result = fn()
    peak = _status_kib("VmHWM")
    del result
    return (peak - before) / 1024


def two_range_spec(numel: int, ws: int) -> ShardingSpec:
    """Each rank holds two ranges, listed last-first: shards arrive out of order."""
    pieces = [(numel * i // (2 * ws), numel * (i + 1) // (2 * ws)) for i in range(2 * ws)]
    return ShardingSpec((numel,), tuple((pieces[ws + r], pieces[r]) for r in range(ws)))


def uneven_spec(numel: int, ws: int) -> ShardingSpec:
    """Rank-ordered ranges; rank 0 holds one element less than an even split."""
    bounds = [0] + [numel * r // ws - (1 if r == 1 else 0) for r in range(1, ws)] + [numel]
    return ShardingSpec((numel,), tuple((bounds[r], bounds[r + 1]) for r in range(ws)))


def rank_body(mib: int, iters: int) -> Dict[str, object]:
    ws, rank = dist.get_world_size(), dist.get_rank()
    numel = mib * MIB // 4
    full = torch.arange(numel, dtype=torch.float32)
    cases = {
        "gather": ShardedFlatTensor.shard(full, synchronize=False),
        "gather (uneven)": ShardedFlatTensor.shard(full, uneven_spec(numel, ws), synchronize=False),
        "gather (copy path)": ShardedFlatTensor.shard(full, two_range_spec(numel, ws), synchronize=False),
    }
    del full
    spec = cases["gather"].sharding_spec
    local = torch.zeros(spec.max_sharded_numel)  # raw all-gathers need equal sizes: pad
    local[:spec.sharded_numels[rank]] = cases["gather"].sharded_data

    def raw() -> torch.Tensor:
        out = torch.empty(ws * local.numel(), dtype=local.dtype)
        dist.all_gather_single(out, local)
        return out

    runs: Dict[str, Callable[[], torch.Tensor]] = {"raw": raw}
    runs.update({name: t.gather for name, t in cases.items()})
    for name, fn in runs.items():  # warm up, and check the results
        out = fn()
        assert torch.equal(out[:8], torch.arange(8, dtype=torch.float32)), name
    times: Dict[str, List[float]] = {name: [] for name in runs}
    for _ in range(iters):
        for name, fn in runs.items():
            dist.barrier()
            start = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - start)
            del out
    dist.barrier()
    memory = {}
    for name, fn in runs.items():
        dist.barrier()
        memory[name] = peak_growth_mib(fn)
    return {
        "rank": rank,
        "times": {name: statistics.median(ts) for name, ts in times.items()},
        "memory": memory,
        "gathered_mib": numel * 4 / MIB,
        "padded_mib": spec.world_size * spec.max_sharded_numel * 4 / MIB,
    }


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64, help="size of the full tensor (MiB)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args(argv)
    results = run_distributed(rank_body, args.ranks, args=(args.mib, args.iters), timeout=600)
    print(f"ShardedFlatTensor.gather of a {args.mib} MiB float32 tensor on {args.ranks} gloo "
          f"ranks, median of {args.iters} (rank 0 timings; memory: worst rank)")
    r0 = results[0]
    raw = r0["times"]["raw"]
    limit = r0["gathered_mib"] + r0["padded_mib"]
    for name, seconds in r0["times"].items():
        gib_s = r0["gathered_mib"] / 1024 / seconds
        mem = max(r["memory"][name] for r in results)
        line = f"{name:20s} {seconds * 1e3:8.1f} ms  {gib_s:6.2f} GiB/s  peak +{mem:6.1f} MiB"
        if name != "raw":
            line += f"  ratio {raw / seconds:.2f}x of raw"
            line += " (target >= 0.85)" if name == "gather" else ""
            line += f"  memory {'within' if mem <= limit + 1 else 'OVER'} gathered+padded ({limit:.0f} MiB)"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
