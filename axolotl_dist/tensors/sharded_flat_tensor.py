"""Flat-sharded tensors and parameters: :class:`ShardedFlatTensor`, :class:`ShardedFlatParameter`.

Each rank of a process group holds, as a plain 1-D tensor, the elements of the flattened full
tensor that a :class:`~axolotl_dist.tensors.ShardingSpec` assigns to it (one or more ranges).
The API is OLMo-core's; what behaves differently from it, and why:

* the default spec never produces a backwards range (5 elements over 4 ranks: 2, 1, 1, 1);
* ``rank0_only`` sends to group rank 0 of the tensor's group, not global rank 0;
* :meth:`ShardedFlatTensor.gather` is one all-gather into one padded flat buffer (in place,
  no copy of the result when the layout allows it) and honours ``dtype`` also when unsharded;
* :meth:`ShardedFlatTensor.reshard_` also reshards a full-shape gradient left by a backward
  pass on the unsharded data, so an optimizer step right after it works;
* meta tensors never communicate.

A sharded tensor is a real ``torch.Tensor`` subclass whose data is the local shard; after
:meth:`~ShardedFlatTensor.unshard_` its ``.data`` is the full tensor (so ``shape`` and
``numel()`` report the full tensor and a module's forward uses it) until
:meth:`~ShardedFlatTensor.reshard_`. Results of ordinary torch ops are plain tensors;
``torch.empty_like`` / ``zeros_like`` / ``ones_like`` / ``full_like`` of a sharded tensor are
sharded like it (so optimizer states are marked sharded too).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Type, TypeVar, Union

import torch
import torch.nn as nn

from ..errors import DistributedConfigError
from ._flat_comm import GroupInfo, assemble, gather_flat, group_info, scatter_flat
from .sharding_spec import RankRanges, ShardingSpec

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = ["ShardedFlatTensor", "ShardedFlatParameter"]

T = TypeVar("T", bound="ShardedFlatTensor")

_LIKE_FUNCS = frozenset({torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like})


def _take(flat: torch.Tensor, ranges: RankRanges) -> torch.Tensor:
    """The elements of ``flat`` in ``ranges``, concatenated: a view for one range, else a copy."""
    if len(ranges) == 1:
        start, end = ranges[0]
        return flat[start:end]
    if not ranges:
        return flat[:0]
    return torch.cat([flat[start:end] for start, end in ranges])


def _shape(tensor: torch.Tensor) -> Tuple[int, ...]:
    return tuple(tensor.shape)


class ShardedFlatTensor(torch.Tensor):
    """A tensor sharded across a process group as contiguous slices of its flattened form.

    Build one with :meth:`shard` (or wrap a local 1-D shard and call :meth:`mark_as_sharded`).
    ``ShardedFlatTensor(data, requires_grad=False)`` makes an unmarked tensor sharing
    ``data``'s storage; ``data`` must be 1-D. Given another ``ShardedFlatTensor``, the new
    tensor shares its local shard and its sharding metadata.
    """

    # Class-level defaults: an instance made without __new__ (``torch.Tensor._make_subclass``,
    # ``tensor.as_subclass(ShardedFlatTensor)``) reads as unmarked instead of raising
    # AttributeError; ``metadata_set`` tells such an instance apart.
    _afd_spec: Optional[ShardingSpec] = None
    _afd_info: Optional[GroupInfo] = None
    _afd_local: Optional[torch.Tensor] = None
    _afd_no_data = False

    def __new__(cls: Type[T], data: Optional[torch.Tensor] = None, requires_grad: bool = False) -> T:
        no_data = data is None
        if data is None:
            data = torch.empty(0)
        if not isinstance(data, torch.Tensor):
            raise TypeError(f"{cls.__name__} needs a torch.Tensor, got {type(data).__name__}")
        source = data if isinstance(data, ShardedFlatTensor) else None
        base = source.sharded_data if source is not None else data
        if base.dim() != 1:
            raise DistributedConfigError(
                f"{cls.__name__} holds a flat (1-D) local shard, got shape {_shape(base)}: "
                f"use {cls.__name__}.shard(tensor) to shard a tensor of any shape"
            )
        tensor = torch.Tensor._make_subclass(cls, base.detach(), requires_grad)
        tensor._afd_spec, tensor._afd_info, tensor._afd_local = None, None, None
        tensor._afd_no_data = no_data  # repr says local_tensor=None until data is set
        if source is not None and source._afd_spec is not None:
            tensor._afd_spec, tensor._afd_info = source._afd_spec, source._afd_info
        return tensor

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """Run ops on the plain data; re-mark ``*_like`` results of a sharded tensor."""
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
            if func in _LIKE_FUNCS and args and isinstance(args[0], ShardedFlatTensor):
                src = args[0]
                if src._afd_spec is not None and src._afd_local is None and out.shape == src.shape:
                    out = ShardedFlatTensor._from_local(out, src._afd_spec, src._afd_info)
        return out

    # ------------------------------------------------------------------ construction
    @classmethod
    def _from_local(
        cls: Type[T], local: torch.Tensor, spec: ShardingSpec, info: Optional[GroupInfo],
        requires_grad: bool = False,
    ) -> T:
        tensor = cls(local, requires_grad=requires_grad)
        tensor._afd_spec, tensor._afd_info = spec, info
        return tensor

    @classmethod
    def shard(
        cls: Type[T],
        tensor: torch.Tensor,
        sharding_spec: Optional[ShardingSpec] = None,
        process_group: Optional["ProcessGroup"] = None,
        synchronize: bool = True,
        device: Optional[Union[torch.device, str]] = None,
        requires_grad: Optional[bool] = None,
    ) -> T:
        """Shard ``tensor`` (any shape) across ``process_group`` (default: the world).

        :param sharding_spec: the layout; default :meth:`ShardingSpec.balanced` (one range per
            rank, sizes differing by at most one element).
        :param synchronize: take the data from group rank 0 (one scatter: each rank receives
            only its shard; ``tensor`` itself is never modified). With ``False`` each rank
            slices its own ``tensor``.
        :param device: where the local shard lives (default: ``tensor``'s device).
        :param requires_grad: default ``tensor.requires_grad``.

        A meta ``tensor`` is uninitialised: nothing is communicated and the local shard is
        ``torch.empty`` on ``device`` (meta if ``device`` is None).
        """
        info = group_info(process_group, f"{cls.__name__}.shard")
        shape = _shape(tensor)
        spec = sharding_spec if sharding_spec is not None else ShardingSpec.balanced(shape, info.world_size)
        if spec.unsharded_shape != shape:
            raise DistributedConfigError(
                f"{cls.__name__}.shard: the tensor has shape {shape} but the sharding spec is for "
                f"shape {spec.unsharded_shape}"
            )
        spec.check_world_size(info.world_size)
        target = torch.device(device) if device is not None else tensor.device
        local = cls._local_shard(tensor.detach(), spec, info, synchronize, target)
        grad = tensor.requires_grad if requires_grad is None else requires_grad
        return cls._from_local(local, spec, info, requires_grad=grad)

    @staticmethod
    def _local_shard(
        tensor: torch.Tensor, spec: ShardingSpec, info: GroupInfo, synchronize: bool, device: torch.device
    ) -> torch.Tensor:
        mine = spec.sharded_numels[info.rank]
        if tensor.is_meta:
            return torch.empty(mine, dtype=tensor.dtype, device=device)
        if synchronize and info.world_size > 1:
            flat = tensor.reshape(-1) if info.rank == 0 else None
            return scatter_flat(flat, spec, info, tensor.dtype, device)
        ranges = spec.unsharded_flattened_offsets[info.rank]
        local = _take(tensor.reshape(-1), ranges)
        return local.to(device=device, copy=len(ranges) <= 1)

    def mark_as_sharded(self, sharding_spec: ShardingSpec, process_group: Optional["ProcessGroup"] = None) -> None:
        """Mark this (local, 1-D) tensor as this rank's shard under ``sharding_spec``."""
        if self._afd_spec is not None:
            raise DistributedConfigError(f"this {type(self).__name__} is already marked as sharded")
        info = group_info(process_group, f"{type(self).__name__}.mark_as_sharded")
        sharding_spec.check_world_size(info.world_size)
        expected = sharding_spec.sharded_numels[info.rank]
        if self.numel() != expected:
            raise DistributedConfigError(
                f"the sharding spec gives group rank {info.rank} {expected} element(s) but this "
                f"local shard has {self.numel()}"
            )
        self._afd_spec, self._afd_info = sharding_spec, info

    # ------------------------------------------------------------------ metadata
    def _require(self) -> Tuple[ShardingSpec, GroupInfo]:
        if self._afd_spec is None or self._afd_info is None:
            raise DistributedConfigError(
                f"this {type(self).__name__} has not been marked as sharded: build it with "
                f"{type(self).__name__}.shard() or call .mark_as_sharded()"
            )
        return self._afd_spec, self._afd_info

    @property
    def metadata_set(self) -> bool:
        """Whether this instance carries its metadata fields (OLMo-core's meaning).

        True for every tensor built by ``ShardedFlatTensor(...)``, :meth:`shard` or a torch
        ``*_like`` function, marked as sharded or not (:attr:`is_sharded` tells that); False
        for one made by ``torch.Tensor._make_subclass`` or ``.as_subclass``, which bypass
        ``__new__``. Such an instance still answers :attr:`is_sharded` (False) and ``repr``.
        """
        return "_afd_spec" in self.__dict__

    @property
    def is_sharded(self) -> bool:
        """True while the data is the local shard (marked, and not unsharded in place)."""
        return self._afd_spec is not None and self._afd_local is None

    @property
    def sharding_spec(self) -> ShardingSpec:
        """The layout (``DistributedConfigError``, a ``ValueError``, if not marked)."""
        return self._require()[0]

    @property
    def process_group(self) -> Optional["ProcessGroup"]:
        """The process group the tensor is sharded over (None: the world)."""
        return self._require()[1].group

    @property
    def unsharded_flattened_offsets(self) -> RankRanges:
        """This rank's ranges into the flattened full tensor."""
        spec, info = self._require()
        return spec.unsharded_flattened_offsets[info.rank]

    @property
    def sharded_numel(self) -> int:
        """Number of elements of this rank's shard."""
        spec, info = self._require()
        return spec.sharded_numels[info.rank]

    @property
    def sharded_shape(self) -> Tuple[int, ...]:
        """Shape of this rank's shard: ``(sharded_numel,)``."""
        return (self.sharded_numel,)

    @property
    def unsharded_numel(self) -> int:
        """Number of elements of the full tensor."""
        return self.sharding_spec.unsharded_numel

    @property
    def unsharded_shape(self) -> Tuple[int, ...]:
        """Shape of the full tensor."""
        return self.sharding_spec.unsharded_shape

    @property
    def sharded_data(self) -> torch.Tensor:
        """This rank's local shard as a plain tensor, also while unsharded."""
        return self._afd_local if self._afd_local is not None else self.data

    @sharded_data.setter
    def sharded_data(self, value: torch.Tensor) -> None:
        if self._afd_local is not None:
            self._afd_local = value.detach()
        else:
            self.data = value

    # ------------------------------------------------------------------ gather / unshard
    def _gather(self, dtype: Optional[torch.dtype], rank0_only: bool) -> torch.Tensor:
        spec, info = self._require()
        local = self.sharded_data
        dtype = dtype or local.dtype
        off_root = rank0_only and info.rank != 0
        if local.is_meta:
            return torch.empty(0 if off_root else spec.unsharded_shape, dtype=dtype, device="meta")
        if info.world_size == 1:  # nothing to communicate; the ranges may still be out of order
            return assemble(local.to(dtype=dtype, copy=True).view(1, -1), spec).view(spec.unsharded_shape)
        flat = gather_flat(local, spec, info, dtype, rank0_only)
        if flat is None:
            return torch.empty(0, dtype=dtype, device=local.device)
        return flat.view(spec.unsharded_shape)

    def gather(self, dtype: Optional[torch.dtype] = None, rank0_only: bool = False) -> torch.Tensor:
        """The full tensor, gathered from every rank (one all-gather); ``self`` is unchanged.

        :param dtype: cast to this dtype (shards are cast before they travel).
        :param rank0_only: only group rank 0 of the tensor's group receives the full tensor
            (one gather); the other ranks get an empty tensor.

        While unsharded in place, returns the current full data (cast if ``dtype`` is given)
        without communicating. The result requires grad if ``self`` does (floating dtypes).
        """
        self._require()
        if self.is_sharded:
            full = self._gather(dtype, rank0_only)
        else:
            full = self.data if dtype is None else self.data.to(dtype)
        if self.requires_grad and (full.is_floating_point() or full.is_complex()):
            full.requires_grad_(True)
        return full

    def unshard_(
        self,
        unsharded_data: Optional[torch.Tensor] = None,
        dtype: Optional[torch.dtype] = None,
        rank0_only: bool = False,
    ) -> None:
        """Replace this tensor's data with the full tensor, in place; undo with :meth:`reshard_`.

        The full data is ``unsharded_data`` (viewed in the full shape) if given, else the
        current full data if already unsharded, else a gather. With ``rank0_only`` the ranks
        other than group rank 0 hold an empty tensor.
        """
        spec, info = self._require()
        if unsharded_data is not None:
            full = unsharded_data.detach()
            if not (rank0_only and info.rank != 0):
                if full.numel() != spec.unsharded_numel:
                    raise DistributedConfigError(
                        f"unshard_: unsharded_data has shape {_shape(full)} but the full tensor has "
                        f"shape {spec.unsharded_shape}"
                    )
                full = full.view(spec.unsharded_shape)
            if dtype is not None:
                full = full.to(dtype)
        elif not self.is_sharded:
            full = self.data if dtype is None else self.data.to(dtype)
        else:
            full = self._gather(dtype, rank0_only)
        if self._afd_local is None:
            self._afd_local = self.data
        self.data = full

    def reshard_(self, writeback: bool = False) -> None:
        """Return to the local shard after :meth:`unshard_`; a no-op while sharded.

        :param writeback: take the new shard from the full data of group rank 0 (one scatter;
            **rank 0's edits win**, other ranks' edits are discarded), cast to the shard's
            dtype. Without it the shard saved by :meth:`unshard_` comes back unchanged.

        A gradient with the full shape (from a backward pass on the unsharded data) is
        replaced by this rank's chunk of it, cast to the shard's dtype. Reduce it across ranks
        first (e.g. ``all_reduce``) if ranks computed different gradients.
        """
        spec, info = self._require()
        if self.is_sharded:
            return
        local = self._afd_local
        assert local is not None
        if writeback:
            local = self._writeback(self.data, local, spec, info)
        grad = self.grad
        self.data = local
        self._afd_local = None
        if grad is not None:
            self._reshard_grad(grad, spec, info)

    def _writeback(
        self, full: torch.Tensor, local: torch.Tensor, spec: ShardingSpec, info: GroupInfo
    ) -> torch.Tensor:
        if local.is_meta or full.is_meta:
            return torch.empty(local.shape, dtype=local.dtype, device=local.device)
        root = info.rank == 0
        if _shape(full) != spec.unsharded_shape and (root or full.numel() > 0):
            raise DistributedConfigError(
                f"reshard_(writeback=True): group rank {info.rank} holds full data of shape "
                f"{_shape(full)}, expected {spec.unsharded_shape}"
                + (" (or empty, off group rank 0)" if not root else "")
            )
        if info.world_size == 1:
            return _take(full.reshape(-1), spec.unsharded_flattened_offsets[0]).to(
                dtype=local.dtype, device=local.device, copy=True)
        flat = full.reshape(-1) if root else None
        return scatter_flat(flat, spec, info, local.dtype, local.device)

    def _reshard_grad(self, grad: torch.Tensor, spec: ShardingSpec, info: GroupInfo) -> None:
        if _shape(grad) == self.sharded_shape and grad.dtype == self.dtype:
            return
        if grad.numel() != spec.unsharded_numel:
            return  # not a full-shape gradient: leave it to the caller
        ranges = spec.unsharded_flattened_offsets[info.rank]
        chunk = _take(grad.detach().reshape(-1), ranges)
        self.grad = chunk.to(dtype=self.dtype, device=self.device, copy=True)

    # ------------------------------------------------------------------ chunks
    def wrap(self, tensor: torch.Tensor, requires_grad: Optional[bool] = None) -> "ShardedFlatTensor":
        """A new :class:`ShardedFlatTensor` for ``tensor`` with this tensor's spec and group.

        ``tensor`` must have this tensor's current shape: the shard's while sharded (it is
        used as the new local shard, sharing storage), the full shape while unsharded (the
        new tensor is unsharded too, with ``tensor`` as its full data).
        """
        spec, info = self._require()
        grad = tensor.requires_grad if requires_grad is None else requires_grad
        if _shape(tensor) != _shape(self):
            raise DistributedConfigError(
                f"wrap: tensor has shape {_shape(tensor)} but this tensor's current "
                f"({'sharded' if self.is_sharded else 'unsharded'}) shape is {_shape(self)}"
            )
        if self.is_sharded:
            return ShardedFlatTensor._from_local(tensor.detach(), spec, info, requires_grad=grad)
        local = self.sharded_chunk(tensor.detach())
        wrapped = ShardedFlatTensor._from_local(local, spec, info, requires_grad=grad)
        wrapped.unshard_(tensor)
        return wrapped

    def _check_full(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        spec = self.sharding_spec
        if _shape(tensor) != spec.unsharded_shape:
            raise DistributedConfigError(
                f"{op}: tensor has shape {_shape(tensor)}, expected the full shape {spec.unsharded_shape}"
            )
        return tensor.reshape(-1)

    def chunk_unsharded(self, tensor: torch.Tensor, pad: bool = False) -> List[torch.Tensor]:
        """Split a full-shape ``tensor`` into every rank's flat shard, indexed by group rank.

        :param pad: right-pad every chunk with zeros to the largest shard's size.
        """
        flat = self._check_full(tensor, "chunk_unsharded")
        spec = self.sharding_spec
        width = spec.max_sharded_numel
        chunks = []
        for ranges, numel in zip(spec.unsharded_flattened_offsets, spec.sharded_numels):
            chunk = _take(flat, ranges)
            if pad and numel < width:
                chunk = torch.cat([chunk, chunk.new_zeros(width - numel)])
            chunks.append(chunk)
        return chunks

    def sharded_chunk(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's flat shard of a full-shape ``tensor`` (a view for one range)."""
        flat = self._check_full(tensor, "sharded_chunk")
        return _take(flat, self.unsharded_flattened_offsets)

    # ------------------------------------------------------------------ python protocol
    def __repr__(self, *, tensor_contents: Any = None) -> str:
        """OLMo-core's format: ``ShardedFlatTensor(local_tensor=tensor([...]))``, plus
        ``global_tensor=`` while unsharded in place (and ``requires_grad=`` for a parameter);
        ``local_tensor=None`` for one built without data.
        An instance without metadata (see :attr:`metadata_set`) prints as a plain tensor."""
        if not self.metadata_set:
            return torch.Tensor.__repr__(self, tensor_contents=tensor_contents)
        local = self.sharded_data
        empty = self._afd_no_data and local.numel() == 0  # built without data, as OLMo-core
        fields = [f"local_tensor={None if empty else local}"]
        if self._afd_local is not None:
            fields.append(f"global_tensor={self.data}")
        fields.extend(self._repr_extra())
        return f"{type(self).__name__}({', '.join(fields)})"

    def _repr_extra(self) -> List[str]:
        return []

    def __deepcopy__(self, memo: Dict[int, Any]) -> "ShardedFlatTensor":
        """A copy with cloned data (and gradient) sharing the spec and the process group."""
        if id(self) in memo:
            return memo[id(self)]
        new = type(self)(self.sharded_data.clone(), requires_grad=self.requires_grad)
        new._afd_spec, new._afd_info = self._afd_spec, self._afd_info
        if self._afd_spec is not None and not self.is_sharded:
            new.unshard_(self.data.clone())
        if self.grad is not None:
            new.grad = self.grad.clone()
        memo[id(self)] = new
        return new


class ShardedFlatParameter(ShardedFlatTensor, nn.Parameter):  # type: ignore[misc]
    """A :class:`ShardedFlatTensor` that is an ``nn.Parameter``: assign it to a module.

    ``ShardedFlatParameter(data=None, requires_grad=True)``; usually built with
    :meth:`ShardedFlatTensor.shard`. An optimizer updates the local shard; to train, unshard
    before the forward pass and reshard after the backward pass::

        p.unshard_(); loss = model(x); loss.backward()
        dist.all_reduce(p.grad); p.grad /= world_size   # if ranks saw different data
        p.reshard_(); optimizer.step()
    """

    def __new__(cls, data: Optional[torch.Tensor] = None, requires_grad: bool = True) -> "ShardedFlatParameter":
        return ShardedFlatTensor.__new__(cls, data, requires_grad)  # type: ignore[return-value]

    def _repr_extra(self) -> List[str]:
        return [f"requires_grad={self.requires_grad}"]
