"""The axolotl_dist helpers in one page.

Run on 2 CPU ranks:   torchrun --standalone --nproc-per-node 2 examples/quickstart.py
or as one process:    python examples/quickstart.py
"""

import json
import os
import tempfile

import torch

import axolotl_dist as ad

log = ad.get_logger("quickstart")


@ad.zero_only
def report(message: str) -> None:
    print(message, flush=True)  # rank 0 only; other ranks skip the call


def main() -> None:
    ad.init_distributed()  # gloo on CPU; a single process needs no env vars and no port
    rank, world = ad.get_rank(), ad.get_world_size()
    # A fresh file per run (never another run's): rank 0 names it, every rank gets the name.
    cache = ad.compute_and_broadcast(lambda: tempfile.mkstemp(prefix="axolotl_dist_quickstart_",
                                                               suffix=".json")[1])

    # Rank 0 prepares the data once; the others wait (without the collective timeout) and reuse it.
    with ad.zero_first():
        if not os.path.exists(cache) or ad.is_main_process():
            with open(cache, "w") as fh:
                json.dump([f"sample {i}" for i in range(10)], fh)
        with open(cache) as fh:
            samples = json.load(fh)

    with ad.split_between_processes(samples) as mine:
        local_tokens = sum(len(s.split()) for s in mine)

    total_tokens = ad.reduce_and_broadcast(lambda: local_tokens, sum)  # one all-gather, exact
    per_rank = ad.gather_from_all_ranks(lambda: local_tokens)  # list on rank 0, None elsewhere
    big = ad.compute_and_broadcast(lambda: 2**53 + 1)  # exact, not float32
    mean = ad.all_reduce(torch.tensor([float(rank)]), "AVG").item()
    log.info("world=%d tokens=%d per_rank=%s", world, total_tokens, per_rank)
    report(f"ranks={world} total_tokens={total_tokens} per_rank={per_rank} big={big} mean_rank={mean}")
    ad.barrier()  # every rank has read the cache
    if ad.is_main_process():
        os.remove(cache)
    ad.cleanup_distributed()


if __name__ == "__main__":
    main()
