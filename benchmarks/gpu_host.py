"""What the helpers cost a GPU's host, next to accelerate's operations, in one run (issue #74).

``scripts/gpu_check.sh`` runs it on a machine with a GPU and prints its table. For each helper
and accelerate's equivalent, in each configuration one GPU allows (NCCL at 1 rank; CUDA tensors
over ``cpu:gloo,cuda:gloo`` at 2 and 3 ranks sharing the GPU, where the kit's group is an
accelerator group and its accelerator branches run):

* **syncs**: host synchronisations torch's sync debug mode reports in one call
  (``torch.cuda.set_sync_debug_mode``), after a warm-up call;
* **held ms**: how long the call holds the host while about 40 ms of kernels are queued
  ahead of it (``torch.cuda._sleep``): a call that waits for the GPU holds it about 40 ms, one
  that only queues work a fraction of a millisecond (the median of 5);
* **step proxy**: a launch-bound training step (small matmuls, the loss reduced the kit's way
  or accelerate's, never read on the host), the kit's time per step over accelerate's;
* **gather peak**: how much a gather of ``--big-mib`` MiB a rank raises the rank's peak GPU
  memory, over the result's size, the kit's and accelerate's;
* **flight recorder**: torch's recorded collectives at the end, and how many it stamped
  finished (the kit reads them with finished entries kept).

``--dry-run-on-cpu`` runs the same code on 2 CPU ranks of the kit's stand-in
(``AXOLOTL_DIST_STANDIN_DEVICE=1``: gloo groups as accelerator groups): a check of this script
where there is no GPU, not a measurement (no sync counts, no queued kernels). Without CUDA and
without it: ``no CUDA device``, exit 2.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from typing import Any, Callable, Dict, List, Tuple

# this checkout's axolotl_dist, not whichever one is installed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: (label, backend, world size) on a GPU machine.
CONFIGS: List[Tuple[str, str, int]] = [("NCCL, 1 rank", "nccl", 1),
                                       ("cpu:gloo,cuda:gloo, 2 ranks", "cpu:gloo,cuda:gloo", 2),
                                       ("cpu:gloo,cuda:gloo, 3 ranks", "cpu:gloo,cuda:gloo", 3)]
DRY_RUN = [("stand-in, 2 CPU ranks (dry run)", "gloo", 2)]
QUEUED_MS = 40.0
STEPS = 50


def _calls(device: Any, rank: int, ws: int) -> List[Tuple[str, Callable[[], Any], Callable[[], Any]]]:
    """``(helper, the kit's call, accelerate's equivalent)`` on this rank's tensors."""
    import torch
    import torch.distributed as dist
    from accelerate.utils import operations as acc

    import axolotl_dist as ad

    loss = torch.rand((), device=device)
    x = torch.rand(64, 16, device=device)
    rows = torch.rand(rank + 1, 8, device=device)

    def raw_all_reduce() -> Any:
        t = x.clone()
        dist.all_reduce(t)
        return t

    return [
        ("reduce (a loss)", lambda: ad.reduce(loss, "mean"), lambda: acc.reduce(loss, "mean")),
        ("all_reduce", lambda: ad.all_reduce(x.clone()), raw_all_reduce),
        ("broadcast", lambda: ad.broadcast(x.clone(), src=ws - 1),
         lambda: acc.broadcast(x.clone(), from_process=ws - 1)),
        ("gather", lambda: ad.gather(x), lambda: acc.gather(x)),
        ("gather_for_metrics", lambda: ad.gather_for_metrics(x, 64 * ws - 1),
         lambda: acc.gather(x)[:64 * ws - 1]),
        ("pad_across_processes", lambda: ad.pad_across_processes(rows),
         lambda: acc.pad_across_processes(rows)),
        ("compute_and_broadcast (tensor)", lambda: ad.compute_and_broadcast(lambda: x),
         lambda: acc.broadcast_object_list([x])),
        ("gather_from_all_ranks (tensor)", lambda: ad.gather_from_all_ranks(lambda: x),
         lambda: acc.gather_object([x])),
    ]


def _syncs(call: Callable[[], Any], cuda: bool) -> Any:
    """Host synchronisations torch reports in one call (None off CUDA)."""
    import torch

    if not cuda:
        return None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in seen)


def _cycles_per_ms(cuda: bool) -> int:
    """``torch.cuda._sleep`` cycles in a millisecond of this GPU (0 off CUDA)."""
    import torch

    if not cuda:
        return 0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    return int(10_000_000 / max(start.elapsed_time(end), 1e-3))


def _held_ms(call: Callable[[], Any], cycles: int, sync: Callable[[], None]) -> float:
    """Milliseconds ``call`` holds the host with :data:`QUEUED_MS` of kernels queued."""
    import torch

    held = []
    for _ in range(5):
        sync()
        if cycles:
            torch.cuda._sleep(int(cycles * QUEUED_MS))
        t0 = time.perf_counter()
        call()
        held.append((time.perf_counter() - t0) * 1e3)
        sync()
    return statistics.median(held)


def _step_ms(device: Any, reduce: Callable[[Any], Any], sync: Callable[[], None]) -> float:
    """Milliseconds a launch-bound step takes: 8 small matmuls, the loss reduced by
    ``reduce`` and never read on the host."""
    import torch

    w = torch.rand(64, 64, device=device) / 64
    x = torch.rand(64, 64, device=device)
    sync()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        h = x
        for _ in range(8):
            h = torch.tanh(h @ w)
        reduce(h.mean())
    sync()
    return (time.perf_counter() - t0) * 1e3 / STEPS


def _peak_ratio(gather: Callable[[Any], Any], mine: Any, cuda: bool) -> Any:
    """How much one gather raises this rank's peak GPU memory, over its result's size."""
    import torch

    if not cuda:
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = gather(mine)
    torch.cuda.synchronize()
    grown = torch.cuda.max_memory_allocated() - base
    return grown / (out.numel() * out.element_size())


def _rank_body(dry_run: bool, big_mib: int) -> Dict[str, Any]:
    import torch
    import torch.distributed as dist
    from accelerate import PartialState
    from accelerate.utils import operations as acc

    import axolotl_dist as ad

    cuda = not dry_run
    rank, ws = ad.get_rank(), ad.get_world_size()
    if cuda:
        os.environ["LOCAL_RANK"] = "0"  # accelerate's device: ranks share the one GPU
    PartialState(cpu=dry_run)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    cycles = _cycles_per_ms(cuda)
    rows: Dict[str, Any] = {}
    for name, kit, theirs in _calls(device, rank, ws):
        kit(), theirs()  # warm-up: channels, slots, caches
        rows[name] = {"syncs": (_syncs(kit, cuda), _syncs(theirs, cuda)),
                      "held": (_held_ms(kit, cycles, sync), _held_ms(theirs, cycles, sync))}
    steps = (_step_ms(device, lambda t: ad.reduce(t, "mean"), sync),
             _step_ms(device, lambda t: acc.reduce(t, "mean"), sync))
    big = torch.ones(big_mib << 18, device=device)  # float32: big_mib MiB
    peaks = (_peak_ratio(ad.gather, big, cuda), _peak_ratio(acc.gather, big, cuda))
    del big
    from axolotl_dist._runtime.liveness import flight

    recorded = flight.recorded(0)
    dist.barrier()
    return {"rows": rows, "steps": steps, "peaks": peaks,
            "flight": (len(recorded), sum(1 for e in recorded if e["d"] > 0))}


def _worst(per_rank: List[Dict[str, Any]], get: Callable[[Dict[str, Any]], Any]) -> Any:
    values = [get(r) for r in per_rank]
    return None if any(v is None for v in values) else max(values)


def _fmt(value: Any, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else format(value, spec) + unit


def table(results: List[Tuple[str, List[Dict[str, Any]]]]) -> List[str]:
    """The markdown table: one row per configuration and helper, then each configuration's
    step proxy, gather peak and flight-recorder counts (the slowest or worst rank's)."""
    lines = ["| configuration | helper | syncs kit | syncs accelerate | held ms kit | "
             "held ms accelerate |", "|---|---|---:|---:|---:|---:|"]
    for label, ranks in results:
        for name in ranks[0]["rows"]:
            cells = [_fmt(_worst(ranks, lambda r: r["rows"][name]["syncs"][i]), "d")
                     for i in (0, 1)]
            cells += [_fmt(_worst(ranks, lambda r: r["rows"][name]["held"][i]), ".2f")
                      for i in (0, 1)]
            lines.append(f"| {label} | `{name}` | " + " | ".join(cells) + " |")
    lines += ["", "| configuration | step kit ms | step accelerate ms | ratio | gather peak kit "
              "| gather peak accelerate | flight entries (finished) |",
              "|---|---:|---:|---:|---:|---:|---|"]
    for label, ranks in results:
        kit, theirs = (_worst(ranks, lambda r: r["steps"][i]) for i in (0, 1))
        peaks = [_fmt(_worst(ranks, lambda r: r["peaks"][i]), ".2f", "x") for i in (0, 1)]
        entries, done = ranks[0]["flight"]
        lines.append(f"| {label} | {kit:.3f} | {theirs:.3f} | {kit / theirs:.2f}x | {peaks[0]} "
                     f"| {peaks[1]} | {entries} ({done}) |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run-on-cpu", action="store_true",
                        help="the same code on the CPU stand-in: a check, not a measurement")
    parser.add_argument("--big-mib", type=int, default=256, help="the big gather's MiB a rank")
    args = parser.parse_args()
    import torch

    from axolotl_dist.testing import run_distributed

    if torch.cuda.device_count() == 0 and not args.dry_run_on_cpu:
        print("no CUDA device")
        return 2
    env = {"AXOLOTL_DIST_STANDIN_DEVICE": "1"} if args.dry_run_on_cpu else {}
    results = []
    for label, backend, ws in (DRY_RUN if args.dry_run_on_cpu else CONFIGS):
        results.append((label, run_distributed(_rank_body, ws, args=(args.dry_run_on_cpu,
                                               args.big_mib), backend=backend, env=env,
                                               timeout=300)))
    print("\n".join(table(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
