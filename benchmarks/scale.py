"""Many real ranks on this machine: the kit under ``axolotl-dist`` (and under torchrun) next to
plain torch under torchrun doing the same work, phase by phase; then what each rank costs the
store, and what that comes to at 1,024 and 8,192 ranks.

Run it from the repository root (it runs this checkout's ``axolotl_dist``)::

    python benchmarks/scale.py                        # W = 8, 16, 32, 64
    python benchmarks/scale.py --worlds 32 --repeats 2
    python benchmarks/scale.py --worlds 8,16 --no-requests

The script every rank runs (written to a temporary file), one configuration after the other,
``--repeats`` times each:

* the kit: ``init_distributed()``; two ``zero_first`` blocks whose body sleeps 2 s on rank 0;
  ``compute_and_broadcast``, ``reduce_and_broadcast``, ``gather_from_all_ranks`` of Python
  numbers; one ``barrier()``, then 20 more; the script ends.
* plain torch: ``init_process_group("gloo")``; twice: rank 0 sleeps 2 s, then
  ``dist.barrier()`` on every rank; ``broadcast_object_list``, ``all_reduce``,
  ``gather_object``; one ``dist.barrier()``, then 20 more; ``destroy_process_group()``.

Configurations: ``plain/torchrun`` (``python -m torch.distributed.run --standalone``),
``kit/torchrun`` and ``kit/axolotl-dist`` (``python -m axolotl_dist.launch``). Per run
(medians over the ranks unless said): **start** (the launcher's start to the script's first
line), **ready** (to ``import torch`` done: what a script can do first), **import** (the
kit's ``import axolotl_dist``; 0 for plain torch), **init**, **block 1**
and **block 2** (the slowest rank: rank 0 sleeps 2.0 s in each), **helpers**, **sync** (the
first barrier after them: it absorbs the spread with which the ranks left the helpers),
**barriers** (the 20 after it),
**hooks** (the last rank's last line to the last rank's exit handlers done: the kit's exit
work), **exit** (the last rank's last line to the launcher's exit), **whole** (the launcher's
start to its exit) and the number of "has not answered" warnings (a stalled store).

Then, unless ``--no-requests``, the store's side for the same world sizes, measured with
``benchmarks/store_traffic.py``'s decoding proxy (its phases: init, a ``zero_first`` wait and a
barrier wait of ``--seconds`` each, whole waits block release included, spread exits), its fit
in W, and its projection to 1,024 and 8,192 ranks against the store's measured capacity.

Every rank is a process of this machine: at 32 ranks and more the CPUs, not the store, bound
most phases, for the kit and plain torch alike; the ratios are the point, not the seconds.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: What every rank runs; argv[1] is "kit" or "plain". Marks are wall-clock (time.time()), one
#: clock for every process of the machine; the launcher's start comes in SCALE_T0.
RANK_SCRIPT = r'''
import atexit, os, sys, time
first = time.time()
t0 = float(os.environ["SCALE_T0"])
# registered first, so it runs last: when the exit handlers (the kit's among them) are done
atexit.register(lambda: sys.stdout.write(f"SCALE_HOOKS rank={rank} hooks={time.time() - t0:.3f}\n") or sys.stdout.flush())
mode = sys.argv[1]
import torch
import torch.distributed as dist
ready = time.time()
imported = ready
if mode == "kit":
    import axolotl_dist as ad
    imported = time.time()
    ad.init_distributed()
    rank, ws = ad.get_rank(), ad.get_world_size()
    t_init = time.time()
    with ad.zero_first():
        if rank == 0:
            time.sleep(2)
    t_b1 = time.time()
    with ad.zero_first():
        if rank == 0:
            time.sleep(2)
    t_b2 = time.time()
    ad.compute_and_broadcast(lambda: 42)
    ad.reduce_and_broadcast(lambda: rank, sum)
    ad.gather_from_all_ranks(lambda: rank)
    t_h = time.time()
    ad.barrier()  # the ranks leave the helpers apart: this one takes up the spread
    t_s = time.time()
    for _ in range(20):
        ad.barrier()
else:
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    t_init = time.time()
    for i in range(2):
        if rank == 0:
            time.sleep(2)
        dist.barrier()
        if i == 0:
            t_b1 = time.time()
    t_b2 = time.time()
    obj = [42 if rank == 0 else None]
    dist.broadcast_object_list(obj, src=0)
    t = torch.tensor([rank])
    dist.all_reduce(t)
    dist.gather_object(rank, [None] * ws if rank == 0 else None, dst=0)
    t_h = time.time()
    dist.barrier()  # the ranks leave the helpers apart: this one takes up the spread
    t_s = time.time()
    for _ in range(20):
        dist.barrier()
t_end = time.time()
print(f"SCALE rank={rank} start={first - t0:.3f} ready={ready - t0:.3f} "
      f"import={imported - ready:.3f} init={t_init - imported:.3f} "
      f"block1={t_b1 - t_init:.3f} block2={t_b2 - t_b1:.3f} helpers={t_h - t_b2:.4f} "
      f"sync={t_s - t_h:.4f} barriers={t_end - t_s:.4f} done={t_end - t0:.3f}", flush=True)
if mode != "kit":
    dist.destroy_process_group()
'''

CONFIGS = ("plain/torchrun", "kit/torchrun", "kit/axolotl-dist")
COLUMNS = ("whole", "start", "ready", "import", "init", "block1", "block2", "helpers", "sync",
           "barriers", "hooks", "exit")


def launch_command(config: str, world: int, script: str) -> List[str]:
    """The command line of one run of ``config`` ("<plain|kit>/<launcher>")."""
    mode, launcher = config.split("/")
    if launcher == "torchrun":
        head = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(world)]
    else:
        head = [sys.executable, "-m", "axolotl_dist.launch", "-n", str(world)]
    return head + [script, mode]


def run_once(config: str, world: int, script: str, timeout: float) -> Dict[str, float]:
    """Run ``config`` with ``world`` ranks; the figures of :data:`COLUMNS` and ``warnings``."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    t0 = time.time()
    env["SCALE_T0"] = repr(t0)
    proc = subprocess.run(launch_command(config, world, script), env=env, cwd=ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    whole = time.time() - t0
    # each record whole, wherever it is: the ranks' lines may interleave in the output
    rows = [dict((k, float(v)) for k, v in re.findall(r"(\w+)=([-\d.]+)", record))
            for record in re.findall(r"SCALE rank=\d+(?: \w+=[-\d.]+)*? done=[-\d.]+\d",
                                     proc.stdout)]
    hooks = [float(v) for v in re.findall(r"SCALE_HOOKS rank=\d+ hooks=([-\d.]+)", proc.stdout)]
    if proc.returncode != 0 or len(rows) != world:
        raise RuntimeError(f"{config} with {world} ranks: exit code {proc.returncode}, "
                           f"{len(rows)} of {world} ranks reported; its output ends:\n"
                           + "\n".join(proc.stdout.splitlines()[-20:]))

    def col(key: str) -> List[float]:
        return [r[key] for r in rows]

    return {
        "whole": whole, "start": statistics.median(col("start")),
        "ready": statistics.median(col("ready")), "import": statistics.median(col("import")),
        "init": statistics.median(col("init")),
        "block1": max(col("block1")), "block2": max(col("block2")),
        "helpers": statistics.median(col("helpers")), "sync": statistics.median(col("sync")),
        "barriers": statistics.median(col("barriers")),
        "exit": whole - max(col("done")),
        "hooks": (max(hooks) - max(col("done"))) if len(hooks) == world else float("nan"),
        "warnings": float(proc.stdout.count("has not answered")),
    }


def print_table(world: int, results: Dict[str, List[Dict[str, float]]]) -> None:
    """One world's table: each configuration's runs, then the kit's ratios to plain torch."""
    print(f"\nW = {world}  (seconds; start/ready/init/helpers/barriers: median rank; blocks: "
          "slowest rank; exit: last rank's end to the launcher's)")
    print(f"{'configuration':18} " + " ".join(f"{c:>8}" for c in COLUMNS) + "  warnings")
    for config, runs in results.items():
        for run in runs:
            print(f"{config:18} " + " ".join(f"{run[c]:8.2f}" if c not in ("helpers", "sync", "barriers")
                                             else f"{run[c]:8.3f}" for c in COLUMNS)
                  + f"  {int(run['warnings'])}")
    plain = results.get("plain/torchrun")
    if not plain:
        return
    base = {c: statistics.median(r[c] for r in plain) for c in COLUMNS}
    for config, runs in results.items():
        if config == "plain/torchrun":
            continue
        med = {c: statistics.median(r[c] for r in runs) for c in COLUMNS}
        ratios = {c: (med[c] / base[c] if base[c] > 0 else float("nan")) for c in COLUMNS}
        print(f"{config + ' / plain':30} whole {ratios['whole']:.2f}x, init {ratios['init']:.2f}x, "
              f"barriers {ratios['barriers']:.2f}x (sync {ratios['sync']:.2f}x), "
              f"first block {med['block1']:.2f} s (plain {base['block1']:.2f} s)")


def store_requests(worlds: Sequence[int], seconds: float) -> None:
    """The store's side (see the module docstring): store_traffic's rows for these worlds."""
    sys.path.insert(0, HERE)
    import store_traffic as st  # noqa: E402 - a sibling benchmark, imported when used

    results: Dict[str, Dict[int, "st.RunResult"]] = {"kit": {}, "torch": {}}
    for world in worlds:
        for mode in ("kit", "torch"):
            results[mode][world] = st.run_world(mode, world, seconds, False, False, 0)
        st.print_world_table(world, {m: results[m][world] for m in ("kit", "torch")})
    fits = st.print_fits(results)
    capacity, _ = st.measure_capacity(8, 3.0, False)
    st.print_projection(fits, capacity, 0)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Many real ranks: the kit under axolotl-dist and torchrun against plain "
                    "torch under torchrun, per phase; the store's requests per rank and their "
                    "projection to 1,024 and 8,192 ranks.",
        epilog="Run from the repository root: python benchmarks/scale.py")
    parser.add_argument("--worlds", default="8,16,32,64",
                        help="comma-separated world sizes (default 8,16,32,64)")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each configuration")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--no-requests", action="store_true",
                        help="skip the store's side (store_traffic's proxy)")
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="the store's side: each wait lasts this long")
    parser.add_argument("--load", type=int, default=0,
                        help="CPU-bound processes (a Python busy loop each) running beside every "
                             "run: a loaded machine (default 0)")
    args = parser.parse_args(argv)
    args.worlds = sorted({int(w) for w in args.worlds.split(",") if w.strip()})
    args.configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown or not args.worlds or min(args.worlds) < 2:
        parser.error(f"--configs takes {', '.join(CONFIGS)} (got {unknown}); --worlds >= 2")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    import torch
    print(f"scale: torch {torch.__version__}, {os.cpu_count()} CPUs, W in {args.worlds}, "
          f"{args.repeats} run(s) per configuration, one after the other"
          + (f", {args.load} CPU-bound process(es) beside" if args.load else ""))
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.load)]
    try:
        return _run_all(args)
    finally:
        for proc in load:
            proc.kill()
            proc.wait()


def _run_all(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="axd-scale-") as tmp:
        script = os.path.join(tmp, "rank.py")
        with open(script, "w") as fh:
            fh.write(RANK_SCRIPT)
        for world in args.worlds:
            results: Dict[str, List[Dict[str, float]]] = {c: [] for c in args.configs}
            for _ in range(args.repeats):
                for config in args.configs:
                    results[config].append(run_once(config, world, script, args.timeout))
            print_table(world, results)
    if not args.no_requests:
        store_requests(args.worlds, args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
