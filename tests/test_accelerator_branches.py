"""The accelerator branches, run on CPU (issue #74; tests/standin.py): gloo groups stand in for
accelerator groups (``AXOLOTL_DIST_STANDIN_DEVICE=1``: device ``cpu:0``, metadata on a CPU
channel of the same ranks), at 2 and 3 ranks. Each tensor helper gives the same result as on a
CPU group and reads no device tensor on the host (what would stall a GPU's host: a
synchronisation); a mismatch is still named on every rank. The detector itself is checked to
catch what the shape check did before (a header all-gathered on the device, read back)."""

from typing import Any, Dict, List, Tuple

import pytest
import torch

from axolotl_dist.testing import run_distributed
from standin import DEVICE, ENV, HostReads

#: The helpers that must make no host read of a device tensor (the issue's list); ``pad`` may
#: make as many as accelerate's (one: its sizes gathered on the device and moved to the host).
NO_READS = ("reduce", "all_reduce", "all_reduce AVG", "broadcast", "gather",
            "gather_for_metrics", "all_gather", "gather (big, equal)", "gather (big, uneven)",
            "compute_and_broadcast (tensor)", "synchronize_value (tensor)",
            "gather_from_all_ranks (tensors)", "reduce_and_broadcast (tensors)",
            "gather_from_all_ranks (mixed)")


def _calls(rank: int, ws: int) -> List[Tuple[str, Any]]:
    """``(name, call)``: each helper on this rank's device tensors (made inside the mode)."""
    import axolotl_dist as ad

    def dev(*shape, fill=None, dtype=torch.float32):
        t = torch.arange(int(torch.tensor(shape).prod()), dtype=dtype, device=DEVICE)
        return t.reshape(shape) * (rank + 1) if fill is None else t.fill_(fill).reshape(shape)

    return [
        ("reduce", lambda: ad.reduce({"loss": dev(3), "n": dev(2, 2)}, "sum")),
        ("all_reduce", lambda: ad.all_reduce(dev(4))),
        ("all_reduce AVG", lambda: ad.all_reduce(dev(4), "AVG")),
        ("broadcast", lambda: ad.broadcast([dev(2), dev(3, dtype=torch.int64)], src=ws - 1)),
        ("gather", lambda: ad.gather({"ids": dev(rank + 1, 2, dtype=torch.int64),
                                      "x": dev(rank + 1)})),
        ("gather_for_metrics", lambda: ad.gather_for_metrics(dev(2, 3), 2 * ws)),
        # more than a MiB a rank: each rank's rows go straight into the result (one
        # all-gather where the shapes agree, else a broadcast per rank)
        ("gather (big, equal)", lambda: ad.gather(dev(2048, 160))),
        ("gather (big, uneven)", lambda: ad.gather(dev(2048 * (rank + 1), 160))),
        ("all_gather", lambda: ad.all_gather(dev(rank + 1))),
        ("pad_across_processes", lambda: ad.pad_across_processes(dev(rank + 1, 2), dim=0)),
        ("compute_and_broadcast", lambda: ad.compute_and_broadcast(lambda: dev(2))),
        ("gather_from_all_ranks", lambda: ad.gather_from_all_ranks(lambda: rank + 0.5)),
        # value helpers given a device tensor: its bytes cross on the device
        ("compute_and_broadcast (tensor)",
         lambda: ad.compute_and_broadcast(lambda: dev(2, 3, dtype=torch.float64), src=ws - 1)),
        ("synchronize_value (tensor)", lambda: ad.synchronize_value(dev(rank + 1), src=1)),
        ("gather_from_all_ranks (tensors)",
         lambda: ad.gather_from_all_ranks(lambda: dev(rank + 1, dtype=torch.int16), dst=1)),
        ("reduce_and_broadcast (tensors)",
         lambda: ad.reduce_and_broadcast(lambda: dev(3), lambda xs: sum(xs))),
        ("gather_from_all_ranks (mixed)", lambda: ad.gather_from_all_ranks(
            lambda: dev(2) if rank % 2 else {"rank": rank})),
    ]


def _plain(value: Any) -> Any:
    """A helper's result as plain Python (read outside the detector)."""
    if isinstance(value, torch.Tensor):
        return [str(value.dtype), list(value.shape), value.tolist()]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _every_helper() -> Tuple[Dict[str, Any], Dict[str, List[Tuple[str, str]]]]:
    import axolotl_dist as ad

    rank, ws = ad.get_rank(), ad.get_world_size()
    results, reads = {}, {}
    for name, call in _calls(rank, ws):
        for turn in range(2):  # the second: after the channel and the slots are made
            with HostReads() as detector:
                out = call()
            reads[name] = detector.reads
        results[name] = _plain(out)
    return results, reads


@pytest.mark.parametrize("ws", [2, 3])
def test_each_helper_reads_no_device_tensor_and_gives_the_cpu_result(ws):
    standin = run_distributed(_every_helper, ws, env=ENV, timeout=120)
    cpu = run_distributed(_every_helper, ws, timeout=120)  # the CPU group's branches
    for rank in range(ws):
        assert standin[rank][0] == cpu[rank][0], rank
        reads = standin[rank][1]
        assert {name: reads[name] for name in NO_READS if reads[name]} == {}, reads
        assert len(reads["pad_across_processes"]) <= 1, reads  # accelerate's: one


def _mismatch():
    import axolotl_dist as ad

    rank = ad.get_rank()
    with pytest.raises(ad.TensorMismatchError) as info:
        ad.all_reduce(torch.ones(2 + rank, device=DEVICE))
    return str(info.value).split(" (called at")[0]


@pytest.mark.parametrize("ws", [2, 3])
def test_a_mismatch_on_the_accelerator_branch_is_named_on_every_rank(ws):
    out = run_distributed(_mismatch, ws, env=ENV, timeout=120)
    assert len(set(out)) == 1, out
    assert out[0].startswith("all_reduce: tensor differs across ranks: float32[2] on rank 0; "
                             "float32[3] on rank 1"), out[0]


def _old_shape_check() -> int:
    """What the shape check did on an accelerator group before: its 4-word header all-gathered
    on the device and read back with ``tolist`` (two host synchronisations)."""
    import torch.distributed as dist

    with HostReads() as detector:
        out = torch.empty(2 * 4, dtype=torch.int64, device=DEVICE)
        dist.all_gather_into_tensor(out, torch.tensor([1, 2, 3, 4], device=DEVICE))
        out.tolist()
    return len(detector.reads)


def test_the_detector_catches_a_header_read_back_from_the_device():
    assert run_distributed(_old_shape_check, 2, timeout=60) == [1, 1]


def _no_interface_for_the_channel():
    import os

    import axolotl_dist as ad

    os.environ["GLOO_SOCKET_IFNAME"] = "axd-no-such-if0"  # after init: the channel's gloo only
    with pytest.raises(ad.DistributedEnvError) as info:
        ad.all_reduce(torch.ones(2, device=DEVICE))
    return str(info.value)


def test_a_channel_gloo_cannot_make_is_one_error_saying_what_to_set():
    for text in run_distributed(_no_interface_for_the_channel, 2, env=ENV, timeout=60):
        assert text.startswith("could not make the CPU channel of a gloo process group (a gloo "
                               "group of its ranks [0, 1]"), text
        assert "Set GLOO_SOCKET_IFNAME to the network interface" in text, text


def test_the_gpu_host_benchmark_runs_its_whole_table_on_the_standin():
    """benchmarks/gpu_host.py (scripts/gpu_check.sh's host-cost table) on the CPU stand-in: a
    check of the script where there is no GPU (its figures mean nothing here)."""
    import subprocess
    import sys

    from fixtures import ROOT, subprocess_env

    proc = subprocess.run([sys.executable, "benchmarks/gpu_host.py", "--dry-run-on-cpu",
                           "--big-mib", "1"], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| stand-in")]
    helpers = ("reduce (a loss)", "all_reduce", "broadcast", "gather", "gather_for_metrics",
               "pad_across_processes", "compute_and_broadcast (tensor)",
               "gather_from_all_ranks (tensor)")
    assert [row.split(" | ")[1] for row in rows[:-1]] == [f"`{h}`" for h in helpers], rows
    assert rows[-1].count("|") == 8 and "x |" in rows[-1], rows[-1]
