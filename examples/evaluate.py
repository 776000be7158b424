"""Distributed evaluation with accelerate's names: every sample counted once, the metric exact.

10 evaluation rows do not split evenly over 3 ranks: the sampler gives each rank 4 rows and
repeats 2. ``gather_for_metrics`` drops the repeats, so 3 ranks report exactly what one
process does (the accuracy, the count of rows and the loss summed with ``math.fsum``, which
does not depend on the order of the rows).

Run on 3 CPU ranks:   axolotl-dist -n 3 examples/evaluate.py
                      (or torchrun --standalone --nproc-per-node 3 examples/evaluate.py)
or as one process:    python examples/evaluate.py
"""

import argparse
import math

import torch
from torch.utils.data import DataLoader, TensorDataset

import axolotl_dist as ad


def build_data(rows: int) -> TensorDataset:
    """The same rows on every rank: features and a label per row."""
    gen = torch.Generator().manual_seed(7)
    features = torch.randn(rows, 4, generator=gen)
    labels = (features @ torch.tensor([1.0, -2.0, 0.5, 1.5])).gt(0).long()
    return TensorDataset(features, labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=3)
    args = parser.parse_args()

    state = ad.PartialState()  # starts the group when launched with several ranks
    ad.set_seed(0)  # the same model on every rank
    model = torch.nn.Linear(4, 2)
    dataset = build_data(args.rows)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=ad.get_sampler(dataset))

    correct, rows, losses = 0, 0, []
    with torch.no_grad():
        for features, labels in loader:
            logits = model(features)
            loss = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
            # predictions, labels and losses of every rank, each sample once
            preds, labels, loss = ad.gather_for_metrics(
                (logits.argmax(-1), labels, loss.double()), loader)
            correct += int((preds == labels).sum())
            rows += len(labels)
            losses += loss.tolist()
    state.wait_for_everyone()
    ad.print(f"ranks={state.num_processes} rows={rows} correct={correct} "
             f"accuracy={correct / rows:.6f} loss_sum={math.fsum(losses).hex()}")


if __name__ == "__main__":
    main()
