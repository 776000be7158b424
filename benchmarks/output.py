"""What folding the ranks' output costs the launcher (``axolotl-dist``; docs/launching.md,
"Output from N ranks").

Run on this machine (starts the launchers itself)::

    python benchmarks/output.py                 # 8 ranks, 10,000 lines/s each, 5 s
    python benchmarks/output.py --ranks 4 --rate 2000 --seconds 3

Two figures:

* **per line** (in process): microseconds the folder (:class:`axolotl_dist.launch._fold.Folder`)
  spends on one line of one rank, fed the way the launcher feeds it (a read of many lines,
  then a tick), when every rank prints the same lines (all folded) and when each prints its
  own (none folded);
* **the launcher's CPU** (end to end): ``axolotl-dist -n RANKS`` runs a script whose every rank
  prints RATE lines per second for SECONDS, paced in batches of 1 ms worth, alike on every
  rank or each its own; the launcher's own CPU time (its process, every thread; the ranks are
  children and not counted) with folding on, minus the same run with ``--no-fold`` (the ranks
  then write to the launcher's stdout directly, as under torchrun), over the run's lines and
  over its seconds. The ranks' achieved rate says whether the launcher kept up (a launcher that
  reads slower than they write slows them down); every line a rank printed must be on the
  launcher's stdout (each once where each rank prints its own lines), or the run fails.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

# this checkout's axolotl_dist, not whichever one is installed
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

RANK_SCRIPT = """
import os, sys, time
rank, rate, seconds, alike = (int(os.environ["RANK"]), int(sys.argv[1]), float(sys.argv[2]),
                              sys.argv[3] == "alike")
batch = max(1, rate // 1000)
start = time.perf_counter()
sent = i = 0
while True:
    now = time.perf_counter() - start
    if now >= seconds:
        break
    due = int(now * rate)
    while sent < due:
        for _ in range(batch):
            if alike:
                print(f"step {i}: loss 0.1234 lr 3e-4 tokens/s 12345.6")
            else:
                print(f"rank {rank} step {i}: loss 0.1234 lr 3e-4 tokens/s 12345.6")
            i += 1
        sent += batch
    time.sleep(0.001)
elapsed = time.perf_counter() - start
print(f"RATE {rank} {i} {i / elapsed:.0f}", file=sys.stderr)
"""

LAUNCHER = """
import resource, sys
from axolotl_dist.launch import main
code = main(sys.argv[1:])
ru = resource.getrusage(resource.RUSAGE_SELF)
print(f"CPU {ru.ru_utime + ru.ru_stime:.3f}", file=sys.stderr)
sys.exit(code)
"""


def per_line(ranks: int, lines: int, alike: bool) -> float:
    """Microseconds per line of one rank through the folder, reads of 100 lines."""
    from axolotl_dist.launch._fold import Folder

    folder = Folder(ranks, {1: False, 2: False})
    chunks = []
    for r in range(ranks):
        text = "".join((f"step {i}: loss 0.1234\n" if alike else f"rank {r} step {i}: loss\n")
                       for i in range(lines))
        data = text.encode()
        chunks.append([data[j:j + 2400] for j in range(0, len(data), 2400)])
    now = 0.0
    start = time.perf_counter()
    for step in range(len(chunks[0])):
        for r in range(ranks):
            if step < len(chunks[r]):
                folder.feed(r, 1, chunks[r][step], now)
        now += 0.01
        folder.tick(now)
        folder.take()
    folder.flush()
    folder.take()
    return (time.perf_counter() - start) / (ranks * lines) * 1e6


def end_to_end(ranks: int, rate: int, seconds: float, alike: bool, fold: bool) -> Dict[str, float]:
    """One launcher run: its CPU seconds and the ranks' achieved rates."""
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "talk.py")
        with open(script, "w") as fh:
            fh.write(RANK_SCRIPT)
        cmd = [sys.executable, "-c", LAUNCHER, "-n", str(ranks)] + ([] if fold else ["--no-fold"])
        cmd += [script, str(rate), str(seconds), "alike" if alike else "own"]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, timeout=seconds * 10 + 120)
    err = proc.stderr.splitlines()
    cpu = [float(line.split()[1]) for line in err if line.startswith("CPU ")]
    rates = [line.split()[-3:] for line in err if "RATE " in line]
    if proc.returncode != 0 or not cpu or len(rates) != ranks:
        raise SystemExit(f"launcher failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    printed = len(proc.stdout.splitlines())
    counts = [int(count) for _, count, _ in rates]
    if printed < (max(counts) if alike else sum(counts)):  # every line at least once
        raise SystemExit(f"lines lost: {printed} printed, the ranks printed {counts}")
    return {"cpu": cpu[0], "rate": min(float(rate) for _, _, rate in rates), "lines": printed}


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--rate", type=int, default=10000, help="lines per second per rank")
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args(argv)
    print(f"in process, {args.ranks} ranks, 2,000 lines each:")
    for alike in (True, False):
        best = min(per_line(args.ranks, 2000, alike) for _ in range(3))
        print(f"  {'alike (folded)' if alike else 'each its own'}: {best:.2f} us per line")
    print(f"end to end, axolotl-dist -n {args.ranks}, {args.rate} lines/s per rank, "
          f"{args.seconds:g} s:")
    for alike in (True, False):
        base = end_to_end(args.ranks, args.rate, args.seconds, alike, fold=False)
        folded = end_to_end(args.ranks, args.rate, args.seconds, alike, fold=True)
        lines = args.ranks * args.rate * args.seconds
        extra = folded["cpu"] - base["cpu"]
        print(f"  {'alike' if alike else 'each its own'}: launcher CPU {folded['cpu']:.2f} s "
              f"(--no-fold {base['cpu']:.2f} s): +{extra:.2f} s = {extra / lines * 1e6:.2f} us "
              f"per line, {extra / args.seconds * 100:.0f}% of one core; slowest rank "
              f"{folded['rate']:.0f} lines/s (--no-fold {base['rate']:.0f}); "
              f"{folded['lines']} lines printed (--no-fold {base['lines']})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
