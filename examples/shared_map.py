"""Dataset preprocessing shared by every rank with ``shared_map`` (instead of ``zero_first``).

Builds a small text dataset on disk (inside ``zero_first``: built once, loaded everywhere),
then tokenizes it with ``shared_map``: each rank tokenizes a contiguous part and every rank
gets the whole tokenized dataset, identical to a one-process ``dataset.map``. A second call
finds the cached parts and maps nothing.

    axolotl-dist -n 2 examples/shared_map.py
    torchrun --standalone --nproc-per-node 2 examples/shared_map.py
    python examples/shared_map.py

Needs Hugging Face datasets: ``pip install -e ".[datasets]"`` from the repository root.
"""

import argparse
import os
import random
import shutil
import tempfile
import time
from typing import Any, Dict, List

import datasets

import axolotl_dist as ad

WORDS = "the a model learns tokens from text data ranks share one cache on disk".split()
VOCAB = {w: i + 1 for i, w in enumerate(WORDS)}


def tokenize(batch: Dict[str, List[str]]) -> Dict[str, List[Any]]:
    """A stand-in for a tokenizer: word ids (0 for unknown words) and their count."""
    ids = [[VOCAB.get(w, 0) for w in text.split()] for text in batch["text"]]
    return {"input_ids": ids, "length": [len(x) for x in ids]}


def build(path: str, n: int) -> None:
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(n)]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache-dir", default=None,
                        help="default: a fresh directory for this run, removed at its end")
    parser.add_argument("--samples", type=int, default=1000)
    args = parser.parse_args()
    ad.init_distributed()
    # A fresh directory per run unless one is given: rank 0 makes it, every rank gets its name.
    cache_dir = args.cache_dir or ad.compute_and_broadcast(
        lambda: tempfile.mkdtemp(prefix="axolotl_dist_shared_map_"))
    path = os.path.join(cache_dir, f"raw_{args.samples}")
    with ad.zero_first():  # built once, by rank 0; the others load it afterwards
        if not os.path.exists(path):
            build(path, args.samples)
    raw = datasets.load_from_disk(path)

    # Was: with ad.zero_first(): tokenized = raw.map(tokenize, batched=True, ...)
    tokenized = ad.shared_map(raw, tokenize, batched=True, batch_size=100, remove_columns=["text"])
    start = time.perf_counter()  # the same call again: every part is cached, nothing is mapped
    ad.shared_map(raw, tokenize, batched=True, batch_size=100, remove_columns=["text"])
    again_ms = (time.perf_counter() - start) * 1e3

    print(f"rank {ad.get_rank()}: rows={len(tokenized)} tokens={sum(tokenized['length'])} "
          f"fingerprint={tokenized._fingerprint} second_call_ms={again_ms:.0f}", flush=True)
    if args.cache_dir is None:
        ad.barrier()  # every rank is done with the parts
        if ad.is_main_process():
            shutil.rmtree(cache_dir, ignore_errors=True)
    ad.cleanup_distributed()


if __name__ == "__main__":
    main()
