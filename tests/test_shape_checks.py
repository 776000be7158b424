"""The tensor operations' shape checks (docs/design/helpers.md, "Shape checks"): ranks that pass
tensors one collective cannot pair get ``TensorMismatchError`` on every rank, naming each
rank's dtype and shape and the call's line, within seconds, under both store placements;
never gloo's abort, a wrong value or a hang. The ranks stay in step after it."""

import time

import pytest
import torch

import axolotl_dist as ad
from axolotl_dist.testing import run_distributed, run_distributed_outcomes


def _cases():
    """name -> the call, each rank passing its own tensors (rank 0 differs from the others)."""
    r = ad.get_rank()
    first = r == 0
    return {
        # accelerate's test_op_checker, and what the backend does without the check
        "pad 2-D vs 3-D": lambda: ad.pad_across_processes(
            {"tensor": torch.zeros(1, 5) if first else torch.zeros(1, 1, 6)}, dim=0),
        "reduce 1x5 vs 1x2x5 (gloo SIGABRT)": lambda: ad.reduce(
            {"tensor": torch.zeros(1, 5) if first else torch.zeros(1, 2, 5)}),
        "reduce 3 vs 4 elements (wrong value, hang)": lambda: ad.reduce(
            torch.ones(3 if first else 4), "sum"),
        "broadcast 2x5 vs 1x2x5 (silently kept)": lambda: ad.broadcast(
            {"tensor": torch.zeros(2, 5) if first else torch.zeros(1, 2, 5)}),
        "broadcast tensor": lambda: ad.broadcast(torch.zeros(2 if first else 3), src=0),
        "all_reduce shapes": lambda: ad.all_reduce(torch.ones(3 if first else 4)),
        # dtype mismatches
        "gather dtype": lambda: ad.gather(torch.zeros(2, dtype=torch.int64 if first
                                                      else torch.float32)),
        "all_reduce dtype": lambda: ad.all_reduce(torch.zeros(2, dtype=torch.float64 if first
                                                              else torch.float32)),
        "all_gather dtype": lambda: ad.all_gather(torch.zeros(2, dtype=torch.float64 if first
                                                              else torch.float32)),
        "reduce structure": lambda: ad.reduce([torch.zeros(1)] * (1 if first else 2)),
        "copy with no holder": lambda: ad.copy_tensor_to_devices(None),
    }


#: case -> what every rank's message says of rank 0's tensor and of rank 1's
SAYS = {
    "pad 2-D vs 3-D": ("pad_across_processes: data['tensor'] differs across ranks:",
                       "float32[1, 5] on rank 0", "float32[1, 1, 6] on rank"),
    "reduce 1x5 vs 1x2x5 (gloo SIGABRT)": ("reduce: data['tensor'] differs across ranks:",
                                           "float32[1, 5] on rank 0",
                                           "float32[1, 2, 5] on rank"),
    "reduce 3 vs 4 elements (wrong value, hang)": ("reduce: data differs across ranks:",
                                                   "float32[3] on rank 0", "float32[4] on rank"),
    "broadcast 2x5 vs 1x2x5 (silently kept)": ("broadcast: data['tensor'] differs",
                                               "float32[2, 5] on rank 0",
                                               "float32[1, 2, 5] on rank"),
    "broadcast tensor": ("broadcast: data differs", "float32[2] on rank 0", "float32[3] on rank"),
    "all_reduce shapes": ("all_reduce: tensor differs", "float32[3] on rank 0",
                          "float32[4] on rank"),
    "gather dtype": ("gather: data differs", "int64[2] on rank 0", "float32[2] on rank"),
    "all_reduce dtype": ("all_reduce: tensor differs", "float64[2] on rank 0",
                         "float32[2] on rank"),
    "all_gather dtype": ("all_gather: tensor differs", "float64[2] on rank 0",
                         "float32[2] on rank"),
    "reduce structure": ("reduce: the ranks passed different numbers of tensors",
                         "1 tensor(s) on rank 0", "2 tensor(s) on rank"),
    "copy with no holder": ("copy_tensor_to_devices: no rank passed a tensor", "None on ranks 0-",
                            "pass it on exactly one rank"),
}


def _every_mismatch():
    out = {}
    for name, call in _cases().items():
        t0 = time.monotonic()
        try:
            call()
            out[name] = ("returned", 0.0)
        except ad.TensorMismatchError as exc:
            out[name] = (str(exc), time.monotonic() - t0)
    out["after"] = ad.gather(torch.tensor([ad.get_rank()])).tolist()  # still in step
    return out


@pytest.mark.parametrize("store", ["parent", "rank0"])
@pytest.mark.parametrize("ws", [2, 3])
def test_every_mismatch_raises_on_every_rank_within_seconds(ws, store):
    outcomes = run_distributed_outcomes(_every_mismatch, ws, store=store, timeout=60)
    for o in outcomes:
        assert o.ok, o.describe()
        got = o.value
        assert got["after"] == list(range(ws))
        for name, fragments in SAYS.items():
            message, elapsed = got[name]
            for fragment in fragments:
                assert fragment in message, (o.rank, name, fragment, message)
            assert "tests/test_shape_checks.py:" in message, message  # the call's line
            assert elapsed < 5.0, (o.rank, name, elapsed)
        # every rank's message is the same account
        assert {n: got[n][0] for n in SAYS} == {n: outcomes[0].value[n][0] for n in SAYS}


def test_the_error_is_a_value_error_and_accelerates_exception_where_accelerate_is_imported():
    pytest.importorskip("accelerate")

    def body():
        from accelerate.utils.operations import DistributedOperationException

        try:
            ad.reduce(torch.ones(2 + ad.get_rank()))
        except DistributedOperationException as exc:
            return (isinstance(exc, ValueError), isinstance(exc, ad.TensorMismatchError),
                    isinstance(exc, ad.DistributedOperationException))
        return "returned"

    assert run_distributed(body, 2) == [(True, True, True)] * 2
    assert ad.DistributedOperationException is ad.TensorMismatchError
    assert issubclass(ad.TensorMismatchError, ValueError)


def _in_step_results():
    r = ad.get_rank()
    t = torch.arange(4.0) + r
    nested = {"a": torch.full((2,), float(r)), "b": [torch.tensor(r)]}
    ad.broadcast(nested, ad.get_world_size() - 1)
    return {
        "broadcast nested": nested,
        "broadcast": ad.broadcast(t.clone(), src=0).tolist(),
        "all_reduce": ad.all_reduce(t.clone()).tolist(),
        "copy": ad.copy_tensor_to_devices(torch.tensor([7, 8], dtype=torch.int32)
                                          if r == ad.get_world_size() - 1 else None),
    }


@pytest.mark.parametrize("ws", [1, 2, 3])
def test_matching_calls_give_their_results(ws):
    for got in run_distributed(_in_step_results, ws):
        assert got["broadcast nested"]["a"].tolist() == [float(ws - 1)] * 2
        assert got["broadcast nested"]["b"][0].item() == ws - 1
        assert got["broadcast"] == [0.0, 1.0, 2.0, 3.0]
        assert got["all_reduce"] == [sum(i + r for r in range(ws)) for i in range(4)]
        assert got["copy"].tolist() == [7, 8] and got["copy"].dtype == torch.int32
