"""Hugging Face ``datasets`` details of :func:`~axolotl_dist.shared_map`.

What a one-process ``Dataset.map`` would do, taken apart so that ranks can each do a piece:

* :func:`prepare` checks and normalizes the ``map`` arguments and computes the fingerprint a
  one-process map gives its result (the same hashing ``datasets`` does);
* :func:`part_bounds` cuts the rows into contiguous parts on batch boundaries, so a batched
  function sees exactly the batches it would see in one process;
* :class:`PartFiles` names a part's Arrow file and its completion marker. A part is written
  under a temporary name, renamed, and only then marked complete; a part without a valid
  marker (a killed writer, a truncated file) is never read;
* :func:`map_part` maps one part, passing global indices, and :func:`assemble` concatenates the
  parts into the dataset a one-process map returns (rows, features, info, format, fingerprint).

Imported only once ``datasets`` is known to be installed.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import socket
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from datasets import Dataset, concatenate_datasets
from datasets.fingerprint import (
    format_kwargs_for_fingerprint,
    format_transform_for_fingerprint,
    is_caching_enabled,
    update_fingerprint,
    validate_fingerprint,
)

from ..data import shard_bounds

__all__ = [
    "MapCall",
    "PartFiles",
    "prepare",
    "part_bounds",
    "map_part",
    "single_file_cache",
    "assemble",
]

#: ``Dataset.map`` parameters and their defaults (this installed ``datasets``).
MAP_DEFAULTS: Dict[str, Any] = {
    name: p.default for name, p in inspect.signature(Dataset.map).parameters.items()
    if name not in ("self", "function")
}
#: The arguments ``map`` hashes into the new fingerprint (the keyword arguments it hands to
#: ``Dataset._map_single``, in ``datasets``' own normalized form).
_HASHED = tuple(name for name in (
    "with_indices", "with_rank", "input_columns", "batched", "batch_size", "drop_last_batch",
    "remove_columns", "keep_in_memory", "writer_batch_size", "features", "disable_nullable",
    "fn_kwargs", "try_original_type", "on_mixed_types") if name in MAP_DEFAULTS)


def _identity(x: Any) -> Any:
    return x


def _maps_identity() -> Callable[[Any], Any]:
    """The ``lambda x: x`` that ``Dataset.map`` hashes for ``function=None``, rebuilt from its
    code object (a lambda written here hashes differently: its code sits elsewhere)."""
    code = inspect.unwrap(Dataset.map).__code__
    lambdas = [c for c in code.co_consts if isinstance(c, types.CodeType)
               and c.co_name == "<lambda>" and c.co_argcount == 1]
    if len(lambdas) != 1:  # another datasets version: hashes differ, results do not
        return lambda x: x  # noqa: E731
    return types.FunctionType(lambdas[0], vars(importlib.import_module(Dataset.__module__)))


@dataclasses.dataclass
class MapCall:
    """One ``shared_map`` call: the user's function and ``map`` arguments, normalized."""

    function: Optional[Callable[..., Any]]
    kwargs: Dict[str, Any]  # every Dataset.map argument, defaults filled in

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["kwargs"][name]
        except KeyError:
            raise AttributeError(name) from None


def _check_input(dataset: Any, function: Optional[Callable[..., Any]],
                 map_kwargs: Dict[str, Any]) -> None:
    """Raise on what ``shared_map`` cannot take: not a ``Dataset``, a function that is not
    callable, arguments ``map`` does not know, ``num_proc`` > 1, ``cache_file_name``."""
    if not isinstance(dataset, Dataset):
        kind = type(dataset).__name__
        hint = (" (map each split: {k: shared_map(d, f) for k, d in dataset.items()})"
                if kind in ("DatasetDict", "dict") else
                " (an IterableDataset is mapped lazily as it is read: call its own .map)"
                if kind.startswith("Iterable") else "")
        raise TypeError(f"shared_map(dataset=...) takes a datasets.Dataset, got {kind}{hint}")
    if function is not None and not callable(function):
        raise TypeError(f"shared_map(function=...) must be callable or None, got {type(function).__name__}")
    unknown = sorted(set(map_kwargs) - set(MAP_DEFAULTS))
    if unknown:
        raise TypeError(f"shared_map() got unknown Dataset.map argument(s) {unknown}; "
                        f"Dataset.map takes {sorted(MAP_DEFAULTS)}")
    num_proc = map_kwargs.get("num_proc")
    if num_proc not in (None, 0, 1):
        raise ValueError(
            f"shared_map(num_proc={num_proc!r}) is not supported: shared_map already splits the "
            "work, one part per rank; drop num_proc (or launch more ranks)")
    if map_kwargs.get("cache_file_name") is not None:
        raise ValueError(
            "shared_map(cache_file_name=...) is not supported: the result is written as one file "
            "per rank's part, so one file name cannot hold it; pass cache_dir=<directory> instead")


def prepare(dataset: Any, function: Optional[Callable[..., Any]], map_kwargs: Dict[str, Any]) -> MapCall:
    """Check ``shared_map``'s input and fill in ``map``'s defaults (raises on bad input)."""
    _check_input(dataset, function, map_kwargs)
    kwargs = {**MAP_DEFAULTS, **map_kwargs}
    for name in ("input_columns", "remove_columns"):
        if isinstance(kwargs[name], str):
            kwargs[name] = [kwargs[name]]
        missing = sorted(set(kwargs[name] or ()) - set(dataset.column_names))
        if missing:
            raise ValueError(f"shared_map({name}={kwargs[name]!r}): column(s) {missing} are not in "
                             f"the dataset, which has {dataset.column_names}")
    if kwargs["fn_kwargs"] is None:
        kwargs["fn_kwargs"] = {}
    if kwargs["features"] is not None:
        from datasets.features import features as _features

        fix = getattr(_features, "_fix_for_backward_compatible_features", None)
        if fix is not None:
            kwargs["features"] = fix(kwargs["features"])
    if kwargs["load_from_cache_file"] is None:
        kwargs["load_from_cache_file"] = is_caching_enabled()
    if kwargs["new_fingerprint"] is not None:
        validate_fingerprint(kwargs["new_fingerprint"])
    return MapCall(function, kwargs)


def one_process_fingerprint(dataset: "Dataset", call: MapCall) -> str:
    """The fingerprint ``dataset.map(function, **kwargs)`` gives its result in one process."""
    if call.new_fingerprint is not None:
        return call.new_fingerprint
    function = call.function if call.function is not None else _maps_identity()
    hashed = {"shard": dataset, "function": function, **{k: call.kwargs[k] for k in _HASHED}}
    transform = format_transform_for_fingerprint(Dataset._map_single)
    args = format_kwargs_for_fingerprint(Dataset._map_single, (), hashed)
    args["fingerprint_name"] = "new_fingerprint"
    return update_fingerprint(dataset._fingerprint, transform, args)


def part_bounds(num_rows: int, num_parts: int, index: int, call: MapCall) -> Tuple[int, int]:
    """Rows ``[start, end)`` of part ``index``: contiguous, cut on the batch boundaries a
    one-process map uses (``batch_size`` rows, or one batch of everything if it is None/<= 0)."""
    unit = 1
    if call.batched:
        size = call.batch_size
        unit = size if size is not None and size > 0 else max(num_rows, 1)
    units = -(-num_rows // unit)
    first, last = shard_bounds(units, num_parts, index)
    return min(first * unit, num_rows), min(last * unit, num_rows)


@dataclasses.dataclass(frozen=True)
class PartFiles:
    """The files of one part: ``cache-<fp>-part<i>of<n>.arrow`` and its ``.done`` marker.

    The name avoids ``datasets``' ``_<rank>_of_<num_proc>`` pattern, so a later ``num_proc`` map
    never mixes these parts (cut on other boundaries) with its own.
    """

    directory: str
    fingerprint: str
    index: int
    count: int

    @property
    def arrow(self) -> str:
        return os.path.join(self.directory,
                            f"cache-{self.fingerprint}-part{self.index:05d}of{self.count:05d}.arrow")

    @property
    def marker(self) -> str:
        return self.arrow[: -len(".arrow")] + ".done"

    def temporary(self, suffix: str) -> str:
        """A name private to this process, in the same directory (so a rename is atomic)."""
        stem = self.arrow[: -len(".arrow")]
        return f"{stem}.incomplete-{socket.gethostname()}-{os.getpid()}{suffix}"

    def read_marker(self, start: int, end: int) -> Optional[Dict[str, Any]]:
        """The marker if it says this part (rows ``[start, end)``) is complete and its file
        still has the size it had when marked; else None."""
        try:
            with open(self.marker) as fh:
                mark = json.load(fh)
            if (mark.get("start"), mark.get("end")) != (start, end):
                return None
            if mark.get("changed") and os.path.getsize(self.arrow) != mark.get("bytes"):
                return None
            return mark
        except (OSError, ValueError, AttributeError):
            return None

    def is_complete(self, start: int, end: int) -> bool:
        """Whether a finished, reusable result for rows ``[start, end)`` is on disk."""
        mark = self.read_marker(start, end)
        return mark is not None and (mark["changed"] or start == end)

    def clear_marker(self) -> None:
        try:
            os.remove(self.marker)
        except FileNotFoundError:
            pass

    def write_marker(self, start: int, end: int, changed: bool) -> None:
        size = os.path.getsize(self.arrow) if changed else 0
        mark = {"start": start, "end": end, "changed": changed, "bytes": size,
                "fingerprint": self.fingerprint}
        tmp = self.temporary(".done")
        with open(tmp, "w") as fh:
            json.dump(mark, fh)
        os.replace(tmp, self.marker)


def _wrap(function: Optional[Callable[..., Any]], call: MapCall, offset: int,
          tick: Callable[[int], None]) -> Callable[..., Any]:
    """``function`` as the part's map calls it: ``map`` always passes (local) indices, which
    are shifted to global ones or dropped, and ``tick`` counts the rows."""
    fn = function if function is not None else _identity
    batched, with_indices = call.batched, call.with_indices
    back = 2 if call.with_rank else 1  # the indices come last, or just before the rank

    def adapt(args: Tuple[Any, ...]) -> List[Any]:
        out = list(args)
        pos = len(out) - back
        indices = out[pos]
        tick(len(indices) if batched else 1)
        if not with_indices:
            del out[pos]
        elif offset:
            out[pos] = [i + offset for i in indices] if batched else indices + offset
        return out

    if inspect.iscoroutinefunction(fn):
        async def run_async(*args: Any, **kwargs: Any) -> Any:
            return await fn(*adapt(args), **kwargs)

        return run_async

    def run(*args: Any, **kwargs: Any) -> Any:
        return fn(*adapt(args), **kwargs)

    return run


def map_part(dataset: "Dataset", call: MapCall, files: PartFiles, start: int, end: int,
             tick: Callable[[int], None]) -> None:
    """Map rows ``[start, end)`` into ``files`` and mark the part complete.

    An old marker is removed first, the Arrow file is written under a temporary name and
    renamed, and the marker is written last: no marker ever describes an unfinished file.
    """
    os.makedirs(files.directory, exist_ok=True)
    files.clear_marker()
    if start == end:
        files.write_marker(start, end, changed=False)
        return
    tmp = files.temporary(".arrow")
    part = dataset.select(range(start, end))
    kwargs = dict(call.kwargs)
    kwargs.update(with_indices=True, cache_file_name=tmp, load_from_cache_file=False,
                  new_fingerprint=files.fingerprint[:48] + f"-p{files.index}of{files.count}",
                  keep_in_memory=False, num_proc=None)
    try:
        mapped = part.map(_wrap(call.function, call, start, tick), **kwargs)
        changed = mapped is not part and os.path.exists(tmp)
        del mapped
        if changed:
            os.replace(tmp, files.arrow)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    files.write_marker(start, end, changed)


def single_file_cache(directory: str, fingerprint: str) -> Optional[str]:
    """``datasets``' own one-process cache file for this map, if one exists."""
    path = os.path.join(directory, f"cache-{fingerprint}.arrow")
    return path if os.path.exists(path) else None


def _with_format(result: "Dataset", like: "Dataset") -> "Dataset":
    """Give ``result`` the format of ``like`` as ``datasets``' ``transmit_format`` does."""
    columns = like._format_columns
    if columns is not None:
        unformatted = set(like.column_names) - set(columns)
        columns = sorted(set(result.column_names) - unformatted)
    if (like._format_type, like._format_kwargs, columns, like._output_all_columns) != (
            result._format_type, result._format_kwargs, result._format_columns,
            result._output_all_columns):
        fingerprint = result._fingerprint
        result.set_format(type=like._format_type, columns=columns,
                          output_all_columns=like._output_all_columns, **like._format_kwargs)
        result._fingerprint = fingerprint
    return result


def assemble(dataset: "Dataset", call: MapCall, fingerprint: str, paths: Sequence[str],
             unchanged: int, in_memory: bool) -> "Dataset":
    """The one-process result from the parts' files (``paths``, in row order).

    :param unchanged: how many non-empty parts ``function`` left unchanged (it returned None).
    """
    if not paths:
        if unchanged:  # a side-effect-only function: map returns the dataset itself
            return dataset
        return dataset.map(call.function, **{**call.kwargs, "new_fingerprint": fingerprint})
    if unchanged:
        raise ValueError(
            "shared_map: function returned None for every row of some parts and a dict for the "
            "rows of others; return a dict for every row (or None for every row)")
    parts = [Dataset.from_file(p, in_memory=in_memory) for p in paths]
    table = parts[0] if len(parts) == 1 else concatenate_datasets(parts)
    info = dataset.info.copy()
    info.features = table.features
    result = Dataset(table.data, info=info, split=dataset.split, fingerprint=fingerprint)
    return _with_format(result, dataset)
