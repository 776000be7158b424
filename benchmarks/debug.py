"""What debug mode costs: nothing measurable when off, a few store round trips when on.

Run on 2 CPU ranks (forks them itself)::

    python benchmarks/debug.py
    python benchmarks/debug.py --iters 3000

For each checked helper it times, interleaved call by call in the same run:

* ``off``: the public helper with debug mode off (what every user runs);
* ``bare``: the same helper's undecorated body (``helper.__wrapped__``), i.e. the helper as it
  would be with no debug hook at all;
* ``on``: the public helper with debug mode on (for information: the price of hunting a bug).

Target: ``off / bare`` within 1.05x for every helper, judged on the median over
rounds of the ratio of the two back-to-back timings (machine drift cancels); the script also
measures the hook's cost per call directly in one process (about 0.2 us).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

# this checkout's axolotl_dist, not whichever one is installed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TARGET = 1.05
HELPERS = ("barrier", "broadcast", "all_reduce", "compute_and_broadcast",
           "gather_from_all_ranks", "reduce_and_broadcast", "all_reduce_value", "zero_first")


def _rank_body(iters: int, warmup: int, block: int) -> Dict[str, List[float]]:
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

    times: Dict[str, List[float]] = {f"{m}:{n}": [] for m in modes for n in HELPERS}
    order = random.Random(99)  # the same order on every rank, so the collectives pair up
    clock = time.perf_counter_ns
    names = list(HELPERS)
    for i in range(warmup + iters):
        order.shuffle(names)
        for name in names:
            # off and bare back to back (in a random order), so both see the same machine
            pair = ["off", "bare"] if order.random() < 0.5 else ["bare", "off"]
            for mode in pair + ["on"]:
                fn = modes[mode][name]
                n = block if mode != "on" else 1
                if mode == "on":
                    ad.enable_debug()
                dist.barrier()
                t0 = clock()
                for _ in range(n):
                    fn()
                t1 = clock()
                if mode == "on":
                    ad.disable_debug()
                if i >= warmup:
                    times[f"{mode}:{name}"].append((t1 - t0) / 1e3 / n)
    return times


def _hook_cost_ns(number: int = 20_000, rounds: int = 25) -> Dict[str, float]:
    """ns per call of the wrapper every helper wears (debug off), in one process without a
    group: ``barrier()`` (its body is a check that there is no group) against its undecorated
    body, alternated in short blocks, the best block of each."""
    import timeit

    import axolotl_dist as ad

    public, bare = ad.barrier, ad.barrier.__wrapped__
    costs = {"off": [], "bare": []}  # type: Dict[str, List[float]]
    for _ in range(rounds):
        costs["off"].append(timeit.timeit(public, number=number) / number * 1e9)
        costs["bare"].append(timeit.timeit(bare, number=number) / number * 1e9)
    return {k: min(v) for k, v in costs.items()}


def _trace_cost_ns(number: int = 20_000, rounds: int = 25) -> Dict[str, float]:
    """ns per call with tracing on and off, in one process with a 1-rank gloo group, best
    block of each (alternated in short blocks of ``number`` calls):

    * ``span`` / ``bare``: the span itself, the way the helpers' wrapper records one, around
      a call that does nothing (what a span costs);
    * ``on`` / ``off``: ``barrier()`` traced and not (what a traced helper costs in place:
      Python runs slower right after a collective, the span's code too)."""
    import tempfile
    import timeit

    import axolotl_dist as ad
    # the span the wrapper records, timed alone
    from axolotl_dist._runtime.protocols import timeline
    from axolotl_dist._runtime.base.callsite import call_site
    from axolotl_dist._runtime.protocols.timeline import TIMELINE  # toggled here

    def nothing() -> None:
        return None

    with tempfile.TemporaryDirectory() as directory:
        ad.init_distributed(trace_dir=directory)
        recorder = TIMELINE.recorder

        def span() -> None:
            timeline.helper_span(recorder, "barrier", None, call_site, nothing, (), {})

        costs = {"span": [], "bare": [], "on": [], "off": []}  # type: Dict[str, List[float]]
        for _ in range(rounds):
            costs["span"].append(timeit.timeit(span, number=number) / number * 1e9)
            costs["bare"].append(timeit.timeit(nothing, number=number) / number * 1e9)
            TIMELINE.recorder = recorder
            costs["on"].append(timeit.timeit(ad.barrier, number=number // 10) / number * 1e10)
            TIMELINE.recorder = None
            costs["off"].append(timeit.timeit(ad.barrier, number=number // 10) / number * 1e10)
        recorder.end(None)  # closed unmerged: a merge of a million spans is not what is timed
        ad.cleanup_distributed()
    return {k: min(v) for k, v in costs.items()}


def _raw_body(iters: int) -> Dict[str, float]:
    """Median us per raw ``dist.all_reduce`` of 4 floats: torch's own (debug mode off) and
    checked by debug mode (on), interleaved in blocks; under ``TORCH_DISTRIBUTED_DEBUG`` (the
    env of the run) the ``off`` column is torch's own check."""
    import torch
    import torch.distributed as dist

    import axolotl_dist as ad

    t = torch.ones(4)
    times: Dict[str, List[float]] = {"off": [], "on": []}
    clock = time.perf_counter_ns
    for i in range(iters // 10 + 5):
        for mode in ("off", "on"):
            if mode == "on":
                ad.enable_debug()
            dist.barrier()
            t0 = clock()
            for _ in range(10):
                dist.all_reduce(t)
            if i >= 5:
                times[mode].append((clock() - t0) / 1e4)
            ad.disable_debug()
    return {k: statistics.median(v) for k, v in times.items()}


def _raw_table(world_size: int, iters: int) -> None:
    """Raw torch collectives: debug mode's check against torch's own
    (``TORCH_DISTRIBUTED_DEBUG=DETAIL``: every collective first checked through a side group)."""
    from axolotl_dist.testing import run_distributed

    plain = run_distributed(_raw_body, world_size, args=(iters,), timeout=3600,
                            env={"AXOLOTL_DIST_DEBUG": "0"})
    detail = run_distributed(_raw_body, world_size, args=(iters,), timeout=3600,
                             env={"AXOLOTL_DIST_DEBUG": "0", "TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    off, on = max(r["off"] for r in plain), max(r["on"] for r in plain)
    det = max(r["off"] for r in detail)
    print(f"\nRaw `dist.all_reduce` of 4 floats, {world_size} gloo ranks, median us per call of "
          "the slower rank (blocks of 10):\n")
    print("| torch alone | debug mode (`AXOLOTL_DIST_DEBUG=1`) | `TORCH_DISTRIBUTED_DEBUG=DETAIL` |")
    print("|---:|---:|---:|")
    print(f"| {off:.0f} | {on:.0f} ({on / off:.1f}x) | {det:.0f} ({det / off:.1f}x) |")


def _slowest(per_rank: Sequence[Dict[str, List[float]]], key: str) -> List[float]:
    """Per round, the slower rank's time."""
    return [max(ts) for ts in zip(*(r[key] for r in per_rank))]


def _median_of_slowest(per_rank: Sequence[Dict[str, List[float]]]) -> Dict[str, float]:
    return {k: statistics.median(_slowest(per_rank, k)) for k in per_rank[0]}


def _paired_ratio(per_rank: Sequence[Dict[str, List[float]]], name: str) -> float:
    """Median over rounds of off/bare measured back to back in the same round (drift cancels)."""
    off, bare = _slowest(per_rank, f"off:{name}"), _slowest(per_rank, f"bare:{name}")
    return statistics.median(o / b for o, b in zip(off, bare))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--block", type=int, default=10,
                        help="back-to-back calls timed together for off/bare (on: 1)")
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args(argv)

    from axolotl_dist.testing import run_distributed

    per_rank = run_distributed(_rank_body, args.world_size, args=(args.iters, args.warmup, args.block),
                               timeout=3600, env={"AXOLOTL_DIST_DEBUG": "0"})
    med = _median_of_slowest(per_rank)
    print(f"\n## debug mode cost: {args.world_size} gloo ranks on CPU, {args.iters} rounds in a "
          f"fresh random order each; off and bare timed back to back over {args.block} calls "
          "after a barrier, on over 1; median per call of the slower rank (us)\n")
    print("| helper | bare body | debug off | off / bare (paired median) | target | met | debug on "
          "| on / bare |")
    print("|---|---:|---:|---:|---|---|---:|---:|")
    ok = True
    for name in HELPERS:
        bare, off, on = med[f"bare:{name}"], med[f"off:{name}"], med[f"on:{name}"]
        ratio = _paired_ratio(per_rank, name)
        met = ratio <= TARGET
        ok &= met
        print(f"| `{name}` | {bare:.0f} | {off:.0f} | {ratio:.3f}x | <= {TARGET:.2f}x | "
              f"{'yes' if met else 'NO'} | {on:.0f} | {on / bare:.1f}x |")
    hook = _hook_cost_ns()
    print(f"\nThe wrapper itself, one process without a group (`barrier()`, best of 25 blocks of "
          f"20k calls each): {hook['off']:.0f} ns with it, {hook['bare']:.0f} ns without: "
          f"{hook['off'] - hook['bare']:+.0f} ns per call.")
    trace = _trace_cost_ns()
    span = trace["span"] - trace["bare"]
    print(f"\nTracing, one process with a 1-rank gloo group (best of 25 blocks): one span costs "
          f"{span:.0f} ns (target <= 5000); `barrier()` takes {trace['off']:.0f} ns off and "
          f"{trace['on']:.0f} ns on ({trace['on'] - trace['off']:+.0f} ns in place, where "
          f"Python runs slower right after a collective).")
    ok &= span <= 5000
    _raw_table(args.world_size, args.iters)
    print("\nall targets met" if ok else "\nSOME TARGETS MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
