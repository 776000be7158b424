"""What debug mode costs: nothing measurable when off, a few store round trips when on.

Run on 2 CPU ranks (forks them itself)::

    python benchmarks/debug.py
    python benchmarks/debug.py --iters 3000

For each checked helper it times, interleaved call by call in the same run:

* ``off``: the public helper with debug mode off (what every user runs);
* ``bare``: the same helper's undecorated body (``helper.__wrapped__``), i.e. the helper as it
  would be with no debug hook at all;
* ``on``: the public helper with debug mode on (for information: the price of hunting a bug).

Target (issue 7): ``off / bare`` within 1.05x for every helper.
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

TARGET = 1.05
HELPERS = ("barrier", "broadcast", "all_reduce", "compute_and_broadcast",
           "gather_from_all_ranks", "reduce_and_broadcast", "all_reduce_value", "zero_first")


def _rank_body(iters: int, warmup: int) -> Dict[str, List[float]]:
    import torch
    import torch.distributed as dist

    import axolotl_dist as ad

    rank = ad.get_rank()
    t = torch.ones(4)

    def zero_first(cm: Callable) -> Callable[[], None]:
        def run() -> None:
            with cm():
                pass
        return run

    def calls(f: Callable) -> Dict[str, Callable[[], object]]:
        return {
            "barrier": lambda: f["barrier"](),
            "broadcast": lambda: f["broadcast"](t, 0),
            "all_reduce": lambda: f["all_reduce"](t, "MAX"),
            "compute_and_broadcast": lambda: f["compute_and_broadcast"](lambda: 0.1),
            "gather_from_all_ranks": lambda: f["gather_from_all_ranks"](lambda: rank),
            "reduce_and_broadcast": lambda: f["reduce_and_broadcast"](lambda: rank, min),
            "all_reduce_value": lambda: f["all_reduce_value"](rank),
            "zero_first": zero_first(f["zero_first"]),
        }

    public = {name: getattr(ad, name) for name in HELPERS}
    bare = {name: fn.__wrapped__ for name, fn in public.items()}
    assert all(bare[n] is not public[n] for n in HELPERS), "a helper is not decorated"
    modes = {"off": calls(public), "bare": calls(bare), "on": calls(public)}

    keys = [(mode, name) for mode in modes for name in HELPERS]
    times: Dict[str, List[float]] = {f"{m}:{n}": [] for m, n in keys}
    order = random.Random(99)  # the same order on every rank, so the collectives pair up
    clock = time.perf_counter_ns
    for i in range(warmup + iters):
        order.shuffle(keys)
        for mode, name in keys:
            if mode == "on":
                ad.enable_debug()
            dist.barrier()
            t0 = clock()
            modes[mode][name]()
            t1 = clock()
            if mode == "on":
                ad.disable_debug()
            if i >= warmup:
                times[f"{mode}:{name}"].append((t1 - t0) / 1e3)
    return times


def _median_of_slowest(per_rank: Sequence[Dict[str, List[float]]]) -> Dict[str, float]:
    return {k: statistics.median(max(ts) for ts in zip(*(r[k] for r in per_rank)))
            for k in per_rank[0]}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)

    from axolotl_dist.testing import run_distributed

    per_rank = run_distributed(_rank_body, args.world_size, args=(args.iters, args.warmup),
                               timeout=3600, env={"AXOLOTL_DIST_DEBUG": "0"})
    med = _median_of_slowest(per_rank)
    print(f"\n## debug mode cost: {args.world_size} gloo ranks on CPU, {args.iters} rounds, "
          "every call timed alone after a barrier, in a fresh random order each round; median "
          "per call of the slower rank (us)\n")
    print("| helper | bare body | debug off | off / bare | target | met | debug on | on / bare |")
    print("|---|---:|---:|---:|---|---|---:|---:|")
    ok = True
    rows: List[Tuple[str, float]] = []
    for name in HELPERS:
        bare, off, on = med[f"bare:{name}"], med[f"off:{name}"], med[f"on:{name}"]
        ratio = off / bare
        met = ratio <= TARGET
        ok &= met
        rows.append((name, ratio))
        print(f"| `{name}` | {bare:.0f} | {off:.0f} | {ratio:.3f}x | <= {TARGET:.2f}x | "
              f"{'yes' if met else 'NO'} | {on:.0f} | {on / bare:.1f}x |")
    print("\nall targets met" if ok else "\nSOME TARGETS MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
