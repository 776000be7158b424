"""The store protocol behind debug mode (:mod:`axolotl_dist.debug`): one check per helper call.

For call number ``seq`` on a group (counted per process and group, so the ranks' numbers line
up as long as they call the same helpers in the same order), every rank

1. takes an arrival slot ``k = add("axd/dbg/<seq>/n", 1)`` and stores its record (helper,
   arguments that must agree, call site) under ``axd/dbg/<seq>/c/<k>``;
2. polls the counter, reading new records as they arrive, until all ranks are there; the
   first disagreement makes it collect the rest (bounded) and raise
   :class:`~axolotl_dist.errors.CollectiveMismatchError`; a rank that does not come within
   the debug timeout after the last arrival, or whose process is gone, is named instead, and
   the error is published (``axd/dbg/<seq>/abort``, the counter pushed past :data:`ABORT`)
   so a rank arriving later raises at once instead of waiting in turn.

Ranks that must not wait (the ranks that go first in :func:`~axolotl_dist.zero_first`: the
others are blocked until they finish, and blocks may nest) only publish their record and
compare it with the records already there; the comparison is repeated, without blocking,
at their next waiting check, or before they report a missing rank.
"""

from __future__ import annotations

import os
import pickle
import time
import weakref
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Sequence

from . import _signals
from .errors import AxolotlDistError, CollectiveMismatchError, RankFailedError

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = ["ABORT", "KEEP_CALLS", "check", "first_rank_block"]

#: Added to a call's arrival counter when a rank gave up on it.
ABORT = 1 << 40
#: A rank deletes its record of call ``seq - KEEP_CALLS`` after checking call ``seq``.
KEEP_CALLS = 64


class Call:
    """One rank's record of one checked call, as stored for the others to read."""

    __slots__ = ("rank", "global_rank", "name", "agree", "site", "pid", "host")

    def __init__(self, rank: int, global_rank: int, name: str, agree: Dict[str, Any], site: str) -> None:
        self.rank, self.global_rank, self.name = rank, global_rank, name
        self.agree = {k: (v if isinstance(v, (int, float, str, bool, type(None))) else repr(v))
                      for k, v in agree.items()}
        self.site = site
        self.pid, self.host = os.getpid(), _signals.HOST

    def __getstate__(self) -> tuple:
        return tuple(getattr(self, s) for s in self.__slots__)

    def __setstate__(self, state: tuple) -> None:
        for slot, value in zip(self.__slots__, state):
            setattr(self, slot, value)

    def call(self) -> str:
        return f"{self.name}(" + ", ".join(f"{k}={v}" for k, v in self.agree.items()) + ")"

    def who(self) -> str:
        return f"rank {self.rank}" + (f" (global {self.global_rank})" if self.global_rank != self.rank else "")


class _GroupLog:
    """This rank's memory of its checks on one group."""

    __slots__ = ("slots", "last", "last_seq", "pending", "first_depth", "__weakref__")

    def __init__(self) -> None:
        self.slots: Dict[int, int] = {}  # call number -> my arrival slot (to delete later)
        self.last: List[Call] = []  # every rank's record of the last call all ranks reached
        self.last_seq = 0
        self.pending: Dict[int, Call] = {}  # calls published without waiting, not yet compared
        self.first_depth = 0  # zero_first blocks this rank is running first, nested


_LOGS: "weakref.WeakKeyDictionary[Any, _GroupLog]" = weakref.WeakKeyDictionary()


def check(name: str, agree: Dict[str, Any], group: Optional["ProcessGroup"], site: str, *,
          wait: bool, timeout: float) -> None:
    """Check this call of helper ``name`` against the other ranks of ``group`` (see above)."""
    import torch.distributed as dist

    from .ranks import get_rank, get_world_size

    _signals.start_heartbeat()
    rank, ws = get_rank(group), get_world_size(group)
    me = Call(rank, rank if group is None else dist.get_global_rank(group, rank), name, agree, site)
    key = group if group is not None else dist.distributed_c10d._world.default_pg
    log = _LOGS.get(key)
    if log is None:
        log = _LOGS[key] = _GroupLog()
    seq = _signals.next_sequence(group, "debug")
    calls: List[Call] = []
    try:
        store = _signals.group_store(group)
        _post(store, seq, me, log)
        if wait:
            _wait_all(store, seq, me, calls, ws, group, log, timeout)
            log.last, log.last_seq = list(calls), seq
            _compare_pending(store, log, ws, group, done=True)
            _tidy(store, seq, me, log)
        else:
            if _disagree(_arrived(store, seq)):  # known bad already: collect the rest, raise
                _wait_all(store, seq, me, calls, ws, group, log, timeout)
            log.pending[seq] = me
    except AxolotlDistError:
        raise
    except Exception as exc:  # the store went away (its host exited) or refused us
        missing = _missing_ranks(calls, ws) if calls else []
        first_line = (str(exc).splitlines() or [""])[0]
        raise CollectiveMismatchError(
            f"debug mode: lost the c10d store while checking call #{seq} ({me.call()}) on "
            f"{_group_name(group)} ({type(exc).__name__}: {first_line}); the process hosting "
            "the store (rank 0, or the launcher) probably exited"
            + (f"; rank(s) {missing} had not arrived" if missing else ""),
            calls=_summary(calls), missing=missing) from exc


def _post(store: Any, seq: int, me: Call, log: _GroupLog) -> None:
    """Take an arrival slot for call ``seq`` and store this rank's record in it."""
    prefix = f"axd/dbg/{seq}"
    slot = store.add(f"{prefix}/n", 1)
    if slot > ABORT:
        raise _read_abort(store, prefix, me)
    store.set(f"{prefix}/c/{slot}", pickle.dumps(me))
    log.slots[seq] = slot


def _arrived(store: Any, seq: int) -> List[Call]:
    """The records of call ``seq`` stored so far, without blocking (empty if any is missing)."""
    prefix = f"axd/dbg/{seq}"
    count = store.add(f"{prefix}/n", 0) % ABORT
    keys = [f"{prefix}/c/{i}" for i in range(1, count + 1)]
    if not keys or not store.check(keys):  # a rank between add and set, or records deleted
        return []
    return [pickle.loads(b) for b in store.multi_get(keys)]


@contextmanager
def first_rank_block(group: Optional["ProcessGroup"], timeout: float) -> Iterator[None]:
    """Around a ``zero_first`` block this rank runs first, right after its (non-waiting) check.

    When the outermost such block ends, every other rank has had to reach the same call (it
    waits for this block), so this rank then waits for their records of it and raises on a
    mismatch or a missing rank. Nested blocks leave their call to the next waiting check.
    """
    import torch.distributed as dist

    from .ranks import get_world_size

    key = group if group is not None else dist.distributed_c10d._world.default_pg
    log = _LOGS.get(key)
    if log is None or not log.pending:
        yield
        return
    seq = max(log.pending)  # the zero_first call just published
    log.first_depth += 1
    try:
        yield
    finally:
        log.first_depth -= 1
    if log.first_depth == 0 and seq in log.pending:
        me, calls, ws = log.pending[seq], [], get_world_size(group)
        try:
            _wait_all(_signals.group_store(group), seq, me, calls, ws, group, log, timeout)
        except AxolotlDistError as exc:
            raise exc.with_traceback(None)
        del log.pending[seq]


def _compare_pending(store: Any, log: _GroupLog, ws: int, group: Optional["ProcessGroup"],
                     done: bool) -> None:
    """Compare the calls this rank published without waiting; ``done``: forget them after."""
    for seq in list(log.pending):
        calls = _arrived(store, seq)
        if _disagree(calls):
            raise _mismatch_error(seq, calls, ws, group)
    if done:
        log.pending.clear()


def _tidy(store: Any, seq: int, me: Call, log: _GroupLog) -> None:
    """Delete this rank's records of calls long past (rank 0 also their counters)."""
    for old in [s for s in log.slots if s <= seq - KEEP_CALLS]:
        slot = log.slots.pop(old)
        store.delete_key(f"axd/dbg/{old}/c/{slot}")
        if me.rank == 0:
            store.delete_key(f"axd/dbg/{old}/n")


def _wait_all(store: Any, seq: int, me: Call, calls: List[Call], ws: int,
              group: Optional["ProcessGroup"], log: _GroupLog, timeout: float) -> None:
    """Collect every rank's record of call ``seq`` into ``calls``; raise on any mismatch."""
    prefix = f"axd/dbg/{seq}"
    watcher = _signals.Watch(_signals.group_store())
    last_progress = time.monotonic()
    next_liveness = last_progress + _signals.HEARTBEAT_INTERVAL
    spins, delay = 0, 0.0002
    mismatched = False  # once seen, keep collecting (bounded) so the error lists every rank

    def give_up(dead: Dict[int, str]) -> None:
        if mismatched:
            raise _mismatch_error(seq, calls, ws, group)
        _compare_pending(store, log, ws, group, done=False)  # an earlier call may explain it
        _abort(store, prefix, _missing_error(seq, me, calls, ws, group, log, dead, timeout))

    while True:
        arrived = store.add(f"{prefix}/n", 0)
        if arrived > ABORT:
            if mismatched:
                raise _mismatch_error(seq, calls, ws, group)
            _compare_pending(store, log, ws, group, done=False)
            raise _read_abort(store, prefix, me)
        if arrived > len(calls):
            keys = [f"{prefix}/c/{i}" for i in range(len(calls) + 1, arrived + 1)]
            calls += [pickle.loads(b) for b in store.multi_get(keys)]
            last_progress = time.monotonic()
            mismatched = mismatched or _disagree(calls)
            if arrived == ws:
                if mismatched:
                    raise _mismatch_error(seq, calls, ws, group)
                return
        now = time.monotonic()
        if now >= next_liveness:
            next_liveness = now + _signals.HEARTBEAT_INTERVAL
            dead = _dead_ranks(watcher, calls, ws, group, now)
            if dead:
                give_up(dead)
        if now - last_progress >= timeout:
            give_up({})
        if spins < 50:
            spins += 1
        else:
            time.sleep(delay)
            delay = min(delay * 2, 0.02)


def _missing_ranks(calls: Sequence[Call], ws: int) -> List[int]:
    present = {c.rank for c in calls}
    return [r for r in range(ws) if r not in present]


def _dead_ranks(watcher: _signals.Watch, calls: Sequence[Call], ws: int,
                group: Optional["ProcessGroup"], now: float) -> Dict[int, str]:
    """Missing group ranks whose process is known to be gone, with why."""
    import torch.distributed as dist

    dead: Dict[int, str] = {}
    for rank in _missing_ranks(calls, ws):
        try:
            watcher.check([rank if group is None else dist.get_global_rank(group, rank)], now)
        except RankFailedError as exc:
            dead[rank] = exc.exc_message
    return dead


def _disagree(calls: Sequence[Call]) -> bool:
    return any(c.name != calls[0].name or c.agree != calls[0].agree for c in calls[1:])


# --- messages -------------------------------------------------------------------------------

def _group_name(group: Optional["ProcessGroup"]) -> str:
    if group is None:
        return "the default group"
    return f"group {getattr(group, 'group_name', '?')!s}"


def _table(calls: Sequence[Call]) -> List[str]:
    return [f"  {c.who()}: {c.call()}\n      at {c.site}" for c in sorted(calls, key=lambda c: c.rank)]


def _summary(calls: Sequence[Call]) -> Dict[int, str]:
    return {c.rank: f"{c.call()} at {c.site}" for c in sorted(calls, key=lambda c: c.rank)}


def _mismatch_error(seq: int, calls: List[Call], ws: int,
                    group: Optional["ProcessGroup"]) -> CollectiveMismatchError:
    ordered = sorted(calls, key=lambda c: c.rank)
    if len({c.name for c in ordered}) > 1:
        why = ("the ranks called different helpers (" + ", ".join(
            f"{c.who()}: {c.name}" for c in ordered) + "): every rank must call the same "
            "helpers in the same order")
    else:
        keys = [k for k in ordered[0].agree if len({repr(c.agree.get(k)) for c in ordered}) > 1]
        why = "; ".join(
            f"the ranks disagree on {k} (" + ", ".join(f"{c.who()}: {c.agree.get(k)}" for c in ordered)
            + ")" for k in keys) + ": it must be the same on every rank"
    missing = _missing_ranks(calls, ws)
    lines = [f"debug mode: mismatched call #{seq} on {_group_name(group)}: {why}."]
    lines += _table(ordered)
    if missing:
        lines.append(f"  rank(s) {missing}: did not arrive (exited, or stuck elsewhere)")
    return CollectiveMismatchError("\n".join(lines), calls=_summary(ordered), missing=missing)


def _missing_error(seq: int, me: Call, calls: List[Call], ws: int, group: Optional["ProcessGroup"],
                   log: _GroupLog, dead: Dict[int, str], timeout: float) -> CollectiveMismatchError:
    from .debug import DEBUG_TIMEOUT_ENV_VAR

    missing = _missing_ranks(calls, ws)
    last = {c.rank: c for c in log.last}
    if dead:
        head = (f"rank(s) {sorted(dead)} exited before reaching call #{seq} ({me.call()}) on "
                f"{_group_name(group)}, which the other ranks are in")
    else:
        head = (f"rank(s) {missing} did not reach call #{seq} ({me.call()}) on "
                f"{_group_name(group)} within {timeout:g} s of the last rank to arrive: they are "
                f"stuck elsewhere, exited, or run without debug mode "
                f"({DEBUG_TIMEOUT_ENV_VAR} / enable_debug(timeout=) set this wait)")
    lines = [f"debug mode: {head}."]
    if log.first_depth and log.pending:
        block = log.pending[min(log.pending)]
        lines[0] += (f" This rank is inside a {block.name} block it runs first (at {block.site}) "
                     "while the other ranks wait for that block to end: a collective inside it "
                     "can never complete; move the call out of the block")
    lines += _table(calls)
    for rank in missing:
        state = f"exited: {dead[rank]}" if rank in dead else "not arrived"
        prev = last.get(rank)
        after = (f"; its last checked call was #{log.last_seq} {prev.call()} at {prev.site}" if prev
                 else "; it made no checked call before this one")
        lines.append(f"  rank {rank}: {state}{after}")
    return CollectiveMismatchError("\n".join(lines), calls=_summary(calls), missing=missing)


def _abort(store: Any, prefix: str, error: CollectiveMismatchError) -> None:
    """Publish ``error`` for ranks that arrive late at this call, then raise it."""
    try:
        store.set(f"{prefix}/abort", pickle.dumps(error))
        store.add(f"{prefix}/n", ABORT)
    except Exception:  # noqa: BLE001 - the store may be gone with the missing rank
        pass
    raise error


def _read_abort(store: Any, prefix: str, me: Call) -> CollectiveMismatchError:
    """The error another rank published when it gave up on this call (we came too late)."""
    error = pickle.loads(store.get(f"{prefix}/abort"))
    if not isinstance(error, CollectiveMismatchError):  # pragma: no cover - defensive
        return CollectiveMismatchError(str(error))
    text = (f"debug mode: {me.who()} reached {me.call()} at {me.site} after another rank had "
            f"given up waiting for it; that rank reported:\n{error.args[0]}")
    return CollectiveMismatchError(text, calls=error.calls, missing=error.missing)
