"""How far a warm call travels through the kit: Python frames and files on each rank.

Run on 2 CPU ranks (forks them itself)::

    python benchmarks/frames.py

For each call below, after a warm-up call of the same kind, a profile hook counts the Python
frames whose code lives in the package (``axolotl_dist/``), the distinct files they are in,
how often the call changes file, and how often it returns to a file it had left. torch's own
frames are not counted: they are what any helper pays.

Targets (issues "one way through the house" and #80): ``compute_and_broadcast`` at most 8 frames
in at most 4 files on each rank; ``with zero_first():`` at most 20 frames in at most 8 files on
every rank.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Dict, List, Tuple

# this checkout's axolotl_dist, not whichever one is installed
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PACKAGE = os.path.join(ROOT, "axolotl_dist") + os.sep
TARGETS = {"compute_and_broadcast": (8, 4), "zero_first (first rank)": (20, 8),
           "zero_first (waiting rank)": (20, 8)}


def _trace(call: Callable[[], Any]) -> Dict[str, Any]:
    """Frames of the kit entered while ``call()`` runs on this thread."""
    frames: List[Tuple[str, str, int]] = []

    def hook(frame: Any, event: str, _arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            code = frame.f_code
            frames.append((os.path.relpath(code.co_filename, ROOT), code.co_name,
                           code.co_firstlineno))

    sys.setprofile(hook)
    try:
        call()
    finally:
        sys.setprofile(None)
    files = [f for f, _, _ in frames]
    changes = sum(1 for a, b in zip(files, files[1:]) if a != b)
    returns, left = 0, set()
    for a, b in zip(files, files[1:]):
        if a != b:
            left.add(a)
            if b in left:
                returns += 1
    return {"frames": len(frames), "files": len(set(files)), "changes": changes,
            "returns": returns, "path": [f"{f}:{name}" for f, name, _ in frames]}


def _rank_body() -> Dict[str, Dict[str, Any]]:
    import axolotl_dist as ad

    ad.init_distributed()
    rank = ad.get_rank()

    def zero_first() -> None:
        with ad.zero_first():
            pass

    calls: Dict[str, Callable[[], Any]] = {
        "compute_and_broadcast": lambda: ad.compute_and_broadcast(lambda: 42),
        "reduce_and_broadcast": lambda: ad.reduce_and_broadcast(lambda: rank, sum),
        "gather_from_all_ranks": lambda: ad.gather_from_all_ranks(lambda: rank),
        "barrier": ad.barrier,
        "zero_first (first rank)" if rank == 0 else "zero_first (waiting rank)": zero_first,
    }
    out = {}
    for name, call in calls.items():
        for _ in range(3):  # warm: caches filled, buffers allocated
            call()
        ad.barrier()
        out[name] = _trace(call)
        ad.barrier()
    return out


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--path", action="store_true", help="print each call's frames")
    args = parser.parse_args(argv)
    from axolotl_dist.testing import run_distributed

    results = run_distributed(_rank_body, args.world_size, timeout=120)
    names = list(dict.fromkeys(n for per_rank in results for n in per_rank))
    print(f"{'call':28} {'rank':>4} {'frames':>6} {'files':>5} {'file changes':>12} "
          f"{'returns':>7}  target")
    missed = 0
    for name in names:
        for rank, per_rank in enumerate(results):
            if name not in per_rank:
                continue
            r = per_rank[name]
            frames_max, files_max = TARGETS.get(name, (None, None))
            ok = ((frames_max is None or r["frames"] <= frames_max)
                  and (files_max is None or r["files"] <= files_max))
            target = "" if frames_max is None else (
                f"<= {frames_max} frames" + (f", <= {files_max} files" if files_max else "")
                + (": ok" if ok else ": MISSED"))
            missed += not ok
            print(f"{name:28} {rank:>4} {r['frames']:>6} {r['files']:>5} {r['changes']:>12} "
                  f"{r['returns']:>7}  {target}")
            if args.path:
                print("      " + " -> ".join(r["path"]))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
