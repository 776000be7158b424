"""Fine-tune a tiny causal language model data-parallel, with the axolotl_dist helpers.

Run it on 2 ranks through the launcher (about 15 s on 2 CPU cores), or any other way::

    axolotl-dist -n 2 examples/finetune.py
    torchrun --standalone --nproc-per-node 2 examples/finetune.py
    python examples/finetune.py                    # one process, same code
    axolotl-dist -n 2 examples/finetune.py --backend gloo   # 2 ranks sharing one GPU

On a machine with GPUs each rank trains on its own GPU (``--device auto``) over NCCL; more
ranks than GPUs need ``--backend gloo`` (NCCL cannot share a GPU between ranks).

Everything is made here, nothing is downloaded: a character-level corpus, its tokenization
(done once, by rank 0, under ``zero_first``; the other ranks reuse the cache), a 2-layer
causal transformer trained with ``DistributedDataParallel``, a ``get_sampler`` data
loader, token counts agreed with ``reduce_and_broadcast``, a progress bar and logs on the main
process only, and a checkpoint through ``ad.checkpoint_dir`` (rank 0 writes the model). Rank 0 prints ``step N loss=X`` lines.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset

import axolotl_dist as ad

try:
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover - tqdm comes with accelerate
    tqdm = None

log = ad.get_logger("finetune")

WORDS = ("the cat sat on the mat . a dog ran to the park . birds sing in the tall tree . "
         "we train small models on many cores . ranks agree on every count .").split()


def make_corpus(n_sentences: int, seed: int) -> str:
    """A deterministic toy corpus: shuffled sentences made of a small vocabulary."""
    rng = random.Random(seed)
    sentences = " ".join(WORDS).split(" . ")
    return " . ".join(rng.choice(sentences) for _ in range(n_sentences)) + " ."


def tokenize(text: str, seq_len: int) -> torch.Tensor:
    """Characters to ids (a fixed alphabet), cut into ``seq_len + 1`` windows."""
    alphabet = sorted(set("".join(WORDS) + " ."))
    ids = torch.tensor([alphabet.index(c) for c in text], dtype=torch.long)
    n = (len(ids) - 1) // seq_len
    return torch.stack([ids[i * seq_len:(i + 1) * seq_len + 1] for i in range(n)])


class TinyCausalLM(nn.Module):
    """Token + position embeddings, a causal transformer encoder, a linear output head."""

    mask: torch.Tensor  # a buffer (registered below)

    def __init__(self, vocab: int, seq_len: int, dim: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq_len, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        mask = torch.triu(torch.full((seq_len, seq_len), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        x = self.body(x, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(x))


def pick_device(choice: str) -> torch.device:
    """``--device``: ``auto`` is this rank's GPU (``LOCAL_RANK``'s, shared round-robin when
    there are fewer GPUs than ranks) where CUDA is usable, else the CPU."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        return torch.device("cuda", ad.get_local_rank() % torch.cuda.device_count())
    return torch.device(choice)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the model trains (auto: this rank's GPU if any, else the CPU)")
    p.add_argument("--backend", default=None,
                   help="process group backend (default: nccl on GPUs, else gloo)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--output-dir", default=None,
                   help="default: a fresh directory for this run (printed at the end)")
    return p.parse_args()


def load_dataset(args: argparse.Namespace) -> TensorDataset:
    """Tokenize once on rank 0 (under ``zero_first``); the other ranks load rank 0's cache."""
    cache = os.path.join(args.output_dir, f"tokens_{args.seq_len}_{args.seed}.pt")
    with ad.zero_first():
        if ad.is_main_process():
            os.makedirs(args.output_dir, exist_ok=True)
            windows = tokenize(make_corpus(600, args.seed), args.seq_len)
            torch.save(windows, cache + ".tmp")
            os.replace(cache + ".tmp", cache)
            log.info("tokenized %d windows of %d tokens into %s", len(windows), args.seq_len, cache)
        windows = torch.load(cache)
    return TensorDataset(windows)


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    ad.init_distributed(backend=args.backend)  # gloo on CPU; `python` needs no env vars
    device = pick_device(args.device)
    # A fresh directory per run unless one is given: rank 0 makes it, every rank gets its name.
    args.output_dir = args.output_dir or ad.compute_and_broadcast(
        lambda: tempfile.mkdtemp(prefix="axolotl_dist_finetune_"))
    world = ad.get_world_size()
    torch.manual_seed(args.seed)  # same initial weights on every rank (DDP also broadcasts)
    dataset = load_dataset(args)
    sampler = ad.get_sampler(dataset, shuffle=True, drop_last=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    vocab = int(dataset.tensors[0].max()) + 1
    model = TinyCausalLM(vocab, args.seq_len).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    log.info("%d rank(s), %d windows, %d parameters", world, len(dataset),
             sum(p.numel() for p in model.parameters()))

    main_process = ad.is_main_process()
    bar = tqdm(total=args.steps, desc="train", disable=not main_process) if tqdm else None
    step, epoch, local_tokens, losses = 0, 0, 0, []
    start = time.monotonic()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for (batch,) in loader:
            batch = batch.to(device, non_blocking=True)
            inputs, targets = batch[:, :-1], batch[:, 1:]
            loss = F.cross_entropy(ddp(inputs).reshape(-1, vocab), targets.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            local_tokens += targets.numel()
            step += 1
            losses.append(loss.item())
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}")
            if main_process and (step % args.log_every == 0 or step == 1):
                message = f"step {step} loss={loss.item():.4f}"
                (bar.write(message) if bar is not None else print(message, flush=True))
            if step >= args.steps:
                break
        epoch += 1
    if bar is not None:
        bar.close()
    # Every rank saw different windows: agree on the totals (one all-gather, exact ints).
    tokens = ad.reduce_and_broadcast(lambda: local_tokens, sum)
    mean_first = ad.reduce_and_broadcast(lambda: losses[0], lambda xs: sum(xs) / len(xs))
    mean_last = ad.reduce_and_broadcast(lambda: losses[-1], lambda xs: sum(xs) / len(xs))
    # Every rank enters; one writes the model; the block returns once it is committed (fsynced,
    # renamed to checkpoints/step-N), with no group timeout on a slow disk.
    with ad.checkpoint_dir(os.path.join(args.output_dir, "checkpoints"), step, keep=2) as path:
        if path.should_save:
            torch.save({"model": model.state_dict(), "step": step, "tokens": tokens},
                       os.path.join(path, "checkpoint.pt"))
    if main_process:
        elapsed = time.monotonic() - start
        print(f"done: ranks={world} steps={step} tokens={tokens} device={device.type} "
              f"loss {mean_first:.3f} -> {mean_last:.3f} (ln vocab {math.log(vocab):.3f}) "
              f"in {elapsed:.1f}s; checkpoint {os.path.join(path.final, 'checkpoint.pt')}",
              flush=True)
    ad.cleanup_distributed()


if __name__ == "__main__":
    main()
