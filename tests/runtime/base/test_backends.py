"""Unit tests of the device a group's collectives use (``_runtime/base/backends.cuda_index``):
the bound device, else ``LOCAL_RANK`` modulo the visible GPUs, else the current one; a current
device that disagrees is one error naming both and the fix. No GPU needed: the counts are
given."""

from __future__ import annotations

import pytest

from axolotl_dist._runtime.base.backends import cuda_index
from axolotl_dist.errors import DistributedEnvError


@pytest.mark.parametrize("count, current, local_rank, bound, chosen", [
    (8, 3, 3, None, 3),      # torchrun's LOCAL_RANK, set_device(LOCAL_RANK) done
    (4, 1, 5, None, 1),      # more ranks than GPUs (gloo shares round-robin)
    (1, 0, 3, None, 0),      # CUDA_VISIBLE_DEVICES gives each rank one GPU of its own
    (8, 2, 5, 2, 2),         # bound by device_id=: the bound device wins over LOCAL_RANK
    (8, 6, None, None, 6),   # no LOCAL_RANK: the current device
])
def test_the_device_is_the_bound_one_else_local_ranks_else_the_current(count, current,
                                                                     local_rank, bound, chosen):
    assert cuda_index(count, current, local_rank, bound) == chosen


def test_every_local_rank_on_cuda_0_is_one_error_naming_both_and_the_fix():
    # init_process_group("nccl") without set_device: every rank's current device is cuda:0
    with pytest.raises(DistributedEnvError) as info:
        cuda_index(8, 0, 3, None)
    text = str(info.value)
    assert text.startswith("this rank's current CUDA device is cuda:0, but LOCAL_RANK=3 of 8 "
                           "visible GPU(s) gives cuda:3"), text
    assert "torch.cuda.set_device(3) before init_process_group" in text, text
    assert "device_id=torch.device('cuda', 0)" in text, text


def test_a_bound_device_that_is_not_current_is_named():
    with pytest.raises(DistributedEnvError, match=r"the group is bound to cuda:1 \(device_id=\)"):
        cuda_index(8, 0, 0, 1)


def _device_as_every_rank_would_choose_it():
    """What the group-building path decides on a GPU machine where the user's
    ``init_process_group("nccl")`` left every rank on cuda:0 (no ``set_device``): 2 GPUs
    visible, each rank's ``LOCAL_RANK`` from its launcher (issue #74; no CUDA needed)."""
    import os

    return cuda_index(2, 0, int(os.environ["LOCAL_RANK"]), None)


def test_a_rank_whose_current_gpu_is_not_its_local_ranks_is_one_clear_error():
    from axolotl_dist.testing import run_distributed_outcomes

    outcomes = run_distributed_outcomes(_device_as_every_rank_would_choose_it, 2, timeout=60)
    assert outcomes[0].ok and outcomes[0].value == 0, outcomes[0].describe()
    assert not outcomes[1].ok, outcomes[1].describe()
    assert outcomes[1].error.startswith(
        "DistributedEnvError: this rank's current CUDA device is cuda:0, but LOCAL_RANK=1 of 2 "
        "visible GPU(s) gives cuda:1"), outcomes[1].error
