"""The fault matrix's scenario, shared by ``tests/test_faults.py`` (which asserts on it) and
``benchmarks/faults.py`` (which times it): every communicating helper, every fault, called the
way a script does. No pytest here, so the benchmark runs without it.
"""

import os
import signal
import time

import torch

import axolotl_dist as ad

__all__ = ["HELPERS", "FAULTS", "call_helper", "fault_body"]

HELPERS = ("compute_and_broadcast", "gather_from_all_ranks", "gather_scalar_from_all_ranks",
           "reduce_and_broadcast", "broadcast_object", "all_gather_object", "barrier",
           "all_reduce", "zero_first", "do_n_at_a_time",
           # accelerate's names (docs/porting.md)
           "gather", "gather_object", "reduce", "pad_across_processes", "gather_for_metrics",
           "wait_for_everyone")
FAULTS = ("raises", "killed", "exits")


def call_helper(helper, value, faulty):
    """Call ``helper`` the way a script does; ``value`` raises on a rank that "raises"."""
    rank = ad.get_rank()
    if helper == "compute_and_broadcast":
        return ad.compute_and_broadcast(value, src=faulty)
    if helper == "gather_from_all_ranks":
        return ad.gather_from_all_ranks(value)
    if helper == "gather_scalar_from_all_ranks":
        return ad.gather_scalar_from_all_ranks(value)
    if helper == "reduce_and_broadcast":
        return ad.reduce_and_broadcast(value, sum)
    if helper == "broadcast_object":
        return ad.broadcast_object({"v": value()}, src=faulty)
    if helper == "all_gather_object":
        return ad.all_gather_object({"v": value()})
    if helper == "barrier":
        value()
        return ad.barrier()
    if helper == "all_reduce":
        return ad.all_reduce(torch.tensor([value()]))
    if helper == "zero_first":
        with ad.zero_first(is_main=rank == faulty):
            return value()
    if helper == "do_n_at_a_time":
        return ad.do_n_at_a_time(value, n=1)
    if helper == "gather":
        return ad.gather({"x": torch.tensor([value()])})
    if helper == "gather_object":
        return ad.gather_object([value()])
    if helper == "reduce":
        return ad.reduce(torch.tensor([float(value())]))
    if helper == "pad_across_processes":
        return ad.pad_across_processes(torch.zeros(value()))
    if helper == "gather_for_metrics":
        return ad.gather_for_metrics(torch.tensor([value()]), ad.get_world_size())
    if helper == "wait_for_everyone":
        value()
        return ad.wait_for_everyone()
    raise AssertionError(helper)


def fault_body(helper, fault, faulty):
    """One rank of a fault case: the faulty rank faults, the others call ``helper`` and then
    ``barrier`` (the script's next step). A survivor returns what its ``RankFailedError`` said
    and how long it took; the faulty rank that "exits" returns "skipped the call"."""
    rank = ad.get_rank()
    if rank == faulty and fault == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == faulty and fault == "exits":
        return "skipped the call"  # the harness then ends the process as a script's exit does

    def value():
        if rank == faulty and fault == "raises":
            raise ValueError(f"fault injected on rank {rank}")
        return rank + 1

    start = time.monotonic()
    try:
        call_helper(helper, value, faulty)
        ad.barrier()  # the script's next step
    except ad.RankFailedError as exc:
        return {"rank": exc.rank, "exc_type": exc.exc_type, "message": str(exc),
                "elapsed": time.monotonic() - start}
    return {"returned": True}
