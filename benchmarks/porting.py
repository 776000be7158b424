"""accelerate's names in the kit next to accelerate's own, measured in the same run.

    python benchmarks/porting.py                 # forks 2 gloo ranks itself (--world-size 3)
    python benchmarks/porting.py --iters 2000 --runs 3

For each helper of docs/porting.md: its median per-call latency on the slower rank, the same
for accelerate's helper on the same inputs (over the kit's process group, through
``Accelerator(cpu=True)``), and for the raw torch collective where one does the same work,
with the ratio per run and the median ratio. The functions run interleaved, in a fresh random
order each round, after a barrier, the same sequence on every rank (benchmarks/collectives.py
does the same for the other helpers). ``set_seed`` needs no collective: both are timed in
each rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Callable, Dict, List, Optional, Sequence, Tuple

# this checkout's axolotl_dist, not whichever one is installed (as benchmarks/mesh.py does)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from collectives import slower_rank_median, time_interleaved  # noqa: E402 - beside this file

#: (kit's helper, what it is compared with)
PAIRS: List[Tuple[str, str]] = [
    ("gather (tensor)", "accelerate gather (tensor)"),
    ("gather (tensor)", "dist.all_gather + cat (tensor)"),
    ("gather (dict of 3)", "accelerate gather (dict of 3)"),
    ("gather_object (list)", "accelerate gather_object (list)"),
    ("reduce (tensor)", "accelerate reduce (tensor)"),
    ("reduce (tensor)", "dist.all_reduce (clone)"),
    ("pad_across_processes (tensor)", "accelerate pad_across_processes (tensor)"),
    ("pad_across_processes (dict of 3)", "accelerate pad_across_processes (dict of 3)"),
    ("gather_for_metrics (pair)", "accelerate gather_for_metrics (pair)"),
    ("broadcast (dict of 3)", "accelerate broadcast (dict of 3)"),
    ("broadcast (tensor)", "dist.broadcast (tensor)"),
    ("all_reduce (tensor)", "dist.all_reduce (tensor)"),
    # accelerate's copy_tensor_to_devices raises on every rank without the tensor (1.15:
    # torch.zeros of a shape tensor): compared with the broadcast a user writes instead
    ("copy_tensor_to_devices", "dist.broadcast (tensor)"),
    ("wait_for_everyone", "accelerate wait_for_everyone"),
    ("set_seed", "accelerate set_seed"),
]


def _rank_body(iters: int, warmup: int) -> Dict[str, List[float]]:
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from accelerate.utils import broadcast as a_broadcast
    from accelerate.utils import gather as a_gather
    from accelerate.utils import gather_object as a_gather_object
    from accelerate.utils import pad_across_processes as a_pad
    from accelerate.utils import reduce as a_reduce
    from accelerate.utils import set_seed as a_set_seed

    import axolotl_dist as ad

    acc = Accelerator(cpu=True)  # accelerate's state over the kit's group
    rank, ws = ad.get_rank(), ad.get_world_size()
    logits = torch.randn(8, 32)
    triple = {"logits": logits, "labels": torch.arange(8), "loss": torch.tensor(0.5)}
    ragged = torch.ones(rank + 3, 16)
    ragged3 = {"ids": ragged.long(), "mask": ragged.bool(), "scores": ragged}
    obj = [{"text": f"sample {rank}", "score": 0.25 * rank}]
    pair = (logits.argmax(-1), torch.arange(8))
    rows = 10**12  # a pass that never ends: the per-batch cost in its middle
    out_list = [torch.empty_like(logits) for _ in range(ws)]

    def raw_gather() -> None:
        dist.all_gather(out_list, logits)
        torch.cat(out_list)

    def raw_reduce() -> None:
        dist.all_reduce(logits.clone())

    held = logits if rank == 0 else None
    in_place = logits.clone()

    fns: Dict[str, Callable[[], object]] = {
        "gather (tensor)": lambda: ad.gather(logits),
        "accelerate gather (tensor)": lambda: a_gather(logits),
        "dist.all_gather + cat (tensor)": raw_gather,
        "gather (dict of 3)": lambda: ad.gather(triple),
        "accelerate gather (dict of 3)": lambda: a_gather(triple),
        "gather_object (list)": lambda: ad.gather_object(obj),
        "accelerate gather_object (list)": lambda: a_gather_object(obj),
        "reduce (tensor)": lambda: ad.reduce(logits),
        "accelerate reduce (tensor)": lambda: a_reduce(logits),
        "dist.all_reduce (clone)": raw_reduce,
        "pad_across_processes (tensor)": lambda: ad.pad_across_processes(ragged),
        "accelerate pad_across_processes (tensor)": lambda: a_pad(ragged),
        "pad_across_processes (dict of 3)": lambda: ad.pad_across_processes(ragged3),
        "accelerate pad_across_processes (dict of 3)": lambda: a_pad(ragged3),
        "gather_for_metrics (pair)": lambda: ad.gather_for_metrics(pair, rows),
        "accelerate gather_for_metrics (pair)": lambda: acc.gather_for_metrics(pair),
        "broadcast (dict of 3)": lambda: ad.broadcast(triple),  # a tensor only, before #55
        "accelerate broadcast (dict of 3)": lambda: a_broadcast(triple),
        "broadcast (tensor)": lambda: ad.broadcast(in_place),
        "dist.broadcast (tensor)": lambda: dist.broadcast(in_place, 0),
        "all_reduce (tensor)": lambda: ad.all_reduce(in_place, "MAX"),
        "dist.all_reduce (tensor)": lambda: dist.all_reduce(in_place, dist.ReduceOp.MAX),
        "copy_tensor_to_devices": lambda: ad.copy_tensor_to_devices(held),
        "wait_for_everyone": ad.wait_for_everyone,
        "accelerate wait_for_everyone": acc.wait_for_everyone,
        "set_seed": lambda: ad.set_seed(1234),
        "accelerate set_seed": lambda: a_set_seed(1234),
    }
    if not hasattr(ad, "copy_tensor_to_devices"):  # a checkout before issue #55, for "before"
        for name in ("broadcast (dict of 3)", "copy_tensor_to_devices"):
            del fns[name]
    # a broken helper must not look fast: the kit's results are accelerate's
    assert torch.equal(ad.gather(logits), a_gather(logits))
    assert torch.equal(ad.reduce(logits), a_reduce(logits))
    assert torch.equal(ad.pad_across_processes(ragged), a_pad(ragged))
    assert ad.gather_object(obj) == a_gather_object(obj)
    if "copy_tensor_to_devices" in fns:
        assert torch.equal(ad.copy_tensor_to_devices(held), ad.broadcast(logits.clone()))

    return time_interleaved(fns, iters, warmup)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=1500)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)

    from axolotl_dist.testing import run_distributed

    runs = [slower_rank_median(run_distributed(_rank_body, args.world_size,
                                                args=(args.iters, args.warmup), timeout=3600))
            for _ in range(args.runs)]
    print(f"\n## accelerate's names: the kit vs accelerate {_accelerate_version()}, "
          f"{args.world_size} gloo ranks on CPU, {len(runs)} run(s) of {args.iters} rounds\n")
    print("| kit | median (us) | compared with | median (us) | ratio per run | median ratio |")
    print("|---|---:|---|---:|---|---:|")
    for mine, other in PAIRS:
        if mine not in runs[0]:
            print(f"| `{mine}` | - | `{other}` | - | - | - |")
            continue
        ratios = [r[mine] / r[other] for r in runs]
        print(f"| `{mine}` | {statistics.median(r[mine] for r in runs):.0f} | `{other}` | "
              f"{statistics.median(r[other] for r in runs):.0f} | "
              f"{', '.join(f'{x:.2f}' for x in ratios)} | {statistics.median(ratios):.2f}x |")
    return 0


def _accelerate_version() -> str:
    import accelerate

    return accelerate.__version__


if __name__ == "__main__":
    sys.exit(main())
