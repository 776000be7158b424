"""Shared pytest setup: rank tests run under axolotl_dist.testing (forked gloo ranks)."""

import os

import pytest

# Tests must not inherit a launcher environment from whatever started pytest.
for _name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK",
              "NUM_NODES", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS",
              "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "AXOLOTL_DIST_DEBUG"):
    os.environ.pop(_name, None)


@pytest.fixture(params=[1, 2, 3], ids=lambda n: f"ws{n}")
def world_size(request):
    """World sizes every multi-process behaviour is checked at (3 catches uneven splits)."""
    return request.param
