"""Peak memory of a big gather: how much a rank's peak resident memory grows while it gathers
a tensor of ``--mib`` MiB per rank (default 256) from every rank, as a multiple of the result's
size (the issue's bound: 1.2x). ``ad.gather`` beside accelerate's ``gather`` (on
``PartialState(cpu=True)``) and ``dist.all_gather_into_tensor`` into a result made for it, in
the same run, each in a fresh pair of ranks (``run_distributed``), on CPU (gloo).

The peak is the kernel's (``VmHWM`` in ``/proc/self/status``), reset before each call
(``/proc/self/clear_refs``: 5), so what the call allocated and freed counts too. The input is
made and touched before the reset; the result is what the call returns.

    python benchmarks/gather_memory.py            # 2 ranks, 256 MiB each
    python benchmarks/gather_memory.py --ranks 3 --mib 64
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_MIB = 1 << 20


def _hwm() -> int:
    """This process's peak resident memory (bytes) since the last reset."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def _measure(kind: str, mib: int) -> float:
    """On every rank: the growth of the peak during one gather, in bytes, divided by the
    result's size."""
    import torch
    import torch.distributed as dist

    import axolotl_dist as ad

    ws = ad.get_world_size()
    x = torch.full((mib * _MIB // 4,), float(ad.get_rank()), dtype=torch.float32)
    calls: Dict[str, Callable[[], torch.Tensor]] = {
        "ad.gather": lambda: ad.gather(x),
        "dist.all_gather_into_tensor": lambda: _raw(x, ws),
    }
    if kind == "accelerate gather":
        from accelerate import PartialState
        from accelerate.utils import gather

        PartialState(cpu=True)
        calls[kind] = lambda: gather(x)
    dist.barrier()
    _reset_peak()
    base = _hwm()
    out = calls[kind]()
    grown = _hwm() - base
    assert out.numel() == ws * x.numel()
    return grown / (out.numel() * out.element_size())


def _raw(x, ws):
    import torch
    import torch.distributed as dist

    out = torch.empty(ws * x.numel(), dtype=x.dtype)
    dist.all_gather_into_tensor(out, x)
    return out


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--mib", type=int, default=256)
    args = parser.parse_args(argv)
    from axolotl_dist.testing import run_distributed

    kinds = ["dist.all_gather_into_tensor", "ad.gather"]
    try:
        import accelerate  # noqa: F401
        kinds.append("accelerate gather")
    except ImportError:
        pass
    print(f"| gather of {args.mib} MiB per rank, {args.ranks} ranks | peak growth / result "
          "size (slower rank) | target |")
    print("|---|---:|---|")
    for kind in kinds:
        ratios = run_distributed(_measure, args.ranks, args=(kind, args.mib), timeout=600)
        target = "<= 1.2x" if kind == "ad.gather" else "-"
        print(f"| `{kind}` | {max(ratios):.2f}x | {target} |")


if __name__ == "__main__":
    main()
