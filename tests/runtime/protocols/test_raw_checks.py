"""Unit tests of debug mode's wrappers on torch's own collectives
(``_runtime/protocols/raw_checks.py``): what must agree across ranks, read from each call's
arguments, and the wrappers put on and taken off with debug mode. No process group: the
checks themselves run on real ranks in tests/test_stuck_collectives.py and tests/test_debug.py."""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

import axolotl_dist as ad
from axolotl_dist._runtime.protocols.raw_checks import CHECKED


def agree(name: str, *args, **kwargs):
    bound = inspect.signature(getattr(dist, name)).bind(*args, **kwargs)
    bound.apply_defaults()
    return CHECKED[name](dict(bound.arguments))


def test_what_must_agree_is_read_from_the_arguments():
    t = torch.ones(4, 2)
    assert agree("all_reduce", t) == {"tensor": "float32[4, 2]", "op": "SUM"}
    assert agree("all_reduce", t, op=dist.ReduceOp.MAX) == {"tensor": "float32[4, 2]", "op": "MAX"}
    assert agree("broadcast", t, 1) == {"tensor": "float32[4, 2]", "src": "1"}
    assert agree("broadcast", t, group_src=1) == {"tensor": "float32[4, 2]", "src": "group_src=1"}
    assert agree("reduce", t.long(), 0) == {"tensor": "int64[4, 2]", "dst": "0", "op": "SUM"}
    assert agree("barrier") == {}
    assert agree("all_to_all_single", torch.zeros(4), torch.ones(4, dtype=torch.bfloat16)) == {
        "dtype": "bfloat16"}
    assert agree("broadcast_object_list", [1, 2], 0) == {"src": "0", "objects": 2}


def test_every_checked_name_is_a_collective_of_this_torch():
    assert all(callable(getattr(dist, name, None)) for name in CHECKED)


def test_the_wrappers_are_on_exactly_while_debug_mode_is():
    original = dist.all_reduce
    assert not hasattr(original, "__axolotl_dist_checks__")
    with ad.debug_mode():
        assert dist.all_reduce is not original
        assert dist.all_reduce.__axolotl_dist_checks__ is original
        assert dist.all_reduce.__name__ == "all_reduce"
    assert dist.all_reduce is original  # torch's own again: torch.compile knows it by identity
