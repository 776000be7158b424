"""Sharded tensors: flat-sharded tensors and parameters, and DTensor shape/offset helpers.

* :class:`ShardingSpec`: which ranges of the flattened tensor each rank holds, validated;
* :class:`ShardedFlatTensor` / :class:`ShardedFlatParameter`: a tensor (parameter) whose
  data is this rank's shard, with ``gather``, ``unshard_`` / ``reshard_`` and chunk helpers;
* :mod:`axolotl_dist.tensors.dtensor_utils`: the local shape and global offset of a DTensor's
  shard on any rank.

Importing this package is cheap: DTensor machinery is imported only when the DTensor helpers
first run.
"""

from __future__ import annotations

from . import dtensor_utils
from .sharded_flat_tensor import ShardedFlatParameter, ShardedFlatTensor
from .sharding_spec import ShardingSpec

__all__ = ["ShardingSpec", "ShardedFlatTensor", "ShardedFlatParameter", "dtensor_utils"]
