"""A restarted run, the kit next to plain torch: ``torchrun --max-restarts 1``, attempt 0 fails,
does attempt 1 finish?

Run it from the repository root (it runs this checkout's ``axolotl_dist``)::

    python benchmarks/restarts.py                 # 5 runs of each form
    python benchmarks/restarts.py --runs 20 --timeout 90
    python benchmarks/restarts.py --forms sigkill,helper

Three ways attempt 0 fails (2 ranks, or 3 for the last), each written twice: with the kit
(``init_distributed()``, ``zero_first``, ``compute_and_broadcast``, ``barrier``) and with plain
torch doing the same (``init_process_group("gloo")``, a barrier around rank 0's work,
``broadcast_object_list``, ``barrier``):

* ``raise``: rank 0 raises while the others wait for it (the kit: in ``zero_first``);
* ``sigkill``: rank 1 is SIGKILLed between two barriers;
* ``helper``: on 3 ranks, the function rank 0 computes for the others raises.

Attempt 1 (``TORCHELASTIC_RESTART_COUNT=1``) runs the same calls without failing and writes a
file per rank. A run counts as **finished** when torchrun exits 0 and every rank's file is
there; **failed** when torchrun exits otherwise (the reason: the first line of attempt 1's
error); **hung** when it runs past ``--timeout`` (then it is killed). The time is torchrun's
start to its exit.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from probes import kill_tree  # noqa: E402 - this checkout's kit, the tests' plumbing

_KIT = """\
import os, signal
import axolotl_dist as ad
ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
ad.init_distributed()
rank = ad.get_rank()
{fail}
ad.barrier()
open(f"done{{rank}}", "w").close()
"""
_KIT_FAIL = {
    "raise": """\
with ad.zero_first():
    if rank == 0 and ATTEMPT == 0:
        raise RuntimeError("flaky data server")
""",
    "sigkill": """\
ad.barrier()
if rank == 1 and ATTEMPT == 0:
    os.kill(os.getpid(), signal.SIGKILL)
ad.barrier()
""",
    "helper": """\
def shard():
    if ATTEMPT == 0:
        raise ValueError("bad shard")
    return 1
ad.compute_and_broadcast(shard)
""",
}
_PLAIN = """\
import os, signal
import torch.distributed as dist
ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
rank = dist.get_rank()
{fail}
dist.barrier()
open(f"done{{rank}}", "w").close()
dist.destroy_process_group()
"""
_PLAIN_FAIL = {
    "raise": """\
if rank == 0 and ATTEMPT == 0:
    raise RuntimeError("flaky data server")
dist.barrier()
""",
    "sigkill": _KIT_FAIL["sigkill"].replace("ad.", "dist."),
    "helper": """\
box = [None]
if rank == 0:
    if ATTEMPT == 0:
        raise ValueError("bad shard")
    box = [1]
dist.broadcast_object_list(box, src=0)
""",
}
_RANKS = {"raise": 2, "sigkill": 2, "helper": 3}


def _one(kind: str, form: str, timeout: float) -> Tuple[str, float, str]:
    """One run: (outcome, seconds, reason)."""
    directory = Path(tempfile.mkdtemp(prefix="axd_restart_"))
    try:
        template, fails = (_KIT, _KIT_FAIL) if kind == "kit" else (_PLAIN, _PLAIN_FAIL)
        (directory / "job.py").write_text(template.format(fail=fails[form]))
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("TORCHELASTIC_", "PET_", "SLURM_", "OMPI_"))}
        env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        ranks = _RANKS[form]
        start = time.monotonic()
        with open(directory / "out.txt", "w") as log:  # a file: orphaned ranks hold no pipe
            proc = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts",
                 "1", "--nproc-per-node", str(ranks), "job.py"], cwd=directory, env=env,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)  # torchrun and its ranks (each in a session of its own)
                proc.wait()
                return "hung", time.monotonic() - start, f"killed after {timeout:.0f} s"
        out = (directory / "out.txt").read_text(errors="replace")
        seconds = time.monotonic() - start
        done = all((directory / f"done{r}").exists() for r in range(ranks))
        if proc.returncode == 0 and done:
            return "finished", seconds, ""
        return "failed", seconds, _reason(out)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _reason(out: str) -> str:
    """The first error line of the last attempt, shortened."""
    tail = out.split("Sending process", 1)[-1]
    m = re.search(r"Gloo connectFullMesh failed.*?(SO_ERROR: [\w ]+)", tail)
    if m:
        return f"Gloo connectFullMesh failed ... {m.group(1).strip()}"
    m = re.search(r"(\w+Error: [^\n]{0,90})", tail)
    return m.group(1) if m else "exit code != 0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=90.0)
    parser.add_argument("--forms", default=",".join(_KIT_FAIL),
                        help="comma-separated: " + ", ".join(_KIT_FAIL))
    args = parser.parse_args()
    print(f"{'form':<9}{'with':<7}{'finished':>9}{'failed':>8}{'hung':>6}{'median s':>10}  "
          "attempt 1's error (plain)")
    for form in args.forms.split(","):
        for kind in ("kit", "plain"):
            counts: Dict[str, int] = {"finished": 0, "failed": 0, "hung": 0}
            times: List[float] = []
            reasons: Dict[str, int] = {}
            for _ in range(args.runs):
                outcome, seconds, reason = _one(kind, form, args.timeout)
                counts[outcome] += 1
                times.append(seconds)
                if reason:
                    reasons[reason] = reasons.get(reason, 0) + 1
            times.sort()
            said = "; ".join(f"{n}x {r}" for r, n in reasons.items())
            print(f"{form:<9}{kind:<7}{counts['finished']:>9}{counts['failed']:>8}"
                  f"{counts['hung']:>6}{times[len(times) // 2]:>10.1f}  {said}", flush=True)


if __name__ == "__main__":
    main()
