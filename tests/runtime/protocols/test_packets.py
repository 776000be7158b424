"""Small tensors ride with the shape check's headers (issue #75): ``all_reduce``, ``reduce`` and
``broadcast`` of up to ``CARRY_BYTES`` on a CPU group are one collective, the same bits on
every rank (a sum in rank order), and what cannot ride (too big, another dtype, autograd's
tensors, an op other than a sum) still takes the check and the collective: two.

The unit tests at the end take the packet codec alone, in one process: ``_pack`` lays a
rank's tensors out (description words, then each leaf's bytes on a 16-byte boundary),
``words`` / ``layout`` / ``specs`` / ``unpack`` read it back bit for bit; a dtype the kit
cannot send is refused naming its path."""

from __future__ import annotations

import math

import pytest
import torch

from axolotl_dist._runtime.protocols import packets
from axolotl_dist._runtime.protocols.packets import (DTYPES, _pack, _padded, layout, specs,
                                                     unpack, words)
from axolotl_dist.testing import run_distributed


def _collectives_per_call():
    import axolotl_dist as ad
    from axolotl_dist._runtime.base.groups import group_of
    from axolotl_dist._runtime.liveness.progress import count
    from axolotl_dist._runtime.protocols.headers import CARRY_BYTES

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
        before = count(g, "collective")
        call()
        out[name] = count(g, "collective") - before
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


# --------------------------------------------------------------------------- the packet codec
CPU = torch.device("cpu")


def _packed(leaves, room=0, data=True, what="gather"):
    """``(buffer, its first int64 words, the description whole)`` of ``leaves``' packet."""
    paths = [f"data[{i}]" for i in range(len(leaves))]
    buf, total = _pack(leaves, paths, CPU, room, what, data)
    assert buf.dtype == torch.uint8 and buf.numel() == max(total, room)
    head = words(buf[None], buf.numel() // 8)[0]
    assert head[0] == total
    return buf, head[:2 + head[1]]


def _bits(dtype, shape, seed=5):
    """A tensor of ``dtype`` and ``shape`` holding random bits (nans, infs, subnormals)."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8,
                        generator=gen)
    if dtype == torch.bool:
        raw = raw % 2  # a bool byte other than 0 or 1 is not a bool
    return raw.view(dtype).reshape(shape)


def _same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


MIXED = [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.tensor([1, -2, 3],
         dtype=torch.int8), torch.tensor(True), torch.empty(0, 4, dtype=torch.float64),
         torch.tensor([0.5, -1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16)]


def test_padding_rounds_up_to_16_bytes():
    assert [_padded(n) for n in (0, 1, 15, 16, 17, 31, 32, 100)] == [0, 16, 16, 16, 32, 32, 32,
                                                                       112]


def test_the_wire_codes_of_the_dtypes_are_their_places():
    assert DTYPES[:12] == [torch.float32, torch.float64, torch.float16, torch.bfloat16,
                           torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                           torch.bool, torch.complex64, torch.complex128]


def test_a_packet_starts_with_its_length_and_description():
    _, head = _packed(MIXED)
    # packet bytes, description words, then leaf count and per leaf: code, ndim, shape
    assert head == [240, 17, 5, 0, 2, 2, 3, 7, 1, 3, 9, 0, 1, 2, 0, 4, 3, 1, 5]


def test_each_leaf_starts_on_a_16_byte_boundary():
    _, head = _packed(MIXED)
    # the description's 19 words (152 bytes) end at 160; an empty leaf takes no room
    assert list(layout(head)) == [(torch.float32, [2, 3], 160, 24), (torch.int8, [3], 192, 3),
                                  (torch.bool, [], 208, 1), (torch.float64, [0, 4], 224, 0),
                                  (torch.bfloat16, [5], 224, 10)]
    assert specs(head) == [(torch.float32, (2, 3)), (torch.int8, (3,)), (torch.bool, ()),
                           (torch.float64, (0, 4)), (torch.bfloat16, (5,))]


def test_mixed_leaves_unpack_bit_for_bit():
    buf, head = _packed(MIXED)
    got = unpack(buf, head)
    assert len(got) == len(MIXED)
    for mine, back in zip(MIXED, got):
        assert _same_bits(mine, back), (mine, back)


def test_the_bytes_between_and_after_leaves_are_zero():
    buf, head = _packed(MIXED, room=320)
    assert buf.numel() == 320
    used = torch.zeros(320, dtype=torch.bool)
    used[:8 * len(head)] = True
    for _, _, at, n in layout(head):
        used[at:at + n] = True
    assert int(buf[~used].count_nonzero()) == 0


@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5), (0,), (2, 0, 3), (2, 1, 1, 3)],
                         ids=str)
def test_every_dtype_the_kit_sends_unpacks_bit_for_bit(shape):
    leaves = [_bits(dtype, shape, seed=i) for i, dtype in enumerate(DTYPES)]
    buf, head = _packed(leaves)
    for _, _, at, _ in layout(head):
        assert at % 16 == 0
    assert specs(head) == [(dtype, shape) for dtype in DTYPES]
    for mine, back in zip(leaves, unpack(buf, head)):
        assert _same_bits(mine, back), mine.dtype


def test_unpacked_leaves_are_views_of_the_packet():
    buf, head = _packed([torch.tensor([1.0, 2.0]), torch.tensor([3, 4])])
    first, second = unpack(buf, head)
    # description [2, 0, 1, 2, 4, 1, 2] after 2 words: 72 bytes, the first leaf at 80
    buf[80:84] = 0  # the first leaf's first float
    assert first.tolist() == [0.0, 2.0] and second.tolist() == [3, 4]


def test_a_strided_leaf_packs_its_values():
    base = torch.arange(24, dtype=torch.int16).reshape(4, 6)
    view = base.t()[::2, 1:]  # shape (3, 3), not contiguous
    buf, head = _packed([view])
    (got,) = unpack(buf, head)
    assert got.tolist() == [[6, 12, 18], [8, 14, 20], [10, 16, 22]]


def test_a_leaf_in_a_graph_packs_its_values():
    leaf = torch.tensor([1.5, -2.5], requires_grad=True) * 2
    buf, head = _packed([leaf])
    (got,) = unpack(buf, head)
    assert got.tolist() == [3.0, -5.0] and not got.requires_grad


def test_a_conjugate_or_negative_view_packs_its_values():
    # a lazy view's memory holds the values before it: packed as bytes, they must be resolved
    leaf = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()
    buf, head = _packed([leaf])
    (got,) = unpack(buf, head)
    assert got.tolist() == [1 - 2j, 3 + 4j]
    negative = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj().imag
    assert negative.is_neg()
    buf, head = _packed([negative])
    (got,) = unpack(buf, head)
    assert got.tolist() == [-2.0, 4.0]


def test_a_description_alone_has_no_data_but_the_same_layout():
    with_data, head = _packed(MIXED)
    alone, described = _packed(MIXED, data=False)
    assert described == [160] + head[1:]  # the description's 152 bytes, padded
    assert alone.numel() == 160
    assert list(layout(described)) == list(layout(head))
    assert torch.equal(alone[8:152], with_data[8:152])


def test_a_room_larger_than_the_packet_is_zero_filled():
    buf, head = _packed([torch.ones(1, dtype=torch.int64)], room=96)
    assert head == [64, 4, 1, 4, 1, 1] and buf.numel() == 96  # 48 bytes of words, 16 of data
    assert buf[48:56].view(torch.int64).item() == 1
    assert int(buf[56:].count_nonzero()) == 0


def test_no_leaves_is_a_description_of_zero_leaves():
    buf, head = _packed([])
    assert head == [32, 1, 0] and buf.numel() == 32
    assert unpack(buf, head) == [] and specs(head) == []


def test_words_reads_each_row_of_a_gather():
    one, _ = _packed([torch.ones(2)], room=128)
    two, _ = _packed([torch.ones(2), torch.zeros(3, dtype=torch.uint8)], room=128)
    rows = torch.stack([one, two])  # ranks x slot bytes, as a gather's result
    assert words(rows, 4) == [[64, 4, 1, 0], [112, 7, 2, 0]]
    assert words(rows, 1) == [[64], [112]]


def test_unpack_reads_a_description_cut_short_by_the_peek():
    leaves = [torch.full((i + 1,), i, dtype=torch.int32) for i in range(30)]
    buf, head = _packed(leaves)
    assert len(head) > 64  # more than the words a gather reads at once
    got = unpack(buf, head[:2])  # just the packet's length and description words
    assert [t.tolist() for t in got] == [[i] * (i + 1) for i in range(30)]


def test_a_dtype_the_kit_cannot_send_is_refused_naming_its_path():
    leaves = [torch.ones(2), torch.zeros(2, dtype=torch.float8_e4m3fnuz)]
    for data in (True, False):
        with pytest.raises(TypeError, match=r"^gather: data\[1\] has dtype "
                                            r"torch\.float8_e4m3fnuz, which the kit cannot "
                                            r"send$"):
            _pack(leaves, ["data[0]", "data[1]"], CPU, 0, "gather", data)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("make", [lambda: torch.eye(2).to_sparse(),
                                  lambda: torch.eye(2).to_sparse_csr()], ids=["coo", "csr"])
def test_a_sparse_leaf_is_refused_naming_its_path_and_the_fix(make):
    # was torch's bare "unsupported memory format option Contiguous"
    leaves = [torch.ones(2), make()]
    for data in (True, False):
        with pytest.raises(TypeError, match=r"^gather: data\['x'\] is a torch\.sparse_\w+ "
                                            r"tensor, which the kit cannot send: pass it dense "
                                            r"\(data\['x'\]\.to_dense\(\)\)$"):
            _pack(leaves, ["data[0]", "data['x']"], CPU, 0, "gather", data)


def test_flatten_gives_the_paths_a_refusal_names():
    leaves, paths, rebuild = packets.flatten({"a": [torch.ones(1), (torch.zeros(2),)]},
                                             "gather")
    assert paths == ["data['a'][0]", "data['a'][1][0]"]
    back = rebuild([torch.tensor([5.0]), torch.tensor([6.0, 7.0])])
    assert type(back["a"][1]) is tuple and back["a"][1][0].tolist() == [6.0, 7.0]
