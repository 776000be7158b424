"""Sharded flat tensors and DTensor shape utilities.

Multi-process behaviour runs on real gloo ranks forked by :func:`run_distributed`; layouts at
8 ranks run with torch's fake process group inside one forked rank, so the pytest process
never holds a process group. Each distributed test does many checks per launch to keep the
suite fast; a failed check raises in the rank and shows its traceback.
"""

from __future__ import annotations

import copy
import logging
import math
import sys

import pytest
import torch

from axolotl_dist.errors import DistributedConfigError
from axolotl_dist.tensors import ShardedFlatParameter, ShardedFlatTensor, ShardingSpec
from axolotl_dist.tensors._flat_comm import assemble, pad_rank_major
from axolotl_dist.testing import run_distributed
from fixtures import fake_group

TIMEOUT = 120


@pytest.fixture(scope="module")
def warm_imports():
    """Import here what torch imports lazily on first use of an optimizer or a DTensor
    (torch._dynamo, torch.distributed.tensor: seconds on a busy machine), so that forked
    ranks inherit the modules instead of each importing them again."""
    import torch.distributed.tensor  # noqa: F401

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # imports torch._dynamo


# ---------------------------------------------------------------------------- ShardingSpec
@pytest.mark.parametrize(
    "offsets, words",
    [
        (((0, 2), (4, 3), (3, 6)), ["rank 1", "(4, 3)", "backwards", "start 4 > end 3"]),
        (((0, 3), (2, 6)), ["rank 0", "(0, 3)", "rank 1", "(2, 6)", "overlap", "[2, 3)"]),
        (((0, 2), (3, 6)), ["[2, 3)", "no rank", "gap", "rank 0", "(0, 2)", "rank 1", "(3, 6)"]),
        (((2, 6), (0, 0)), ["[0, 2)", "no rank", "rank 0", "(2, 6)"]),
        (((0, 2), (2, 5)), ["[5, 6)", "no rank", "rank 1", "(2, 5)", "5 of 6"]),
        (((0, 2), (2, 7)), ["rank 1", "(2, 7)", "outside", "6 element"]),
        (((-1, 2), (2, 6)), ["rank 0", "(-1, 2)", "outside"]),
        ((((0, 2), (4, 6)), ((2, 5),)), ["rank 0", "(4, 6)", "rank 1", "(2, 5)", "overlap", "[4, 5)"]),
        ((), ["no ranks"]),
        (((0, 2), "ab"), ["rank 1"]),
    ],
)
def test_spec_rejects_bad_offsets_with_clear_message(offsets, words):
    with pytest.raises(DistributedConfigError) as info:
        ShardingSpec((2, 3), offsets)
    assert isinstance(info.value, ValueError)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_spec_normalizes_and_reports_sizes():
    spec = ShardingSpec(torch.Size([2, 3]), [[0, 4], [[4, 5], [5, 6]]])
    assert spec.unsharded_shape == (2, 3)
    assert spec.unsharded_flattened_offsets == (((0, 4),), ((4, 5), (5, 6)))
    assert spec.unsharded_numel == 6 and spec.unsharded_flattened_shape == (6,)
    assert spec.sharded_numels == (4, 2) and spec.world_size == 2
    assert spec == ShardingSpec((2, 3), ((0, 4), ((4, 5), (5, 6)))) and hash(spec)
    with pytest.raises(DistributedConfigError, match="3 rank.*process group has 2"):
        ShardingSpec((3,), ((0, 1), (1, 2), (2, 3))).check_world_size(2)
    # empty ranges anywhere inside the tensor are fine; ranks may hold nothing
    assert ShardingSpec((4,), (((0, 2), (3, 3)), (), ((2, 4),))).sharded_numels == (2, 0, 2)


@pytest.mark.parametrize("numel, ws, sizes", [
    (5, 4, (2, 1, 1, 1)), (2, 8, (1, 1, 0, 0, 0, 0, 0, 0)), (0, 3, (0, 0, 0)), (12, 4, (3,) * 4),
])
def test_balanced_spec_examples(numel, ws, sizes):
    assert ShardingSpec.balanced((numel,), ws).sharded_numels == sizes


def test_balanced_spec_never_goes_backwards():
    for ws in range(1, 17):
        for numel in range(0, 40):
            spec = ShardingSpec.balanced((numel,), ws)  # validates fully
            assert max(spec.sharded_numels) - min(spec.sharded_numels) <= 1
            assert max(spec.sharded_numels) == math.ceil(numel / ws)


def _random_spec(gen: torch.Generator, numel: int, ws: int) -> ShardingSpec:
    cuts = sorted(torch.randint(0, numel + 1, (3 * ws - 1,), generator=gen).tolist())
    bounds = [0] + cuts + [numel]
    pieces = [(bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    owners = torch.randint(0, ws, (len(pieces),), generator=gen).tolist()
    order = torch.randperm(len(pieces), generator=gen).tolist()
    per_rank = [[] for _ in range(ws)]
    for i in order:
        per_rank[owners[i]].append(pieces[i])
    return ShardingSpec((numel,), tuple(tuple(r) for r in per_rank))


def test_padded_buffer_layout_round_trips_for_any_spec():
    """The gather layout (pad per rank, assemble) inverts itself, also at 8 ranks, 2 elements."""
    gen = torch.Generator().manual_seed(0)
    specs = [ShardingSpec.balanced(shape, ws) for shape, ws in [((2,), 8), ((5,), 4), ((17,), 3),
                                                                ((1000,), 7), ((12,), 4)]]
    specs += [ShardingSpec((7,), (((0, 2), (2, 3)), (), ((3, 4), (4, 7))))]  # in place, gaps
    specs += [_random_spec(gen, n, ws) for n, ws in [(2, 8), (5, 4), (17, 3), (64, 8), (9, 1)] * 4]
    assert sum(s._aligned for s in specs) >= 2 and sum(s._monotone and not s._aligned for s in specs) >= 4
    for spec in specs:
        for dtype in (torch.float64, torch.bfloat16):
            full = torch.arange(spec.unsharded_numel, dtype=torch.float32)
            buf = pad_rank_major(full, spec, dtype)
            assert buf.shape == (spec.world_size, spec.max_sharded_numel)
            for rank, ranges in enumerate(spec.unsharded_flattened_offsets):
                expect = torch.cat([full[s:e] for s, e in ranges] + [full[:0]])
                assert torch.equal(buf[rank, :expect.numel()], expect.to(dtype))
            assert torch.equal(assemble(buf, spec), full.to(dtype)), spec


# ---------------------------------------------------------------------------- one process
def test_single_process_without_init():
    """No process group and no launcher env: a world of one, nothing communicates."""
    full = torch.arange(12.0).view(3, 4)
    t = ShardedFlatTensor.shard(full)
    assert t.is_sharded and t.sharded_shape == (12,) and t.unsharded_shape == (3, 4)
    gathered = t.gather(dtype=torch.float64)
    assert gathered.dtype == torch.float64 and torch.equal(gathered, full.double())
    gathered.add_(1)  # a copy, not the shard
    assert torch.equal(t.gather(), full)
    t.unshard_()
    assert not t.is_sharded and t.shape == (3, 4)
    t.data.mul_(2)
    t.reshard_(writeback=True)
    assert t.is_sharded and torch.equal(t.gather(), full * 2)
    with pytest.raises(DistributedConfigError, match="not been marked"):
        ShardedFlatTensor(torch.ones(3)).sharding_spec
    with pytest.raises(DistributedConfigError, match="1-D"):
        ShardedFlatTensor(torch.ones(2, 2))
    with pytest.raises(DistributedConfigError, match=r"shape \(3, 4\).*\(12,\)"):
        ShardedFlatTensor.shard(full, ShardingSpec((12,), ((0, 12),)))
    with pytest.raises(DistributedConfigError, match="2 rank"):
        ShardedFlatTensor.shard(full, ShardingSpec((3, 4), ((0, 6), (6, 12))))


def test_mark_as_sharded_and_sharded_data_setter():
    spec = ShardingSpec((2, 2), ((0, 4),))
    t = ShardedFlatTensor(torch.arange(4.0))
    assert t.metadata_set and not t.is_sharded  # OLMo-core: built by __new__, not yet marked
    t.mark_as_sharded(spec)
    assert t.is_sharded and t.unsharded_flattened_offsets == ((0, 4),) and t.sharded_numel == 4
    with pytest.raises(DistributedConfigError, match="already marked"):
        t.mark_as_sharded(spec)
    with pytest.raises(DistributedConfigError, match="1 element.*has 3"):
        ShardedFlatTensor(torch.ones(3)).mark_as_sharded(ShardingSpec((1,), ((0, 1),)))
    t.sharded_data = torch.ones(4)
    assert torch.equal(t.gather(), torch.ones(2, 2))
    t.unshard_()
    t.sharded_data = torch.zeros(4)  # while unsharded: replaces the saved shard
    assert t.shape == (2, 2)
    t.reshard_()
    assert torch.equal(t.gather(), torch.zeros(2, 2))
    same = ShardedFlatTensor(t)  # shares the shard and the metadata
    assert same.sharding_spec is spec and same.data_ptr() == t.data_ptr()


def test_like_functions_deepcopy_and_module_use():
    p = ShardedFlatParameter.shard(torch.arange(6.0).view(2, 3), requires_grad=True)
    assert isinstance(p, torch.nn.Parameter) and p.requires_grad
    state = torch.zeros_like(p)
    assert type(state) is ShardedFlatTensor and state.is_sharded
    assert state.sharding_spec is p.sharding_spec
    assert type(p + 1) is torch.Tensor  # ordinary ops give plain tensors
    q = copy.deepcopy(p)
    assert type(q) is ShardedFlatParameter and q.sharding_spec == p.sharding_spec
    q.data.add_(1)
    assert not torch.equal(q.sharded_data, p.sharded_data)
    lin = torch.nn.Linear(3, 2)
    lin.weight = ShardedFlatParameter.shard(lin.weight.detach(), requires_grad=True)
    assert lin.weight in list(lin.parameters())
    assert repr(lin.weight) == (
        f"ShardedFlatParameter(local_tensor={lin.weight.sharded_data}, requires_grad=True)")


@pytest.mark.parametrize("cls", [ShardedFlatTensor, ShardedFlatParameter])
@pytest.mark.parametrize("make", ["_make_subclass", "as_subclass"])
def test_instances_made_without_new_answer_metadata_set_is_sharded_and_repr(cls, make):
    data = torch.arange(3.0)
    t = torch.Tensor._make_subclass(cls, data, False) if make == "_make_subclass" else data.as_subclass(cls)
    assert type(t) is cls
    assert t.metadata_set is False and t.is_sharded is False
    assert "[0., 1., 2.]" in repr(t) and "local_tensor=" not in repr(t)  # a plain tensor's repr
    with pytest.raises(DistributedConfigError, match="not been marked"):
        t.sharding_spec
    t.mark_as_sharded(ShardingSpec((3,), ((0, 3),)))  # and it can still be marked
    assert t.metadata_set and t.is_sharded and torch.equal(t.gather(), data)


def test_repr_follows_olmo_core_format():
    t = ShardedFlatTensor(torch.arange(4.0))
    assert repr(t) == "ShardedFlatTensor(local_tensor=tensor([0., 1., 2., 3.]))"
    t.mark_as_sharded(ShardingSpec((2, 2), ((0, 4),)))
    t.unshard_()
    assert repr(t) == ("ShardedFlatTensor(local_tensor=tensor([0., 1., 2., 3.]), "
                       f"global_tensor={t.data})")
    p = ShardedFlatParameter(torch.ones(2), requires_grad=False)
    assert repr(p) == "ShardedFlatParameter(local_tensor=tensor([1., 1.]), requires_grad=False)"
    # built without data: OLMo-core's repr says None
    assert repr(ShardedFlatParameter()) == "ShardedFlatParameter(local_tensor=None, requires_grad=True)"
    assert repr(ShardedFlatTensor()) == "ShardedFlatTensor(local_tensor=None)"
    assert repr(ShardedFlatTensor(torch.empty(0))) == "ShardedFlatTensor(local_tensor=tensor([]))"


def test_meta_tensors_stay_on_meta():
    t = ShardedFlatTensor.shard(torch.empty(4, 5, device="meta"), requires_grad=False)
    assert t.is_meta and t.sharded_shape == (20,)
    assert t.gather().is_meta and t.gather().shape == (4, 5)
    t.unshard_()
    assert t.is_meta and t.shape == (4, 5)
    t.reshard_(writeback=True)
    assert t.is_meta and t.shape == (20,)
    on_cpu = ShardedFlatTensor.shard(torch.empty(7, device="meta"), device="cpu")
    assert on_cpu.device.type == "cpu" and on_cpu.shape == (7,)


# ---------------------------------------------------------------------------- gloo ranks
def _expect_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, (what, actual.dtype, expected.dtype)
    assert tuple(actual.shape) == tuple(expected.shape), (what, actual.shape, expected.shape)
    assert torch.equal(actual, expected), (what, actual, expected)


def _round_trip_body():
    """Every rank: shard/gather round trips, casts, unshard/reshard, wrap, chunks, several ranges."""
    import torch.distributed as dist

    rank, ws = dist.get_rank(), dist.get_world_size()
    checked = 0
    for shape in [(8, 4), (5,), (7, 3), (1,), (2, 3, 5), (0,)]:
        full = torch.arange(math.prod(shape), dtype=torch.float32).view(shape) * 0.5
        mine = full + 1000 * rank  # synchronize=True takes group rank 0's values
        t = ShardedFlatTensor.shard(mine)
        assert t.sharding_spec == ShardingSpec.balanced(shape, ws)
        _expect_equal(t.gather(), full, f"gather {shape}")
        _expect_equal(t.gather(dtype=torch.float64), full.double(), f"gather f64 {shape}")
        _expect_equal(t.gather(dtype=torch.bfloat16), full.bfloat16(), f"gather bf16 {shape}")
        _expect_equal(t.sharded_data, t.sharded_chunk(full), f"shard {shape}")
        assert torch.equal(mine, full + 1000 * rank), "shard() must not modify its input"
        own = ShardedFlatTensor.shard(mine, synchronize=False)
        _expect_equal(own.sharded_data, own.sharded_chunk(mine), f"own shard {shape}")
        checked += 1

    # unshard_ / reshard_ without and with writeback: rank 0's edits win
    full = torch.arange(10, dtype=torch.float32)
    t = ShardedFlatTensor.shard(full)
    t.unshard_(dtype=torch.float64)
    assert not t.is_sharded and t.shape == (10,) and t.dtype == torch.float64
    t.data.add_(100 * (rank + 1))
    t.reshard_()
    assert t.is_sharded and t.dtype == torch.float32
    _expect_equal(t.gather(), full, "reshard without writeback")
    t.unshard_()
    t.data.add_(100 * (rank + 1))
    t.reshard_(writeback=True)
    _expect_equal(t.gather(), full + 100, "writeback: rank 0's edits win")
    t.unshard_(rank0_only=True)
    assert t.shape == ((10,) if rank == 0 else (0,))
    if rank == 0:
        t.data.mul_(2)
    t.reshard_(writeback=True)
    _expect_equal(t.gather(), (full + 100) * 2, "writeback after rank0_only unshard")
    t.unshard_(unsharded_data=torch.full((2, 5), 7.0))
    t.reshard_(writeback=True)
    _expect_equal(t.gather(), torch.full((10,), 7.0), "unshard_ with given data")

    # wrap, sharded and unsharded
    w = t.wrap(torch.full(t.sharded_shape, float(rank)))
    assert type(w) is ShardedFlatTensor and w.sharding_spec == t.sharding_spec
    owner = torch.tensor([r for r, n in enumerate(t.sharding_spec.sharded_numels) for _ in range(n)])
    _expect_equal(w.gather(), owner.float(), "wrap of shards")
    t.unshard_()
    wu = t.wrap(torch.arange(10.0) * 3)
    assert not wu.is_sharded and wu.shape == (10,)
    wu.reshard_()
    _expect_equal(wu.gather(), torch.arange(10.0) * 3, "wrap of full data")
    t.reshard_()

    # chunk_unsharded with padding
    chunks = t.chunk_unsharded(torch.arange(10.0), pad=True)
    width = max(t.sharding_spec.sharded_numels)
    assert len(chunks) == ws and all(c.shape == (width,) for c in chunks)
    _expect_equal(torch.cat([c[:n] for c, n in zip(chunks, t.sharding_spec.sharded_numels)]),
                  torch.arange(10.0), "chunk_unsharded")
    for c, n in zip(chunks, t.sharding_spec.sharded_numels):
        assert not c[n:].any(), "padding must be zeros"

    # several ranges per rank, out of order, with an empty range and uneven sizes
    numel = 6 * ws + 1
    pieces = [(i * 3, min(numel, i * 3 + 3)) for i in range(-(-numel // 3))]
    per_rank = [tuple(pieces[i] for i in range(len(pieces)) if i % ws == r)[::-1] for r in range(ws)]
    per_rank[-1] = per_rank[-1] + ((numel, numel),)
    spec = ShardingSpec((numel,), tuple(per_rank))
    data = torch.arange(numel, dtype=torch.int64)
    multi = ShardedFlatTensor.shard(data, spec)
    _expect_equal(multi.sharded_data, torch.cat([data[s:e] for s, e in spec.unsharded_flattened_offsets[rank]]), "multi shard")
    _expect_equal(multi.gather(), data, "multi gather")
    _expect_equal(multi.gather(dtype=torch.float32), data.float(), "multi gather cast")
    multi.unshard_()
    multi.data.neg_()
    multi.reshard_(writeback=True)
    _expect_equal(multi.gather(), -data, "multi writeback")

    # meta tensors never communicate: only the last rank touches them
    if rank == ws - 1:
        m = ShardedFlatTensor.shard(torch.empty(5, 3, device="meta"))
        assert m.gather().is_meta and m.gather().shape == (5, 3)
        m.unshard_()
        m.reshard_(writeback=True)
        assert m.is_meta and m.shape == m.sharded_shape
    dist.barrier()
    return checked


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_round_trips_on_gloo(ws):
    assert run_distributed(_round_trip_body, ws, timeout=TIMEOUT) == [6] * ws


def _subgroup_body():
    """rank0_only, synchronize and writeback on the subgroup [1, 2] of a world of 3."""
    import torch.distributed as dist

    rank = dist.get_rank()
    group = dist.new_group([1, 2])
    if rank == 0:
        return None
    full = torch.arange(9, dtype=torch.float32).view(3, 3)
    t = ShardedFlatTensor.shard(full * rank, process_group=group)  # group rank 0 is global 1
    assert t.process_group is group and t.sharding_spec.world_size == 2
    g = t.gather(rank0_only=True)
    if rank == 1:
        assert torch.equal(g, full), g
    else:
        assert g.numel() == 0
    assert torch.equal(t.gather(), full)
    t.unshard_(rank0_only=True, dtype=torch.float64)
    assert t.shape == ((3, 3) if rank == 1 else (0,))
    if rank == 1:
        t.data.add_(1)
    t.reshard_(writeback=True)
    assert t.dtype == torch.float32
    return t.gather().tolist()


def test_rank0_only_on_subgroup_without_global_rank_0():
    out = run_distributed(_subgroup_body, 3, timeout=TIMEOUT)
    expect = (torch.arange(9.0).view(3, 3) + 1).tolist()
    assert out == [None, expect, expect]


def _training_body():
    """A ShardedFlatParameter model trains like the unsharded one (AdamW, 2 steps)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    rank, ws = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    model = copy.deepcopy(ref)
    for mod in (model[0], model[2]):
        for name, param in list(mod.named_parameters(recurse=False)):
            setattr(mod, name, ShardedFlatParameter.shard(param.detach(), requires_grad=True))
    assert all(isinstance(p, ShardedFlatParameter) for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    x, y = torch.randn(4 * ws, 5), torch.randn(4 * ws, 3)
    for _ in range(2):
        params = list(model.parameters())
        for p in params:
            p.unshard_()
        part = slice(4 * rank, 4 * rank + 4)
        F.mse_loss(model(x[part]), y[part]).backward()
        for p in params:
            dist.all_reduce(p.grad)
            p.grad.div_(ws)
            p.reshard_()
            assert p.is_sharded and p.grad.shape == p.sharded_shape
        opt.step()
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    state = opt.state[next(model.parameters())]["exp_avg"]
    assert isinstance(state, ShardedFlatTensor) and state.is_sharded
    worst = 0.0
    for p, r in zip(model.parameters(), ref.parameters()):
        assert p.gather().shape == r.shape
        worst = max(worst, (p.gather() - r.detach()).abs().max().item())
    return worst



@pytest.mark.parametrize("ws", [2, 3])
def test_sharded_parameter_training_step_matches_reference(ws, warm_imports):
    for worst in run_distributed(_training_body, ws, timeout=TIMEOUT):
        assert worst < 1e-5


# ---------------------------------------------------------------------------- DTensor utils
def _placement_cases():
    from torch.distributed.tensor import Replicate, Shard

    return [
        ((8, 4), [Shard(0), Shard(1)]),
        ((5, 3), [Shard(0), Shard(0)]),
        ((3, 5), [Shard(1), Shard(0)]),
        ((1, 7), [Shard(0), Shard(0)]),   # empty shards
        ((3, 2), [Shard(1), Shard(1)]),   # nested sharding with empty shards
        ((7, 6), [Replicate(), Shard(-1)]),
        ((2,), [Shard(0), Replicate()]),
        ((4, 0), [Shard(1), Shard(0)]),
    ]


def _dtensor_2x2_body():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as torch_calc

    from axolotl_dist.tensors import dtensor_utils as du

    # full_tensor() of nested shards warns (torch's log) that it does two all-gathers
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2))
    answers = []
    for shape, placements in _placement_cases():
        full = torch.arange(math.prod(shape), dtype=torch.float32).view(shape)
        dt = distribute_tensor(full, mesh, placements)
        local_shape, offset = du.get_local_shape_and_global_offset(dt)
        assert local_shape == tuple(dt.to_local().shape), (shape, placements, local_shape)
        assert (local_shape, offset) == tuple(map(tuple, torch_calc(shape, mesh, placements)))
        index = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
        if all(local_shape):
            assert torch.equal(dt.to_local(), full[index]), (shape, placements)
        # DTensor rebuilt from our slices gathers back to the full tensor
        piece = full[index] if all(local_shape) else torch.empty(local_shape)
        back = DTensor.from_local(piece, mesh, placements, run_check=False, shape=full.shape,
                                  stride=full.stride()).full_tensor()
        assert torch.equal(back, full), (shape, placements)
        every = [du.compute_local_shape_and_global_offset(shape, mesh, placements, rank=r)
                 for r in range(4)]
        assert every[rank] == (local_shape, offset)
        answers.append(every)
    return answers


def test_dtensor_utils_agree_with_dtensor_on_2x2_mesh(warm_imports):
    answers = run_distributed(_dtensor_2x2_body, 4, timeout=TIMEOUT)
    assert all(a == answers[0] for a in answers)  # every rank agrees on every rank's answer


def _fake_body():
    """8 fake ranks, one at a time in this process: the seed's examples and 2 elements over 8."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from axolotl_dist.tensors import dtensor_utils as du

    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as torch_calc
    from torch.distributed.tensor.placement_types import _StridedShard

    out = {"first": [], "second": [], "second_placed": [], "flat8": [], "sft": []}
    for rank in range(8):
        os.environ.update(RANK=str(rank), WORLD_SIZE="8")
        fake_group(rank, 8)
        try:
            mesh = init_device_mesh("cpu", (2, 4))
            full = torch.arange(32.0).view(8, 4)
            dt = distribute_tensor(full, mesh, [Shard(0), Shard(0)], src_data_rank=None)
            got = du.get_local_shape_and_global_offset(dt)
            assert got[0] == tuple(dt.to_local().shape)
            assert torch.equal(dt.to_local(), full[got[1][0]:got[1][0] + got[0][0]])
            out["first"].append(got)
            two = torch.tensor([10.0, 20.0])
            out["second"].append(du.compute_local_shape_and_global_offset((2,), mesh, [Shard(0)]))
            placed = distribute_tensor(two, mesh, [Shard(0), Replicate()], src_data_rank=None)
            out["second_placed"].append(placed.to_local().tolist())
            strided = [_StridedShard(0, split_factor=4), Shard(0)]  # FSDP2 + TP layouts
            for shape, placements in [((16, 2), strided), ((9, 5), [Shard(1), Shard(0)])]:
                assert du.compute_local_shape_and_global_offset(shape, mesh, placements) == tuple(
                    map(tuple, torch_calc(shape, mesh, placements))), (shape, placements)
            flat = init_device_mesh("cpu", (8,))
            out["flat8"].append(du.compute_local_shape_and_global_offset((2,), flat, [Shard(0)]))
            # 2 elements over 8 ranks: no backwards range; each rank's part of the gather
            t = ShardedFlatTensor.shard(two, synchronize=False)
            g = t.gather()  # the fake backend moves no data: check this rank's own slot
            ranges = t.unsharded_flattened_offsets
            assert g.shape == (2,) and all(torch.equal(g[s:e], two[s:e]) for s, e in ranges)
            out["sft"].append((t.sharding_spec.sharded_numels, t.sharded_data.tolist()))
        finally:
            dist.destroy_process_group()
    return out


def test_dtensor_utils_seed_examples_with_fake_backend(warm_imports):
    out = run_distributed(_fake_body, 1, init=False, timeout=TIMEOUT)[0]
    # seed example 1: (8, 4) over a (2, 4) mesh with [Shard(0), Shard(0)]
    assert out["first"] == [((1, 4), (r, 0)) for r in range(8)]
    # seed example 2, as DTensor places it: rows of the row-major mesh, ranks 0 and 4 first
    assert out["second_placed"] == [[10.0]] * 4 + [[20.0]] * 4
    assert out["second"] == [((1,), (0,))] * 4 + [((1,), (1,))] * 4
    # the seed's table (ranks 0 and 1 hold the elements) is the 1-D mesh of 8 ranks
    assert out["flat8"] == [((1,), (0,)), ((1,), (1,))] + [((0,), (2,))] * 6
    assert [s[0] for s in out["sft"]] == [(1, 1, 0, 0, 0, 0, 0, 0)] * 8
    assert [s[1] for s in out["sft"]] == [[10.0], [20.0]] + [[]] * 6


def test_dtensor_utils_rank_outside_mesh_and_bad_placements():
    def body():
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import Partial, Shard
    
        from axolotl_dist.tensors import dtensor_utils as du

        fake_group(0, 4)
        try:
            mesh = DeviceMesh("cpu", [0, 1])
            outside = du.compute_local_shape_and_global_offset((4,), mesh, [Shard(0)], rank=3)
            partial = du.compute_local_shape_and_global_offset((4,), mesh, [Partial()], rank=1)
            try:
                du.compute_local_shape_and_global_offset((4,), mesh, [Shard(0), Shard(0)])
            except DistributedConfigError as exc:
                error = str(exc)
            return outside, partial, error
        finally:
            dist.destroy_process_group()

    outside, partial, error = run_distributed(body, 1, init=False, timeout=TIMEOUT)[0]
    assert outside == ((), ()) and partial == ((4,), (0,))
    assert "2 placement" in error and "1-dim mesh" in error


def test_import_is_cheap():
    """Importing the package must not pull in torch.distributed.tensor (about 0.5 s).

    Checked in a forked process (cheaper than a fresh interpreter): forget every
    ``axolotl_dist`` and ``torch.distributed.tensor`` module, import the package again and
    see whether DTensor came back.
    """

    def body():
        for name in list(sys.modules):
            if name.split(".")[0] == "axolotl_dist" or name.startswith("torch.distributed.tensor"):
                del sys.modules[name]
        import axolotl_dist  # noqa: F401
        import axolotl_dist.tensors.dtensor_utils  # noqa: F401

        return sorted(n for n in sys.modules if n.startswith("torch.distributed.tensor"))

    assert run_distributed(body, 1, init=False, timeout=TIMEOUT) == [[]]
