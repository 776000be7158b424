"""A ``datasets`` map in a ``zero_first`` block that leaves the other ranks no cache file to
load: said once per process, on the block's main rank, with the fix (docs/preprocessing.md,
"A map that writes no cache").

``with zero_first(): ds = ds.map(tokenize)`` saves work only through ``datasets``' cache: rank
0 maps and writes ``cache-<fingerprint>.arrow`` beside the dataset's files, and every other
rank, computing the same fingerprint, loads that file instead of mapping. ``datasets`` writes
no such file for a dataset held in memory (``Dataset.from_dict``), with ``keep_in_memory=True``
or with its caching disabled; for a function it cannot hash it draws a random fingerprint, so
the file it writes has a name no other rank computes. Either way every other rank silently maps
again.

The kit never imports ``datasets``. When a block starts on its group's rank 0 and the script
has imported ``datasets``, :func:`watch` wraps ``datasets.Dataset.map`` (once per process; a
``DatasetDict.map`` maps each split through it). Outside such a block, or once the note was
given, the wrapper only calls the real ``map``; inside, it looks at what the real one did: the
result's ``cache_files``, ``datasets``' caching switch, and whether ``datasets`` drew a random
fingerprint during the call (its ``fingerprint_rng`` moved: a hash failed, or caching is off).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from types import FrameType
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..base.callsite import is_ours, short_path
from ..base.kitlog import kit as log
from .blocks import BLOCKS
from .protocols_state import NOTES

__all__ = ["IN_MEMORY", "KEEP_IN_MEMORY", "NOT_HASHED", "NO_CACHING", "watch", "reasons",
           "note_text"]

#: Why a map wrote no file the other ranks load (each with its own fix in :func:`note_text`).
IN_MEMORY = ("the dataset is held in memory (Dataset.from_dict, from_list, from_pandas, or an "
             "in-memory map's result), so datasets has no cache directory to write to")
KEEP_IN_MEMORY = "keep_in_memory=True kept the result in memory"
NOT_HASHED = ("datasets could not hash the function or its arguments (its warning \"couldn't be "
              "hashed properly\") and used a random fingerprint, so the cache file it wrote has "
              "a name no other rank looks for")
NO_CACHING = ("datasets' caching is off (datasets.disable_caching()): the result went to a "
              "temporary file the other ranks do not read")

_FIXES = {
    IN_MEMORY: "save_to_disk the dataset, then load_from_disk it before the map (a dataset on "
               "disk has cache files)",
    KEEP_IN_MEMORY: "drop keep_in_memory=True, or pass cache_file_name= (a path every rank can "
                    "read) in its place",
    NOT_HASHED: "make the function and fn_kwargs picklable by dill (nothing in the closure that "
                "pickle or dill cannot serialize)",
    NO_CACHING: "call datasets.enable_caching(), or pass cache_file_name= (a path every rank can "
                "read) with load_from_cache_file=True",
}

_DOCS = 'docs/preprocessing.md, "A map that writes no cache"'

#: Set on the wrapper: ``Dataset.map`` is wrapped already.
_MARK = "__axolotl_dist_map_cache__"


def watch() -> None:
    """A ``zero_first`` block starts on its group's rank 0: wrap ``datasets.Dataset.map``
    unless it is already wrapped, the note was given, or the script has not imported
    ``datasets`` (the kit never imports it). Cheap: a block is on a loop's hot path."""
    if NOTES.map_cache_said:
        return
    datasets = sys.modules.get("datasets")  # imported by the user's script, or not at all
    dataset_class: Any = getattr(datasets, "Dataset", None)  # None: not imported (or importing)
    original = getattr(dataset_class, "map", None)
    if original is None or getattr(original, _MARK, False):
        return
    dataset_class.map = _wrap(original, datasets)


def _wrap(original: Callable[..., Any], datasets: Any) -> Callable[..., Any]:
    """``Dataset.map``, with a look at each call made inside a block's main side."""
    fingerprint = getattr(datasets, "fingerprint", None)
    rng: Any = getattr(fingerprint, "fingerprint_rng", None)  # draws datasets' random fingerprints
    caching_on: Callable[[], bool] = getattr(fingerprint, "is_caching_enabled", lambda: True)
    code = getattr(inspect.unwrap(original), "__code__", None)
    home = os.path.dirname(code.co_filename) + os.sep if code is not None else "\0"  # datasets'

    @functools.wraps(original)
    def map(self: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: A001 - the method it wraps
        if not BLOCKS.first_runs.main or NOTES.map_cache_said:
            return original(self, *args, **kwargs)
        before = rng.getstate() if rng is not None else None
        result = original(self, *args, **kwargs)
        try:
            drew = before is not None and rng.getstate() != before
            call = _arguments(original, self, args, kwargs)
            why = reasons(self, result, call, drew, caching_on())
            if why and not NOTES.map_cache_said:
                NOTES.map_cache_said = True
                log.warning("%s", note_text(call.get("function"), _site(home), why))
        except Exception:  # noqa: BLE001 - a note never breaks the user's map
            pass
        return result

    setattr(map, _MARK, True)
    return map


def _arguments(original: Callable[..., Any], dataset: Any, args: Tuple[Any, ...],
               kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The arguments of a ``map`` call that decide its caching, by name."""
    if len(args) <= 1:  # the usual call: map(function, keyword=...)
        return dict(kwargs, function=args[0]) if args else dict(kwargs)
    bound = inspect.signature(original).bind_partial(dataset, *args, **kwargs)
    return dict(bound.arguments)


def reasons(dataset: Any, result: Any, call: Dict[str, Any], drew_random: bool,
            caching: bool) -> List[str]:
    """Why ``result = dataset.map(**call)`` left no cache file another rank's same call loads
    (``[]``: it did, or there was nothing to map). ``drew_random``: ``datasets`` drew a random
    fingerprint during the call; ``caching``: its caching is on."""
    if len(dataset) == 0 or call.get("load_from_cache_file") is False:
        return []  # nothing mapped; or every rank is told to map anyway
    why: List[str] = []
    if not result.cache_files:
        if not dataset.cache_files:
            why.append(IN_MEMORY)
        elif call.get("keep_in_memory"):
            why.append(KEEP_IN_MEMORY)
        else:
            return []  # not a case datasets has: say nothing rather than guess
    if not caching:  # the others' map neither computes the file's name nor loads a named one
        if not (call.get("load_from_cache_file") and call.get("cache_file_name")):
            why.append(NO_CACHING)
    elif drew_random and call.get("cache_file_name") is None:
        why.append(NOT_HASHED)  # (with cache_file_name=, the others load that file by name)
    return why


def note_text(function: Any, site: Optional[str], why: List[str]) -> str:
    """The note for a map of ``function`` called at ``site`` that wrote no reusable file."""
    if function is None:
        name = "function=None"
    else:
        name = (getattr(function, "__qualname__", None) or getattr(function, "__name__", None)
                or type(function).__name__)
    where = f" at {site}" if site else ""
    fixes = [_FIXES[w] for w in why]
    if NO_CACHING not in why and KEEP_IN_MEMORY not in why:  # theirs say it
        fixes.append("pass cache_file_name= (a path every rank can read)")
    fixes.append("in place of the block, call ad.shared_map(dataset, fn, ...): it splits the map "
                 "across every rank")
    return (f"zero_first: the datasets map of {name}{where} wrote no cache file the other ranks "
            f"can load: {'; and '.join(why)}. Every other rank will run the whole map again "
            f"after this block. To map once: {'; or '.join(fixes)} ({_DOCS}). Said once per "
            "process.")


def _site(datasets_home: str) -> Optional[str]:
    """``file.py:41``: the user's line that called ``map`` (the innermost frame outside the kit
    and ``datasets``: a ``DatasetDict.map`` is traced to its caller)."""
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None and (is_ours(frame.f_code)
                                 or frame.f_code.co_filename.startswith(datasets_home)):
        frame = frame.f_back
    return None if frame is None else f"{short_path(frame.f_code.co_filename)}:{frame.f_lineno}"
