"""The GPU path (docs/design/decisions.md, decision 18): every helper, block, mesh and sharded tensor on
CUDA, with real processes.

A machine of this project's has one GPU, and NCCL refuses two ranks on one GPU, so each CUDA
test runs in the configurations one GPU allows (:data:`CUDA`): NCCL at world size 1, and CUDA
tensors over gloo at 2 and 3 ranks sharing the GPU. Those are marked ``gpu`` and skip without
CUDA; ``scripts/gpu_check.sh`` runs them (``pytest -m gpu``). Each test body also runs on CPU
ranks over gloo (:data:`CPU_TWIN`, unmarked), so CI proves the tests themselves: a body that
could not pass, or an expectation computed wrongly, fails here first.

The test process never initializes CUDA (a forked rank could not use it then): the markers
ask NVML (``axolotl_dist.testing.GPU_MARKS``), the ranks return CPU data only, and expected
values are computed here on CPU and compared bit for bit.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from typing import Any, Dict, List, NamedTuple, Optional

import pytest
import torch

import axolotl_dist as ad
from axolotl_dist.collectives import comm_device
from axolotl_dist.testing import GPU_MARKS, run_distributed, run_distributed_outcomes
from fixtures import ROOT, subprocess_env

TIMEOUT = 120


class Config(NamedTuple):
    """Where a body runs: the tensors' device, the backend, the number of ranks."""

    device: str
    backend: str
    world_size: int

    @property
    def id(self) -> str:
        return f"{self.device}-{self.backend}-{self.world_size}"


#: What one GPU allows: NCCL at world size 1, CUDA tensors over gloo at 2 and 3 ranks.
CUDA = (Config("cuda", "nccl", 1), Config("cuda", "gloo", 2), Config("cuda", "gloo", 3))
#: Every body's CPU run (CI has no GPU): gloo at 2 ranks.
CPU_TWIN = Config("cpu", "gloo", 2)


def configs(*chosen: Config) -> List[Any]:
    """``pytest.param`` per configuration: the CUDA ones marked ``gpu`` (skipped without it)."""
    return [pytest.param(c, id=c.id, marks=GPU_MARKS if c.device == "cuda" else ())
            for c in chosen]


def gpu(test: Any) -> Any:
    """Mark a one-configuration test ``gpu`` (skipped without CUDA)."""
    for mark in GPU_MARKS:
        test = mark(test)
    return test


def run_on(config: Config, body: Any, *args: Any, **kwargs: Any) -> List[Any]:
    """``body(config.device, *args)`` on every rank of ``config``; each rank's return value."""
    return run_distributed(body, config.world_size, args=(config.device, *args),
                           backend=config.backend, timeout=TIMEOUT, **kwargs)


# --- values and their exact descriptions ----------------------------------------------------

#: Python values through the helpers: exact, whatever the backend.
PY_VALUES: Dict[str, Any] = {
    "2**53+1": 2**53 + 1,
    "2**70": 2**70,
    "0.1": 0.1,
    "-0.0": -0.0,
    "None": None,
    "dict": {"loss": 0.97, "n": [1, 2**64], "s": "é"},
}


def tensors_of(rank: int) -> Dict[str, torch.Tensor]:
    """Rank ``rank``'s tensors (CPU), different on every rank; bit patterns that a float32
    or a lossy path would change."""
    return {
        "f64": torch.tensor([0.1 * (rank + 1), -0.0, math.inf, math.nan, 2.0**53 + 2 * rank],
                            dtype=torch.float64),
        "bf16": torch.tensor([[1.5, -2.25], [3.0e38, 1e-3 * (rank + 1)]], dtype=torch.bfloat16),
        "i64": torch.tensor([2**62 + rank, -(2**63), rank], dtype=torch.int64),
        "i32-0d": torch.tensor(7 + rank, dtype=torch.int32),
        "bool": torch.tensor([True, rank % 2 == 0]),
        "empty": torch.empty(0, 3, dtype=torch.float16),
    }


_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
         torch.float16: torch.int16}


def describe(value: Any, device: Optional[str] = None) -> Any:
    """A picklable, exactly comparable description of ``value``: for a tensor its dtype,
    shape, device (``device`` overrides it, for expectations built on CPU) and bits."""
    if isinstance(value, torch.Tensor):
        data = value.detach().cpu()
        bits = data.view(_BITS[data.dtype]) if data.dtype in _BITS else data
        return ("tensor", str(data.dtype), tuple(data.shape), device or str(value.device),
                value.requires_grad, bits.tolist())
    if isinstance(value, float):
        return ("float", "nan" if math.isnan(value) else value.hex(), math.copysign(1.0, value))
    if isinstance(value, dict):
        return ("dict", sorted((k, describe(v, device)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [describe(v, device) for v in value])
    return (type(value).__name__, value)


def here(device: str) -> str:
    """Inside a rank: where the kit puts a tensor that came from ``device``: this rank's
    current CUDA device, or the CPU."""
    return str(torch.device("cuda", torch.cuda.current_device())) if device == "cuda" else "cpu"


def on(device: str, rank: int) -> Dict[str, torch.Tensor]:
    """Inside a rank: its :func:`tensors_of` on ``device``."""
    return {name: t.to(device) for name, t in tensors_of(rank).items()}


def expect_tensors(rank: int, device: str) -> Dict[str, Any]:
    """The descriptions of rank ``rank``'s tensors as they arrive on ``device``."""
    return {name: describe(t, device) for name, t in tensors_of(rank).items()}


def check_ranks(results: List[Any], expect: Any) -> None:
    """Every rank returned ``(its device, what it saw)``; ``expect(rank, device)`` says what
    it should have seen, computed here on CPU."""
    for rank, (device, seen) in enumerate(results):
        assert device.startswith(("cuda:", "cpu")), device
        wanted = expect(rank, device)
        for key in wanted:
            assert seen[key] == wanted[key], (rank, key, seen[key], wanted[key])
        assert set(seen) == set(wanted), (rank, set(seen) ^ set(wanted))


# --- init on a GPU machine ------------------------------------------------------------------


def _init_default_body() -> Dict[str, Any]:
    ad.init_distributed()
    return {"backend": ad.get_backend(), "default": ad.default_backend(),
            "current": torch.cuda.current_device(), "local_rank": ad.get_local_rank(),
            "comm": str(comm_device()), "supports_cuda": ad.backend_supports_cuda()}


@gpu
def test_init_on_a_gpu_machine_picks_nccl_and_the_local_gpu():
    (got,) = run_distributed(_init_default_body, 1, init=False, timeout=TIMEOUT)
    assert got == {"backend": "nccl", "default": "nccl", "current": 0, "local_rank": 0,
                   "comm": "cuda:0", "supports_cuda": True}


def _gloo_on_gpu_body(device: str) -> Dict[str, Any]:
    before = torch.cuda.is_initialized()
    total = ad.reduce_and_broadcast(lambda: ad.get_rank() + 1, sum)  # Python values only
    return {"comm": str(comm_device()), "backend": ad.get_backend(), "total": total,
            "cuda_initialized": (before, torch.cuda.is_initialized())}


@pytest.mark.parametrize("config", configs(Config("cuda", "gloo", 2)))
def test_gloo_on_a_gpu_machine_keeps_cpu_communication(config):
    # backend="gloo" on a GPU machine: CPU communication, and the kit does not even start CUDA
    results = run_on(config, _gloo_on_gpu_body)
    assert results == [{"comm": "cpu", "backend": "gloo", "total": 3,
                        "cuda_initialized": (False, False)}] * 2


def _init_with(backend: Optional[str]) -> str:
    ad.init_distributed(backend=backend)
    return "initialized"  # must not happen: more ranks than GPUs


@gpu
@pytest.mark.parametrize("backend", [None, "nccl"], ids=["default-backend", "nccl"])
def test_more_local_ranks_than_gpus_fails_at_init_naming_the_fix(backend):
    gpus = torch.cuda.device_count()  # NVML: does not initialize CUDA here
    ranks = gpus + 1
    outcomes = run_distributed_outcomes(_init_with, ranks, args=(backend,), init=False,
                                        timeout=TIMEOUT)
    for o in outcomes:
        assert not o.timed_out, o.describe()
        assert isinstance(o.exception, ad.DistributedEnvError), o.describe()
        message = str(o.exception)
        assert (f"this node runs {ranks} rank(s) (LOCAL_WORLD_SIZE={ranks}; this is "
                f"LOCAL_RANK={o.rank}) but sees {gpus} CUDA GPU(s)") in message, message
        for fix in (f"axolotl-dist -n {gpus}", f"torchrun --nproc-per-node {gpus}",
                    "CUDA_VISIBLE_DEVICES", "backend='gloo'"):
            assert fix in message, (fix, message)
        assert "Duplicate GPU" not in o.error
        assert o.elapsed < 60, o.describe()


# --- the value helpers, with Python values and tensors ----------------------------------------

HELPER_CONFIGS = configs(*CUDA, CPU_TWIN)


def _compute_and_broadcast_body(device: str) -> Any:
    rank, last = ad.get_rank(), ad.get_world_size() - 1
    seen = {}
    for name, t in on(device, rank).items():
        seen[name] = describe(ad.compute_and_broadcast(lambda: t, src=last))
    for name, value in PY_VALUES.items():
        seen[name] = describe(ad.compute_and_broadcast(lambda: value if rank == 0 else "decoy"))
    return here(device), seen


@pytest.mark.parametrize("config", HELPER_CONFIGS)
def test_compute_and_broadcast(config):
    last = config.world_size - 1
    check_ranks(run_on(config, _compute_and_broadcast_body), lambda rank, dev: {
        **expect_tensors(last, dev), **{k: describe(v) for k, v in PY_VALUES.items()}})


def _gather_from_all_ranks_body(device: str) -> Any:
    rank, last = ad.get_rank(), ad.get_world_size() - 1
    seen = {}
    for name, t in on(device, rank).items():
        got = ad.gather_from_all_ranks(lambda: t, dst=last)
        seen[name] = None if got is None else describe(got)
    for name, value in PY_VALUES.items():
        got = ad.gather_from_all_ranks(lambda: value, world_size=ad.get_world_size())
        seen[name] = None if got is None else describe(got)
    return here(device), seen


@pytest.mark.parametrize("config", HELPER_CONFIGS)
def test_gather_from_all_ranks(config):
    ws, last = config.world_size, config.world_size - 1

    def expect(rank, dev):
        out = {name: (describe([tensors_of(r)[name] for r in range(ws)], dev) if rank == last
                      else None) for name in tensors_of(0)}
        out.update({k: describe([v] * ws) if rank == 0 else None for k, v in PY_VALUES.items()})
        return out
    check_ranks(run_on(config, _gather_from_all_ranks_body), expect)


def _gather_scalar_body(device: str) -> Any:
    rank = ad.get_rank()
    seen = {
        "int": ad.gather_scalar_from_all_ranks(lambda: 2**53 + rank),
        "float": ad.gather_scalar_from_all_ranks(lambda: 0.1 * (rank + 1)),
        "bool": ad.gather_scalar_from_all_ranks(lambda: rank % 2 == 0),
        "0-d tensor": ad.gather_scalar_from_all_ranks(
            lambda: torch.tensor(0.1 * (rank + 1), dtype=torch.float64, device=device)),
    }
    return here(device), {k: None if v is None else describe(v) for k, v in seen.items()}


@pytest.mark.parametrize("config", HELPER_CONFIGS)
def test_gather_scalar_from_all_ranks(config):
    ws = config.world_size

    def expect(rank, dev):
        if rank != 0:
            return {k: None for k in ("int", "float", "bool", "0-d tensor")}
        return {"int": describe([2**53 + r for r in range(ws)]),
                "float": describe([0.1 * (r + 1) for r in range(ws)]),
                "bool": describe([r % 2 == 0 for r in range(ws)]),
                "0-d tensor": describe([torch.tensor(0.1 * (r + 1), dtype=torch.float64)
                                        for r in range(ws)], dev)}
    check_ranks(run_on(config, _gather_scalar_body), expect)


def _reduce_and_broadcast_body(device: str) -> Any:
    rank = ad.get_rank()
    seen = {}
    for name, t in on(device, rank).items():
        seen[name] = describe(ad.reduce_and_broadcast(lambda: t, list))
    i64 = on(device, rank)["i64"][2:]  # small ints: their sum is exact in int64
    seen["i64 sum"] = describe(ad.reduce_and_broadcast(lambda: i64, lambda xs: sum(xs)))
    seen["int sum"] = describe(ad.reduce_and_broadcast(lambda: 2**62 + rank, sum))
    seen["max"] = describe(ad.reduce_and_broadcast(lambda: 0.1 * (rank + 1), max))
    return here(device), seen


@pytest.mark.parametrize("config", HELPER_CONFIGS)
def test_reduce_and_broadcast(config):
    ws = config.world_size

    def expect(rank, dev):
        out = {name: describe([tensors_of(r)[name] for r in range(ws)], dev)
               for name in tensors_of(0)}
        out["i64 sum"] = describe(torch.tensor([sum(range(ws))], dtype=torch.int64), dev)
        out["int sum"] = describe(sum(2**62 + r for r in range(ws)))  # beyond int64: exact
        out["max"] = describe(0.1 * ws)
        return out
    check_ranks(run_on(config, _reduce_and_broadcast_body), expect)


def _synchronize_value_body(device: str) -> Any:
    rank, last = ad.get_rank(), ad.get_world_size() - 1
    seen = {}
    for name, t in on(device, rank).items():
        seen[name] = describe(ad.synchronize_value(t, src=last))
        seen[name + " to cpu"] = describe(ad.synchronize_value(t, device="cpu"))
    for name, value in PY_VALUES.items():
        seen[name] = describe(ad.synchronize_value(value if rank == 0 else "decoy"))
    seen["flag"] = ad.synchronize_flag(rank == 0)
    return here(device), seen


@pytest.mark.parametrize("config", HELPER_CONFIGS)
def test_synchronize_value(config):
    last = config.world_size - 1

    def expect(rank, dev):
        out = expect_tensors(last, dev)
        out.update({name + " to cpu": d for name, d in expect_tensors(0, "cpu").items()})
        out.update({k: describe(v) for k, v in PY_VALUES.items()})
        out["flag"] = True
        return out
    check_ranks(run_on(config, _synchronize_value_body), expect)


def _all_reduce_value_body(device: str) -> Any:
    rank = ad.get_rank()
    mine = on(device, rank)
    i64 = mine["i64"][2:]
    halves = torch.tensor([0.5 * (rank + 1)], dtype=torch.float64, device=device)
    seen = {
        "i64 sum": describe(ad.all_reduce_value(i64)),
        "i64 max": describe(ad.all_reduce_value(mine["i64"], op="MAX")),
        "avg": describe(ad.all_reduce_value(halves, op="AVG")),
        "bf16 max": describe(ad.all_reduce_value(mine["bf16"], op="MAX")),
        "input untouched": describe(i64) == describe(on(device, rank)["i64"][2:]),
        "int sum": describe(ad.all_reduce_value(2**62 + rank)),
        "float max": describe(ad.all_reduce_value(0.1 * (rank + 1), op="MAX")),
    }
    return here(device), seen


@pytest.mark.parametrize("config", HELPER_CONFIGS)
def test_all_reduce_value(config):
    ws = config.world_size

    def expect(rank, dev):
        every = [tensors_of(r) for r in range(ws)]
        return {
            "i64 sum": describe(torch.tensor([sum(range(ws))], dtype=torch.int64), dev),
            "i64 max": describe(torch.stack([t["i64"] for t in every]).amax(0), dev),
            "avg": describe(torch.tensor([0.5 * (ws + 1) / 2], dtype=torch.float64), dev),
            "bf16 max": describe(torch.stack([t["bf16"] for t in every]).amax(0), dev),
            "input untouched": True,
            "int sum": describe(sum(2**62 + r for r in range(ws))),
            "float max": describe(0.1 * ws),
        }
    check_ranks(run_on(config, _all_reduce_value_body), expect)


def _objects(rank: int, device: Optional[str]) -> Dict[str, Any]:
    """An object holding tensors (moved through pickle by the object helpers)."""
    t = tensors_of(rank)
    return {"rank": rank, "n": 2**70, "f64": t["f64"] if device is None else t["f64"].to(device),
            "bf16": t["bf16"] if device is None else t["bf16"].to(device)}


def _broadcast_object_body(device: str) -> Any:
    rank, last = ad.get_rank(), ad.get_world_size() - 1
    seen = {"src=last": describe(ad.broadcast_object(_objects(rank, device), src=last)),
            "src=0": describe(ad.broadcast_object(_objects(rank, device)))}
    box = [_objects(rank, device), "tail"] if rank == 0 else [None]
    seen["list"] = describe(ad.broadcast_object_list(box))
    for name, value in PY_VALUES.items():
        seen[name] = describe(ad.broadcast_object(value if rank == 0 else "decoy"))
    return here(device), seen


@pytest.mark.parametrize("config", HELPER_CONFIGS)
def test_broadcast_object(config):
    last = config.world_size - 1

    def expect(rank, dev):
        return {"src=last": describe(_objects(last, None), dev),
                "src=0": describe(_objects(0, None), dev),
                "list": describe([_objects(0, None), "tail"], dev),
                **{k: describe(v) for k, v in PY_VALUES.items()}}
    check_ranks(run_on(config, _broadcast_object_body), expect)


def _all_gather_object_body(device: str) -> Any:
    rank = ad.get_rank()
    seen = {"objects": describe(ad.all_gather_object(_objects(rank, device)))}
    for name, t in on(device, rank).items():
        seen[name] = describe(ad.all_gather_object(t))
    return here(device), seen


@pytest.mark.parametrize("config", HELPER_CONFIGS)
def test_all_gather_object(config):
    ws = config.world_size

    def expect(rank, dev):
        out = {"objects": describe([_objects(r, None) for r in range(ws)], dev)}
        out.update({name: describe([tensors_of(r)[name] for r in range(ws)], dev)
                    for name in tensors_of(0)})
        return out
    check_ranks(run_on(config, _all_gather_object_body), expect)


# --- tensor collectives ---------------------------------------------------------------------


def _tensor_collectives_body(device: str) -> Any:
    rank, ws, last = ad.get_rank(), ad.get_world_size(), ad.get_world_size() - 1
    b = torch.arange(6, dtype=torch.float32, device=device).view(2, 3) * (rank + 1)
    returned = ad.broadcast(b, src=last)
    r = torch.full((4,), rank + 1, dtype=torch.int64, device=device)
    ad.all_reduce(r)
    avg = torch.full((2,), 0.5 * (rank + 1), dtype=torch.float64, device=device)
    ad.all_reduce(avg, "AVG")
    mx = tensors_of(rank)["bf16"].to(device)
    ad.all_reduce(mx, "MAX")
    gathered = ad.all_gather(torch.tensor([rank, 10 * rank], dtype=torch.int64, device=device))
    ad.barrier()
    return here(device), {"broadcast": describe(b), "in place": returned is b,
                          "all_reduce": describe(r), "avg": describe(avg), "max": describe(mx),
                          "all_gather": describe(gathered), "ws": ws}


@pytest.mark.parametrize("config", HELPER_CONFIGS)
def test_tensor_collectives(config):
    ws = config.world_size
    every = [tensors_of(r) for r in range(ws)]
    check_ranks(run_on(config, _tensor_collectives_body), lambda rank, dev: {
        "broadcast": describe(torch.arange(6, dtype=torch.float32).view(2, 3) * ws, dev),
        "in place": True,
        "all_reduce": describe(torch.full((4,), ws * (ws + 1) // 2, dtype=torch.int64), dev),
        "avg": describe(torch.full((2,), 0.5 * (ws + 1) / 2, dtype=torch.float64), dev),
        "max": describe(torch.stack([t["bf16"] for t in every]).amax(0), dev),
        "all_gather": describe([torch.tensor([r, 10 * r], dtype=torch.int64)
                                for r in range(ws)], dev),
        "ws": ws})


# --- blocks, with CUDA work in flight -------------------------------------------------------


def side(device: str) -> int:
    """The matrices' side for :func:`queue_work`: big on a GPU, small on CPU ranks."""
    return 1024 if device == "cuda" else 128


def queue_work(device: str, rounds: int = 8) -> torch.Tensor:
    """Matrix products queued on ``device`` and not waited for (on CUDA still running when
    this returns). ``x @ y`` keeps a constant ``y`` constant, exactly (powers of two): the
    result's sum is ``side**2 * 2**-9`` whatever the order of the additions."""
    n = side(device)
    x = torch.full((n, n), 1.0 / n, device=device)
    y = torch.full((n, n), 2.0**-9, device=device)
    for _ in range(rounds):
        y = x @ y
    return y


def _blocks_body(device: str, path: str) -> Any:
    rank = ad.get_rank()
    pending: Optional[torch.Tensor] = None
    with ad.zero_first():
        if rank == 0:
            pending = queue_work(device)  # still running on CUDA as the block releases the rest
            with open(path, "w") as f:
                f.write("built by rank 0")
        with open(path) as f:
            cached = f.read()
    total = ad.compute_and_broadcast(lambda: pending.sum())  # type: ignore[union-attr]

    @ad.zero_only
    def report(value: torch.Tensor) -> float:
        return float(value)

    ran = False
    with ad.zero_only():
        ran = True
    turns = ad.do_n_at_a_time(lambda: (rank, float(queue_work(device, 2).sum())), n=1)
    return here(device), {"cached": cached, "total": describe(total), "report": report(total),
                          "zero_only body ran": ran, "turn": turns}


@pytest.mark.parametrize("config", HELPER_CONFIGS)
def test_zero_first_zero_only_do_n_at_a_time(config, tmp_path):
    n = side(config.device)
    total = n * n * 2.0**-9
    check_ranks(run_on(config, _blocks_body, str(tmp_path / "cache.txt")), lambda rank, dev: {
        "cached": "built by rank 0", "total": describe(torch.tensor(total), dev),
        "report": total if rank == 0 else None, "zero_only body ran": rank == 0,
        "turn": (rank, total)})


FAILING_CONFIGS = configs(Config("cuda", "gloo", 2), Config("cuda", "gloo", 3), CPU_TWIN)


def _fails_in_block_body(device: str) -> str:
    with ad.zero_first():
        if ad.get_rank() == 0:
            queue_work(device)  # in flight when the exception leaves the block
            raise ValueError("bad shard on the GPU")
    return "ran the block after rank 0 failed"  # must not happen


@pytest.mark.parametrize("config", FAILING_CONFIGS)
def test_failure_in_zero_first_with_cuda_work_in_flight_is_relayed(config, store):
    outcomes = run_distributed_outcomes(_fails_in_block_body, config.world_size,
                                        args=(config.device,), backend=config.backend,
                                        timeout=TIMEOUT, store=store)
    assert isinstance(outcomes[0].exception, ValueError), outcomes[0].describe()
    for o in outcomes[1:]:
        assert isinstance(o.exception, ad.RankFailedError), o.describe()
        assert o.exception.rank == 0 and o.exception.exc_type == "ValueError"
        assert re.search(r"rank 0 failed in zero_first block #1 at \S*test_gpu\.py:\d+ in "
                         r"_fails_in_block_body: ValueError: bad shard on the GPU",
                         o.error), o.error
        assert o.value is None and o.elapsed < 30, o.describe()


def _dies_body(device: str, dying: int) -> str:
    rank = ad.get_rank()
    with ad.zero_first():
        if rank == 0:
            queue_work(device)
            if dying == 0:
                os._exit(3)  # dies inside the block the others wait for
    if rank == dying:
        queue_work(device)
        os._exit(3)  # dies while the others wait in the barrier
    ad.barrier()
    return "survived"


@pytest.mark.parametrize("config", FAILING_CONFIGS)
@pytest.mark.parametrize("dying", [0, 1], ids=["rank0-in-block", "rank1-before-barrier"])
def test_a_rank_that_dies_while_others_wait_is_named(config, dying, store):
    outcomes = run_distributed_outcomes(_dies_body, config.world_size,
                                        args=(config.device, dying), backend=config.backend,
                                        timeout=TIMEOUT, store=store)
    assert outcomes[dying].exitcode == 3, outcomes[dying].describe()
    for o in outcomes:
        if o.rank == dying:
            continue
        assert isinstance(o.exception, ad.RankFailedError), o.describe()
        assert o.exception.rank == dying and o.exception.exc_type == "died", o.describe()
        assert o.elapsed < 30, o.describe()


# --- meshes, DTensor utilities, sharded flat tensors ------------------------------------------

MESH_CONFIGS = configs(Config("cuda", "nccl", 1), CPU_TWIN)


def _mesh_body(device: str) -> Any:
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    from axolotl_dist.tensors import dtensor_utils

    ws = ad.get_world_size()
    seen: Dict[str, Any] = {}
    for name, kwargs in (("dp", dict(dp=ad.DataParallelConfig("fsdp"))),
                         ("dp_tp", dict(dp=ad.DataParallelConfig("ddp"),
                                        tp=ad.TensorParallelConfig(ws)))):
        mesh = ad.build_world_mesh(**kwargs)  # the device type follows the backend
        dp_group = ad.get_dp_process_group(mesh)
        ones = torch.ones(3, dtype=torch.int64, device=device)
        ad.all_reduce(ones, group=dp_group)
        seen[name] = {"device_type": mesh.device_type, "names": list(mesh.mesh_dim_names),
                      "dp": ad.get_dp_mesh(mesh).mesh.tolist(),
                      "dp_group": dist.get_process_group_ranks(dp_group),
                      "dp sum": describe(ones)}
        if "tp" in mesh.mesh_dim_names:
            tp = ad.get_tp_mesh(mesh)
            full = torch.arange(12.0, device=device).view(4, 3)
            dt = distribute_tensor(full, tp, [Shard(0)])
            shape, offset = dtensor_utils.get_local_shape_and_global_offset(dt)
            local = dt.to_local()
            seen[name]["dtensor"] = {
                "shape": shape, "offset": offset, "local device": str(local.device),
                "matches": tuple(local.shape) == shape and bool(torch.equal(
                    local, full[offset[0]:offset[0] + shape[0]])),
                "computed": dtensor_utils.compute_local_shape_and_global_offset(
                    (4, 3), tp, [Shard(0)]) == (shape, offset)}
        ad.reset_world_mesh()
    return here(device), seen


@pytest.mark.parametrize("config", MESH_CONFIGS)
def test_meshes_and_dtensor_utils(config):
    ws = config.world_size
    rows = 4 // ws  # every configuration here splits 4 rows evenly

    def expect(rank, dev):
        dp_sum = describe(torch.full((3,), ws, dtype=torch.int64), dev)
        return {
            "dp": {"device_type": config.device, "names": ["dp"], "dp": list(range(ws)),
                   "dp_group": list(range(ws)), "dp sum": dp_sum},
            "dp_tp": {"device_type": config.device, "names": ["dp", "tp"], "dp": [rank],
                      "dp_group": [rank], "dp sum": describe(
                          torch.ones(3, dtype=torch.int64), dev),
                      "dtensor": {"shape": (rows, 3), "offset": (rank * rows, 0),
                                  "local device": dev, "matches": True, "computed": True}},
        }
    check_ranks(run_on(config, _mesh_body), expect)


SHARDED_CONFIGS = configs(*CUDA, CPU_TWIN)


def _sharded_body(device: str) -> Any:
    rank = ad.get_rank()
    full = torch.arange(10 * 3, dtype=torch.float32, device=device).view(10, 3) * 0.5
    t = ad.ShardedFlatTensor.shard(full + 1000 * rank)  # synchronized: rank 0's values
    seen: Dict[str, Any] = {"shard device": str(t.sharded_data.device),
                            "gather": describe(t.gather()),
                            "gather bf16": describe(t.gather(dtype=torch.bfloat16))}
    t.unshard_()
    t.data.add_(rank + 1)  # rank 0's edits win with writeback
    t.reshard_(writeback=True)
    seen["writeback"] = describe(t.gather())
    root = t.gather(rank0_only=True)
    seen["rank0_only"] = describe(root) if rank == 0 else root.numel()
    p = ad.ShardedFlatParameter.shard(torch.ones(7, device=device), requires_grad=True)
    seen["parameter"] = (type(p).__name__, p.requires_grad, str(p.device),
                         describe(p.gather().detach()))
    return here(device), seen


@pytest.mark.parametrize("config", SHARDED_CONFIGS)
def test_sharded_flat_tensor_and_parameter(config):
    full = torch.arange(30, dtype=torch.float32).view(10, 3) * 0.5
    check_ranks(run_on(config, _sharded_body), lambda rank, dev: {
        "shard device": dev, "gather": describe(full, dev),
        "gather bf16": describe(full.bfloat16(), dev),
        "writeback": describe(full + 1, dev),
        "rank0_only": describe(full + 1, dev) if rank == 0 else 0,
        "parameter": ("ShardedFlatParameter", True, dev, describe(torch.ones(7), dev))})


# --- the examples on CUDA ---------------------------------------------------------------------

#: (the script, its arguments on a GPU run, what its last line says)
EXAMPLES = {
    "finetune": (["examples/finetune.py", "--steps", "20"], r"^done: ranks=(\d) steps=20 .*"
                 r"device=cuda "),
    "hf_finetune": (["examples/hf_finetune.py", "--steps", "12", "--lines", "400"],
                    r"^done: ranks=(\d) steps=12 .*device=cuda "),
}


def _example(name: str, tmp_path: Any, launch: List[str], *extra: str) -> str:
    script, pattern = EXAMPLES[name]
    if name == "hf_finetune":
        pytest.importorskip("datasets", reason="hf_finetune needs the hf extra (datasets)")
        pytest.importorskip("transformers", reason="hf_finetune needs the hf extra")
    cmd = [sys.executable, *launch, *script, "--output-dir", str(tmp_path / "out"), *extra]
    proc = subprocess.run(cmd, env=subprocess_env(tmp_path), cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    found = re.search(pattern, proc.stdout, re.MULTILINE)
    assert found, proc.stdout[-3000:]
    return found.group(1)


@gpu
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_on_one_gpu_over_nccl(name, tmp_path):
    assert _example(name, tmp_path, []) == "1"


#: torchrun, and the kit's launcher where this torch has what it needs (setup.cfg's floor)
_LAUNCHERS = {"torchrun": ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"],
              "axolotl-dist": ["-m", "axolotl_dist.launch", "-n", "2"]}


@gpu
@pytest.mark.parametrize("launcher", sorted(_LAUNCHERS))
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_on_two_ranks_sharing_the_gpu_over_gloo(name, launcher, tmp_path):
    if launcher == "axolotl-dist" and tuple(
            int(p) for p in re.findall(r"\d+", torch.__version__)[:2]) < (2, 12):
        pytest.skip(f"axolotl-dist needs torch 2.12 (LaunchConfig.shutdown_timeout); this is "
                    f"{torch.__version__}")
    assert _example(name, tmp_path, _LAUNCHERS[launcher], "--backend", "gloo") == "2"


# --- accelerate's names (docs/porting.md) ------------------------------------------------------


def _porting_body(device: str) -> Any:
    rank, ws = ad.get_rank(), ad.get_world_size()
    mine = on(device, rank)
    ragged = torch.ones(rank + 1, 2, device=device)
    halves = torch.tensor([0.5 * (rank + 1), 2.0**-3], dtype=torch.float64, device=device)
    rows = torch.arange(3, device=device) + 3 * rank  # 2 * ws + 1 rows: 3 per rank, 1 repeated
    return here(device), {
        "gather": describe(ad.gather(mine)),
        "pad": describe(ad.pad_across_processes(ragged, pad_index=5)),
        "mean": describe(ad.reduce(halves)),
        "metrics": describe(ad.gather_for_metrics(rows, 2 * ws + 1)),
        "broadcast": describe(ad.broadcast({"a": torch.full((2,), float(rank), device=device)})),
        "state": (ad.PartialState().device.type, ws)}


@pytest.mark.parametrize("config", HELPER_CONFIGS)
def test_accelerates_names(config):
    ws = config.world_size

    def expect(rank, dev):
        every = [tensors_of(r) for r in range(ws)]
        padded = torch.full((ws, 2), 5.0)
        padded[:rank + 1] = 1.0
        kept = torch.cat([torch.arange(3 if r == 0 else 2) + 3 * r for r in range(ws)])
        return {"gather": describe({n: torch.cat([t[n].reshape(-1) if t[n].dim() == 0 else t[n]
                                                  for t in every]) for n in every[0]}, dev),
                "pad": describe(padded, dev),
                "mean": describe(sum(torch.tensor([0.5 * (r + 1), 2.0**-3], dtype=torch.float64)
                                     for r in range(ws)) / ws, dev),
                "metrics": describe(kept, dev),
                "broadcast": describe({"a": torch.zeros(2)}, dev),
                "state": (dev.split(":")[0], ws)}
    check_ranks(run_on(config, _porting_body), expect)

