"""How a tensor is split into flat shards: :class:`ShardingSpec`.

A spec lists, for every rank of a process group (by *group* rank), the half-open ranges
``(start, end)`` of the flattened unsharded tensor that the rank holds, in the order its
local shard stores them. One range per rank is the common case; several are allowed.

The spec is validated fully when it is built: a range that runs
backwards, falls outside the tensor, overlaps another range, or leaves elements that no rank
holds raises :class:`~axolotl_dist.errors.DistributedConfigError` naming the rank, the range
and the numbers. The number of ranks is checked against the process group where the group is
known (see :meth:`ShardingSpec.check_world_size`).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, List, Sequence, Tuple

from ..errors import DistributedConfigError

__all__ = ["ShardingSpec", "Range", "RankRanges"]

#: A half-open ``(start, end)`` range of flattened element indices.
Range = Tuple[int, int]
#: The ranges one rank holds, in the order its local shard stores them.
RankRanges = Tuple[Range, ...]


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise DistributedConfigError(f"ShardingSpec: {what} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise DistributedConfigError(f"ShardingSpec: {what} must be an int, got {value!r}") from None


def _is_range(item: Any) -> bool:
    """True for ``(start, end)`` given as two ints (rather than a sequence of ranges)."""
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        return False
    try:
        operator.index(item[0])
        operator.index(item[1])
    except TypeError:
        return False
    return True


def _normalize_offsets(offsets: Iterable[Any]) -> Tuple[RankRanges, ...]:
    """Accept one ``(start, end)`` per rank or a sequence of ranges per rank; return the latter."""
    if isinstance(offsets, (str, bytes)) or not isinstance(offsets, Iterable):
        raise DistributedConfigError(
            f"ShardingSpec: unsharded_flattened_offsets must be a sequence with one entry per "
            f"rank, got {offsets!r}"
        )
    result: List[RankRanges] = []
    for rank, item in enumerate(offsets):
        if _is_range(item):
            items: Sequence[Any] = (item,)
        elif isinstance(item, (tuple, list)):
            items = item
        else:
            raise DistributedConfigError(
                f"ShardingSpec: the offsets of rank {rank} must be a (start, end) pair or a "
                f"sequence of such pairs, got {item!r}"
            )
        ranges = []
        for rng in items:
            if not _is_range(rng):
                raise DistributedConfigError(
                    f"ShardingSpec: rank {rank} has a range {rng!r} that is not a (start, end) pair"
                )
            ranges.append((_as_int(rng[0], f"rank {rank}'s start"), _as_int(rng[1], f"rank {rank}'s end")))
        result.append(tuple(ranges))
    if not result:
        raise DistributedConfigError("ShardingSpec: unsharded_flattened_offsets lists no ranks")
    return tuple(result)


def _check_ranges(numel: int, offsets: Tuple[RankRanges, ...]) -> None:
    """Raise unless the ranges tile ``[0, numel)`` exactly (no gap, overlap or stray range)."""
    spans = []
    for rank, ranges in enumerate(offsets):
        for start, end in ranges:
            if start > end:
                raise DistributedConfigError(
                    f"ShardingSpec: rank {rank}'s range ({start}, {end}) runs backwards "
                    f"(start {start} > end {end})"
                )
            if start < 0 or end > numel:
                raise DistributedConfigError(
                    f"ShardingSpec: rank {rank}'s range ({start}, {end}) falls outside the "
                    f"flattened tensor of {numel} element(s) (valid: 0 <= start <= end <= {numel})"
                )
            if start < end:
                spans.append((start, end, rank))
    spans.sort()
    covered_to, prev = 0, None
    for start, end, rank in spans:
        if start > covered_to:
            after = "the start" if prev is None else f"rank {prev[2]}'s range ({prev[0]}, {prev[1]})"
            raise DistributedConfigError(
                f"ShardingSpec: elements [{covered_to}, {start}) of the {numel}-element flattened "
                f"tensor are held by no rank (a gap between {after} and rank {rank}'s range "
                f"({start}, {end}))"
            )
        if start < covered_to:
            assert prev is not None
            raise DistributedConfigError(
                f"ShardingSpec: rank {prev[2]}'s range ({prev[0]}, {prev[1]}) and rank {rank}'s "
                f"range ({start}, {end}) overlap on elements [{start}, {min(end, covered_to)})"
            )
        covered_to, prev = end, (start, end, rank)
    if covered_to != numel:
        after = "any rank" if prev is None else f"rank {prev[2]}'s range ({prev[0]}, {prev[1]})"
        raise DistributedConfigError(
            f"ShardingSpec: elements [{covered_to}, {numel}) of the {numel}-element flattened "
            f"tensor are held by no rank (nothing after {after}); the ranges cover "
            f"{sum(e - s for s, e, _ in spans)} of {numel} element(s)"
        )


@dataclass(frozen=True)
class ShardingSpec:
    """The layout of a flat-sharded tensor across the ranks of a process group.

    :param unsharded_shape: the shape of the full (unsharded, unflattened) tensor.
    :param unsharded_flattened_offsets: indexed by group rank; for each rank, its ranges
        ``((start, end), ...)`` into the flattened full tensor, in the order the rank's local
        shard stores them. A single ``(start, end)`` per rank is accepted and normalized.

    Raises :class:`~axolotl_dist.errors.DistributedConfigError` (a ``ValueError``) for
    ranges that run backwards, fall outside the tensor, overlap, or leave a gap.
    """

    unsharded_shape: Tuple[int, ...]
    unsharded_flattened_offsets: Tuple[RankRanges, ...]
    _plan: Tuple[Tuple[int, int, int], ...] = field(init=False, repr=False, compare=False)
    _aligned: bool = field(init=False, repr=False, compare=False)
    _monotone: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            shape = tuple(_as_int(d, "every dim of unsharded_shape") for d in self.unsharded_shape)
        except TypeError:
            raise DistributedConfigError(
                f"ShardingSpec: unsharded_shape must be a sequence of ints, got {self.unsharded_shape!r}"
            ) from None
        if any(d < 0 for d in shape):
            raise DistributedConfigError(f"ShardingSpec: unsharded_shape {shape} has a negative dim")
        offsets = _normalize_offsets(self.unsharded_flattened_offsets)
        object.__setattr__(self, "unsharded_shape", shape)
        object.__setattr__(self, "unsharded_flattened_offsets", offsets)
        _check_ranges(math.prod(shape), offsets)
        object.__setattr__(self, "_plan", self._make_plan())
        object.__setattr__(self, "_aligned", self._is_aligned())
        object.__setattr__(self, "_monotone", self._is_monotone())

    @classmethod
    def balanced(cls, unsharded_shape: Sequence[int], world_size: int) -> "ShardingSpec":
        """The default layout: one range per rank, in rank order, sizes differing by at most 1.

        Ranks ``r < numel % world_size`` get one extra element, so no range ever runs
        backwards, also with fewer elements than ranks (5 over 4 ranks: 2, 1, 1, 1; 2 over 8
        ranks: 1, 1, 0, 0, 0, 0, 0, 0).
        """
        world_size = _as_int(world_size, "world_size")
        if world_size < 1:
            raise DistributedConfigError(f"ShardingSpec.balanced: world_size={world_size} must be >= 1")
        numel = math.prod(int(d) for d in unsharded_shape)
        base, extra = divmod(numel, world_size)
        offsets = []
        for rank in range(world_size):
            start = rank * base + min(rank, extra)
            offsets.append(((start, start + base + (1 if rank < extra else 0)),))
        return cls(tuple(unsharded_shape), tuple(offsets))

    @property
    def unsharded_numel(self) -> int:
        """Number of elements of the full tensor."""
        return math.prod(self.unsharded_shape)

    @property
    def sharded_numels(self) -> Tuple[int, ...]:
        """Number of elements each rank holds, by group rank."""
        return tuple(sum(e - s for s, e in ranges) for ranges in self.unsharded_flattened_offsets)

    @property
    def unsharded_flattened_shape(self) -> Tuple[int, ...]:
        """The shape of the flattened full tensor: ``(unsharded_numel,)``."""
        return (self.unsharded_numel,)

    @property
    def world_size(self) -> int:
        """The number of ranks this spec describes."""
        return len(self.unsharded_flattened_offsets)

    @property
    def max_sharded_numel(self) -> int:
        """The largest shard: every shard is padded to this size for communication."""
        return max(self.sharded_numels)

    def check_world_size(self, world_size: int, what: str = "the process group") -> None:
        """Raise :class:`DistributedConfigError` unless the spec has ``world_size`` ranks."""
        if self.world_size != world_size:
            raise DistributedConfigError(
                f"ShardingSpec lists offsets for {self.world_size} rank(s) but {what} has "
                f"{world_size} rank(s): give one entry per group rank"
            )

    def _make_plan(self) -> Tuple[Tuple[int, int, int], ...]:
        """Copies ``(padded_src, dst, length)`` from the rank-major padded buffer to the output."""
        width = max(self.sharded_numels)
        plan = []
        for rank, ranges in enumerate(self.unsharded_flattened_offsets):
            local = 0
            for start, end in ranges:
                if end > start:
                    src = rank * width + local
                    if plan and plan[-1][0] + plan[-1][2] == src and plan[-1][1] + plan[-1][2] == start:
                        s, d, n = plan[-1]
                        plan[-1] = (s, d, n + end - start)
                    else:
                        plan.append((src, start, end - start))
                local += end - start
        return tuple(plan)

    def _is_aligned(self) -> bool:
        """True if the padded rank-major buffer already *is* the flattened tensor (no copy)."""
        return all(src == dst for src, dst, _ in self._plan)

    def _is_monotone(self) -> bool:
        """True if the buffer can be compacted in place: in output order, every piece moves
        left (or stays) and the pieces keep their order (rank-ordered layouts, uneven or not)."""
        pieces = sorted(self._plan, key=lambda p: p[1])
        return all(dst <= src for src, dst, _ in pieces) and all(
            a[0] < b[0] for a, b in zip(pieces, pieces[1:]))
