"""Splitting data across ranks: a ``DistributedSampler`` factory and Accelerate's
``split_between_processes``. Neither communicates."""

from __future__ import annotations

from contextlib import contextmanager
from typing import (
    TYPE_CHECKING,
    Any,
    ContextManager,
    Dict,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
    TypeVar,
    overload,
)

import torch

from .ranks import get_rank, get_world_size, is_initialized

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup
    from torch.utils.data import Dataset, DistributedSampler

__all__ = ["get_sampler", "split_between_processes", "shard_bounds"]


def shard_bounds(length: int, world_size: int, rank: int) -> Tuple[int, int]:
    """``[start, end)`` of ``rank``'s contiguous chunk; the first ``length % world_size`` ranks
    get one extra. The one rule of every splitter of the kit: :func:`split_between_processes`
    and ``shared_map``'s parts use it, so a rank gets the same rows from each."""
    base, extra = divmod(length, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")


def get_sampler(
    dataset: "Dataset",
    *,
    drop_last: bool = False,
    shuffle: bool = False,
    num_replicas: Optional[int] = None,
    rank: Optional[int] = None,
    seed: int = 0,
) -> "DistributedSampler":
    """A ``DistributedSampler`` for ``dataset`` over this run's ranks (composer's helper).

    ``num_replicas`` and ``rank`` default to :func:`get_world_size` / :func:`get_rank`, which
    work before init too, so no process group is needed to build the loader.
    """
    from torch.utils.data import DistributedSampler

    replicas = get_world_size() if num_replicas is None else num_replicas
    this = get_rank() if rank is None else rank
    if not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"get_sampler(num_replicas={replicas!r}) must be an int >= 1")
    if not isinstance(this, int) or not 0 <= this < replicas:
        raise ValueError(
            f"get_sampler(rank={this!r}) is out of range for num_replicas={replicas}: pass a "
            f"rank in [0, {replicas})")
    return DistributedSampler(dataset, num_replicas=replicas, rank=this, shuffle=shuffle,
                              seed=seed, drop_last=drop_last)


def _length(inputs: Any) -> int:
    if isinstance(inputs, dict):
        lengths = {k: len(v) for k, v in inputs.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(
                f"split_between_processes needs the dict's values to have equal lengths, got "
                f"{lengths}: pad or trim them first")
        return next(iter(lengths.values()), 0)
    if isinstance(inputs, torch.Tensor):
        if inputs.dim() == 0:
            raise ValueError("split_between_processes cannot split a 0-d tensor: pass a tensor with a first dimension")
        return inputs.shape[0]
    if isinstance(inputs, (list, tuple)) or hasattr(inputs, "__getitem__") and hasattr(inputs, "__len__"):
        return len(inputs)
    raise TypeError(
        f"split_between_processes takes a list, tuple, dict of equal-length lists, tensor or "
        f"dataset, got {type(inputs).__name__}")


def _take_rows(tensor: torch.Tensor, start: int, end: int, pad_to: Optional[int]) -> torch.Tensor:
    """Rows ``[start, end)`` of ``tensor``, padded to ``pad_to`` rows with its last row (zeros
    for an empty tensor)."""
    rows = tensor[start:end]
    if pad_to is not None and rows.shape[0] < pad_to:
        last = tensor[-1:] if tensor.shape[0] else tensor.new_zeros((1,) + tuple(tensor.shape[1:]))
        rows = torch.cat([rows] + [last] * (pad_to - rows.shape[0]))
    return rows


def _select_rows(dataset: Any, start: int, end: int, pad_to: Optional[int]) -> Any:
    """``dataset.select`` of rows ``[start, end)``, padded to ``pad_to`` with its last row."""
    idx: List[int] = list(range(start, end))
    if pad_to is not None and len(idx) < pad_to and len(dataset):
        idx += [len(dataset) - 1] * (pad_to - len(idx))
    return dataset.select(idx)


def _take(inputs: Any, start: int, end: int, pad_to: Optional[int]) -> Any:
    """Items ``[start, end)`` of ``inputs`` in its own kind, padded to ``pad_to`` with the last."""
    if isinstance(inputs, dict):
        return {k: _take(v, start, end, pad_to) for k, v in inputs.items()}
    if isinstance(inputs, torch.Tensor):
        return _take_rows(inputs, start, end, pad_to)
    if hasattr(inputs, "select") and not isinstance(inputs, (list, tuple)):  # datasets.Dataset
        return _select_rows(inputs, start, end, pad_to)
    part = list(inputs[start:end])
    if pad_to is not None and len(part) < pad_to and len(inputs):
        part += [inputs[-1]] * (pad_to - len(part))
    return tuple(part) if isinstance(inputs, tuple) else part


@overload
def split_between_processes(inputs: List[T], *, apply_padding: bool = False,
                            group: Optional["ProcessGroup"] = None) -> ContextManager[List[T]]: ...


@overload
def split_between_processes(inputs: Tuple[T, ...], *, apply_padding: bool = False,
                            group: Optional["ProcessGroup"] = None) -> ContextManager[Tuple[T, ...]]: ...


@overload
def split_between_processes(inputs: torch.Tensor, *, apply_padding: bool = False,
                            group: Optional["ProcessGroup"] = None) -> ContextManager[torch.Tensor]: ...


@overload
def split_between_processes(inputs: Dict[K, V], *, apply_padding: bool = False,
                            group: Optional["ProcessGroup"] = None) -> ContextManager[Dict[K, V]]: ...


@overload
def split_between_processes(inputs: Sequence[T], *, apply_padding: bool = False,
                            group: Optional["ProcessGroup"] = None) -> ContextManager[Sequence[T]]: ...


@overload
def split_between_processes(inputs: Any, *, apply_padding: bool = False,
                            group: Optional["ProcessGroup"] = None) -> ContextManager[Any]: ...


@contextmanager
def split_between_processes(
    inputs: Any,
    *,
    apply_padding: bool = False,
    group: Optional["ProcessGroup"] = None,
) -> Iterator[Any]:
    """Yield this rank's contiguous share of ``inputs`` (Accelerate's helper).

    Lists, tuples, tensors (split on dim 0), dicts of equal-length values and datasets with
    ``select``. The first ``len % world_size`` ranks get one item more; with
    ``apply_padding=True`` every rank gets the same length, padded with the last item, so a
    following gather lines up (drop the padding afterwards). A single process gets ``inputs``
    unchanged. No communication.

    For type checkers the share has the input's type: a list gives a list, a tuple a tuple,
    a tensor a tensor, a dict a dict, another sequence a sequence (a list at runtime), and a
    dataset what its ``select`` returns (typed ``Any``).
    """
    ws = get_world_size(group) if group is not None or is_initialized() else get_world_size()
    if ws == 1:
        yield inputs
        return
    rank = get_rank(group) if group is not None else get_rank()
    length = _length(inputs)
    start, end = shard_bounds(length, ws, rank)
    pad_to = -(-length // ws) if apply_padding else None
    yield _take(inputs, start, end, pad_to)
