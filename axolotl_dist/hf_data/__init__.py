"""Dataset preprocessing on every rank: :func:`shared_map`.

``with zero_first(): dataset = dataset.map(tokenize)`` makes rank 0 do all the preprocessing
while every other rank waits. ``dataset = shared_map(dataset, tokenize)`` splits the rows into
contiguous parts, one per rank that shares the filesystem, maps each part on its rank into an
Arrow file next to the dataset's cache files, and gives every rank the concatenation: the rows,
order, features and fingerprint of a one-process ``dataset.map(tokenize)``.

Ranks signal through the process group's c10d store, never through collectives (the parts
travel as files). Keys live under ``axd/sm/<call number>/``:

* ``who/<rank>``, ``arrived``: each rank posts where it stands (its filesystem group, host,
  dataset fingerprint and length; rank 0 adds the result's fingerprint) and waits for all;
* ``progress``: rows mapped so far, added by every rank twice a second (the main rank's bar);
* ``done``: ranks whose part is on disk and marked complete; everyone waits for all of them;
* ``failed``, ``error/<rank>``: a rank that raises publishes a failure report, and the others
  raise :class:`~axolotl_dist.errors.RankFailedError` naming it and its rows: at the first
  row or batch after their next half-second check while they map, at once while they wait
  (a killed rank is noticed by heartbeat while they wait);
* ``left``, ``left/<filesystem group>``: the last rank to leave deletes the call's keys (and,
  for a dataset held in memory, the group's temporary part files).

Requires Hugging Face ``datasets``: ``pip install datasets`` (or, in a clone of axolotl_dist,
``pip install -e ".[datasets]"``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import time
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

from .._runtime.base import kitlog as _kitlog
from .._runtime.protocols import timeline as _timeline
from .._runtime.base.callsite import call_site
from .._runtime.protocols.helpers import call
from .._runtime.base.groups import Group, group_of
from .._runtime.base.private import private_dir, user_dir
from .._runtime.liveness.failures import await_readers, publish_error, read_error
from .._runtime.protocols.timeline import TIMELINE
from .._runtime.store import keys as _keys, records as _records
from .._runtime.store.access import checked, kit_store, put
from .._runtime.liveness.progress import Point, advance
from .._runtime.liveness.polls import poll_until
from ..env import env_shared_filesystem
from ..errors import DistributedConfigError, DistributedEnvError, RankFailedError
from ..ranks import get_global_rank, get_node_rank, get_rank, get_world_size

if TYPE_CHECKING:  # pragma: no cover
    from datasets import Dataset
    from torch.distributed import ProcessGroup

    from ._parts import MapCall, PartFiles

__all__ = ["shared_map"]

#: The ``setup.cfg`` extra that installs Hugging Face ``datasets``.
DATASETS_EXTRA = "datasets"
INSTALL_HINT = (f'pip install datasets (or, in a clone of axolotl_dist, pip install -e '
                f'".[{DATASETS_EXTRA}]")')
#: Seconds between a mapping rank's progress reports (and its checks for failed peers).
PROGRESS_INTERVAL = 0.5
#: In this user's own directory under the system's temporary one
#: (``<tmp>/axolotl_dist-<uid>``, mode 0700): parts of datasets held in memory.
TEMP_DIR_NAME = "shared_map"

log = logging.getLogger("axolotl_dist")


def _require_datasets() -> None:
    try:
        import datasets  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"shared_map needs Hugging Face datasets, which is not installed: {INSTALL_HINT} "
            f"(the '{DATASETS_EXTRA}' extra of axolotl-dist)") from exc


@call("shared_map", lambda a: {"batched": bool(a["map_kwargs"].get("batched", False))},
      own_waits=True)
def shared_map(
    dataset: "Dataset",
    function: Optional[Callable[..., Any]] = None,
    *,
    group: Optional["ProcessGroup"] = None,
    cache_dir: Optional[Union[str, "os.PathLike[str]"]] = None,
    timeout: Optional[float] = None,
    **map_kwargs: Any,
) -> "Dataset":
    """``dataset.map(function, **map_kwargs)`` with the work split across ranks.

    Every rank of ``group`` must call it with the same dataset, function and arguments. Each
    rank maps a contiguous part (cut on batch boundaries when ``batched=True``) and every rank
    returns the whole result, identical to a one-process map: rows, order, features, format
    and fingerprint; ``with_indices`` passes global indices (``with_rank`` passes None, as one
    process does).

    * **Who shares the work:** ranks that share a filesystem. With
      ``AXOLOTL_DIST_SHARED_FS=1`` (or ``OLMO_SHARED_FS=1``; :func:`init_distributed` sets it
      by default) all ranks split it; with ``0`` each node's ranks split it among themselves,
      and every node ends up with the whole result on its own disk.
    * **Caching:** the parts are written next to the dataset's cache files, or in
      ``cache_dir``, as ``cache-<fingerprint>-part<i>of<n>.arrow`` with a ``.done`` marker
      (written after an atomic rename). A later call with the same dataset, function and
      arguments maps nothing and loads them (``load_from_cache_file=False`` recomputes);
      ``datasets``' own one-process cache file is reused too. A part without a valid marker
      is recomputed, never read. A dataset held in memory (or ``keep_in_memory=True``, or
      ``datasets`` caching disabled) without ``cache_dir`` is mapped through temporary files
      into an in-memory result and not cached, as ``datasets`` does.
    * **Failures:** if ``function`` raises on one rank, that rank re-raises and every other
      rank raises :class:`~axolotl_dist.errors.RankFailedError` naming it and its rows, within
      about a second (between two rows or batches); a killed rank is noticed within seconds
      once the others wait. Completed parts stay reusable.
    * **Progress:** one bar on rank 0 counting every rank's rows; ``datasets``' bars are off.

    :param cache_dir: directory for the parts (default: next to the dataset's cache files).
    :param timeout: seconds a rank waits for the others before raising
        :class:`~axolotl_dist.errors.RankTimeoutError` (default: no limit; the process
        group's timeout does not apply).
    :param map_kwargs: any ``Dataset.map`` argument except ``num_proc`` > 1 and
        ``cache_file_name`` (use ``cache_dir``).

    One process (or a group of one): exactly ``dataset.map(function, **map_kwargs)``.
    """
    _require_datasets()
    from . import _parts

    call = _parts.prepare(dataset, function, map_kwargs)
    if timeout is not None and not timeout > 0:
        raise ValueError(f"shared_map(timeout={timeout!r}) must be a positive number of seconds or None")
    if cache_dir is not None:
        if not isinstance(cache_dir, (str, os.PathLike)):
            raise TypeError(f"shared_map(cache_dir=...) must be a directory path, got {type(cache_dir).__name__}")
        cache_dir = os.path.abspath(os.fspath(cache_dir))
    g = group_of(group, "shared_map")
    if g is None or g.size == 1:
        return _one_process(dataset, call, map_kwargs, cache_dir)
    return _SharedMap(dataset, call, g, cache_dir, timeout).run()


def _one_process(dataset: "Dataset", call: "MapCall", map_kwargs: Dict[str, Any],
                 cache_dir: Optional[str]) -> "Dataset":
    """Exactly ``dataset.map``; with ``cache_dir`` its cache file goes there, same name."""
    if cache_dir is None or call.keep_in_memory:
        return dataset.map(call.function, **map_kwargs)
    from ._parts import one_process_fingerprint

    os.makedirs(cache_dir, exist_ok=True)
    name = f"cache-{one_process_fingerprint(dataset, call)}.arrow"
    return dataset.map(call.function, cache_file_name=os.path.join(cache_dir, name), **map_kwargs)


@contextlib.contextmanager
def _datasets_bars_off() -> Iterator[None]:
    import datasets

    was_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_off:
            datasets.enable_progress_bars()


class _Progress:
    """A ``shared_map`` call's progress: its bar (rank 0, or None), the rows this rank has
    counted and reported to the store, and when it next reports and refreshes the bar."""

    __slots__ = ("bar", "counted", "reported", "next_report", "next_bar")

    def __init__(self) -> None:
        self.bar: Any = None
        self.counted = self.reported = 0
        self.next_report = self.next_bar = 0.0


class _SharedMap:
    """One multi-rank ``shared_map`` call: the store protocol around the part files."""

    def __init__(self, dataset: "Dataset", call: "MapCall", g: Group,
                 cache_dir: Optional[str], timeout: Optional[float]) -> None:
        self.dataset, self.call, self.group, self.timeout = dataset, call, g, timeout
        self.cache_dir = cache_dir
        self.rank, self.ws = g.rank, g.size
        self.others = [g.global_rank(r) for r in range(self.ws) if r != self.rank]
        self.store = kit_store(g)
        self.seq = advance(g, "shared_map")
        self.site = call_site()
        self.what = f"shared_map call #{self.seq}"
        self.temp = call.keep_in_memory or cache_dir is None and (
            not dataset.cache_files or not _caching_enabled())
        self.entries: List[Dict[str, Any]] = []
        self.fs_key = "shared" if env_shared_filesystem() else f"node{get_node_rank()}"
        self.temp_dir: Optional[str] = None
        # An error this rank must not publish as its own: a peer's, or one every rank finds
        # by itself (the ranks disagree about the dataset).
        self.not_mine: Optional[BaseException] = None
        self.progress = _Progress()

    def key(self, *parts: Union[str, int]) -> str:
        return "/".join([_keys.shared_map(self.seq), *map(str, parts)])

    # --- the call ---------------------------------------------------------------------------

    def run(self) -> "Dataset":
        try:
            return self._run()
        except BaseException as exc:
            if exc is not self.not_mine:
                key = self.key("error", self.rank)
                publish_error(self.store, key, self.rank, exc, self.what)
                with contextlib.suppress(Exception):
                    self.store.add(self.key("failed"), 1)
                # where this process hosts the store: keep it up until the others have read it
                await_readers(self.store, key, [r for r in range(self.ws) if r != self.rank],
                              self.group)
            raise
        finally:
            if self.progress.bar is not None:
                self.progress.bar.close()
            self._leave()

    def _run(self) -> "Dataset":
        from . import _parts

        self._arrive()
        try:
            members = self._plan()
        except DistributedConfigError as exc:  # every rank read the same entries: all raise it
            self.not_mine = exc
            raise
        count, index = len(members), members.index(self.rank)
        rows = len(self.dataset)
        bounds = [_parts.part_bounds(rows, count, j, self.call) for j in range(count)]
        files = [_parts.PartFiles(self.directory, self.fingerprint, j, count) for j in range(count)]
        start, end = bounds[index]
        self.what = f"{self.what} (part {index + 1}/{count}: rows [{start}, {end}))"
        reuse = self.call.load_from_cache_file and not self.temp
        whole = _parts.single_file_cache(self.directory, self.fingerprint) if reuse else None
        if self.rank == 0 and not (whole or reuse and all(
                f.is_complete(*b) for f, b in zip(files, bounds))):
            self._open_bar(rows * len({e["fs"] for e in self.entries}))
        self._map_part(files[index], start, end, f"{index + 1}/{count}", whole, reuse)
        self._all_done(end - start)
        if whole:
            return _parts.assemble(self.dataset, self.call, self.fingerprint, [whole], 0, False)
        return self._assemble(files, bounds)

    def _map_part(self, part: "PartFiles", start: int, end: int, label: str,
                  whole: Optional[str], reuse: bool) -> None:
        """Map rows ``[start, end)`` into ``part`` unless a cache holds them: ``datasets``' own
        one-file cache (``whole``), or the part itself when caches may be ``reuse``d."""
        from . import _parts

        t0 = _timeline.now()  # the part's span covers the look at its cache
        if not (whole or reuse and part.is_complete(start, end)):
            with _datasets_bars_off():
                _parts.map_part(self.dataset, self.call, part, start, end, self._tick)
        if TIMELINE.recorder is not None:
            _timeline.body_span(f"shared_map part {label}", t0, self.site, self.group, self.seq)

    def _all_done(self, mine: int) -> None:
        """Count this rank's ``mine`` rows and its part done; wait until every rank's is."""
        self.progress.counted = max(self.progress.counted, mine)
        self._report()
        self.store.add(self.key("done"), 1)
        t0 = _timeline.now()
        self._wait("done", self.ws)
        if TIMELINE.recorder is not None:
            _timeline.wait_span("shared_map", t0, self.others, self.site, self.group, self.seq)
        self._refresh_bar(force=True)

    def _assemble(self, files: List["PartFiles"], bounds: List[Tuple[int, int]]) -> "Dataset":
        """The whole result from every part's file (raises if a part reported done is missing)."""
        from . import _parts

        marks = [f.read_marker(*b) for f, b in zip(files, bounds)]
        lost = [j for j, mark in enumerate(marks) if mark is None]
        if lost:
            raise DistributedEnvError(
                f"{self.what}: part(s) {lost} were reported complete but are not in "
                f"{self.directory}: ranks sharing a filesystem must see the same directory; set "
                "AXOLOTL_DIST_SHARED_FS=0 if the nodes do not share one, or pass the same cache_dir")
        paths = [f.arrow for f, mark in zip(files, marks) if mark and mark["changed"]]
        unchanged = sum(1 for mark, (s, e) in zip(marks, bounds) if s != e and not mark["changed"])
        return _parts.assemble(self.dataset, self.call, self.fingerprint, paths, unchanged, self.temp)

    # --- arrival and the split --------------------------------------------------------------

    def _arrive(self) -> None:
        """Post this rank's facts, wait for every rank's, read them all."""
        from ._parts import one_process_fingerprint

        entry = {"fs": self.fs_key, "host": socket.gethostname(), "pid": os.getpid(),
                 "fp": self.dataset._fingerprint, "rows": len(self.dataset), "temp": self.temp}
        if self.rank == 0:
            entry["new"] = one_process_fingerprint(self.dataset, self.call)
        put(self.store, self.key("who", self.rank), _records.document(entry))
        self.store.add(self.key("arrived"), 1)
        self._wait("arrived", self.ws)
        names = [self.key("who", r) for r in range(self.ws)]
        self.entries = [_entry(v, key, r) for r, (v, key) in
                        enumerate(zip(self.store.multi_get(names), names))]

    def _plan(self) -> List[int]:
        """Check that the ranks agree; return the group ranks that share this rank's files."""
        first = self.entries[0]
        differ = [r for r, e in enumerate(self.entries) if (e["fp"], e["rows"]) != (first["fp"], first["rows"])]
        if differ:
            seen = ", ".join(f"rank {r}: {e['rows']} rows, fingerprint {e['fp']}"
                             for r, e in enumerate(self.entries) if r in differ or r == 0)
            raise DistributedConfigError(
                f"{self.what}: every rank must pass the same dataset, but {seen}; build or load "
                "it the same way on every rank (e.g. inside zero_first) before shared_map")
        if len({e["temp"] for e in self.entries}) > 1:
            raise DistributedConfigError(
                f"{self.what}: some ranks would write temporary files and others cache files "
                "(cache_dir=, keep_in_memory= or datasets caching differ between ranks); pass "
                "the same arguments on every rank")
        self.fingerprint: str = first["new"]
        members = [r for r, e in enumerate(self.entries) if e["fs"] == self.fs_key]
        if not self.temp:
            self.directory: str = self.cache_dir or os.path.dirname(
                os.path.abspath(self.dataset.cache_files[0]["filename"]))
            return members
        hosts = sorted({self.entries[r]["host"] for r in members})
        if len(hosts) > 1:
            raise DistributedConfigError(
                f"{self.what}: the dataset has no cache files (it is held in memory, or "
                f"keep_in_memory=True or caching is off), and the ranks sharing the work run on "
                f"{len(hosts)} hosts ({', '.join(hosts[:4])}): pass cache_dir=<a directory every "
                "rank can read>, or set AXOLOTL_DIST_SHARED_FS=0 to split the work per node")
        leader = self.entries[members[0]]["pid"]
        self.directory = self.temp_dir = os.path.join(
            _temp_parent(), f"{self.fingerprint}-{leader}-{self.seq}")
        return members

    # --- waiting, failures, progress --------------------------------------------------------

    def _wait(self, counter: str, target: int) -> None:
        """Wait until ``counter`` reaches ``target``; raise if a rank failed first or died."""
        def reached() -> bool:
            return self.store.add(self.key(counter), 0) >= target

        def ready() -> bool:
            self._refresh_bar()
            return reached() or self.store.add(self.key("failed"), 0) > 0

        try:
            poll_until(ready, watch=lambda: self.others, timeout=self.timeout, what=self.what,
                       me=self.rank, point=Point(self.group, "shared_map", self.seq, "shared_map"))
        except RankFailedError as exc:
            self.not_mine = exc
            raise
        if not reached():  # a failure after everyone got there belongs to a later step
            self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if not self.store.add(self.key("failed"), 0):
            return
        for r in range(self.ws):
            if self.store.check([self.key("error", r)]):
                self.not_mine = read_error(self.store, self.key("error", r), self.rank)
                await_readers(self.store, self.key("error", r),
                              [x for x in range(self.ws) if x not in (r, self.rank)], self.group)
                break
        else:
            self.not_mine = RankFailedError(-1, "unknown", "a rank reported a failure whose "
                                            "report could not be read", where=self.what)
        raise self.not_mine

    def _tick(self, rows: int) -> None:
        """Called by the mapping function for each row or batch (cheap unless it is time to report)."""
        self.progress.counted += rows
        if time.monotonic() >= self.progress.next_report:
            self._report()
            self._raise_if_failed()
            self._refresh_bar()

    def _report(self) -> None:
        self.progress.next_report = time.monotonic() + PROGRESS_INTERVAL
        if self.progress.counted > self.progress.reported:
            self.store.add(self.key("progress"), self.progress.counted - self.progress.reported)
            self.progress.reported = self.progress.counted

    def _open_bar(self, total: int) -> None:
        from datasets.utils import tqdm as hf_tqdm  # the class: off with datasets' bars

        desc = self.call.desc or "Map"
        self.progress.bar = _kitlog.add_bar(hf_tqdm(total=total, unit=" examples",
                                         desc=f"{desc} (shared_map over {self.ws} ranks)"))

    def _refresh_bar(self, force: bool = False) -> None:
        if self.progress.bar is None or not force and time.monotonic() < self.progress.next_bar:
            return
        self.progress.next_bar = time.monotonic() + 0.1
        done = self.store.add(self.key("progress"), 0)
        if done > self.progress.bar.n:
            self.progress.bar.update(done - self.progress.bar.n)

    # --- leaving ----------------------------------------------------------------------------

    def _leave(self) -> None:
        """Count this rank out; the last one of a filesystem group removes its temporary
        parts, the last one overall deletes the call's store keys."""
        try:
            if self.temp_dir is not None:
                members = sum(1 for e in self.entries if e["fs"] == self.fs_key)
                if self.store.add(self.key("left", self.fs_key), 1) == members:
                    shutil.rmtree(self.temp_dir, ignore_errors=True)
            if self.store.add(self.key("left"), 1) == self.ws:
                for key in self._keys():
                    self.store.delete_key(key)
        except Exception as exc:  # noqa: BLE001 - the store may be gone with a failed rank
            log.debug("%s: cleanup skipped: %s", self.what, exc)

    def _keys(self) -> List[str]:
        names = ["arrived", "done", "failed", "progress", "left"]
        keys = [self.key(n) for n in names] + [self.key("who", r) for r in range(self.ws)]
        keys += [self.key("left", fs) for fs in {e["fs"] for e in self.entries}]
        if self.store.add(self.key("failed"), 0):
            keys += [self.key("error", r) for r in range(self.ws)]
        return keys


_ENTRY = MappingProxyType({"fs": str, "host": str, "pid": int, "fp": (str, type(None)),
                           "rows": int, "temp": (bool, int)})


def _entry(data: bytes, key: str, rank: int) -> Dict[str, Any]:
    """Group rank ``rank``'s facts as :meth:`_SharedMap._arrive` posts them (rank 0's with the
    fingerprint of the result, ``new``); DistributedEnvError naming ``key`` for anything else."""
    fields = dict(_ENTRY, new=str) if rank == 0 else _ENTRY
    return checked(lambda raw: _records.read_object(raw, fields, "a rank's shared_map facts"),
                   data, key, rank)


def _temp_parent() -> str:
    """Where the temporary parts of a call go: this user's alone (docs/design/launching.md, "Local
    channels"); raises OSError (:class:`~.._runtime.base.private.NotPrivateError`: another
    user's directory is there) with the path and the fix."""
    fix = "or pass shared_map(cache_dir=<a directory of your own>)"
    return private_dir(os.path.join(user_dir(fix), TEMP_DIR_NAME), fix)


def _caching_enabled() -> bool:
    from datasets.fingerprint import is_caching_enabled

    return is_caching_enabled()
