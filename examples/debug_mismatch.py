"""A classic distributed bug, caught by debug mode instead of hanging.

Rank 0 picks the best checkpoint with ``compute_and_broadcast`` while the other ranks, one
branch off, gather their losses: without debug mode the ranks block in different collectives
until the group times out (30 minutes by default). Run it::

    AXOLOTL_DIST_DEBUG=1 axolotl-dist -n 2 examples/debug_mismatch.py

and every rank raises ``CollectiveMismatchError`` at once, naming each rank's helper and line.
``--fixed`` runs the corrected version (every rank makes the same calls) and exits 0.
"""

from __future__ import annotations

import argparse

import axolotl_dist as ad


def evaluate(fixed: bool) -> None:
    loss = 1.0 / (ad.get_rank() + 1)
    if fixed or ad.is_main_process():
        best = ad.compute_and_broadcast(lambda: min(loss, 0.5))  # the intended call
    else:
        best = None
    losses = ad.gather_from_all_ranks(lambda: loss)  # every rank must make this call too
    if ad.is_main_process():
        print(f"best={best} losses={losses}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixed", action="store_true", help="run the corrected version")
    args = parser.parse_args()
    ad.init_distributed()
    try:
        evaluate(args.fixed)
    finally:
        ad.cleanup_distributed()


if __name__ == "__main__":
    main()
