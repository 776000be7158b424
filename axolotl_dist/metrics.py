"""``gather_for_metrics``: an evaluation's predictions from every rank, each sample once.

A ``DistributedSampler`` (``get_sampler``) and ``split_between_processes(...,
apply_padding=True)`` give every rank ``ceil(n / world_size)`` samples, so when ``n`` does not
divide evenly the last ranks repeat a sample at the end of their share; gathered as they are,
those samples count twice (9 rows on 2 ranks give 10 predictions). accelerate's
``Accelerator.gather_for_metrics`` drops them using the state of the loader it prepared; the
kit has no prepared loader, so the call names the evaluation data instead (``data_source``:
the ``DataLoader``, its sampler, the dataset or its length).

Both layouts leave rank ``r`` with ``n // world_size + (r < n % world_size)`` real samples
first and any repeats after them. :func:`gather_for_metrics` counts, per ``data_source``, the
rows each rank has sent in this pass (the gather itself tells every rank all the counts, so no
extra collective), keeps each rank's rows up to its real count and drops the rest; the pass
ends, and the count restarts, once every rank has sent its share. Call it once per batch,
every batch, or once with the whole pass's predictions: both work. An eval loop left early
leaves its count behind: :func:`reset_metrics_count` forgets it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Hashable, List, Optional, Tuple

from ._runtime.base.groups import Group
from ._runtime.base.state import RoomState, register
from ._runtime.protocols.helpers import collective
from ._runtime.protocols.packets import flatten
from .operations import gather_parts, join_ranks
from .values import all_gather_object

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = ["gather_for_metrics", "reset_metrics_count"]




class _EvalCounts(RoomState):
    """``rows``: (data source, world size) -> the rows each rank has sent in the evaluation
    pass in progress (a part of the process state: :mod:`axolotl_dist._runtime.base.state`)."""

    def __init__(self) -> None:
        self.rows: Dict[Tuple[Hashable, int], List[int]] = {}


_COUNTS = register("metrics", _EvalCounts())

def _source(data_source: Any) -> Any:
    """``data_source`` as counted: a ``DataLoader``'s ``DistributedSampler``, else itself."""
    sampler = getattr(data_source, "sampler", None) if hasattr(data_source, "dataset") else None
    if sampler is not None and hasattr(sampler, "num_replicas"):
        return sampler
    if isinstance(data_source, (bool, str, bytes)) or not (isinstance(data_source, int)
                                             or hasattr(data_source, "__len__")):
        raise TypeError(
            f"gather_for_metrics(data_source={data_source!r}): pass the evaluation DataLoader, "
            "its DistributedSampler, the dataset, or its number of samples")
    if isinstance(data_source, int) and data_source < 0:
        raise ValueError(f"gather_for_metrics(data_source={data_source}) must be >= 0")
    return data_source


def _identity(source: Any) -> Hashable:
    return ("rows", source) if isinstance(source, int) else id(source)


def _layout(source: Any, world_size: int) -> Tuple[int, int]:
    """``(n, share)``: how many distinct samples the pass has and how many rows each rank gets."""
    if hasattr(source, "num_replicas") and hasattr(source, "num_samples"):
        if source.num_replicas != world_size:
            raise ValueError(
                f"gather_for_metrics: the sampler splits over num_replicas="
                f"{source.num_replicas} ranks but this group has {world_size}: build it with "
                "get_sampler(dataset)")
        return min(len(source.dataset), source.num_samples * world_size), source.num_samples
    if isinstance(source, int):
        n = source
    else:
        n = len(source.dataset if hasattr(source, "sampler") else source)
    return n, -(-n // world_size)


def _real(n: int, world_size: int, rank: int) -> int:
    """How many of rank ``rank``'s rows are distinct samples (``n`` split over the ranks)."""
    return n // world_size + (1 if rank < n % world_size else 0)


def _rows_kept(key: Tuple[Hashable, int], n: int, share: int, rows: List[int]) -> List[int]:
    """How many of each rank's ``rows`` of this call to keep; counts the pass and ends it."""
    ws = len(rows)
    sent = _COUNTS.rows.setdefault(key, [0] * ws)
    over = [r for r in range(ws) if sent[r] + rows[r] > share]
    if over:
        r = over[0]
        _COUNTS.rows.pop(key, None)
        raise ValueError(
            f"gather_for_metrics: rank {r} has sent {sent[r] + rows[r]} rows in this pass, but "
            f"{n} samples over {ws} ranks give each rank at most {share}: shard the evaluation "
            "data with get_sampler(dataset) or split_between_processes(..., "
            "apply_padding=True) and pass that DataLoader, sampler, dataset or length as "
            "data_source (or reset_metrics_count() after an evaluation loop left early)")
    keep = [max(0, min(rows[r], _real(n, ws, r) - sent[r])) for r in range(ws)]
    for r in range(ws):
        sent[r] += rows[r]
    if all(sent[r] >= _real(n, ws, r) for r in range(ws)):
        del _COUNTS.rows[key]
    return keep


def _rows(leaves: List[Any], paths: List[str], rank: int) -> int:
    counts = {len(t) for t in leaves}
    if len(counts) > 1:
        shown = ", ".join(f"{p}: {len(t)}" for p, t in zip(paths, leaves))
        raise ValueError(
            f"gather_for_metrics: rank {rank}'s tensors have different numbers of rows "
            f"({shown}): every tensor needs one row per sample")
    return counts.pop() if counts else 0


def _all_tensors(data: Any) -> bool:
    try:
        flatten(data, "gather_for_metrics")
    except TypeError:
        return False
    return True


@collective("gather_for_metrics")
def gather_for_metrics(g: Optional[Group], input_data: Any, data_source: Any = None,
                       use_gather_object: bool = False,
                       group: Optional["ProcessGroup"] = None) -> Any:
    """accelerate's ``gather_for_metrics``: :func:`~axolotl_dist.gather` (or, for objects,
    :func:`~axolotl_dist.gather_object`) without the samples the sampler repeated.

    ``data_source``: the evaluation ``DataLoader``, its ``DistributedSampler``, the dataset or
    its number of samples (the kit has no prepared loader to ask). Rows come in rank order
    within each call. Tensors need one row per sample; objects come as a list per rank. A rank
    that sends more rows in a pass than its share raises ``ValueError`` on every rank (a
    wrong ``data_source``, or unsharded data). One process: the input.
    """
    if data_source is None:
        raise TypeError(
            "gather_for_metrics(input_data) needs data_source=: accelerate's reads the loader "
            "Accelerator.prepare wrapped; pass the evaluation DataLoader (or its sampler, the "
            "dataset or its length): gather_for_metrics(preds, loader) "
            '(docs/porting.md, "Evaluation: every sample once")')
    ws = 1 if g is None else g.size
    source = _source(data_source)
    key = (_identity(source), ws)
    n, share = _layout(source, ws)
    if use_gather_object or not _all_tensors(input_data):
        if not isinstance(input_data, (list, tuple)):
            raise TypeError(
                f"gather_for_metrics: objects go as a list (one item per sample), got "
                f"{type(input_data).__name__}")
        parts = [list(input_data)] if g is None else [list(p) for p in
                                                     all_gather_object(input_data, group)]
        keep = _rows_kept(key, n, share, [len(p) for p in parts])
        return [x for part, k in zip(parts, keep) for x in part[:k]]
    return _tensors_kept(g, input_data, key, n, share, group)


def _tensors_kept(g: Optional[Group], input_data: Any, key: Tuple[Hashable, int], n: int,
                  share: int, group: Optional["ProcessGroup"]) -> Any:
    """:func:`gather_for_metrics` of tensors: every rank's rows gathered, those the sampler
    repeated dropped, on the input's devices (as :func:`~axolotl_dist.gather`'s result)."""
    per_rank, mine, paths, rebuild, joined = gather_parts(g, input_data, "gather_for_metrics",
                                                          group)
    rows = [_rows(leaves, paths, r) for r, leaves in enumerate(per_rank)]
    keep = _rows_kept(key, n, share, rows)
    if joined is not None and keep == rows:  # big, and every row kept: the joined result
        return rebuild(join_ranks([joined], mine))
    kept = [[t[:k] for t in leaves] for leaves, k in zip(per_rank, keep)]
    return rebuild(join_ranks(kept, mine))


def reset_metrics_count(data_source: Any = None) -> None:
    """Forget the rows :func:`gather_for_metrics` counted for ``data_source`` in an unfinished
    pass (every data source's with no argument); call it on every rank."""
    if data_source is None:
        _COUNTS.rows.clear()
        return
    ident = _identity(_source(data_source))
    for key in [k for k in _COUNTS.rows if k[0] == ident]:
        del _COUNTS.rows[key]
