"""split_between_processes: every rank's share, reassembled, with and without padding."""

import pytest
import torch

import axolotl_dist as ad
from axolotl_dist.testing import run_distributed

# ---------------------------------------------------------------- split_between_processes


def _split_inputs():
    return {
        "list": list(range(10)),
        "tuple": tuple("abcdefghij"),
        "dict": {"a": list(range(10)), "b": [str(i) for i in range(10)]},
        "tensor": torch.arange(20).reshape(10, 2),
    }


def _concat(parts, kind):
    if kind == "dict":
        return {k: sum((p[k] for p in parts), []) for k in parts[0]}
    if kind == "tensor":
        return torch.cat(parts)
    if kind == "tuple":
        return tuple(x for p in parts for x in p)
    return [x for p in parts for x in p]


@pytest.mark.parametrize("padding", [False, True])
def test_split_between_processes_reassembles(padding):
    def body():
        out = {}
        for kind, value in _split_inputs().items():
            with ad.split_between_processes(value, apply_padding=padding) as mine:
                out[kind] = mine
        return out

    parts = run_distributed(body, 3, timeout=60)
    for kind, value in _split_inputs().items():
        pieces = [p[kind] for p in parts]
        lengths = [len(x) if kind != "dict" else len(x["a"]) for x in pieces]
        if padding:
            assert lengths == [4, 4, 4]  # equal lengths, each rank padded with the input's last item
            for piece, (lo, hi) in zip(pieces, [(0, 4), (4, 7), (7, 10)]):
                pad = 4 - (hi - lo)
                if kind == "dict":
                    assert piece["a"] == value["a"][lo:hi] + [value["a"][-1]] * pad
                elif kind == "tensor":
                    assert torch.equal(piece, torch.cat([value[lo:hi]] + [value[-1:]] * pad))
                else:
                    assert list(piece) == list(value[lo:hi]) + [value[-1]] * pad
        else:
            assert lengths == [4, 3, 3]  # first len % world ranks get one extra
            whole = _concat(pieces, kind)
            if kind == "tensor":
                assert torch.equal(whole, value)
            else:
                assert whole == value


def test_split_between_processes_single_process_unchanged():
    data = [1, 2, 3]
    with ad.split_between_processes(data, apply_padding=True) as mine:
        assert mine is data


def test_split_between_processes_bad_input():
    def body():
        errors = []
        for bad, match in (({"a": [1, 2], "b": [1]}, "equal lengths"), (42, "takes a list")):
            try:
                with ad.split_between_processes(bad):
                    pass
            except (ValueError, TypeError) as exc:
                errors.append(match in str(exc))
        return errors

    assert run_distributed(body, 2, timeout=60) == [[True, True], [True, True]]


