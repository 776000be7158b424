"""``set_seed``: accelerate's seeding of Python's, NumPy's and torch's generators."""

from __future__ import annotations

import random

import torch

from .ranks import get_rank

__all__ = ["set_seed"]


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed ``random``, NumPy (when installed) and torch (every device) with ``seed``.

    ``device_specific=True`` adds this process's global rank, so ranks draw different numbers
    (accelerate's ``process_index``); ``deterministic=True`` turns on
    ``torch.use_deterministic_algorithms``. The same generators end in the same states as
    after accelerate's ``set_seed`` with the same arguments. Needs no process group.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"set_seed(seed={seed!r}) needs an int")
    if device_specific:
        seed += get_rank()
    if not 0 <= seed < 2**32:
        raise ValueError(
            f"set_seed: seed {seed} is outside [0, 2**32), which NumPy's generator needs: "
            "pass a smaller non-negative seed")
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(seed)
    torch.manual_seed(seed)  # seeds every CUDA device too
    if deterministic:
        torch.use_deterministic_algorithms(True)
