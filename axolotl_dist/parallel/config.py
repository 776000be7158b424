"""Parallelism enums and configs: small dataclasses that validate themselves in one place.

Every config checks its own fields in ``validate()``, which runs on construction and again in
:func:`~axolotl_dist.parallel.build_world_mesh` (dataclasses are mutable). Errors are
:class:`~axolotl_dist.errors.DistributedConfigError` and name the config and the numbers.
Enum fields accept the enum or its string value (schedule names in any case, as torch's
``get_schedule_class`` does).
"""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Any, Iterable, Optional, Tuple, Type, TypeVar, Union

import torch

from ..errors import DistributedConfigError

__all__ = [
    "StrEnum",
    "MeshDimName",
    "DPMeshDimName",
    "DataParallelType",
    "PipelineSplitStyle",
    "PipelineScheduleType",
    "DataParallelConfig",
    "TensorParallelConfig",
    "ContextParallelConfig",
    "ExpertParallelConfig",
    "PipelineParallelConfig",
]

_E = TypeVar("_E", bound="StrEnum")


class StrEnum(str, Enum):
    """A string-valued enum whose ``str()`` and ``format()`` give the value (Python 3.9+)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return str(self.value).__format__(spec)

    @classmethod
    def coerce(cls: Type[_E], value: Any, where: str) -> _E:
        """``value`` as a member, matching values and names case-insensitively.

        :param where: the config and field, for the error message (``"Foo.bar"``).
        :raises DistributedConfigError: if nothing matches; the message lists the choices.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            wanted = value.lower()
            for member in cls:
                if wanted in (member.value.lower(), member.name.lower()):
                    return member
        choices = ", ".join(repr(m.value) for m in cls)
        raise DistributedConfigError(f"{where}={value!r} is not a valid {cls.__name__}: use one of {choices}")


class MeshDimName(StrEnum):
    """Names of the device-mesh dimensions that :func:`build_world_mesh` and the getters use."""

    #: Data parallel (DP).
    dp = "dp"
    #: The DP dimension over which the model is replicated (HSDP).
    dp_replicate = "dp_replicate"
    #: The DP dimension over which the model is sharded (HSDP).
    dp_shard = "dp_shard"
    #: Tensor parallel (TP).
    tp = "tp"
    #: Context parallel (CP).
    cp = "cp"
    #: Pipeline parallel (PP).
    pp = "pp"
    #: Expert parallel (EP).
    ep = "ep"
    #: Replicate dimension of a stand-alone expert-parallel mesh.
    ep_replicate = "ep_replicate"
    #: Shard dimension of a stand-alone expert-parallel mesh.
    ep_shard = "ep_shard"
    #: DP and EP flattened together.
    dp_ep = "dp_ep"
    #: DP (shard) and CP flattened together: gradients reduce over it.
    dp_cp = "dp_cp"


class DPMeshDimName(StrEnum):
    """Device-mesh dimension names for data parallelism."""

    #: The dimension over which the model is replicated.
    replicate = "dp_replicate"
    #: The dimension over which the model is sharded.
    shard = "dp_shard"


class DataParallelType(StrEnum):
    """The kind of data parallelism: fully sharded, hybrid sharded or replicated."""

    fsdp = "fsdp"
    hsdp = "hsdp"
    ddp = "ddp"


class PipelineSplitStyle(StrEnum):
    """How stages are assigned to pipeline ranks: round-robin (``loop``) or folded (``v``)."""

    loop = "loop"
    v = "v"


class PipelineScheduleType(StrEnum):
    """Pipeline schedules, by the names of ``torch.distributed.pipelining.get_schedule_class``.

    .. warning:: The zero-bubble variants are not compatible with ``torch.compile``.
    """

    single_1F1B = "1F1B"
    interleaved_1F1B = "Interleaved1F1B"
    gpipe = "GPipe"
    looped_bfs = "LoopedBFS"
    interleaved_zero_bubble = "InterleavedZeroBubble"
    zbv_zero_bubble = "ZBVZeroBubble"

    @property
    def is_single_stage(self) -> bool:
        """Whether each rank runs exactly one stage (``1F1B``, ``GPipe``)."""
        return self in (PipelineScheduleType.single_1F1B, PipelineScheduleType.gpipe)

    @property
    def is_multi_stage(self) -> bool:
        """Whether each rank may run several stages."""
        return not self.is_single_stage

    @property
    def default_style(self) -> PipelineSplitStyle:
        """``v`` for ``ZBVZeroBubble``, ``loop`` for every other schedule."""
        if self == PipelineScheduleType.zbv_zero_bubble:
            return PipelineSplitStyle.v
        return PipelineSplitStyle.loop


def _check_int(owner: str, field: str, value: Any, minimum: int = 1, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise DistributedConfigError(f"{owner}: {field}={value!r} must be an integer >= {minimum}")


def _check_dtype(owner: str, field: str, value: Any, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, torch.dtype):
        return
    if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
        return
    raise DistributedConfigError(
        f"{owner}: {field}={value!r} is not a torch dtype: use e.g. 'bfloat16', 'float32' or "
        "torch.bfloat16")


class _Config:
    """Mixin: ``validate()`` on construction, ``as_dict()``, a compact ``describe()``."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:  # pragma: no cover - overridden
        """Check every field; raise :class:`DistributedConfigError` naming the bad one."""

    def as_dict(self) -> dict:
        """The fields as a plain dict (enums as their string values)."""
        return {f.name: (str(v) if isinstance(v, Enum) else v)
                for f in dataclasses.fields(self) for v in [getattr(self, f.name)]}

    def describe(self) -> str:
        """``ClassName(field=value, ...)`` for error messages (only non-default fields)."""
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.default is dataclasses.MISSING or value != f.default:
                parts.append(f"{f.name}={str(value)!r}" if isinstance(value, Enum) else f"{f.name}={value!r}")
        return f"{type(self).__name__}({', '.join(parts)})"


@dataclasses.dataclass
class DataParallelConfig(_Config):
    """Data parallelism: ``name`` (fsdp, hsdp, ddp), dtypes and the HSDP replica layout.

    ``num_replicas`` and ``shard_degree`` only matter for HSDP; see
    :meth:`get_replicate_and_shard_degree`.
    """

    name: DataParallelType
    param_dtype: Optional[Any] = None
    reduce_dtype: Any = "float32"
    num_replicas: Optional[int] = None
    shard_degree: Optional[int] = None

    def validate(self) -> None:
        """Coerce ``name``; dtypes must name torch dtypes; degrees must be ints >= 1 if set."""
        self.name = DataParallelType.coerce(self.name, "DataParallelConfig.name")
        _check_dtype(self.describe(), "param_dtype", self.param_dtype, optional=True)
        _check_dtype(self.describe(), "reduce_dtype", self.reduce_dtype)
        _check_int(self.describe(), "num_replicas", self.num_replicas, optional=True)
        _check_int(self.describe(), "shard_degree", self.shard_degree, optional=True)

    def get_replicate_and_shard_degree(self, dp_world_size: int) -> Tuple[int, int]:
        """``(num_replicas, shard_degree)`` for a data-parallel world of ``dp_world_size`` ranks.

        * Neither set: one replica per node (``NUM_NODES`` or world / ``LOCAL_WORLD_SIZE``),
          sharded over the rest, which must divide evenly.
        * One set: it must divide ``dp_world_size``; the other is the quotient.
        * Both set: their product must equal ``dp_world_size``.

        :raises DistributedConfigError: naming the config and the numbers.
        """
        _check_int(self.describe(), "dp_world_size", dp_world_size)
        r, s = self.num_replicas, self.shard_degree
        if r is not None and s is not None:
            if r * s != dp_world_size:
                raise DistributedConfigError(
                    f"{self.describe()}: num_replicas * shard_degree = {r} * {s} = {r * s} but the "
                    f"data parallel world size is {dp_world_size}: make the product equal "
                    f"{dp_world_size}, or set only one of them")
            return r, s
        if r is None and s is None:
            return self._per_node_degrees(dp_world_size)
        field, given = ("num_replicas", r) if r is not None else ("shard_degree", s)
        if dp_world_size % given != 0:
            raise DistributedConfigError(
                f"{self.describe()}: the data parallel world size ({dp_world_size}) must be "
                f"divisible by {field!r} ({given})")
        other = dp_world_size // given
        return (given, other) if r is not None else (other, given)

    def _per_node_degrees(self, dp_world_size: int) -> Tuple[int, int]:
        from .. import env as _env
        from ..ranks import get_world_size

        nodes = _env.env_num_nodes(get_world_size())
        if dp_world_size % nodes != 0:
            raise DistributedConfigError(
                f"{self.describe()}: HSDP defaults to one replica per node, but the data parallel "
                f"world size ({dp_world_size}) is not divisible by the number of nodes ({nodes}): "
                "set num_replicas or shard_degree")
        return nodes, dp_world_size // nodes


@dataclasses.dataclass
class TensorParallelConfig(_Config):
    """Tensor parallelism (TP) of ``degree`` ranks."""

    degree: int
    #: Enable torch's experimental async tensor parallelism.
    enable_async: bool = False

    def validate(self) -> None:
        """``degree`` must be an int >= 1."""
        _check_int(self.describe(), "degree", self.degree)


@dataclasses.dataclass
class ContextParallelConfig(_Config):
    """Context parallelism (CP) of ``degree`` ranks: CP ranks split the sequence."""

    degree: int

    def validate(self) -> None:
        """``degree`` must be an int >= 1."""
        _check_int(self.describe(), "degree", self.degree)


@dataclasses.dataclass
class ExpertParallelConfig(_Config):
    """Expert parallelism (EP) of ``degree`` ranks; reuses the HSDP shard dimension."""

    degree: int

    def validate(self) -> None:
        """``degree`` must be an int >= 1 (OLMo-core let negatives through)."""
        _check_int(self.describe(), "degree", self.degree)


@dataclasses.dataclass
class PipelineParallelConfig(_Config):
    """Pipeline parallelism (PP): ``degree`` ranks, a ``schedule`` and a split ``style``."""

    degree: int
    schedule: PipelineScheduleType = PipelineScheduleType.interleaved_1F1B
    style: Optional[PipelineSplitStyle] = None

    def validate(self) -> None:
        """``degree`` >= 1; ``schedule`` and ``style`` must name known members."""
        _check_int(self.describe(), "degree", self.degree)
        self.schedule = PipelineScheduleType.coerce(self.schedule, "PipelineParallelConfig.schedule")
        if self.style is not None:
            self.style = PipelineSplitStyle.coerce(self.style, "PipelineParallelConfig.style")

    def infer_style(self) -> PipelineSplitStyle:
        """``style`` if set, else the schedule's default (``v`` for ZBV, else ``loop``)."""
        return self.style if self.style is not None else self.schedule.default_style

    def final_stage_rank(self) -> int:
        """The PP rank that runs the last stage: ``degree - 1`` (loop) or ``0`` (v)."""
        return self.degree - 1 if self.infer_style() == PipelineSplitStyle.loop else 0

    def rank_completion_order(self) -> Iterable[int]:
        """The order in which PP ranks finish a batch: last rank first (loop), rank 0 first (v)."""
        if self.infer_style() == PipelineSplitStyle.loop:
            return range(self.degree - 1, -1, -1)
        return range(self.degree)

    def stage_ids_this_rank(self, pp_rank: int, num_stages: int) -> Tuple[int, ...]:
        """The stage ids run by ``pp_rank`` out of ``num_stages``.

        * loop: ``pp_rank, pp_rank + degree, pp_rank + 2 * degree, ...``
        * v: two stages per rank, ``(pp_rank, num_stages - 1 - pp_rank)``; e.g. degree 4 with 8
          stages gives (0, 7), (1, 6), (2, 5), (3, 4).

        :raises DistributedConfigError: if ``num_stages`` is not a multiple of ``degree``,
            ``pp_rank`` is out of range, or a V style does not have two stages per rank.
        """
        _check_int(self.describe(), "num_stages", num_stages)
        if not isinstance(pp_rank, int) or not 0 <= pp_rank < self.degree:
            raise DistributedConfigError(
                f"{self.describe()}: pp_rank={pp_rank!r} must be in [0, {self.degree})")
        if num_stages % self.degree != 0:
            raise DistributedConfigError(
                f"{self.describe()}: num_stages ({num_stages}) must be divisible by the pipeline "
                f"degree ({self.degree})")
        per_rank = num_stages // self.degree
        if self.infer_style() == PipelineSplitStyle.loop:
            return tuple(pp_rank + i * self.degree for i in range(per_rank))
        if per_rank != 2:
            raise DistributedConfigError(
                f"{self.describe()}: a V-style split runs 2 stages per rank, but {num_stages} "
                f"stages over {self.degree} ranks is {per_rank} per rank: use "
                f"num_stages={2 * self.degree}")
        return (pp_rank, num_stages - 1 - pp_rank)


ParallelConfig = Union[
    DataParallelConfig, TensorParallelConfig, ContextParallelConfig, ExpertParallelConfig,
    PipelineParallelConfig,
]
