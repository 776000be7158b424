"""Benchmark: ``build_world_mesh`` against a direct ``init_device_mesh`` of the same shape.

Runs in one process on torch's fake process group (backend ``"fake"``), as one chosen rank of
a large world (default 8,192 ranks), so it needs no cluster::

    python benchmarks/mesh.py                      # 8,192 ranks, 7 repeats per case
    python benchmarks/mesh.py --world-size 1024 --repeats 3 --check

Each repeat creates a fresh fake group, times ``init_device_mesh(device, shape, names)`` and, in
another fresh group, ``build_world_mesh(...)`` for the configs giving that shape (order
alternating). ``build_world_mesh`` also validates the configs and creates the flattened DP and
DP x CP groups up front. Prints the best (min) and median times; the ratios use the best
times, which are the least disturbed by other processes on a shared machine. One ratio line
per case and an overall one; ``--check`` exits with status 1 if any ratio exceeds
``--target`` (default 1.5). The garbage collector is off while timing, as in ``timeit``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's axolotl_dist

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

import axolotl_dist as ad  # noqa: E402
from axolotl_dist.parallel import (  # noqa: E402
    ContextParallelConfig,
    DataParallelConfig,
    ExpertParallelConfig,
    PipelineParallelConfig,
    TensorParallelConfig,
)

RANKS_PER_NODE = 8


def cases(world_size: int) -> List[Tuple[str, Dict[str, object]]]:
    """Named ``build_world_mesh`` keyword sets that fit ``world_size`` (a multiple of 64)."""
    return [
        ("fsdp+tp", dict(dp=DataParallelConfig("fsdp"), tp=TensorParallelConfig(8))),
        ("hsdp (1 replica/node)+ep", dict(dp=DataParallelConfig("hsdp"),
                                           ep=ExpertParallelConfig(RANKS_PER_NODE))),
        ("pp+hsdp+cp+tp", dict(pp=PipelineParallelConfig(2),
                               dp=DataParallelConfig("hsdp", num_replicas=max(1, world_size // 512)),
                               cp=ContextParallelConfig(2), tp=TensorParallelConfig(2))),
    ]


def fresh_group(rank: int, world_size: int) -> None:
    """A new fake default group in which this process is ``rank``."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn()`` takes, with the garbage collector off (as ``timeit`` does)."""
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    finally:
        gc.enable()


def run_case(kwargs: Dict[str, object], rank: int, world_size: int,
             repeats: int) -> Tuple[str, List[float], List[float]]:
    """``(mesh info, direct seconds, build_world_mesh seconds)``, one time per repeat."""
    fresh_group(rank, world_size)
    mesh = ad.build_world_mesh(**kwargs)  # the shape to reproduce, and a warm-up
    info, shape, names = ad.get_device_mesh_info(mesh), tuple(mesh.shape), mesh.mesh_dim_names
    ad.reset_world_mesh()
    direct: List[float] = []
    ours: List[float] = []

    def one_direct() -> None:
        fresh_group(rank, world_size)
        direct.append(timed(lambda: init_device_mesh("cpu", shape, mesh_dim_names=names)))

    def one_ours() -> None:
        fresh_group(rank, world_size)
        ours.append(timed(lambda: ad.build_world_mesh(**kwargs)))
        ad.reset_world_mesh()

    for i in range(repeats):
        for step in ((one_direct, one_ours) if i % 2 == 0 else (one_ours, one_direct)):
            step()
    dist.destroy_process_group()
    return info, direct, ours


def _ms(times: List[float]) -> str:
    return f"{min(times) * 1e3:.1f} / {statistics.median(times) * 1e3:.1f}"


def main(argv: List[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=8192)
    parser.add_argument("--rank", type=int, default=None, help="the rank to be (default: 5/8 of the world)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--target", type=float, default=1.5)
    parser.add_argument("--check", action="store_true", help="exit 1 if a ratio exceeds --target")
    args = parser.parse_args(argv)
    rank = args.rank if args.rank is not None else args.world_size * 5 // 8
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "NUM_NODES"):
        os.environ.pop(name, None)
    os.environ["LOCAL_WORLD_SIZE"] = str(RANKS_PER_NODE)
    print(f"torch {torch.__version__}, fake backend, world size {args.world_size}, as rank {rank}, "
          f"{args.repeats} repeats; times in ms as best / median")
    print(f"{'case':<27} {'mesh':<72} {'init_device_mesh':>17} {'build_world_mesh':>17} {'ratio':>6}")
    worst = 0.0
    total_direct = total_ours = 0.0
    for name, kwargs in cases(args.world_size):
        info, direct, ours = run_case(kwargs, rank, args.world_size, args.repeats)
        ratio = min(ours) / min(direct)
        worst = max(worst, ratio)
        total_direct += min(direct)
        total_ours += min(ours)
        print(f"{name:<27} {info:<72} {_ms(direct):>17} {_ms(ours):>17} {ratio:>6.2f}")
    overall = total_ours / total_direct
    print(f"ratio build_world_mesh / init_device_mesh: overall {overall:.2f}x, worst case "
          f"{worst:.2f}x (target <= {args.target}x)")
    return 1 if args.check and worst > args.target else 0


if __name__ == "__main__":
    sys.exit(main())
