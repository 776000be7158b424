"""A typed user script: what a user's mypy sees when calling the kit's helpers.

Checked by ``mypy`` in the README's test command (config in setup.cfg) and run as one process by
``tests/test_typing.py``. Every result is assigned to an annotated variable, so a helper
whose type regresses is caught. Each ``# type: ignore[code]`` marks a mistake that mypy must
report; with ``warn_unused_ignores`` an ignore that is not needed (the helper typed too
loosely, e.g. ``Any``) fails the check too.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import torch
from torch.utils.data import TensorDataset

import axolotl_dist as ad


def double(x: int) -> int:
    return 2 * x


@ad.zero_only
def report(message: str, *, step: int = 0) -> str:
    return f"{step}: {message}"


@ad.zero_only(default=-1)
def rank_zero_count() -> int:
    return 1


@ad.on_main_process
def save(path: str) -> bool:
    return bool(path)


@ad.on_local_main_process
def local_setup() -> int:
    return 0


@ad.on_last_process
def last_word() -> str:
    return "bye"


@ad.on_process(process_index=0)
def on_zero(x: float) -> float:
    return x


@ad.on_local_process(0)
def on_local_zero() -> List[int]:
    return [0]


def main() -> None:
    ad.init_distributed()
    rank: int = ad.get_rank()
    world: int = ad.get_world_size()
    local: int = ad.get_local_rank() + ad.get_local_world_size() + ad.get_node_rank()
    main_process: bool = ad.is_main_process() and ad.is_local_main_process()
    backend: Optional[str] = ad.get_backend()
    straggler: Optional[ad.StragglerReport] = ad.straggler_report()
    late_ms: Optional[float] = straggler.late * 1000 if straggler is not None else None

    # values: the result types follow the functions passed in
    n_local = 3
    total: int = ad.reduce_and_broadcast(lambda: n_local, sum)
    fewest: int = ad.reduce_and_broadcast(lambda: n_local, min)
    mean: float = ad.reduce_and_broadcast(lambda: 0.5, lambda xs: sum(xs) / len(xs))
    best: str = ad.compute_and_broadcast(lambda: "rank0-choice")
    gathered: Optional[List[int]] = ad.gather_from_all_ranks(lambda: rank)
    scalars: Optional[List[float]] = ad.gather_scalar_from_all_ranks(lambda: 1.5)
    summed: int = ad.all_reduce_value(rank)
    agreed: Dict[str, int] = ad.broadcast_object({"steps": 10})
    synced: float = ad.synchronize_value(0.25)
    flag: bool = ad.synchronize_flag(True)
    objects: List[Tuple[int, str]] = ad.all_gather_object((rank, "x"))

    # tensors
    t = torch.ones(2)
    ad.all_reduce(t, "SUM")
    ad.broadcast(t, src=0)
    ad.barrier()
    parts: List[torch.Tensor] = ad.all_gather(t)

    # ordered blocks
    with ad.zero_first():
        prepared = [1, 2, 3]
    with ad.main_process_first(), ad.local_main_process_first(), ad.run_local_rank_zero_first():
        prepared.append(4)
    first: int = ad.do_n_at_a_time(lambda: 7)

    # rank-gated functions keep their parameters and return Optional results
    message: Optional[str] = report("hello", step=1)
    count: int = rank_zero_count()
    saved: Optional[bool] = save("/tmp/x")
    local_ok: Optional[int] = local_setup()
    last: Optional[str] = last_word()
    zero: Optional[float] = on_zero(1.0)
    local_zero: Optional[List[int]] = on_local_zero()
    with ad.zero_only() as is_main:
        flag = is_main

    # data
    with ad.split_between_processes([1, 2, 3]) as mine:
        my_items: List[int] = mine
    with ad.split_between_processes(("a", "b")) as my_tuple:
        my_letters: Tuple[str, ...] = my_tuple
    with ad.split_between_processes(torch.arange(4)) as my_rows:
        my_tensor: torch.Tensor = my_rows
    with ad.split_between_processes({"ids": [1, 2], "mask": [1, 1]}) as my_cols:
        my_dict: Dict[str, List[int]] = my_cols
    sampler = ad.get_sampler(TensorDataset(torch.arange(8)), shuffle=True)
    sampler.set_epoch(1)

    # output
    log: logging.LoggerAdapter[logging.Logger] = ad.get_logger("snippet")
    log.info("rank %d of %d", rank, world)
    for step in ad.tqdm(range(2), desc="steps"):
        doubled: int = double(step)
    bar: ad.ProgressBar[str] = ad.tqdm(["a", "b"])
    letters: List[str] = list(bar)
    ad.print("done", total, fewest, mean, best, gathered, scalars, summed, agreed, synced, flag,
             objects, parts, first, message, count, saved, local_ok, last, zero, local_zero,
             my_items, my_letters, my_tensor, my_dict, local, main_process, backend, doubled,
             letters)
    ad.cleanup_distributed()


def mistakes_mypy_must_report() -> None:
    """Never called: each line is a mistake, and its ``type: ignore`` must be needed."""
    wrong_total: str = ad.reduce_and_broadcast(lambda: 3, sum)  # type: ignore[assignment]
    wrong_best: int = ad.compute_and_broadcast(lambda: "s")  # type: ignore[assignment]
    wrong_gather: List[int] = ad.gather_from_all_ranks(lambda: 1)  # type: ignore[assignment]
    report(3)  # type: ignore[arg-type]
    report("x", stepp=1)  # type: ignore[call-arg]
    not_optional: str = report("x")  # type: ignore[assignment]
    not_optional = save("path")  # type: ignore[assignment]
    on_zero("1.0")  # type: ignore[arg-type]
    with ad.split_between_processes([1, 2]) as mine:
        wrong_items: List[str] = mine  # type: ignore[assignment]
    with ad.split_between_processes(torch.arange(4)) as rows:
        wrong_rows: List[int] = rows  # type: ignore[assignment]
    for letter in ad.tqdm(["a", "b"]):
        wrong_letter: int = letter  # type: ignore[assignment]
    print(wrong_total, wrong_best, wrong_gather, not_optional, wrong_items, wrong_rows, wrong_letter)


if __name__ == "__main__":
    main()
