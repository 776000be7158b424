"""Words the kit's messages share: ``ranks 0-3, 8`` for a set of ranks."""

from __future__ import annotations

from typing import List, Sequence

__all__ = ["ranks_text"]


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 3`` / ``ranks 0-3, 8``: runs of consecutive ranks folded."""
    runs: List[List[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    body = ", ".join(f"{a}" if a == b else f"{a}, {b}" if b == a + 1 else f"{a}-{b}"
                     for a, b in runs)
    return f"rank {body}" if len(ranks) == 1 else f"ranks {body}"
