"""The store protocol behind debug mode (:mod:`axolotl_dist.debug`): one check per helper call.

Call number ``seq`` on a group is counted per process and group, so the ranks' numbers line up
as long as they call the same helpers in the same order. For it every rank, under
``axd/dbg/<seq>/``,

1. stores its record (helper, arguments that must agree, call site) as ``c/<rank>``, adds 1 to
   ``d/<digest>`` (the digest of helper and arguments) and then to the arrival counter ``n``;
2. polls ``n`` and its own digest's counter: ``n`` above the digest's count means some rank
   that arrived differs, ``n`` equal to both and to the world size means every rank is here
   and agrees. The fast path is O(1) store operations per rank, whatever the world size:
   records are read only to write an error.

On a mismatch each rank collects the records (waiting, bounded, for the rest) and raises
:class:`~axolotl_dist.errors.CollectiveMismatchError` with every rank's call. When a rank does
not come, group rank 0 (the monitor; every rank watches rank 0 itself) names it once its
process is gone or the debug timeout has passed since the last arrival, and publishes the
error (``abort``; ``n`` pushed past :data:`ABORT`): ranks waiting, and ranks arriving later,
raise it at once.

Ranks that must not wait (the ranks that go first in :func:`~axolotl_dist.zero_first`: the
others are blocked until they finish, and blocks may nest) only post their record and look at
the counters; they compare again, without blocking, at their next waiting check or before
reporting a missing rank, and wait for the others when their outermost block ends. See
docs/design/helpers.md, "Debug-mode checks".
"""

from __future__ import annotations

import hashlib
import os
import time
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from ..liveness.progress import advance
from ...env import variables
from ..base.constants import HEARTBEAT_INTERVAL, HOST
from ..base.groups import Group
from ..store.access import checked, group_store, put, store_host
from ..liveness.failures import await_readers
from ..liveness.stalls import PeerChecker
from .protocols_state import DEBUG, DebugLog
from .unchecked import UncheckedLook
from ...errors import AxolotlDistError, CollectiveMismatchError, DistributedEnvError, RankFailedError

__all__ = ["ABORT", "KEEP_CALLS", "DEBUG_TIMEOUT_ENV_VAR", "SEQUENCE_KIND", "check", "first_rank_block",
           "Switches", "switches", "set_switches", "refresh_from_env"]

#: The per-group call counter (:mod:`..liveness.progress`) debug checks are numbered by.
SEQUENCE_KIND = "debug"
#: Seconds a rank waits, after the last rank arrived, for the ranks still missing.
from ...env.variables import DEBUG_ENV_VAR, DEBUG_TIMEOUT_ENV_VAR  # noqa: E402 - re-exported
from ..store import keys, records

#: Added to a call's arrival counter when a rank gave up on it.
ABORT = 1 << 40
#: A rank deletes its record of call ``seq - KEEP_CALLS`` after checking call ``seq``.
KEEP_CALLS = 64
#: Extra seconds a rank other than the monitor waits for the monitor's report.
MONITOR_GRACE = 1.0


class Call:
    """One rank's record of one checked call, as stored for the others to read."""

    __slots__ = ("rank", "global_rank", "name", "agree", "site", "pid", "host")

    def __init__(self, rank: int, global_rank: int, name: str, agree: Dict[str, Any], site: str) -> None:
        self.rank, self.global_rank, self.name = rank, global_rank, name
        self.agree = {k: (v if isinstance(v, (int, float, str, bool, type(None))) else repr(v))
                      for k, v in agree.items()}
        self.site = site
        self.pid, self.host = os.getpid(), HOST

    def fields(self) -> tuple:
        """What :func:`..store.records.call_record` stores."""
        return tuple(getattr(self, s) for s in self.__slots__)

    @classmethod
    def from_fields(cls, fields: tuple) -> "Call":
        """The call another rank stored (:func:`..store.records.read_call_record`)."""
        call = cls.__new__(cls)
        for slot, value in zip(cls.__slots__, fields):
            setattr(call, slot, value)
        return call

    def digest(self) -> str:
        """What must be equal on every rank, hashed (the same on every rank and host)."""
        text = repr((self.name, sorted(self.agree.items())))
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def call(self) -> str:
        return f"{self.name}(" + ", ".join(f"{k}={v}" for k, v in self.agree.items()) + ")"

    def who(self) -> str:
        return f"rank {self.rank}" + (f" (global {self.global_rank})" if self.global_rank != self.rank else "")


class _Ctx:
    """One check in progress: who, which call, where its keys live."""

    __slots__ = ("store", "seq", "me", "digest", "ws", "group", "log", "timeout", "prefix")

    def __init__(self, store: Any, seq: int, me: Call, ws: int, group: Group,
                 log: DebugLog, timeout: float) -> None:
        self.store, self.seq, self.me, self.ws, self.group = store, seq, me, ws, group
        self.log, self.timeout = log, timeout
        self.digest = me.digest()
        self.prefix = keys.debug_check(seq)

    def counts(self) -> Tuple[int, int]:
        """(arrived, arrived with my digest); ``n`` is read first, so a rank counted in it has
        already counted its digest: ``arrived > same`` proves a rank that differs."""
        arrived = self.store.add(f"{self.prefix}/n", 0)
        return arrived, self.store.add(f"{self.prefix}/d/{self.digest}", 0)


def _log_of(g: Group, create: bool) -> Optional[DebugLog]:
    """This rank's :class:`~.protocols_state.DebugLog` of ``g``."""
    return DEBUG.logs[g] if create else DEBUG.logs.get(g)


def check(name: str, agree: Dict[str, Any], group: Group, site: str, *,
          wait: bool, timeout: float) -> None:
    """Check this call of helper ``name`` against the other ranks of ``group`` (see above)."""
    rank, ws = group.rank, group.size
    me = Call(rank, group.global_rank(rank), name, agree, site)
    log = _log_of(group, create=True)
    assert log is not None
    seq = advance(group, SEQUENCE_KIND)
    try:
        ctx = _Ctx(group_store(group.arg), seq, me, ws, group, log, timeout)
        _post(ctx)
        if wait:
            _wait_all(ctx)
            log.last_seq = seq
            _compare_pending(log, done=True)
            _tidy(ctx)
        else:
            arrived, same = ctx.counts()
            if arrived > same:  # known bad already: collect the rest and raise
                _wait_all(ctx)
            log.pending[seq] = ctx
    except AxolotlDistError:
        raise
    except Exception as exc:  # the store went away (its host exited) or refused us
        raise _store_lost(exc, seq, me, group) from exc


def _store_lost(exc: BaseException, seq: int, me: Call, group: Group
                ) -> CollectiveMismatchError:
    """The error for a store that vanished during call ``seq``: its host is gone."""
    first_line = (str(exc).splitlines() or [""])[0]
    host = store_host()
    where = f"call #{seq} ({me.call()}) on {_group_name(group)}"
    if host is not None:
        head = (f"rank {host} (the store host) died or exited while this rank checked {where}: "
                f"the c10d store it hosted is gone ({type(exc).__name__}: {first_line}); look at "
                f"rank {host}'s own output for why it ended")
    else:
        head = (f"lost the c10d store while checking {where} ({type(exc).__name__}: "
                f"{first_line}): the launcher process that hosted it exited or was killed")
    return CollectiveMismatchError(f"debug mode: {head}", calls={me.rank: f"{me.call()} at {me.site}"},
                                   missing=() if host is None else (host,))


def _post(ctx: _Ctx) -> None:
    """Store this rank's record and count it, digest first (see :meth:`_Ctx.counts`)."""
    store, p = ctx.store, ctx.prefix
    put(store, f"{p}/c/{ctx.me.rank}", records.call_record(ctx.me.fields()))
    store.add(f"{p}/d/{ctx.digest}", 1)
    ctx.log.posted[ctx.seq] = ctx.digest
    if store.add(f"{p}/n", 1) > ABORT:  # the others gave up on this call before we came
        raise _read_abort(ctx, late=True)


@contextmanager
def first_rank_block(group: Group, timeout: float) -> Iterator[None]:
    """Around a ``zero_first`` block this rank runs first, right after its (non-waiting) check.

    When the outermost such block ends, every other rank has had to reach the same call (it
    waits for this block), so this rank then waits for them and raises on a mismatch or a
    missing rank. Nested blocks leave their call to the next waiting check.
    """
    log = _log_of(group, create=False)
    if log is None or not log.pending:
        yield
        return
    seq = max(log.pending)  # the zero_first call just posted
    log.first_depth += 1
    try:
        yield
    finally:
        log.first_depth -= 1
    if log.first_depth == 0 and seq in log.pending:
        try:
            _wait_all(log.pending[seq])
        except AxolotlDistError as exc:
            raise exc.with_traceback(None)
        del log.pending[seq]


def _compare_pending(log: DebugLog, done: bool) -> None:
    """Look again at the calls posted without waiting (never blocks); ``done``: every rank has
    since reached a later call, so they are settled and forgotten."""
    for seq, ctx in list(log.pending.items()):
        arrived, same = ctx.counts()
        if arrived % ABORT > same:
            raise _mismatch_error(ctx, _records(ctx))
    if done:
        log.pending.clear()


def _tidy(ctx: _Ctx) -> None:
    """Delete this rank's keys of calls long past (rank 0 also their counters)."""
    log, store = ctx.log, ctx.store
    for old in [s for s in log.posted if s <= ctx.seq - KEEP_CALLS]:
        digest = log.posted.pop(old)
        store.delete_key(f"{keys.debug_check(old)}/c/{ctx.me.rank}")
        if ctx.me.rank == 0:
            store.delete_key(f"{keys.debug_check(old)}/n")
            store.delete_key(f"{keys.debug_check(old)}/d/{digest}")


def _wait_all(ctx: _Ctx) -> None:
    """Return once every rank reached this call with the same digest; else raise."""
    checker = PeerChecker(group_store())
    monitor = ctx.me.rank == 0
    last_progress = time.monotonic()
    next_liveness = last_progress + HEARTBEAT_INTERVAL
    spins, delay, seen = 0, 0.0002, 0
    me = ctx.me
    torch_look = UncheckedLook(ctx.group, last_progress,
                               f"{me.who()} is at checked call #{ctx.seq} {me.call()} at "
                               f"{me.site.split(': ', 1)[0]}")
    while True:
        arrived = ctx.store.add(f"{ctx.prefix}/n", 0)
        if arrived > ABORT:
            _compare_pending(ctx.log, done=False)
            raise _read_abort(ctx, late=False)
        now = time.monotonic()
        if arrived != seen:  # someone came: do they all agree so far? (see _Ctx.counts)
            if arrived > ctx.store.add(f"{ctx.prefix}/d/{ctx.digest}", 0):
                raise _collect_mismatch(ctx, last_progress)
            if arrived == ctx.ws:
                return
            seen, last_progress = arrived, now
        if now >= next_liveness:
            next_liveness = now + HEARTBEAT_INTERVAL
            dead = _dead_ranks(ctx, checker, now, all_ranks=monitor)
            if dead:
                _give_up(ctx, dead)
        finding = torch_look.look(now, lambda: _present(ctx))
        if finding is not None:
            _publish(ctx, _unchecked_error(ctx, finding), [ctx.me.rank])
        if now - last_progress >= ctx.timeout + (0.0 if monitor else MONITOR_GRACE):
            _give_up(ctx, {})
        if spins < 50:
            spins += 1
        else:
            time.sleep(delay)
            delay = min(delay * 2, 0.02)


def _collect_mismatch(ctx: _Ctx, last_progress: float) -> CollectiveMismatchError:
    """A rank differs: wait (bounded) for the rest so the error shows every rank's call."""
    checker = PeerChecker(group_store())
    next_liveness = time.monotonic() + HEARTBEAT_INTERVAL
    seen = 0
    while True:
        arrived = ctx.store.add(f"{ctx.prefix}/n", 0) % ABORT
        now = time.monotonic()
        if arrived >= ctx.ws or now - last_progress >= ctx.timeout:
            break
        if arrived > seen:
            seen, last_progress = arrived, now
        if now >= next_liveness:
            next_liveness = now + HEARTBEAT_INTERVAL
            if _dead_ranks(ctx, checker, now, all_ranks=True):
                break
        time.sleep(0.005)
    return _mismatch_error(ctx, _records(ctx))


def _give_up(ctx: _Ctx, dead: Dict[int, str]) -> None:
    """Name the missing ranks: publish the error for the others, then raise it."""
    _compare_pending(ctx.log, done=False)  # an earlier call may explain it
    calls = _records(ctx)
    if len({c.digest() for c in calls}) > 1:
        raise _mismatch_error(ctx, calls)
    _publish(ctx, _missing_error(ctx, calls, dead), [c.rank for c in calls])


def _publish(ctx: _Ctx, error: CollectiveMismatchError, readers: List[int]) -> None:
    """Publish ``error`` for the ranks waiting at this call and those still coming, then raise it."""
    try:
        put(ctx.store, f"{ctx.prefix}/abort", records.mismatch(error, ctx.me.rank))
        ctx.store.add(f"{ctx.prefix}/n", ABORT)
    except Exception:  # noqa: BLE001 - the store may be gone with the missing rank
        raise error from None
    _acknowledge(ctx, f"{ctx.prefix}/abort", readers)
    raise error


def _unchecked_error(ctx: _Ctx, finding: Tuple[str, List[int]]) -> CollectiveMismatchError:
    """The error where ranks sit in torch collectives no checked call issued (:mod:`.unchecked`)."""
    calls = _records(ctx)
    return CollectiveMismatchError("\n".join([f"debug mode: {finding[0]}."] + _table(calls)),
                                   calls=_summary(calls), missing=finding[1])


def _present(ctx: _Ctx, seq: Optional[int] = None) -> List[int]:
    """The group ranks whose record of call ``seq`` (default: this one) is stored (one store
    round trip each; this rank's own record of this call is known to be there)."""
    p = keys.debug_check(seq) if seq is not None else ctx.prefix
    mine = ctx.me.rank if seq is None else None
    return [r for r in range(ctx.ws) if r == mine or ctx.store.check([f"{p}/c/{r}"])]


def _records(ctx: _Ctx, seq: Optional[int] = None, ranks: Optional[Sequence[int]] = None) -> List[Call]:
    """The stored records of call ``seq`` (default: this one) of ``ranks`` (default: all there)."""
    p = keys.debug_check(seq) if seq is not None else ctx.prefix
    if ranks is None:
        ranks = _present(ctx, seq)
    if not ranks:
        return []
    names = [f"{p}/c/{r}" for r in ranks]
    return [Call.from_fields(checked(records.read_call_record, b, key, rank))
            for b, key, rank in zip(ctx.store.multi_get(names), names, ranks)]


def _missing_ranks(calls: Sequence[Call], ws: int) -> List[int]:
    present = {c.rank for c in calls}
    return [r for r in range(ws) if r not in present]


def _dead_ranks(ctx: _Ctx, checker: PeerChecker, now: float, all_ranks: bool) -> Dict[int, str]:
    """Missing group ranks whose process is known to be gone, with why. The monitor looks at
    every missing rank; the others only at rank 0 (one round trip), whom nobody else watches."""
    if all_ranks:
        present = set(_present(ctx))
        missing = [r for r in range(ctx.ws) if r not in present]
    else:
        missing = [] if ctx.store.check([f"{ctx.prefix}/c/0"]) else [0]
    dead: Dict[int, str] = {}
    for rank in missing:
        try:
            checker.check([ctx.group.global_rank(rank)], now)
        except RankFailedError as exc:
            dead[rank] = exc.exc_message
    return dead


# --- messages -------------------------------------------------------------------------------

def _group_name(group: Group) -> str:
    if group.default:
        return "the default group"
    return f"group {getattr(group.pg_ref(), 'group_name', '?')!s}"


def _table(calls: Sequence[Call]) -> List[str]:
    return [f"  {c.who()}: {c.call()}\n      at {c.site}" for c in sorted(calls, key=lambda c: c.rank)]


def _summary(calls: Sequence[Call]) -> Dict[int, str]:
    return {c.rank: f"{c.call()} at {c.site}" for c in sorted(calls, key=lambda c: c.rank)}


def _acknowledge(ctx: _Ctx, key: str, readers: Sequence[int]) -> None:
    """This rank has read what it needs under ``key`` for its error; if it hosts the store it
    keeps it up until the other ``readers`` have too (bounded), so they can name the cause."""
    try:
        ctx.store.set(keys.ack(key, ctx.me.rank), b"")
    except Exception:  # noqa: BLE001 - the store is gone: the error says what we know
        return
    await_readers(ctx.store, key, [r for r in readers if r != ctx.me.rank], ctx.group)


def _mismatch_error(ctx: _Ctx, calls: List[Call]) -> CollectiveMismatchError:
    _acknowledge(ctx, ctx.prefix, [c.rank for c in calls])
    ordered = sorted(calls, key=lambda c: c.rank)
    if len({c.name for c in ordered}) > 1:
        kind = ("collectives" if any(c.name.startswith("torch.") for c in ordered)
                else "helpers")
        why = (f"the ranks called different {kind} (" + ", ".join(
            f"{c.who()}: {c.name}" for c in ordered) + f"): every rank must call the same "
            f"{kind} in the same order")
    else:
        differ = [k for k in ordered[0].agree if len({repr(c.agree.get(k)) for c in ordered}) > 1]
        why = "; ".join(
            f"the ranks disagree on {k} (" + ", ".join(f"{c.who()}: {c.agree.get(k)}" for c in ordered)
            + ")" for k in differ) + ": it must be the same on every rank"
    missing = _missing_ranks(calls, ctx.ws)
    lines = [f"debug mode: mismatched call #{ctx.seq} on {_group_name(ctx.group)}: {why}."]
    lines += _table(ordered)
    if missing:
        lines.append(f"  rank(s) {missing}: did not arrive (exited, or stuck elsewhere)")
    return CollectiveMismatchError("\n".join(lines), calls=_summary(ordered), missing=missing)


def _missing_error(ctx: _Ctx, calls: List[Call], dead: Dict[int, str]) -> CollectiveMismatchError:
    log, where = ctx.log, f"call #{ctx.seq} ({ctx.me.call()}) on {_group_name(ctx.group)}"
    missing = _missing_ranks(calls, ctx.ws)
    if dead:
        head = f"rank(s) {sorted(dead)} exited before reaching {where}, which the other ranks are in"
    else:
        head = (f"rank(s) {missing} did not reach {where} within {ctx.timeout:g} s of the last "
                "rank to arrive: they are stuck elsewhere, exited, or run without debug mode "
                f"({DEBUG_TIMEOUT_ENV_VAR} / enable_debug(timeout=) set this wait)")
    lines = [f"debug mode: {head}."]
    if log.first_depth and log.pending:
        block = log.pending[min(log.pending)].me
        lines[0] += (f" This rank is inside a {block.name} block it runs first (at {block.site}) "
                     "while the other ranks wait for that block to end: a collective inside it "
                     "can never complete; move the call out of the block")
    lines += _table(calls)
    last: Dict[int, Call] = {}
    if log.last_seq:
        try:
            last = {c.rank: c for c in _records(ctx, log.last_seq, missing)}
        except Exception:  # noqa: BLE001 - only for the message
            last = {}
    for rank in missing:
        state = f"exited: {dead[rank]}" if rank in dead else "not arrived"
        prev = last.get(rank)
        after = (f"; its last checked call was #{log.last_seq} {prev.call()} at {prev.site}" if prev
                 else "; it made no checked call before this one" if not log.last_seq else "")
        lines.append(f"  rank {rank}: {state}{after}")
    return CollectiveMismatchError("\n".join(lines), calls=_summary(calls), missing=missing)


def _read_abort(ctx: _Ctx, late: bool) -> CollectiveMismatchError:
    """The error a rank published when it gave up on this call."""
    key = f"{ctx.prefix}/abort"
    _, message, calls, missing = checked(records.read_mismatch, ctx.store.get(key), key)
    error = CollectiveMismatchError(message, calls, missing)
    _acknowledge(ctx, key, [r for r in range(ctx.ws) if r not in error.missing])
    if not late:
        return error
    me = ctx.me
    text = (f"debug mode: {me.who()} reached {me.call()} at {me.site} after another rank had "
            f"given up waiting for it; that rank reported:\n{error.args[0]}")
    return CollectiveMismatchError(text, calls=error.calls, missing=error.missing)


# --- debug mode's switches (DEBUG): :mod:`axolotl_dist.debug` is their public face -------------

#: ``(on, timeout, explicit, env_error)``: see :class:`.protocols_state.DebugState`.
Switches = Tuple[bool, Optional[float], bool, Optional[str]]


def switches() -> Switches:
    """Debug mode's switches as they are now (to restore them later with :func:`set_switches`)."""
    return DEBUG.on, DEBUG.timeout, DEBUG.explicit, DEBUG.env_error


def set_switches(on: bool, timeout: Optional[float], explicit: bool,
                 env_error: Optional[str]) -> None:
    """Set debug mode's switches (``enable_debug``, ``disable_debug``, ``debug_mode``)."""
    DEBUG.on, DEBUG.timeout = on, timeout
    DEBUG.explicit, DEBUG.env_error = explicit, env_error


def refresh_from_env() -> None:
    """Read ``AXOLOTL_DIST_DEBUG`` again unless a function call decided. A value that is not a
    switch turns checking on, to raise its error at the first helper call (not at import)."""
    if DEBUG.explicit:
        return
    DEBUG.env_error = None
    try:
        DEBUG.on = variables.kit_switch(DEBUG_ENV_VAR)
    except DistributedEnvError as exc:
        DEBUG.on, DEBUG.env_error = True, str(exc)
