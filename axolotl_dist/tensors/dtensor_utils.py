"""Where a DTensor's local shard sits in the global tensor, for any rank (OLMo-core's helpers).

:func:`compute_local_shape_and_global_offset` answers, for a global shape, a device mesh and
placements, what local shape a rank holds and at which global offset its shard starts; with
``rank=`` it answers for any global rank, not only this process (checkpoint planning).

The answer is what DTensor itself places on each rank (torch's ``Shard`` rule, as
``distribute_tensor`` splits): a dim of size ``s`` split ``n`` ways gives coordinate ``c``
``s / n`` elements at ``c * s / n`` when even; otherwise ``k = ceil(s / n)`` and the shard is
``[k * c, min(s, k * c + k))``, empty past the end. Sharding one dim on several mesh dims
nests (each split applies to the previous local size; offsets add up). An empty shard reports
the global size of its dim as the offset, as DTensor does. ``Replicate`` and ``Partial`` leave
a dim whole.

Note that the device mesh is row-major: on a ``(2, 4)`` mesh, ``Shard(0)`` on mesh dim 0 only
splits between the rows ``[0, 1, 2, 3]`` and ``[4, 5, 6, 7]``, so a ``(2,)`` tensor lands on
ranks 0 and 4 (each replicated along its row); landing on ranks 0 and 1 needs a 1-D mesh of
8 ranks.

``torch.distributed.tensor`` costs about half a second to import, so it is imported only when
these functions first run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple, Union

import torch

from ..errors import DistributedConfigError
from ..ranks import get_mesh_coordinates

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement

__all__ = ["get_local_shape_and_global_offset", "compute_local_shape_and_global_offset"]

ShapeAndOffset = Tuple[Tuple[int, ...], Tuple[int, ...]]


def _split(size: int, parts: int, index: int) -> Tuple[int, int]:
    """(length, start) of chunk ``index`` of a dim of ``size`` split ``parts`` ways (DTensor's rule)."""
    if size % parts == 0:
        length = size // parts
        return length, length * index
    full = -(-size // parts)
    start = full * index
    return max(0, min(size, start + full) - start), min(size, start)


def _shard_dim(placement: Any, ndim: int, mesh_dim: int) -> int:
    dim = int(placement.dim)
    if dim < 0:
        dim += ndim
    if not 0 <= dim < ndim:
        raise DistributedConfigError(
            f"placement {placement} on mesh dim {mesh_dim} shards dim {placement.dim} of a "
            f"{ndim}-dim tensor"
        )
    return dim


def _at_coordinate(
    global_shape: Tuple[int, ...],
    mesh_shape: Tuple[int, ...],
    coordinate: Sequence[int],
    placements: Sequence["Placement"],
) -> ShapeAndOffset:
    """Local shape and global offset at mesh ``coordinate`` (plain data, no process group)."""
    from torch.distributed.tensor.placement_types import Shard

    local = list(global_shape)
    offset = [0] * len(global_shape)
    for mesh_dim, placement in enumerate(placements):
        if not isinstance(placement, Shard):
            if hasattr(placement, "split_factor"):  # _StridedShard: torch's own bookkeeping
                return _torch_at_coordinate(global_shape, mesh_shape, coordinate, placements)
            continue  # Replicate, Partial: the dim stays whole
        dim = _shard_dim(placement, len(global_shape), mesh_dim)
        length, start = _split(local[dim], mesh_shape[mesh_dim], coordinate[mesh_dim])
        local[dim] = length
        offset[dim] = offset[dim] + start if length else global_shape[dim]
    return tuple(local), tuple(offset)


def _torch_at_coordinate(
    global_shape: Tuple[int, ...],
    mesh_shape: Tuple[int, ...],
    coordinate: Sequence[int],
    placements: Sequence["Placement"],
) -> ShapeAndOffset:
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    shape, offset = _compute_local_shape_and_global_offset(
        global_shape, mesh_shape, list(coordinate), placements
    )
    return tuple(int(s) for s in shape), tuple(int(o) for o in offset)


def compute_local_shape_and_global_offset(
    global_shape: Union[torch.Size, List[int], Tuple[int, ...]],
    mesh: "DeviceMesh",
    placements: Sequence["Placement"],
    rank: Optional[int] = None,
) -> ShapeAndOffset:
    """The local shape and the global offset of the shard that global ``rank`` holds.

    :param global_shape: the shape of the full tensor.
    :param mesh: the device mesh.
    :param placements: one placement per mesh dim (``Shard(d)``, ``Replicate()``, ``Partial()``);
        as in OLMo-core, a shorter list leaves the remaining mesh dims replicated.
    :param rank: the global rank to answer for (default: this process).
    :returns: ``(local_shape, global_offset)``, or ``((), ())`` if the rank is not in the mesh.

    Example, an ``(8, 4)`` tensor on a ``(2, 4)`` mesh with ``[Shard(0), Shard(0)]``: rank
    ``r`` holds ``(1, 4)`` at ``(r, 0)``. A ``(2,)`` tensor with ``[Shard(0)]`` (that is,
    ``[Shard(0), Replicate()]``) on the same mesh: ranks 0-3 hold ``(1,)`` at ``(0,)`` and
    ranks 4-7 ``(1,)`` at ``(1,)``. With ``[Shard(0)]`` on a 1-D mesh of 8 ranks, ranks 0 and
    1 hold one element each (at 0 and 1) and ranks 2-7 hold ``(0,)`` at ``(2,)``.
    """
    shape = tuple(int(d) for d in global_shape)
    placements = tuple(placements)
    if len(placements) > mesh.ndim:
        raise DistributedConfigError(
            f"{len(placements)} placement(s) {list(placements)} for a {mesh.ndim}-dim mesh "
            f"{tuple(mesh.shape)}: give at most one placement per mesh dim"
        )
    if rank is None:
        coordinate = mesh.get_coordinate()
    else:
        coordinate = get_mesh_coordinates(mesh, rank)
    if coordinate is None:
        return (), ()
    return _at_coordinate(shape, tuple(mesh.shape), coordinate, placements)


def get_local_shape_and_global_offset(dtensor: "DTensor", rank: Optional[int] = None) -> ShapeAndOffset:
    """:func:`compute_local_shape_and_global_offset` for a ``DTensor``'s shape, mesh and placements."""
    return compute_local_shape_and_global_offset(
        dtensor.shape, dtensor.device_mesh, dtensor.placements, rank=rank
    )
