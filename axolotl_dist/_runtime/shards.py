"""How a length splits into contiguous per-rank chunks: one rule for every splitter of the kit.

``split_between_processes`` (:mod:`axolotl_dist.data`) and ``shared_map``'s parts
(:mod:`axolotl_dist._runtime.hf_parts`) both use it, so the same rank gets the same rows from each.
"""

from __future__ import annotations

from typing import Tuple

__all__ = ["shard_bounds"]


def shard_bounds(length: int, world_size: int, rank: int) -> Tuple[int, int]:
    """``[start, end)`` of ``rank``'s contiguous chunk; the first ``length % world_size`` ranks
    get one extra."""
    base, extra = divmod(length, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)
