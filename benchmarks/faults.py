"""How fast every surviving rank learns of a fault: the fault matrix of ``tests/test_faults.py``,
timed, as the table in the README's "When a rank fails".

Run: ``python benchmarks/faults.py`` (3 gloo ranks on this machine, group timeout 300 s). For
each helper, fault (the rank raises / is SIGKILLed before the call / skips it and exits 0),
faulty rank (0 or 1) and store placement (the test process, like torchrun's agent, or rank 0's
own process, like bare env vars), it records the slowest survivor's time from its call to its
``RankFailedError`` (in the helper or at the next barrier) and prints, per helper and fault,
the worst over both faulty ranks and placements, with the error type survivors saw.
"""

import os
import signal
import sys
import time
from collections import defaultdict

# this checkout's axolotl_dist, not whichever one is installed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import axolotl_dist as ad  # noqa: E402
from axolotl_dist.testing import STORE_PLACEMENTS, run_distributed_outcomes  # noqa: E402

HELPERS = ("compute_and_broadcast", "gather_from_all_ranks", "gather_scalar_from_all_ranks",
           "reduce_and_broadcast", "broadcast_object", "all_gather_object", "barrier",
           "all_reduce", "zero_first", "do_n_at_a_time")
FAULTS = ("raises", "killed", "exits")


def _call(helper, value, faulty):
    rank = ad.get_rank()
    calls = {
        "compute_and_broadcast": lambda: ad.compute_and_broadcast(value, src=faulty),
        "gather_from_all_ranks": lambda: ad.gather_from_all_ranks(value),
        "gather_scalar_from_all_ranks": lambda: ad.gather_scalar_from_all_ranks(value),
        "reduce_and_broadcast": lambda: ad.reduce_and_broadcast(value, sum),
        "broadcast_object": lambda: ad.broadcast_object(value(), src=faulty),
        "all_gather_object": lambda: ad.all_gather_object(value()),
        "barrier": lambda: (value(), ad.barrier()),
        "all_reduce": lambda: ad.all_reduce(torch.tensor([value()])),
        "do_n_at_a_time": lambda: ad.do_n_at_a_time(value, n=1),
    }
    if helper == "zero_first":
        with ad.zero_first(is_main=rank == faulty):
            return value()
    return calls[helper]()


def _body(helper, fault, faulty):
    rank = ad.get_rank()
    if rank == faulty and fault == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == faulty and fault == "exits":
        return None

    def value():
        if rank == faulty and fault == "raises":
            raise ValueError("injected")
        return rank + 1

    start = time.monotonic()
    try:
        _call(helper, value, faulty)
        ad.barrier()
    except ad.RankFailedError as exc:
        return time.monotonic() - start, exc.rank, exc.exc_type
    return None


def main() -> None:
    worst = defaultdict(float)
    seen = defaultdict(set)
    for helper in HELPERS:
        for fault in FAULTS:
            for faulty in (0, 1):
                for store in STORE_PLACEMENTS:
                    outcomes = run_distributed_outcomes(_body, 3, args=(helper, fault, faulty),
                                                        store=store, timeout=60, pg_timeout=300)
                    for o in outcomes:
                        if o.rank == faulty:
                            continue
                        if not (o.ok and o.value and o.value[1] == faulty):
                            raise SystemExit(f"{helper}/{fault}/rank {faulty}/{store}: "
                                             f"{o.describe()} {o.value}")
                        worst[helper, fault] = max(worst[helper, fault], o.value[0])
                        seen[helper, fault].add(o.value[2])
    print(f"{'helper':30s} " + " ".join(f"{f:>22s}" for f in FAULTS))
    for helper in HELPERS:
        cells = [f"{worst[helper, f]:7.2f} s {'/'.join(sorted(seen[helper, f])):>12s}"
                 for f in FAULTS]
        print(f"{helper:30s} " + " ".join(cells))


if __name__ == "__main__":
    main()
