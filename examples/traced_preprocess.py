"""The preprocessing example, traced: who waited for whom, in one timeline.

The same steps as ``preprocess_dataset.py`` (rank 0 tokenizes and caches inside
``zero_first``, the others load the cache, the ranks agree on the token count), with tracing
on, a ``trace_span`` around the work each rank does itself, and one slow rank (``--slow-rank``
sleeps ``--slow-seconds`` while packing, as a rank on a busy node would). At the end rank 0
merges every rank's events into ``<trace dir>/trace.json`` (open it in https://ui.perfetto.dev),
``summary.txt`` and, with matplotlib (``pip install -e ".[trace]"``), ``timeline.png``.

    axolotl-dist -n 3 examples/traced_preprocess.py --trace-dir /tmp/trace
    torchrun --standalone --nproc-per-node 3 examples/traced_preprocess.py
"""

import argparse
import json
import os
import shutil
import tempfile
import time

import axolotl_dist as ad
from preprocess_dataset import build_cache


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache-dir", default=None,
                        help="default: a fresh directory for this run, removed at its end")
    # Tracing starts in init_distributed, before the ranks can agree on a fresh name: the
    # default is keyed by user and by the run's port (every rank of a run shares it).
    parser.add_argument("--trace-dir", default=os.path.join(
        tempfile.gettempdir(),
        f"axolotl_dist_trace_{os.getuid()}_{os.environ.get('MASTER_PORT', os.getpid())}"))
    parser.add_argument("--samples", type=int, default=50000)
    parser.add_argument("--slow-rank", type=int, default=-1, help="default: the last rank")
    parser.add_argument("--slow-seconds", type=float, default=0.4)
    args = parser.parse_args()
    ad.init_distributed(trace_dir=args.trace_dir)
    rank, world = ad.get_rank(), ad.get_world_size()
    slow = args.slow_rank if args.slow_rank >= 0 else world - 1
    cache_dir = args.cache_dir or ad.compute_and_broadcast(
        lambda: tempfile.mkdtemp(prefix="axolotl_dist_traced_"))
    cache = os.path.join(cache_dir, f"tokenized_{args.samples}.json")

    with ad.zero_first():  # rank 0 tokenizes and writes the cache; the others read it afterwards
        if ad.is_main_process() or not os.path.exists(cache):
            with ad.trace_span("tokenize"):
                build_cache(cache, args.samples)
        with ad.trace_span("load cache"), open(cache) as fh:
            data = json.load(fh)

    with ad.split_between_processes(data["ids"]) as mine, ad.trace_span("pack"):
        local_tokens = sum(len(ids) for ids in mine)
        if rank == slow:
            time.sleep(args.slow_seconds)  # a rank on a busy node
    total = ad.reduce_and_broadcast(lambda: local_tokens, sum)
    longest = ad.gather_from_all_ranks(lambda: max(len(ids) for ids in mine))
    ad.print(f"ranks={world} samples={len(data['ids'])} total_tokens={total} longest={longest}")
    if args.cache_dir is None:
        ad.barrier()  # every rank has read the cache
        if ad.is_main_process():
            shutil.rmtree(cache_dir, ignore_errors=True)
    ad.cleanup_distributed()  # rank 0 merges the timeline here


if __name__ == "__main__":
    main()
