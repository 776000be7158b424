"""What torch's flight recorder costs: the same gloo work with it on (torch's default, 2,000
entries) and off (``TORCH_FR_BUFFER_SIZE=0``), in the same run.

    python benchmarks/flight_recorder.py               # 2 ranks, 15 rounds
    python benchmarks/flight_recorder.py --ranks 3 --rounds 5

The where report's verdict on torch's collectives (docs/faults.md, "When a run is stuck")
reads the recorder; the kit leaves it as torch sets it, so its cost is torch's default's.
Each round starts fresh processes for each setting, in a random order (the recorder reads
its size once per process), and every rank times:

* **all_reduce**: 2,000 ``dist.all_reduce`` of one float32 (the recorder's worst case: the
  smallest collective, so its bookkeeping weighs most);
* **DDP step**: 50 forward/backward steps of a 4-layer MLP (512 wide) under
  ``DistributedDataParallel``, whose bucket all-reduces the recorder sees.

It prints each setting's median per call and per step over the rounds (the slowest rank's
time in each round), and the ratio on/off (the kit's rule: on by default only at <= 1.02).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

SMALL_CALLS = 2000
DDP_STEPS = 50


def _worker(rank: int, ws: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=ws)
    one = torch.ones(1)
    for _ in range(200):
        dist.all_reduce(one)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(SMALL_CALLS):
        dist.all_reduce(one)
    small = (time.perf_counter() - start) / SMALL_CALLS
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        *[torch.nn.Linear(512, 512) for _ in range(4)]))
    batch = torch.randn(16, 512)
    for _ in range(5):
        model(batch).sum().backward()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(DDP_STEPS):
        model(batch).sum().backward()
    step = (time.perf_counter() - start) / DDP_STEPS
    entries = len(json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, True))
                  .get("entries", []))
    dist.destroy_process_group()
    with open(out, "w") as f:
        json.dump({"small": small, "step": step, "entries": entries}, f)
    # torch 2.13 with TORCH_FR_BUFFER_SIZE=0 can abort at interpreter exit ("terminate called
    # without an active exception"); the figures are written, so leave without that exit
    os._exit(0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _round(setting: str, ws: int) -> Dict[str, float]:
    """One set of fresh ranks with the recorder ``on`` or ``off``: the slowest rank's times."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TORCH_FR_BUFFER_SIZE", None)
    if setting != "on":
        env["TORCH_FR_BUFFER_SIZE"] = "0"
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"{r}.json") for r in range(ws)]
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(ws),
                                   str(port), outs[r]], env=env) for r in range(ws)]
        for proc in procs:
            if proc.wait(timeout=600) != 0:
                raise SystemExit(f"a rank failed ({setting})")
        got = [json.load(open(o)) for o in outs]
    return {"small": max(g["small"] for g in got), "step": max(g["step"] for g in got),
            "entries": got[0]["entries"]}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    import torch
    seen: Dict[str, List[Dict[str, float]]] = {"on": [], "off": []}
    for _ in range(args.rounds):
        for setting in random.sample(["on", "off"], 2):
            seen[setting].append(_round(setting, args.ranks))
    med = {s: {k: statistics.median(r[k] for r in seen[s]) for k in ("small", "step")}
           for s in seen}
    print(f"## torch's flight recorder on and off: torch {torch.__version__}, gloo, "
          f"{args.ranks} ranks, {args.rounds} rounds")
    print(f"entries recorded by rank 0: on {seen['on'][0]['entries']}, "
          f"off {seen['off'][0]['entries']}")
    print("| work | on (torch's default) | off (TORCH_FR_BUFFER_SIZE=0) | ratio |")
    print("|---|---:|---:|---:|")
    for key, label, unit, scale in (("small", "all_reduce of 1 float32", "us", 1e6),
                                    ("step", "DDP step (4x512 MLP)", "ms", 1e3)):
        on, off = med["on"][key], med["off"][key]
        print(f"| {label} | {on * scale:.1f} {unit} | {off * scale:.1f} {unit} | "
              f"{on / off:.3f}x |")


if __name__ == "__main__":
    main()
