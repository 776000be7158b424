"""Fine-tuning-style dataset preprocessing across ranks.

Rank 0 builds a small text dataset, tokenizes it and caches it to disk inside ``zero_first``;
the other ranks then load the cache instead of redoing the work. Logging goes through
``@zero_only``; the ranks agree on the token count with ``reduce_and_broadcast``.

    torchrun --standalone --nproc-per-node 2 examples/preprocess_dataset.py
    axolotl-dist -n 2 examples/preprocess_dataset.py
    python examples/preprocess_dataset.py
"""

import argparse
import json
import os
import random
import shutil
import tempfile
from typing import Dict, List

import axolotl_dist as ad

WORDS = "the a model learns tokens from text data ranks share one cache on disk".split()


def make_corpus(n: int, seed: int = 0) -> List[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(n)]


def build_vocab(texts: List[str]) -> Dict[str, int]:
    vocab = {"<unk>": 0}
    for text in texts:
        for word in text.split():
            vocab.setdefault(word, len(vocab))
    return vocab


def tokenize(texts: List[str], vocab: Dict[str, int]) -> List[List[int]]:
    return [[vocab.get(w, 0) for w in t.split()] for t in texts]


@ad.zero_only
def log(message: str) -> None:
    print(message, flush=True)


def build_cache(cache: str, samples: int) -> None:
    """Tokenize ``samples`` generated texts and write them to ``cache`` (atomically)."""
    texts = make_corpus(samples)
    vocab = build_vocab(texts)
    data = {"vocab": vocab, "ids": tokenize(texts, vocab)}
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    tmp = cache + f".tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(data, fh)
    os.replace(tmp, cache)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache-dir", default=None,
                        help="default: a fresh directory for this run, removed at its end")
    parser.add_argument("--samples", type=int, default=200)
    args = parser.parse_args()
    ad.init_distributed()
    # A fresh directory per run unless one is given: rank 0 makes it, every rank gets its name.
    cache_dir = args.cache_dir or ad.compute_and_broadcast(
        lambda: tempfile.mkdtemp(prefix="axolotl_dist_preprocess_"))
    cache = os.path.join(cache_dir, f"tokenized_{args.samples}.json")

    with ad.zero_first():  # rank 0 tokenizes and writes the cache; the others read it afterwards
        if ad.is_main_process() or not os.path.exists(cache):
            build_cache(cache, args.samples)
            log(f"rank 0 tokenized {args.samples} samples into {cache}")
        with open(cache) as fh:
            data = json.load(fh)

    with ad.split_between_processes(data["ids"]) as mine:
        local_tokens = sum(len(ids) for ids in mine)
    total = ad.reduce_and_broadcast(lambda: local_tokens, sum)
    log(f"ranks={ad.get_world_size()} samples={len(data['ids'])} vocab={len(data['vocab'])} "
        f"total_tokens={total}")
    print(f"rank {ad.get_rank()} local_tokens={local_tokens} total_tokens={total}", flush=True)
    if args.cache_dir is None:
        ad.barrier()  # every rank has read the cache
        if ad.is_main_process():
            shutil.rmtree(cache_dir, ignore_errors=True)
    ad.cleanup_distributed()


if __name__ == "__main__":
    main()
