"""Small tensors ride with the shape check's headers (issue #75): ``all_reduce``, ``reduce`` and
``broadcast`` of up to ``CARRY_BYTES`` on a CPU group are one collective, the same bits on
every rank (a sum in rank order), and what cannot ride (too big, another dtype, autograd's
tensors, an op other than a sum) still takes the check and the collective: two."""

import pytest
import torch

from axolotl_dist.testing import run_distributed


def _collectives_per_call():
    import axolotl_dist as ad
    from axolotl_dist._runtime.base.groups import CARRY_BYTES, group_of

    g = group_of(None, "test")
    calls = {
        "all_reduce scalar": lambda: ad.all_reduce(torch.ones(1)),
        "all_reduce AVG 1 KiB": lambda: ad.all_reduce(torch.ones(256), "AVG"),
        "all_reduce at the limit": lambda: ad.all_reduce(torch.ones(CARRY_BYTES // 4)),
        "reduce dict": lambda: ad.reduce({"a": torch.ones(3), "b": torch.ones(2, dtype=torch.int64)},
                                         "sum"),
        "broadcast list": lambda: ad.broadcast([torch.ones(2), torch.zeros(3, dtype=torch.int8)]),
        "all_reduce past the limit": lambda: ad.all_reduce(torch.ones(CARRY_BYTES // 4 + 1)),
        "all_reduce MAX": lambda: ad.all_reduce(torch.ones(1), "MAX"),
        "all_reduce bool": lambda: ad.all_reduce(torch.ones(1, dtype=torch.bool), "MAX"),
        "reduce of a tensor in a graph": lambda: ad.reduce(torch.ones(2, requires_grad=True)),
    }
    out = {}
    for name, call in calls.items():
        call()
        before = g.calls
        call()
        out[name] = g.calls - before
    return out


@pytest.mark.parametrize("ws", [2, 3])
def test_small_sums_and_broadcasts_are_one_collective_the_rest_two(ws):
    for counts in run_distributed(_collectives_per_call, ws, timeout=60):
        assert counts == {"all_reduce scalar": 1, "all_reduce AVG 1 KiB": 1,
                          "all_reduce at the limit": 1, "reduce dict": 1, "broadcast list": 1,
                          "all_reduce past the limit": 2, "all_reduce MAX": 2,
                          "all_reduce bool": 2, "reduce of a tensor in a graph": 2}, counts


def _inputs(rank):
    gen = torch.Generator().manual_seed(7 + rank)
    return torch.randn(5, 3, generator=gen), torch.randn(4, generator=gen, dtype=torch.float64)


def _results():
    import axolotl_dist as ad

    rank = ad.get_rank()
    x, y = _inputs(rank)
    summed = ad.all_reduce(x.clone())
    mean = ad.reduce({"x": x, "y": y})
    avg = ad.all_reduce(y.clone(), "AVG")
    sent = ad.broadcast([x.clone(), y.clone()], src=ad.get_world_size() - 1)
    strided = x.clone().t()  # summed into it in place, whatever its strides
    ad.all_reduce(strided)
    # parameters (autograd's leaves) take what rode, in place, as a model sync does
    param = torch.nn.Parameter(x.clone())
    ad.broadcast(param, src=ad.get_world_size() - 1)
    grad_sum = torch.nn.Parameter(x.clone())
    ad.all_reduce(grad_sum)
    assert param.requires_grad and grad_sum.requires_grad
    return [t.tolist() for t in (summed, mean["x"], mean["y"], avg, *sent, strided, param,
                                 grad_sum)]


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_every_rank_gets_the_sum_in_rank_order_to_the_bit(ws):
    parts = [_inputs(r) for r in range(ws)]

    def in_order(i, mean=False):
        total = parts[0][i].clone()
        for p in parts[1:]:
            total += p[i]
        return total / ws if mean else total

    expected = [in_order(0).tolist(), in_order(0, True).tolist(), in_order(1, True).tolist(),
                in_order(1, True).tolist(), parts[-1][0].tolist(), parts[-1][1].tolist(),
                in_order(0).t().tolist(), parts[-1][0].tolist(), in_order(0).tolist()]
    for got in run_distributed(_results, ws, timeout=60):
        assert got == expected
