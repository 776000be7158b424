"""Recording this rank's kit calls for the cross-rank timeline (``AXOLOTL_DIST_TRACE``).

While tracing is on (``TIMELINE.recorder`` holds a :class:`Recorder`), every outermost kit call on a
thread becomes one span (helper, call site, group, the group's call number, bytes this rank
sent), and the waits the kit knows of become spans with the ranks waited for: a ``zero_first``
block's wait for its first rank(s), a ``do_n_at_a_time`` round's wait, ``shared_map``'s wait
for the other parts. Users add spans with :func:`axolotl_dist.tracing.trace_span`. Off, the
only cost is the ``TIMELINE.recorder is None`` test the helpers' wrapper makes.

Each rank appends to its own ``rank<k>.jsonl`` in the trace directory, one JSON object per
line, copied as it happens into a shared memory map of the file
(:class:`~..base.mapped_file.MappedFile`: no system call per event): a rank killed mid-run
leaves every event up to its death, because the kernel's page cache, not the process, holds
what was copied. The file grows in :data:`~..base.mapped_file.CHUNK` steps, allocated before
use (a full disk stops tracing, never the run), and is cut to its length when the rank ends;
a killed rank's file ends in zero bytes, which the merge skips. Times are this host's
monotonic clock in nanoseconds; :func:`align` measures, through the c10d store, each rank's
offset to rank 0's clock and its error bound (half the best of a few round trips), written in
the file's first line. The tracing feature (``axolotl_dist.tracing._merge``) turns the files
into one Chrome trace. Line kinds:

* ``meta``: rank, world size, host, pid, clock offset and error bound;
* ``thread`` / ``group``: a thread's row and name; a group's name and global ranks;
* ``span``: kind (``helper``, ``body``, ``wait``, ``user``), name, start, duration, thread,
  site, group and call number, bytes, ranks waited for, how it synchronizes (``all``: it waits
  for every rank; ``src:k``: the others wait for group rank ``k``; ``none``: it records its
  own waits), the error if it raised;
* ``end``: the process ended (normally, or on an exception named there).

See docs/design/helpers.md, "Timeline".
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from ..liveness.progress import advance
from ..base import procs
from ..base.mapped_file import MappedFile
from ..base.groups import default_pg
from ..liveness import flight
from ..store import keys, records
from ..store.access import checked, put
from ..base.state import RoomState, register

__all__ = ["Recorder", "TIMELINE", "TimelineState", "start", "finish", "align",
           "trace_dir_requested", "helper_span", "add_bytes", "wait_span", "body_span", "now",
           "FILE_PREFIX", "rank_file", "rank_of_file", "register_sync", "torch_so_far"]


class TimelineState(RoomState):
    """``recorder`` (the recorder of this rank's kit calls while tracing is on, else None:
    :mod:`.timeline`)"""

    def __init__(self) -> None:
        self.recorder: Optional["Recorder"] = None


TIMELINE = register("trace", TimelineState())

#: Per-rank event files: ``rank<k>.jsonl`` (:func:`rank_file`; read by :func:`rank_of_file`).
FILE_PREFIX, _SUFFIX = "rank", ".jsonl"


def rank_file(directory: str, rank: object) -> str:
    """The path of rank ``rank``'s event file in ``directory``."""
    return os.path.join(directory, f"{FILE_PREFIX}{rank}{_SUFFIX}")


def rank_of_file(path: str) -> int:
    """The rank whose event file ``path`` is (named by :func:`rank_file`), else -1."""
    k = os.path.basename(path)[len(FILE_PREFIX):-len(_SUFFIX)]
    ok = k.isascii() and k.isdigit() and rank_file(os.path.dirname(path), k) == path
    return int(k) if ok else -1


#: Round trips measured per rank when aligning clocks; the best one is kept.
_ROUNDS = 5
#: How long one side of the alignment waits for the other (a rank that does not trace, or is
#: slow to start): past it, tracing stays off with a warning.
_ALIGN_WAIT = timedelta(seconds=60)

now = time.monotonic_ns


def _js(text: str, cache: Dict[str, str] = {}) -> str:  # noqa: B006 - a deliberate memo
    out = cache.get(text)
    if out is None:
        if len(cache) > 4096:
            cache.clear()
        out = cache[text] = json.dumps(text)
    return out


class Recorder:
    """One rank's event file (see the module docstring)."""

    def __init__(self, directory: str, rank: int, world_size: int, offset_ns: int,
                 error_ns: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.directory, self.rank, self.world_size = directory, rank, world_size
        self.path = rank_file(directory, rank)
        self.file: Optional[MappedFile] = MappedFile(self.path)
        self.threads: Dict[int, int] = {}
        self.groups: Dict[Any, str] = {}
        self.active: Set[int] = set()  # threads inside a traced kit call (nested calls: none)
        self.moved: Dict[int, int] = {}
        self.lock = threading.Lock()
        self.default_name = ""  # the default group's name, once the meta line is written
        self.wall_start = time.time_ns()  # torch's flight recorder stamps this clock
        #: torch's collectives written finished, ``(group, seq)``: :func:`torch_so_far`
        self.torch_done: Set[Tuple[str, int]] = set()
        #: run by the exit's cleanup once this rank's groups are destroyed (the tracing
        #: feature merges the files there: :mod:`axolotl_dist.tracing`)
        self.at_end: Optional[Callable[["Recorder"], None]] = None
        self._line({"e": "meta", "rank": rank, "world_size": world_size,
                    "host": socket.gethostname(), "pid": os.getpid(),
                    "machine": procs.MACHINE, "offset_ns": offset_ns,
                    "error_ns": error_ns, "clock": "monotonic", "t": now()})

    def _line(self, obj: Dict[str, Any]) -> None:
        self._raw(json.dumps(obj, separators=(",", ":")) + "\n")

    def _raw(self, line: str) -> None:
        file = self.file
        if file is None:  # ended
            return
        try:
            file.write(line.encode())
        except (OSError, ValueError):  # the disk is full: tracing never fails a run
            pass

    def thread(self) -> int:
        """This thread's row (its first event names it)."""
        ident = threading.get_ident()
        row = self.threads.get(ident)
        if row is None:
            row = self.row(ident, threading.current_thread().name)
        return row

    def row(self, key: int, name: str) -> int:
        """The row of ``key`` (a thread's id; negative for events of no thread, such as torch's
        collectives), named ``name`` in the file."""
        with self.lock:
            row = self.threads.setdefault(key, len(self.threads))
        self._line({"e": "thread", "th": row, "name": name})
        return row

    def group(self, pg: Any) -> str:
        """The name ``pg`` has on every rank (torch's group name), written once with its
        global ranks."""
        name = self.groups.get(pg)
        if name is None:
            import torch.distributed as dist

            name = str(getattr(pg, "group_name", "") or "0")
            try:
                ranks = list(dist.get_process_group_ranks(pg))
            except Exception:  # noqa: BLE001 - the default group before full init
                ranks = list(range(self.world_size))
            self.groups[pg] = name
            self._line({"e": "group", "g": name, "ranks": ranks})
        return name

    def span(self, kind: str, name: str, t0: int, t1: int, site: str = "", group: str = "",
             seq: int = 0, nbytes: int = 0, waited: Sequence[int] = (), sync: str = "",
             error: str = "", thread: Optional[int] = None) -> None:
        """Append one span (``t0``/``t1``: :func:`now` values)."""
        th = self.thread() if thread is None else thread
        parts = [f'{{"e":"span","k":"{kind}","n":{_js(name)},"t":{t0},"d":{t1 - t0},"th":{th}']
        if site:
            parts.append(f',"site":{_js(site)}')
        if group:
            parts.append(f',"g":{_js(group)},"s":{seq}')
        if nbytes:
            parts.append(f',"b":{nbytes}')
        if waited:
            parts.append(f',"w":[{",".join(str(int(r)) for r in waited)}]')
        if sync:
            parts.append(f',"sync":"{sync}"')
        if error:
            parts.append(f',"err":{json.dumps(error)}')
        parts.append("}\n")
        self._raw("".join(parts))

    def end(self, exc: Optional[BaseException]) -> None:
        """The process is ending (``exc``: the exception it ends on): last line, file closed."""
        from ..base.tracebacks import safe_str

        error = "" if exc is None else f"{type(exc).__name__}: {safe_str(exc)}"
        self._line({"e": "end", "t": now(), "error": error})
        file, self.file = self.file, None
        if file is not None:
            try:
                file.close()
            except OSError:
                pass


def trace_dir_requested(explicit: Optional[str]) -> Optional[str]:
    """The trace directory asked for: ``explicit`` (``init_distributed(trace_dir=...)``), else
    ``AXOLOTL_DIST_TRACE``; None if neither."""
    from ...env.variables import kit_path
    from ...env.variables import TRACE_ENV_VAR

    return explicit or kit_path(TRACE_ENV_VAR)


def align(store: Any, rank: int, world_size: int) -> Tuple[int, int]:
    """``(offset, error bound)`` in ns of this rank's monotonic clock to rank 0's: every rank
    calls it once, together. Rank k stamps a ping, rank 0 answers with its clock, and of
    :data:`_ROUNDS` round trips the fastest gives ``offset = rank0 - midpoint`` with an error
    of at most half its round trip. Ranks on one host share the clock: offset 0 within the
    error (kept as measured)."""
    if world_size == 1:
        return 0, 0
    if rank == 0:
        for k in range(1, world_size):
            for i in range(_ROUNDS):
                store.wait([keys.clock(k, i, "ping")], _ALIGN_WAIT)  # a rank not tracing: raises
                put(store, keys.clock(k, i, "pong"), records.clock(now()))
        return 0, 0
    best: Optional[Tuple[int, int]] = None
    for i in range(_ROUNDS):
        t1 = now()
        store.set(keys.clock(rank, i, "ping"), b"")
        store.wait([keys.clock(rank, i, "pong")], _ALIGN_WAIT)
        pong = keys.clock(rank, i, "pong")
        theirs = checked(records.read_clock, store.get(pong), pong, 0)
        t2 = now()
        trip = (t2 - t1, theirs - (t1 + t2) // 2)
        if best is None or trip[0] < best[0]:
            best = trip
    for i in range(_ROUNDS):
        for side in ("ping", "pong"):
            store.delete_key(keys.clock(rank, i, side))
    assert best is not None
    return best[1], best[0] // 2


def start(directory: str, store: Any, rank: int, world_size: int,
          at_end: Optional[Callable[[Recorder], None]] = None) -> Recorder:
    """Align this rank's clock (with every other rank, through ``store``) and open its file;
    ``at_end(recorder)`` runs at the cleanup that closes it, after the groups are gone."""
    offset, error = align(store, rank, world_size)
    recorder = Recorder(os.path.abspath(directory), rank, world_size, offset, error)
    pg = default_pg()
    recorder.default_name = recorder.group(pg) if pg is not None else ""
    recorder.at_end = at_end
    TIMELINE.recorder = recorder
    return recorder


def finish(exc: Optional[BaseException] = None) -> Optional[Recorder]:
    """Close this rank's file (idempotent); returns the recorder that was open, if any."""
    recorder = TIMELINE.recorder
    if recorder is None:
        return None
    TIMELINE.recorder = None
    _torch_spans(recorder)
    recorder.end(exc)
    return recorder


def _torch_spans(recorder: Recorder, open_ones: bool = False) -> None:
    """torch's own collectives since tracing began, from its flight recorder, on a row of their
    own, those not written finished before (:func:`torch_so_far`): ``torch`` spans (a raw
    ``dist.all_reduce``, DDP's all-reduce; no duration where the backend stamps no completion,
    as gloo); with ``open_ones``, ``torch-open`` for one not finished, drawn up to now (the
    merge keeps a collective's last line). Without (the rank's end), every one is finished:
    gloo marks an entry completed a moment after its wait returned."""
    try:
        found = flight.recorded(recorder.wall_start)
    except Exception:  # noqa: BLE001 - a torch without the recorder: the timeline goes without
        return
    found = [e for e in found or () if (e["group"], e["seq"]) not in recorder.torch_done]
    if not found:
        return
    row = recorder.row(-1, "torch's collectives (flight recorder)")
    at = now()
    shift = time.time_ns() - at  # the recorder stamps the wall clock; the file, monotonic
    for entry in found:
        t0, done = entry["t"] - shift, entry["done"] or not open_ones
        if done:
            recorder.torch_done.add((entry["group"], entry["seq"]))
        recorder.span("torch" if done else "torch-open", entry["name"], t0,
                      t0 + entry["d"] if done else max(t0, at), group=entry["group"],
                      seq=entry["seq"], thread=row)


def torch_so_far() -> None:
    """Write torch's collectives so far to this rank's file, while tracing (a rank answering a
    where request: a stuck run's timeline then shows them, the open one included)."""
    recorder = TIMELINE.recorder
    if recorder is not None:
        _torch_spans(recorder, open_ones=True)


# --- what the kit's code calls ---------------------------------------------------------------

#: How each kit call's ranks synchronize, registered where the call is decorated
#: (:mod:`.helpers`): ``("none", -1)`` for a call that records its own waits, ``("src:N",
#: -1)`` for a fixed source rank, ``(argument, position)`` for a source rank argument; a call
#: not registered is ``all`` (every rank waits for every other).
_SYNC: Dict[str, Tuple[str, int]] = {}


def register_sync(name: str, signature: Any, src: Any = None, own_waits: bool = False) -> None:
    """Say how the ranks of kit call ``name`` (public ``signature``) synchronize: ``src``, the
    name of its source-rank argument or the source rank itself; ``own_waits``: the call
    records its waits itself, with the ranks waited for."""
    if own_waits:
        _SYNC[name] = ("none", -1)
    elif isinstance(src, int) and not isinstance(src, bool):
        _SYNC[name] = (f"src:{src}", -1)
    elif isinstance(src, str):
        _SYNC[name] = (src, list(signature.parameters).index(src))


def _sync(name: str, args: tuple, kwargs: dict) -> str:
    spec = _SYNC.get(name)
    if spec is None:
        return "all"
    arg, position = spec
    if position < 0:
        return arg
    src = kwargs.get(arg, kwargs.get("rank"))
    if src is None:
        src = args[position] if len(args) > position else 0
    return f"src:{src}" if isinstance(src, int) else "all"


_get_ident = threading.get_ident


def helper_span(recorder: Recorder, name: str, group: Any, site: Any, call: Any,
                args: tuple, kwargs: dict) -> Any:
    """Run ``call()`` (kit helper ``name`` on the :class:`~..base.groups.Group` ``group``, None for
    one process; ``site()`` gives the call site) as one span, unless this thread is already
    inside a traced kit call. Calls are numbered by the group's ``"traced"`` counter (every
    rank counts the same calls). The hot path of tracing: a few dict operations and one
    formatted line (``benchmarks/debug.py``)."""
    me = _get_ident()
    active = recorder.active
    if me in active:
        return call()
    active.add(me)
    moved = recorder.moved
    moved[me] = 0
    gname = _group_name(recorder, group)
    seq = advance(group, "traced") if group is not None else 0
    error = ""
    t0 = now()
    try:
        return call()
    except BaseException as exc:
        error = type(exc).__name__
        raise
    finally:
        t1 = now()
        active.discard(me)
        th = recorder.threads.get(me)
        if th is None:
            th = recorder.thread()
        err = f',"err":"{error}"' if error else ""
        recorder._raw(f'{{"e":"span","k":"helper","n":"{name}","t":{t0},"d":{t1 - t0},'
                      f'"th":{th},"site":{_site_json(site())},"g":{_js(gname)},"s":{seq},'
                      f'"b":{moved.pop(me, 0)},"sync":"{_sync(name, args, kwargs)}"{err}}}\n')


def _site_json(site: Any, cache: Dict[Any, str] = {}) -> str:  # noqa: B006 - a memo
    """A call site as a JSON string (sites are cached objects: one lookup)."""
    out = cache.get(site)
    if out is None:
        if len(cache) > 4096:
            cache.clear()
        out = cache[site] = json.dumps(str(site))
    return out


def add_bytes(nbytes: int) -> None:
    """This thread's traced call sent ``nbytes`` more (a no-op while tracing is off)."""
    recorder = TIMELINE.recorder
    if recorder is not None:
        me = threading.get_ident()
        recorder.moved[me] = recorder.moved.get(me, 0) + int(nbytes)


def _group_name(recorder: Recorder, group: Any) -> str:
    """The name of the :class:`~..base.groups.Group` ``group`` on every rank ("" for None)."""
    if group is None:
        return recorder.default_name
    if group.default and recorder.default_name:
        return recorder.default_name
    pg = group.pg_ref()
    return recorder.group(pg) if pg is not None else ""


def wait_span(name: str, t0: int, waited: Sequence[int], site: Any = "", group: Any = None,
              seq: int = 0, error: str = "") -> None:
    """Record a kit wait from ``t0`` until now for global ranks ``waited`` (no-op if off)."""
    recorder = TIMELINE.recorder
    if recorder is None:
        return
    gname = _group_name(recorder, group)
    recorder.span("wait", name, t0, now(), str(site), gname, seq, waited=waited, error=error)


def body_span(name: str, t0: int, site: Any = "", group: Any = None, seq: int = 0,
              error: str = "") -> None:
    """Record the body of a block this rank ran first, from ``t0`` until now (no-op if off)."""
    recorder = TIMELINE.recorder
    if recorder is None:
        return
    gname = _group_name(recorder, group)
    recorder.span("body", name, t0, now(), str(site), gname, seq, error=error)
