"""Fine-tune a tiny causal LM data-parallel with Hugging Face datasets, tokenizers and transformers.

Needs the ``hf`` extra (``pip install -e ".[hf]"``). Every launcher runs it unchanged::

    python examples/hf_finetune.py                                     # one process
    axolotl-dist -n 2 examples/hf_finetune.py
    torchrun --standalone --nproc-per-node 2 examples/hf_finetune.py
    accelerate launch --multi_gpu --num_processes 2 examples/hf_finetune.py   # 2 CPU processes
    axolotl-dist -n 2 examples/hf_finetune.py --backend gloo   # 2 ranks sharing one GPU

On a machine with GPUs each rank trains on its own GPU (``--device auto``) over NCCL; more
ranks than GPUs need ``--backend gloo`` (NCCL cannot share a GPU between ranks).

Everything is made here, nothing is downloaded (the hub is never contacted): a generated text
corpus saved as a ``datasets`` dataset on disk; a byte-level BPE tokenizer trained with
``tokenizers`` and wrapped as a ``transformers`` ``PreTrainedTokenizerFast``; tokenization with
``Dataset.map`` inside ``ad.zero_first()``, so rank 0 runs the map and writes ``datasets``'
cache file and the other ranks then load that file instead of calling the map function (each
rank prints ``map calls=N`` and the cache file it uses); a 2-layer GPT-2 built from a config
and trained with ``DistributedDataParallel`` and an ``ad.get_sampler`` loader; a
progress bar and logs on the main process only; the token count agreed with
``ad.reduce_and_broadcast``; and a checkpoint through ``ad.checkpoint_dir`` that the main process
fills with ``save_pretrained``. The main process prints ``step N loss=X`` lines and a ``done:`` line.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
import time
from typing import Any, Dict, List, Tuple

# Nothing here needs the network, and nothing may write to ~/.cache: set before the imports.
for _name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_name, "1")
os.environ.setdefault("HF_HOME", os.path.join(tempfile.gettempdir(), f"axolotl_dist_hf_home_{os.getuid()}"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no fork warnings from the Rust pool

import datasets  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast  # noqa: E402

import axolotl_dist as ad  # noqa: E402

log = ad.get_logger("hf_finetune")  # INFO on the main process, no logging setup needed

SUBJECTS = ["the cat", "a dog", "my model", "every rank", "the tokenizer", "our data"]
VERBS = ["reads", "writes", "counts", "shares", "trains on", "caches"]
OBJECTS = ["the file", "many tokens", "one batch", "a small corpus", "the checkpoint", "its shard"]
SPECIAL_TOKENS = ["<unk>", "<eos>"]
MAP_CALLS = [0]  # how often this process ran the tokenize function (0 when the cache was used)


def make_corpus(n_lines: int, seed: int) -> List[str]:
    """A deterministic toy corpus: short sentences from a small grammar."""
    rng = random.Random(seed)
    return [f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} ."
            for _ in range(n_lines)]


def train_tokenizer(texts: List[str], vocab_size: int, path: str) -> None:
    """Train a byte-level BPE tokenizer with ``tokenizers`` and save it as one JSON file."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(path)


def build_raw_data(raw_dir: str, tokenizer_file: str, args: argparse.Namespace) -> None:
    """Rank 0: save the corpus with ``save_to_disk`` (so ``map`` gets a cache on disk) and the tokenizer."""
    texts = make_corpus(args.lines, args.seed)
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(raw_dir)
    train_tokenizer(texts, args.vocab_size, tokenizer_file)
    log.info("wrote %d lines to %s and trained a %d-token BPE tokenizer", len(texts), raw_dir,
             args.vocab_size)


def load_tokenizer(path: str) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(tokenizer_file=path, unk_token="<unk>", eos_token="<eos>",
                                   pad_token="<eos>")


def prepare_data(args: argparse.Namespace) -> Tuple[PreTrainedTokenizerFast, Any]:
    """Tokenize and pack the corpus; rank 0 first, the others reuse its ``datasets`` cache."""
    work = os.path.join(args.output_dir, f"data_{args.lines}_{args.vocab_size}_{args.seed}")
    raw_dir, tokenizer_file = os.path.join(work, "raw"), os.path.join(work, "tokenizer.json")
    block = args.seq_len

    with ad.zero_first():  # rank 0 runs the block first; the others wait, then run it too
        if ad.is_main_process() and not os.path.exists(tokenizer_file):
            build_raw_data(raw_dir, tokenizer_file, args)
        tokenizer = load_tokenizer(tokenizer_file)
        raw = datasets.load_from_disk(raw_dir)

        def tokenize(batch: Dict[str, List[str]]) -> Dict[str, Any]:
            MAP_CALLS[0] += 1
            return tokenizer([t + tokenizer.eos_token for t in batch["text"]])

        def pack(batch: Dict[str, List[List[int]]]) -> Dict[str, List[List[int]]]:
            ids = [i for seq in batch["input_ids"] for i in seq]
            n = len(ids) // block * block
            return {"input_ids": [ids[i:i + block] for i in range(0, n, block)]}

        tokens = raw.map(tokenize, batched=True, remove_columns=["text"], desc="tokenize")
        blocks = tokens.map(pack, batched=True, remove_columns=tokens.column_names, desc="pack")
    files = [os.path.basename(f["filename"]) for f in tokens.cache_files]
    print(f"rank {ad.get_rank()} map calls={MAP_CALLS[0]} cache={','.join(files)}", flush=True)
    return tokenizer, blocks.with_format("torch")


def pick_device(choice: str) -> torch.device:
    """``--device``: ``auto`` is this rank's GPU (``LOCAL_RANK``'s, shared round-robin when
    there are fewer GPUs than ranks) where CUDA is usable, else the CPU."""
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        return torch.device("cuda", ad.get_local_rank() % torch.cuda.device_count())
    return torch.device(choice)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the model trains (auto: this rank's GPU if any, else the CPU)")
    p.add_argument("--backend", default=None,
                   help="process group backend (default: nccl on GPUs, else gloo)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lines", type=int, default=1200, help="corpus size")
    p.add_argument("--vocab-size", type=int, default=320)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--output-dir", default=None,
                   help="default: a fresh directory for this run (printed at the end)")
    return p.parse_args()


def save_checkpoint(model: GPT2LMHeadModel, tokenizer: PreTrainedTokenizerFast, root: str,
                    step: int) -> str:
    """Every rank: a checkpoint of ``step`` under ``root``; the main process ``save_pretrained``s
    the model and the tokenizer into it. Returns where it is once committed."""
    with ad.checkpoint_dir(root, step, keep=2) as path:
        if path.should_save:
            model.save_pretrained(path)
            tokenizer.save_pretrained(path)
    return path.final


def main() -> None:
    args = parse_args()
    ad.init_distributed(backend=args.backend)  # gloo on CPU; `python` needs no env vars
    device = pick_device(args.device)
    # A fresh directory per run unless one is given (a second run then maps again, as the
    # first): rank 0 makes it, every rank gets its name.
    args.output_dir = args.output_dir or ad.compute_and_broadcast(
        lambda: tempfile.mkdtemp(prefix="axolotl_dist_hf_finetune_"))
    if not ad.is_main_process():
        datasets.disable_progress_bars()  # datasets' own bars on the main process only
    tokenizer, blocks = prepare_data(args)

    torch.manual_seed(args.seed)  # the same initial weights on every rank (DDP broadcasts too)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=args.seq_len, n_embd=64,
                        n_layer=2, n_head=4, n_inner=128, resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, bos_token_id=tokenizer.eos_token_id,
                        eos_token_id=tokenizer.eos_token_id)
    model = GPT2LMHeadModel(config).to(device)
    model.loss_type = "ForCausalLM"  # what GPT-2 computes anyway; silences transformers' warning
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    sampler = ad.get_sampler(blocks, shuffle=True, drop_last=True, seed=args.seed)
    loader = DataLoader(blocks, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    log.info("%d rank(s), %d blocks of %d tokens, %d parameters", ad.get_world_size(),
             len(blocks), args.seq_len, model.num_parameters())

    bar = ad.tqdm(total=args.steps, desc="train")
    step, epoch, local_tokens, losses = 0, 0, 0, []
    start = time.monotonic()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            ids = batch["input_ids"].to(device, non_blocking=True)
            loss = ddp(input_ids=ids, labels=ids).loss  # the model shifts the labels
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            local_tokens += ids.numel()
            losses.append(loss.item())
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            if step == 1 or step % args.log_every == 0:
                ad.print(f"step {step} loss={losses[-1]:.4f}", flush=True)
            if step >= args.steps:
                break
        epoch += 1
    bar.close()
    # Every rank saw different blocks: agree on the totals (one all-gather each, exact).
    tokens = ad.reduce_and_broadcast(lambda: local_tokens, sum)
    first = ad.reduce_and_broadcast(lambda: losses[0], lambda xs: sum(xs) / len(xs))
    last = ad.reduce_and_broadcast(lambda: sum(losses[-5:]) / len(losses[-5:]),
                                   lambda xs: sum(xs) / len(xs))
    saved = save_checkpoint(model, tokenizer, os.path.join(args.output_dir, "checkpoints"), step)
    ad.print(f"done: ranks={ad.get_world_size()} steps={step} tokens={tokens} device={device.type} "
             f"loss {first:.3f} -> {last:.3f} in {time.monotonic() - start:.1f}s; "
             f"checkpoint {saved}", flush=True)
    ad.cleanup_distributed()


if __name__ == "__main__":
    main()
