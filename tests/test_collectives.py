"""Tensor collectives (composer's names) on 1, 2 and 3 real gloo ranks, single-process shapes,
and subgroups with group-relative ``src``."""

import pytest
import torch
import torch.distributed as dist

import axolotl_dist as ad
from axolotl_dist.testing import run_distributed
from fixtures import NO_ENV



def test_tensor_collectives(world_size):
    def body():
        rank, ws = ad.get_rank(), ad.get_world_size()
        out = {}
        ad.barrier()
        t = torch.full((2, 3), float(rank))
        out["broadcast_returns_input"] = ad.broadcast(t, src=ws - 1) is t
        out["broadcast"] = t.tolist()
        nc = torch.arange(6.0).view(2, 3).t() * (rank + 1)  # non-contiguous
        out["broadcast_noncontig"] = ad.broadcast(nc, src=0).tolist()
        for op in ("sum", "SUM", "max", "min", "product", "avg", dist.ReduceOp.MAX):
            v = torch.tensor([rank + 1.0, -(rank + 1.0)])
            out[f"all_reduce {op}"] = ad.all_reduce(v, op).tolist()
        out["all_reduce default"] = ad.all_reduce(torch.tensor([1])).tolist()
        out["all_reduce bor"] = ad.all_reduce(torch.tensor([1 << rank]), "bor").tolist()
        out["all_reduce noncontig"] = ad.all_reduce(torch.ones(3, 2).t() * rank).tolist()
        # shapes differ per rank (rank r sends r+1 rows); dtype and values kept
        parts = ad.all_gather(torch.full((rank + 1, 2), rank, dtype=torch.bfloat16))
        out["all_gather"] = [(p.shape[0], p.dtype, p.float().unique().tolist()) for p in parts]
        out["all_gather 0-d"] = [p.item() for p in ad.all_gather(torch.tensor(rank * 1.5))]
        out["all_gather empty"] = [tuple(p.shape) for p in ad.all_gather(torch.empty(0, 3))]
        out["all_gather bool"] = [p.tolist() for p in ad.all_gather(torch.tensor([rank % 2 == 0]))]
        lazy = torch.tensor([complex(rank, 1)]).conj()  # a conjugate view: its memory says +1j
        out["gather conj"] = ad.gather(lazy).tolist()
        out["all_gather conj"] = [p.tolist() for p in ad.all_gather(lazy)]
        out["gather neg"] = ad.gather(lazy.imag).tolist()  # a negative view of +1
        return out

    got = run_distributed(body, world_size, timeout=60)
    n = world_size
    for rank, out in enumerate(got):
        assert out["gather conj"] == [complex(r, -1) for r in range(n)]
        assert out["all_gather conj"] == [[complex(r, -1)] for r in range(n)]
        assert out["gather neg"] == [-1.0] * n
        assert out["broadcast_returns_input"] is True
        assert out["broadcast"] == [[float(n - 1)] * 3] * 2
        assert out["broadcast_noncontig"] == torch.arange(6.0).view(2, 3).t().tolist()
        s = sum(range(1, n + 1))
        assert out["all_reduce sum"] == out["all_reduce SUM"] == [s, -s]
        assert out["all_reduce max"] == out[f"all_reduce {dist.ReduceOp.MAX}"] == [n, -1.0]
        assert out["all_reduce min"] == [1.0, -n]
        p = 1
        for k in range(1, n + 1):
            p *= k
        assert out["all_reduce product"] == [p, p * (-1) ** n]
        assert out["all_reduce avg"] == [s / n, -s / n]
        assert out["all_reduce default"] == [n]
        assert out["all_reduce bor"] == [(1 << n) - 1]
        assert out["all_reduce noncontig"] == (torch.ones(3, 2).t() * sum(range(n))).tolist()
        assert out["all_gather"] == [(r + 1, torch.bfloat16, [float(r)]) for r in range(n)]
        assert out["all_gather 0-d"] == [r * 1.5 for r in range(n)]
        assert out["all_gather empty"] == [(0, 3)] * n
        assert out["all_gather bool"] == [[r % 2 == 0] for r in range(n)]


@pytest.mark.parametrize("init", [False, True], ids=["no-group", "group-of-1"])
def test_single_process_collectives_keep_the_multi_rank_shape(init):
    def body():
        t = torch.arange(4.0)
        gathered = ad.all_gather(t)
        return (ad.barrier(), ad.broadcast(t.clone()).tolist(), ad.all_reduce(t.clone(), "max").tolist(),
                type(gathered).__name__, [g.tolist() for g in gathered],
                ad.all_gather_object("x"), ad.broadcast_object_list(["y"]), dist.is_initialized())

    [got] = run_distributed(body, 1, init=init, env=NO_ENV)
    assert got == (None, [0.0, 1.0, 2.0, 3.0], [0.0, 1.0, 2.0, 3.0], "list", [[0.0, 1.0, 2.0, 3.0]],
                   ["x"], ["y"], init)


def test_collectives_on_a_subgroup_are_group_relative():
    def body():
        sub = dist.new_group([1, 2])
        rank = ad.get_rank()
        if rank == 0:
            with pytest.raises(ValueError, match="not a member of the group"):
                ad.broadcast(torch.zeros(1), src=0, group=sub)
            return "not a member"
        ad.barrier(sub)
        t = torch.tensor([rank * 10])
        ad.broadcast(t, src=1, group=sub)  # group rank 1 = global rank 2
        red = ad.all_reduce(torch.tensor([rank]), "sum", group=sub)
        parts = ad.all_gather(torch.tensor([rank] * rank), group=sub)
        with pytest.raises(ValueError, match=r"src=2 is outside the group of 2 rank\(s\).*relative to group="):
            ad.broadcast(t, src=2, group=sub)
        return t.tolist(), red.tolist(), [p.tolist() for p in parts]

    got = run_distributed(body, 3, timeout=60)
    assert got[0] == "not a member"
    for rank in (1, 2):
        assert got[rank] == ([20], [3], [[1], [2, 2]])  # a list sized by the group, not the world


def test_all_gather_rejects_mismatched_dtypes_on_every_rank():
    def body():
        rank = ad.get_rank()
        t = torch.zeros(2, dtype=torch.float32 if rank == 0 else torch.int64)
        with pytest.raises(ValueError, match="cast every rank's tensor to one dtype"):
            ad.all_gather(t)
        return ad.all_reduce_value(1)  # still in step

    assert run_distributed(body, 2) == [2, 2]


def test_a_sparse_tensor_is_refused_naming_the_fix():
    # was torch's bare "reshape is not implemented for sparse tensors" (all_gather) and
    # "unsupported memory format option Contiguous" (the packed helpers)
    def body():
        sparse, said = torch.eye(2).to_sparse(), []
        for name in ("all_gather", "gather", "reduce", "broadcast", "all_reduce"):
            with pytest.raises(TypeError, match=r"is a torch\.sparse_coo tensor, which the kit "
                                                r"cannot send: pass it dense "
                                                r"\(\w+\.to_dense\(\)\)$"):
                getattr(ad, name)(sparse)
            said.append(name)
        return said, ad.all_reduce_value(1)  # still in step

    names = ["all_gather", "gather", "reduce", "broadcast", "all_reduce"]
    assert run_distributed(body, 2, timeout=60) == [(names, 2)] * 2


@pytest.mark.parametrize("backend", ["cpu:gloo,cuda:nccl", "cuda:nccl,cpu:gloo"])
def test_a_mixed_backend_gets_one_device_answer_everywhere(backend, monkeypatch):
    # The kit's one rule (one function answers for collectives, meshes and sharded tensors):
    # the accelerator the backend serves when this machine has one, else the CPU, whatever the
    # order of the list.
    from axolotl_dist.parallel import default_device_type

    for has_cuda, expected in ((False, "cpu"), (True, "cuda")):
        # a machine with or without a GPU: the kit counts devices (NVML first, so the question
        # does not initialize CUDA); is_available answers the same
        monkeypatch.setattr(torch.cuda, "device_count", lambda: int(has_cuda))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: has_cuda)
        assert default_device_type(backend) == expected
    assert ad.backend_supports_cuda(backend) and ad.backend_supports_cpu(backend)


def test_comm_device_and_mesh_device_agree_on_a_real_group():
    def body():
        from axolotl_dist.collectives import comm_device
        from axolotl_dist.parallel import default_device_type

        return str(comm_device()), default_device_type()

    assert run_distributed(body, 2) == [("cpu", "cpu")] * 2
