"""How fast every surviving rank learns of a fault: the fault matrix of ``tests/test_faults.py``,
timed, as the table in docs/faults.md, "The fault matrix".

Run: ``python benchmarks/faults.py`` (3 gloo ranks on this machine, group timeout 300 s). For
each helper, fault (the rank raises / is SIGKILLed before the call / skips it and exits 0),
faulty rank (0 or 1) and store placement (the test process, like torchrun's agent, or rank 0's
own process, like bare env vars), it records the slowest survivor's time from its call to its
``RankFailedError`` (in the helper or at the next barrier) and prints, per helper and fault,
the worst over both faulty ranks and placements, with the error type survivors saw.
"""

import os
import sys
from collections import defaultdict

# this checkout's axolotl_dist, not whichever one is installed, and the tests' fault scenario
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from axolotl_dist.testing import STORE_PLACEMENTS, run_distributed_outcomes  # noqa: E402
from fault_matrix import FAULTS, HELPERS, fault_body  # noqa: E402


def main() -> None:
    worst = defaultdict(float)
    seen = defaultdict(set)
    for helper in HELPERS:
        for fault in FAULTS:
            for faulty in (0, 1):
                for store in STORE_PLACEMENTS:
                    outcomes = run_distributed_outcomes(fault_body, 3,
                                                        args=(helper, fault, faulty),
                                                        store=store, timeout=60, pg_timeout=300)
                    for o in outcomes:
                        if o.rank == faulty:
                            continue
                        if not (o.ok and o.value and o.value.get("rank") == faulty):
                            raise SystemExit(f"{helper}/{fault}/rank {faulty}/{store}: "
                                             f"{o.describe()} {o.value}")
                        worst[helper, fault] = max(worst[helper, fault], o.value["elapsed"])
                        seen[helper, fault].add(o.value["exc_type"])
    print(f"{'helper':30s} " + " ".join(f"{f:>22s}" for f in FAULTS))
    for helper in HELPERS:
        cells = [f"{worst[helper, f]:7.2f} s {'/'.join(sorted(seen[helper, f])):>12s}"
                 for f in FAULTS]
        print(f"{helper:30s} " + " ".join(cells))


if __name__ == "__main__":
    main()
