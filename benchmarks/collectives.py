"""Latency of the functional layer's helpers next to the raw torch collectives they wrap.

Run it on 2 CPU ranks, either through the package's own harness (default)::

    python benchmarks/collectives.py                 # forks 2 gloo ranks itself
    python benchmarks/collectives.py --iters 3000

or under a real launcher::

    torchrun --standalone --nproc-per-node 2 benchmarks/collectives.py

On a machine with a GPU, ``--device cuda`` measures the helpers on CUDA tensors instead (NCCL
at world size 1, gloo at 2 ranks sharing the GPU): ``benchmarks/collectives_cuda.py``.

It prints one table: for each helper, its median latency, the median of what it is compared
with (the raw torch collective it needs, or accelerate's equivalent helper on
``PartialState(cpu=True)``: ``main_process_first``, ``broadcast_object_list``, ``gather_object``),
and the ratio in each run and their median, with the target where the project sets one
(docs/performance.md). Every function is called once after a barrier and timed (per-call
latency of the slower rank); all of them are interleaved in a fresh random order each round
(the machine may be shared and noisy), after a warm-up, and every rank runs the same sequence
so the collectives pair up. ``--runs`` (default 3) repeats the whole measurement with fresh
ranks. It also measures,
in a process with no process group, ``is_main_process()`` / ``get_rank()`` against
``os.environ.get``, and the cost of ``import axolotl_dist`` on top of ``import torch`` in
fresh interpreters.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import tempfile
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

# this checkout's axolotl_dist, not whichever one is installed (as benchmarks/mesh.py does)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# --------------------------------------------------------------------------------------------
# Distributed part: runs on every rank.
# --------------------------------------------------------------------------------------------

#: (helper name, what it is compared with, target ratio helper/other or None)
PAIRS: List[Tuple[str, str, Optional[float]]] = [
    ("gather_scalar_from_all_ranks", "dist.gather", 1.0),
    ("gather_from_all_ranks", "dist.gather", 1.0),
    ("compute_and_broadcast", "dist.broadcast", 1.3),
    ("reduce_and_broadcast", "dist.all_gather_into_tensor", 1.3),
    ("synchronize_value", "dist.broadcast", None),
    ("all_reduce_value", "dist.all_reduce", None),
    ("all_reduce (tensor)", "dist.all_reduce", None),
    ("broadcast (tensor)", "dist.broadcast", None),
    ("all_gather_object (dict)", "dist.all_gather_object (dict)", None),
    ("broadcast_object (dict)", "dist.broadcast_object_list (dict)", None),
    ("barrier", "dist.barrier", 1.3),
    ("barrier", "accelerate wait_for_everyone", None),
    ("zero_first (empty block)", "dist.barrier", 0.9),
    ("zero_first (empty block)", "accelerate main_process_first (empty block)", 0.8),
    ("broadcast_object (dict)", "accelerate broadcast_object_list (dict)", None),
    ("all_gather_object (dict)", "accelerate gather_object (dict)", None),
    ("gather_from_all_ranks", "accelerate gather_object (scalar)", None),
]
#: helper must be at least this many times faster than the raw op
FASTER: List[Tuple[str, str, float]] = [
    ("gather_from_all_ranks", "dist.all_gather_object", 2.0),
]


def _rank_body(iters: int, warmup: int, block: int = 10) -> Dict[str, List[float]]:
    import torch
    import torch.distributed as dist

    import axolotl_dist as ad

    rank, ws = ad.get_rank(), ad.get_world_size()
    value = 0.1 * (rank + 1)
    obj = {"loss": 1.25, "tokens": 123456789, "name": "eval"}

    scalar = torch.tensor([value], dtype=torch.float64)
    gather_list = [torch.empty(1, dtype=torch.float64) for _ in range(ws)] if rank == 0 else None
    bcast = torch.empty(1, dtype=torch.float64)
    red = torch.empty(1, dtype=torch.int64)
    ag_out = torch.empty(ws, dtype=torch.int64)
    ag_in = torch.tensor([rank], dtype=torch.int64)
    ag_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def raw_gather() -> None:
        dist.gather(scalar, gather_list, dst=0)

    def raw_broadcast() -> None:
        if rank == 0:
            bcast.fill_(value)
        dist.broadcast(bcast, src=0)

    def raw_all_reduce() -> None:
        red.fill_(rank)
        dist.all_reduce(red)

    def raw_all_gather() -> None:
        ag_single(ag_out, ag_in)

    def raw_all_gather_object_scalar() -> None:
        out: List[object] = [None] * ws
        dist.all_gather_object(out, value)

    def raw_all_gather_object_dict() -> None:
        out: List[object] = [None] * ws
        dist.all_gather_object(out, obj)

    def raw_broadcast_object_list() -> None:
        lst = [obj if rank == 0 else None]
        dist.broadcast_object_list(lst, src=0)

    from accelerate import PartialState
    from accelerate.utils import broadcast_object_list as acc_broadcast_object_list
    from accelerate.utils import gather_object as acc_gather_object

    state = PartialState(cpu=True)  # reuses the kit's group

    def empty_zero_first() -> None:
        with ad.zero_first():
            pass

    def empty_main_process_first() -> None:
        with state.main_process_first():
            pass

    fns: Dict[str, Callable[[], object]] = {
        "dist.barrier": dist.barrier,
        "barrier": ad.barrier,
        "accelerate wait_for_everyone": state.wait_for_everyone,
        "zero_first (empty block)": empty_zero_first,
        "accelerate main_process_first (empty block)": empty_main_process_first,
        "accelerate broadcast_object_list (dict)": lambda: acc_broadcast_object_list(
            [obj if rank == 0 else None]),
        "accelerate gather_object (dict)": lambda: acc_gather_object([obj]),
        "accelerate gather_object (scalar)": lambda: acc_gather_object([value]),
        "dist.gather": raw_gather,
        "dist.broadcast": raw_broadcast,
        "dist.all_reduce": raw_all_reduce,
        "dist.all_gather_into_tensor": raw_all_gather,
        "dist.all_gather_object": raw_all_gather_object_scalar,
        "dist.all_gather_object (dict)": raw_all_gather_object_dict,
        "dist.broadcast_object_list (dict)": raw_broadcast_object_list,
        "gather_scalar_from_all_ranks": lambda: ad.gather_scalar_from_all_ranks(lambda: value),
        "gather_from_all_ranks": lambda: ad.gather_from_all_ranks(lambda: value),
        "compute_and_broadcast": lambda: ad.compute_and_broadcast(lambda: value),
        "reduce_and_broadcast": lambda: ad.reduce_and_broadcast(lambda: rank + 3, min),
        "synchronize_value": lambda: ad.synchronize_value(value),
        "all_reduce_value": lambda: ad.all_reduce_value(rank),
        "all_reduce (tensor)": lambda: ad.all_reduce(red.fill_(rank)),
        "broadcast (tensor)": lambda: ad.broadcast(bcast.fill_(value) if rank == 0 else bcast),
        "all_gather_object (dict)": lambda: ad.all_gather_object(obj),
        "broadcast_object (dict)": lambda: ad.broadcast_object(obj),
    }
    # sanity: the helpers return what they should (a broken helper must not look fast)
    assert ad.reduce_and_broadcast(lambda: rank + 3, min) == 3
    got = ad.gather_from_all_ranks(lambda: value)
    assert got is None if rank else got == [0.1 * (r + 1) for r in range(ws)], got
    assert ad.compute_and_broadcast(lambda: value) == 0.1
    assert acc_gather_object([value]) == [0.1 * (r + 1) for r in range(ws)]

    return time_interleaved(fns, iters, warmup, block)


def time_interleaved(fns: Dict[str, Callable[[], object]], iters: int, warmup: int,
                     block: int = 1) -> Dict[str, List[float]]:
    """Microseconds per call of each function, per round: every round runs them all in a
    fresh order (the same on every rank, so the collectives pair up), each after a barrier
    and timed over ``block`` calls; the first ``warmup`` rounds are not kept."""
    import torch.distributed as dist

    names = list(fns)
    times: Dict[str, List[float]] = {n: [] for n in names}
    clock = time.perf_counter_ns
    order = random.Random(1234)
    for i in range(warmup + iters):
        # a fresh order every round: no function always follows the same one
        order.shuffle(names)
        for name in names:
            fn = fns[name]
            dist.barrier()
            t0 = clock()
            for _ in range(block):
                fn()
            t1 = clock()
            if i >= warmup:
                times[name].append((t1 - t0) / 1e3 / block)  # microseconds per call
    return times


def slower_rank_median(per_rank: Sequence[Dict[str, List[float]]]) -> Dict[str, float]:
    """Each function's per-call latency as the slower rank sees it: the larger of the ranks'
    medians (how long a call takes on the rank that waits longest)."""
    names = per_rank[0].keys()
    return {n: max(statistics.median(r[n]) for r in per_rank) for n in names}


def _median_of_max(per_rank: Sequence[Dict[str, List[float]]]) -> Dict[str, float]:
    """Median over rounds of the later rank's time in each round (until *both* ranks are
    done): stricter for a protocol where one rank always waits to learn of the other."""
    names = per_rank[0].keys()
    return {n: statistics.median(max(ts) for ts in zip(*(r[n] for r in per_rank))) for n in names}


def _loop_body(blocks: int, repeats: int) -> Dict[str, float]:
    """Per-block cost of a loop of ``blocks`` back-to-back empty blocks (closed by one barrier),
    median of ``repeats``: what a loop of ``with zero_first(): ...`` costs."""
    import torch.distributed as dist
    from accelerate import PartialState

    import axolotl_dist as ad

    state = PartialState(cpu=True)

    def zf() -> None:
        with ad.zero_first():
            pass

    def mpf() -> None:
        with state.main_process_first():
            pass

    fns = {"dist.barrier": dist.barrier, "zero_first (empty block)": zf,
           "accelerate main_process_first (empty block)": mpf}
    out: Dict[str, List[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(blocks):
                fn()
            dist.barrier()
            out[name].append((time.perf_counter() - start) / blocks * 1e6)
    return {k: statistics.median(v) for k, v in out.items()}


# --------------------------------------------------------------------------------------------
# Single-process parts.
# --------------------------------------------------------------------------------------------


_D = {"RANK": "0"}


def _dict_lookup():
    """The reference cost: one Python function call doing one dict lookup."""
    return _D.get("RANK")


def _query_costs(number: int = 200_000, repeat: int = 7) -> Dict[str, float]:
    """ns per call in this process (no process group), best of medians over ``repeat`` runs."""
    import timeit

    import torch.distributed as dist

    import axolotl_dist as ad

    assert not dist.is_initialized()
    stmts = {
        "os.environ.get('RANK')": ("get('RANK')", {"get": os.environ.get}),
        "is_main_process()": ("f()", {"f": ad.is_main_process}),
        "get_rank()": ("f()", {"f": ad.get_rank}),
        "dict lookup + call": ("f()", {"f": _dict_lookup}),
    }
    samples: Dict[str, List[float]] = {k: [] for k in stmts}
    for _ in range(repeat):  # interleave the statements
        for name, (stmt, glb) in stmts.items():
            samples[name].append(timeit.timeit(stmt, globals=glb, number=number) / number * 1e9)
    assert not dist.is_initialized(), "a query created a process group"
    return {k: statistics.median(v) for k, v in samples.items()}


_IMPORT_SNIPPET = (
    "import gc, time; pause = [0.0, 0.0]\n"
    "def timed(phase, info):\n"
    "    if info['generation'] == 2:\n"
    "        pause[phase == 'stop'] = time.perf_counter() if phase == 'start' else "
    "pause[1] + time.perf_counter() - pause[0]\n"
    "t0 = time.perf_counter(); import torch; t1 = time.perf_counter()\n"
    "gc.callbacks.append(timed)\n"
    "import axolotl_dist; t2 = time.perf_counter(); gc.callbacks.remove(timed)\n"
    "print(t1 - t0, t2 - t1, pause[1])"
)


def _import_costs(repeat: int = 7) -> Tuple[float, float, float]:
    """Median seconds of ``import torch``, of ``import axolotl_dist`` after it, and of the full
    (generation 2) garbage collections that ran inside the latter, fresh processes with the
    modules' bytecode cached (as an installed package has it: one run first compiles it).

    The collections are torch's: ``import torch`` leaves about a million objects for the
    cyclic collector's next full pass (~70 ms here), which whatever the script allocates next
    starts (20,000 small dicts do); the kit's import happens to be that. Its own cost is the
    rest (docs/performance.md, "Import")."""
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = os.path.join(tempfile.gettempdir(), "axolotl_dist_bench_pyc")
    subprocess.run([sys.executable, "-c", _IMPORT_SNIPPET], env=env, check=True,
                   capture_output=True)  # compiles the bytecode
    torch_s, pkg_s, gc_s = [], [], []
    for _ in range(repeat):
        out = subprocess.run([sys.executable, "-c", _IMPORT_SNIPPET], env=env, check=True,
                             capture_output=True, text=True).stdout.split()
        torch_s.append(float(out[0]))
        pkg_s.append(float(out[1]))
        gc_s.append(float(out[2]))
    return statistics.median(torch_s), statistics.median(pkg_s), statistics.median(gc_s)


# --------------------------------------------------------------------------------------------
# Report.
# --------------------------------------------------------------------------------------------


def _report(runs: List[Tuple[Dict[str, float], Dict[str, float], Dict[str, float]]],
            queries: Dict[str, float], imports: Tuple[float, float, float], iters: int, block: int,
            launcher: str) -> bool:
    ok = True
    print(f"\n## axolotl_dist collectives benchmark: 2 gloo ranks on CPU, launched by {launcher}; "
          f"{len(runs)} run(s) of {iters} rounds in a fresh random order each, every function "
          f"timed over {block} call(s) after a barrier\n")
    print("Per call: each rank's median latency, the slower rank's taken (the target is judged "
          "on it); `both done`: the median over rounds of the later rank's time, the stricter "
          "view (a helper is done only when every rank is).\n")
    print("| helper | median (us) | compared with | median (us) | ratio per run | median ratio "
          "| target | met | both done: ratio |")
    print("|---|---:|---|---:|---|---:|---|---|---:|")
    slower = [r[0] for r in runs]
    both = [r[1] for r in runs]
    mid = {n: statistics.median(r[n] for r in slower) for n in slower[0]}
    for helper, other, target in PAIRS:
        ratios = [r[helper] / r[other] for r in slower]
        ratio = statistics.median(ratios)
        strict = statistics.median(r[helper] / r[other] for r in both)
        met = "" if target is None else ("yes" if ratio <= target else "NO")
        ok &= met != "NO"
        print(f"| `{helper}` | {mid[helper]:.0f} | `{other}` | {mid[other]:.0f} | "
              f"{', '.join(f'{x:.2f}' for x in ratios)} | {ratio:.2f}x | "
              f"{'<= %.1fx' % target if target else '-'} | {met} | {strict:.2f}x |")
    for helper, raw, factor in FASTER:
        speedup = statistics.median(r[raw] / r[helper] for r in slower)
        met = "yes" if speedup >= factor else "NO"
        ok &= met == "yes"
        print(f"| `{helper}` (scalar) | {mid[helper]:.0f} | `{raw}` (scalar) | {mid[raw]:.0f} | "
              f"{', '.join(f'{r[helper] / r[raw]:.2f}' for r in slower)} | {1 / speedup:.2f}x "
              f"({speedup:.1f}x faster) | >= {factor:.0f}x faster | {met} | |")

    loops = [r[2] for r in runs]
    zf = "zero_first (empty block)"
    print("\n| loop of empty blocks (per block, slower rank) | us | zero_first / it |")
    print("|---|---:|---:|")
    for name in loops[0]:
        per = statistics.median(r[name] for r in loops)
        ratio = statistics.median(r[zf] / r[name] for r in loops)
        print(f"| `{name}` | {per:.0f} | {ratio:.2f}x |")

    base = queries["os.environ.get('RANK')"]
    ref = queries["dict lookup + call"]
    print("\n| query, no process group | ns/call | vs `os.environ.get('RANK')` | vs dict lookup + call "
          "| target | met |")
    print("|---|---:|---:|---:|---|---|")
    for name in ("os.environ.get('RANK')", "dict lookup + call", "is_main_process()", "get_rank()"):
        ratio = queries[name] / base
        target = name in ("is_main_process()", "get_rank()")
        met = ("yes" if ratio <= 1.0 else "NO") if target else ""
        ok &= met != "NO"
        print(f"| `{name}` | {queries[name]:.0f} | {ratio:.2f}x | {queries[name] / ref:.2f}x | "
              f"{'<= os.environ.get' if target else '-'} | {met} |")

    torch_s, pkg_s, gc_s = imports
    own = pkg_s - gc_s
    share = own / torch_s
    met = "yes" if share <= 0.10 else "NO"
    ok &= met == "yes"
    print("\n| import (fresh interpreters, bytecode cached, median) | seconds | share of "
          "`import torch` | target | met |")
    print("|---|---:|---:|---|---|")
    print(f"| `import torch` | {torch_s:.3f} | 100% | - | |")
    print(f"| `import axolotl_dist` after it, in all | {pkg_s:.4f} | {pkg_s / torch_s:.1%} | - | |")
    print(f"| of which the full garbage collection `import torch` left due | {gc_s:.4f} | "
          f"{gc_s / torch_s:.1%} | - | |")
    print(f"| `import axolotl_dist`'s own | {own:.4f} | {share:.1%} | <= 10% | {met} |")
    return ok


def main(argv: Optional[Sequence[str]] = None) -> int:
    device = argparse.ArgumentParser(add_help=False)
    device.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    known, rest = device.parse_known_args(argv)
    if known.device == "cuda":
        import collectives_cuda  # beside this file

        return collectives_cuda.main(rest)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], parents=[device])
    parser.add_argument("--iters", type=int, default=3000, help="measured rounds (default 3000)")
    parser.add_argument("--warmup", type=int, default=200, help="unmeasured rounds first")
    parser.add_argument("--block", type=int, default=1, help="calls timed together per round (1: per-call latency)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--import-repeats", type=int, default=7)
    parser.add_argument("--runs", type=int, default=3, help="measurements with fresh ranks (default 3)")
    parser.add_argument("--loop-blocks", type=int, default=200, help="blocks per timed loop")
    parser.add_argument("--loop-repeats", type=int, default=15)
    args = parser.parse_args(argv)

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun: one run
        import torch.distributed as dist

        import axolotl_dist as ad

        ad.init_distributed(backend="gloo")
        times = _rank_body(args.iters, args.warmup, args.block)
        loop = _loop_body(args.loop_blocks, args.loop_repeats)
        gathered: List[Optional[Dict[str, List[float]]]] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, times)
        rank = dist.get_rank()
        ad.cleanup_distributed()
        if rank != 0:
            return 0
        runs = [(slower_rank_median(gathered), _median_of_max(gathered), loop)]  # type: ignore[arg-type]
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            os.environ.pop(name, None)  # the query costs are measured with no launcher env
        launcher = "torchrun"
    else:
        from axolotl_dist.testing import run_distributed

        runs = []
        for _ in range(args.runs):
            per_rank = run_distributed(_rank_body, args.world_size,
                                       args=(args.iters, args.warmup, args.block), timeout=3600)
            loops = run_distributed(_loop_body, args.world_size,
                                    args=(args.loop_blocks, args.loop_repeats), timeout=3600)
            loop = {k: max(r[k] for r in loops) for k in loops[0]}
            runs.append((slower_rank_median(per_rank), _median_of_max(per_rank), loop))
        launcher = "axolotl_dist.testing.run_distributed (forked ranks)"
    queries = _query_costs()
    imports = _import_costs(args.import_repeats)
    ok = _report(runs, queries, imports, args.iters, args.block, launcher)
    print("\nall targets met" if ok else "\nSOME TARGETS MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
