"""Words the kit's messages share: ``ranks 0-3, 8`` for a set of ranks."""

from __future__ import annotations

from typing import List, Sequence

__all__ = ["ranks_text", "ranks_in_text", "is_decimal"]


def is_decimal(text: str) -> bool:
    """Whether ``text`` is one or more ASCII digits: a number the kit wrote, or one ``int()``
    reads back from an environment variable, a store record or a file name. Not
    ``str.isdigit``, which also takes ``'²'`` (``int()`` then raises)."""
    return text.isascii() and text.isdigit()


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


def ranks_in_text(body: str) -> List[int]:
    """The ranks :func:`ranks_text` wrote after ``rank``/``ranks``: ``3``, ``0, 1``, ``0-3, 8``."""
    found: List[int] = []
    for part in body.split(","):
        first, _, last = part.strip().partition("-")
        if is_decimal(first) and (not last or is_decimal(last)):
            found.extend(range(int(first), int(last or first) + 1))
    return found
