"""Debug mode: catch ranks that call different helpers before the collective hangs or mixes data.

Turn it on with ``AXOLOTL_DIST_DEBUG=1`` in the environment (read at import and again by
:func:`~axolotl_dist.init_distributed`), or with :func:`enable_debug` / ``with debug_mode():``.
While it is on, every communicating helper of the kit (the tensor collectives, the value
helpers, :func:`~axolotl_dist.zero_first`, :func:`~axolotl_dist.do_n_at_a_time`, barriers)
first checks, through the process group's c10d store and not through a collective, that every
rank of the group is in the *same helper* at the *same call number* with *compatible
arguments* (``src``/``dst``, the reduction, tensor shapes and dtypes where they must agree):

* on a mismatch every rank raises :class:`~axolotl_dist.errors.CollectiveMismatchError` at
  once, listing rank by rank which helper it called, with which arguments, from which file and
  line;
* a rank that does not arrive is named after the debug timeout (``AXOLOTL_DIST_DEBUG_TIMEOUT``
  seconds without a new rank arriving, default 5), or within about 3 s if its process is gone,
  together with the last checked call it made. Like ``torch.distributed.monitored_barrier``,
  but for every helper, and independent of the group's collective timeout.

A check costs a few store round trips (about 0.1-0.5 ms on one host), so keep debug mode for
hunting bugs. Off, the only cost is one global lookup per helper call (``benchmarks/debug.py``).
Calls made by a helper inside another (``synchronize_flag`` uses ``synchronize_value``) are
checked once, under the outer name.
"""

from __future__ import annotations

import functools
import inspect
import linecache
import os
import pickle
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence, TypeVar, Union

from .errors import AxolotlDistError, CollectiveMismatchError, DistributedConfigError, DistributedEnvError, RankFailedError

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = [
    "DEBUG_ENV_VAR",
    "DEBUG_TIMEOUT_ENV_VAR",
    "DEFAULT_DEBUG_TIMEOUT",
    "enable_debug",
    "disable_debug",
    "is_debug_enabled",
    "debug_mode",
    "checked",
]

DEBUG_ENV_VAR = "AXOLOTL_DIST_DEBUG"
DEBUG_TIMEOUT_ENV_VAR = "AXOLOTL_DIST_DEBUG_TIMEOUT"
#: Seconds a rank waits, after the last rank to arrive, before naming the ranks still missing.
DEFAULT_DEBUG_TIMEOUT = 5.0

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep

F = TypeVar("F", bound=Callable[..., Any])

# --- switching it on and off ------------------------------------------------------------------

#: The one flag the helpers read on every call; True also while a bad env value waits to raise.
_ENABLED = False
_timeout: Optional[float] = None  # set by enable_debug(timeout=...); None: env or default
_explicit = False  # set by a function call: the env no longer decides
_env_error: Optional[str] = None


def _parse_env() -> None:
    global _ENABLED, _env_error
    raw = os.environ.get(DEBUG_ENV_VAR, "")
    value = raw.strip().lower()
    _env_error = None
    if value in _TRUE:
        _ENABLED = True
    elif value in _FALSE:
        _ENABLED = False
    else:  # raise on the first helper call, not at import
        _ENABLED = True
        _env_error = (f"{DEBUG_ENV_VAR}={raw!r} is not a switch: set {DEBUG_ENV_VAR}=1 to turn "
                      f"debug mode on or {DEBUG_ENV_VAR}=0 (or unset it) to leave it off")


def refresh_from_env() -> None:
    """Re-read :data:`DEBUG_ENV_VAR` unless :func:`enable_debug`/:func:`disable_debug` decided."""
    if not _explicit:
        _parse_env()


def enable_debug(timeout: Optional[float] = None) -> None:
    """Turn debug mode on in this process (every rank must turn it on, like the env var).

    :param timeout: seconds to wait, after the last rank arrived, for ranks still missing
        (default: ``AXOLOTL_DIST_DEBUG_TIMEOUT`` or 5).
    """
    global _ENABLED, _timeout, _explicit, _env_error
    if timeout is not None:
        _check_timeout(timeout, "enable_debug(timeout=...)")
    _ENABLED, _timeout, _explicit, _env_error = True, timeout, True, None


def disable_debug() -> None:
    """Turn debug mode off in this process (whatever the env var says)."""
    global _ENABLED, _timeout, _explicit, _env_error
    _ENABLED, _timeout, _explicit, _env_error = False, None, True, None


def is_debug_enabled() -> bool:
    """Whether helpers check their calls across ranks (see :mod:`axolotl_dist.debug`)."""
    return _ENABLED


@contextmanager
def debug_mode(timeout: Optional[float] = None) -> Iterator[None]:
    """Debug mode on inside the block, restored to its previous state after it."""
    saved = (_ENABLED, _timeout, _explicit, _env_error)
    enable_debug(timeout)
    try:
        yield
    finally:
        _restore(saved)


def _restore(saved: tuple) -> None:
    global _ENABLED, _timeout, _explicit, _env_error
    _ENABLED, _timeout, _explicit, _env_error = saved


def _check_timeout(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise DistributedConfigError(f"{name}={value!r} must be a positive number of seconds")
    return float(value)


def debug_timeout() -> float:
    """The debug timeout in effect, in seconds."""
    if _timeout is not None:
        return _timeout
    raw = os.environ.get(DEBUG_TIMEOUT_ENV_VAR)
    if raw is None or raw.strip() == "":
        return DEFAULT_DEBUG_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise DistributedEnvError(
            f"{DEBUG_TIMEOUT_ENV_VAR}={raw!r} must be a positive number of seconds, e.g. "
            f"{DEBUG_TIMEOUT_ENV_VAR}={DEFAULT_DEBUG_TIMEOUT:g}")
    return value


_parse_env()

# --- the decorator the helpers wear -------------------------------------------------------------

_TLS = threading.local()


def checked(name: str, describe: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None,
            *, group_arg: Union[str, Callable[[Dict[str, Any]], Any]] = "group") -> Callable[[F], F]:
    """Mark ``fn`` as a communicating helper that debug mode checks before it runs.

    :param name: the helper's public name, as shown in errors.
    :param describe: maps the bound arguments (defaults applied) to the values that must agree
        across ranks, e.g. ``{"src": 0, "tensor": "float32[4, 2]"}``; it must not raise.
    :param group_arg: the name of the process-group parameter, or a function of the bound
        arguments returning the group.
    """

    def decorate(fn: F) -> F:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not _ENABLED:
                return fn(*args, **kwargs)
            return _call_checked(fn, signature, name, describe, group_arg, args, kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def _call_checked(fn: Callable[..., Any], signature: inspect.Signature, name: str,
                  describe: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]],
                  group_arg: Union[str, Callable[[Dict[str, Any]], Any]],
                  args: tuple, kwargs: dict) -> Any:
    if getattr(_TLS, "inside", False):  # a helper called by a helper: checked by the outer one
        return fn(*args, **kwargs)
    if _env_error is not None:
        raise DistributedEnvError(_env_error)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return fn(*args, **kwargs)  # let the helper raise its own TypeError
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    group = group_arg(arguments) if callable(group_arg) else arguments.get(group_arg)
    if _communicates(group):
        agree = describe(arguments) if describe is not None else {}
        try:
            _check(name, agree, group, _call_site())
        except CollectiveMismatchError as exc:
            raise exc.with_traceback(None)  # the user's frames matter, not the check's
    _TLS.inside = True
    try:
        return fn(*args, **kwargs)
    finally:
        _TLS.inside = False


def _communicates(group: Optional["ProcessGroup"]) -> bool:
    from .ranks import get_world_size, is_initialized

    return is_initialized() and get_world_size(group) > 1


def _call_site() -> str:
    """``file:line in function`` of the innermost frame outside this package."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
    if frame is None:  # pragma: no cover - called from inside the package only
        return "<unknown>"
    path = frame.f_code.co_filename
    try:
        rel = os.path.relpath(path)
        path = rel if not rel.startswith("..") else path
    except ValueError:  # pragma: no cover - another drive on Windows
        pass
    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    site = f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
    return f"{site}: {code}" if code else site


# --- describing arguments (used by the helpers' ``describe`` functions) -----------------------

def tensor_signature(value: Any) -> str:
    """``"float32[4, 2]"`` for a tensor; the type name for anything else."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')}{list(value.shape)}"
    return type(value).__name__


def reduce_name(op: Any) -> str:
    """The normalised reduction name, or the repr of an invalid one (never raises)."""
    from .collectives import as_reduce_op

    try:
        return as_reduce_op(op)
    except Exception:  # noqa: BLE001 - the helper itself reports bad ops
        return repr(op)


# --- the check ------------------------------------------------------------------------------

_ABORT = 1 << 40  # added to a call's arrival counter when a rank gave up on it


class _Call:
    """One rank's record of one checked call, as stored for the others to read."""

    __slots__ = ("rank", "global_rank", "name", "agree", "site", "pid", "host")

    def __init__(self, rank: int, global_rank: int, name: str, agree: Dict[str, Any], site: str) -> None:
        self.rank, self.global_rank, self.name = rank, global_rank, name
        self.agree = {k: (v if isinstance(v, (int, float, str, bool, type(None))) else repr(v))
                      for k, v in agree.items()}
        self.site = site
        self.pid, self.host = os.getpid(), _signals_host()

    def __getstate__(self) -> tuple:
        return tuple(getattr(self, s) for s in self.__slots__)

    def __setstate__(self, state: tuple) -> None:
        for slot, value in zip(self.__slots__, state):
            setattr(self, slot, value)

    def call(self) -> str:
        return f"{self.name}(" + ", ".join(f"{k}={v}" for k, v in self.agree.items()) + ")"

    def who(self) -> str:
        return f"rank {self.rank}" + (f" (global {self.global_rank})" if self.global_rank != self.rank else "")


def _signals_host() -> str:
    from ._signals import HOST

    return HOST


class _GroupLog:
    """Per-group memory of this rank's checks: arrival slots to delete, the last call list."""

    __slots__ = ("slots", "last", "__weakref__")

    def __init__(self) -> None:
        self.slots: Dict[int, int] = {}
        self.last: List[_Call] = []


_LOGS: "weakref.WeakKeyDictionary[Any, _GroupLog]" = weakref.WeakKeyDictionary()


def _check(name: str, agree: Dict[str, Any], group: Optional["ProcessGroup"], site: str) -> None:
    import torch.distributed as dist

    from . import _signals
    from .ranks import get_rank, get_world_size

    _signals.start_heartbeat()
    rank, ws = get_rank(group), get_world_size(group)
    me = _Call(rank, rank if group is None else dist.get_global_rank(group, rank), name, agree, site)
    key = group if group is not None else dist.distributed_c10d._world.default_pg
    log = _LOGS.get(key)
    if log is None:
        log = _LOGS[key] = _GroupLog()
    seq = _signals.next_sequence(group, "debug")
    calls: List[_Call] = []
    try:
        _exchange(_signals.group_store(group), seq, me, calls, ws, group, log)
    except AxolotlDistError:
        raise
    except Exception as exc:  # the store went away (its host exited) or refused us
        missing = _missing_ranks(calls, ws) if calls else []
        raise CollectiveMismatchError(
            f"debug mode: lost the c10d store while checking call #{seq} ({me.call()}) on "
            f"{_group_name(group)} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
            "the process hosting the store (rank 0, or the launcher) probably exited"
            + (f"; rank(s) {missing} had not arrived" if missing else ""),
            calls=_summary(calls), missing=missing) from exc


def _exchange(store: Any, seq: int, me: _Call, calls: List[_Call], ws: int,
              group: Optional["ProcessGroup"], log: _GroupLog) -> None:
    """Publish this rank's record of call ``seq``, collect everyone's, tidy up older calls."""
    prefix = f"axd/dbg/{seq}"
    slot = store.add(f"{prefix}/n", 1)
    if slot > _ABORT:
        raise _read_abort(store, prefix, me)
    store.set(f"{prefix}/c/{slot}", pickle.dumps(me))
    log.slots[seq] = slot
    _wait_all(store, prefix, seq, me, calls, ws, group, log)
    log.last = list(calls)
    old = log.slots.pop(seq - 2, None)  # every rank has read call seq-2: drop my record of it
    if old is not None:
        store.delete_key(f"axd/dbg/{seq - 2}/c/{old}")
        if me.rank == 0:
            store.delete_key(f"axd/dbg/{seq - 2}/n")


def _wait_all(store: Any, prefix: str, seq: int, me: _Call, calls: List[_Call], ws: int,
              group: Optional["ProcessGroup"], log: _GroupLog) -> None:
    """Collect every rank's record of call ``seq`` into ``calls``; raise on any mismatch."""
    from . import _signals

    timeout = debug_timeout()
    watcher = _signals.Watch(_signals.group_store())
    last_progress = time.monotonic()
    next_liveness = last_progress + _signals.HEARTBEAT_INTERVAL
    spins, delay = 0, 0.0002
    mismatched = False  # once seen, keep collecting (bounded) so the error lists every rank
    while True:
        arrived = store.add(f"{prefix}/n", 0)
        if arrived > _ABORT:
            if mismatched:
                raise _mismatch_error(seq, calls, ws, group)
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
            if dead and mismatched:
                raise _mismatch_error(seq, calls, ws, group)
            if dead:
                _abort(store, prefix, _missing_error(seq, me, calls, ws, group, log, dead, timeout))
        if now - last_progress >= timeout:
            if mismatched:
                raise _mismatch_error(seq, calls, ws, group)
            _abort(store, prefix, _missing_error(seq, me, calls, ws, group, log, {}, timeout))
        if spins < 50:
            spins += 1
        else:
            time.sleep(delay)
            delay = min(delay * 2, 0.02)


def _missing_ranks(calls: Sequence[_Call], ws: int) -> List[int]:
    present = {c.rank for c in calls}
    return [r for r in range(ws) if r not in present]


def _global_rank(group: Optional["ProcessGroup"], rank: int) -> int:
    import torch.distributed as dist

    return rank if group is None else dist.get_global_rank(group, rank)


def _dead_ranks(watcher: "Any", calls: Sequence[_Call], ws: int, group: Optional["ProcessGroup"],
                now: float) -> Dict[int, str]:
    """Missing group ranks whose process is known to be gone, with why."""
    dead: Dict[int, str] = {}
    for rank in _missing_ranks(calls, ws):
        try:
            watcher.check([_global_rank(group, rank)], now)
        except RankFailedError as exc:
            dead[rank] = exc.exc_message
    return dead


def _disagree(calls: Sequence[_Call]) -> bool:
    first = calls[0]
    return any(c.name != first.name or c.agree != first.agree for c in calls[1:])


def _table(calls: Sequence[_Call]) -> List[str]:
    return [f"  {c.who()}: {c.call()}\n      at {c.site}" for c in sorted(calls, key=lambda c: c.rank)]


def _group_name(group: Optional["ProcessGroup"]) -> str:
    if group is None:
        return "the default group"
    return f"group {getattr(group, 'group_name', '?')!s}"


def _mismatch_error(seq: int, calls: List[_Call], ws: int,
                    group: Optional["ProcessGroup"]) -> CollectiveMismatchError:
    ordered = sorted(calls, key=lambda c: c.rank)
    names = {c.name for c in ordered}
    if len(names) > 1:
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


def _missing_error(seq: int, me: _Call, calls: List[_Call], ws: int, group: Optional["ProcessGroup"],
                   log: _GroupLog, dead: Dict[int, str], timeout: float) -> CollectiveMismatchError:
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
    lines += _table(calls)
    for rank in missing:
        state = f"exited: {dead[rank]}" if rank in dead else "not arrived"
        prev = last.get(rank)
        after = (f"; its last checked call was #{seq - 1} {prev.call()} at {prev.site}" if prev
                 else "; it made no checked call before this one")
        lines.append(f"  rank {rank}: {state}{after}")
    return CollectiveMismatchError("\n".join(lines), calls=_summary(calls), missing=missing)


def _summary(calls: Sequence[_Call]) -> Dict[int, str]:
    return {c.rank: f"{c.call()} at {c.site}" for c in sorted(calls, key=lambda c: c.rank)}


def _abort(store: Any, prefix: str, error: CollectiveMismatchError) -> None:
    """Publish ``error`` for ranks that arrive late at this call, then raise it."""
    try:
        store.set(f"{prefix}/abort", pickle.dumps(error))
        store.add(f"{prefix}/n", _ABORT)
    except Exception:  # noqa: BLE001 - the store may be gone with the missing rank
        pass
    raise error


def _read_abort(store: Any, prefix: str, me: _Call) -> CollectiveMismatchError:
    """The error another rank published when it gave up on this call (we came too late)."""
    error = pickle.loads(store.get(f"{prefix}/abort"))
    if not isinstance(error, CollectiveMismatchError):  # pragma: no cover - defensive
        return CollectiveMismatchError(str(error))
    text = (f"debug mode: {me.who()} reached {me.call()} at {me.site} after another rank had "
            f"given up waiting for it; that rank reported:\n{error.args[0]}")
    return CollectiveMismatchError(text, calls=error.calls, missing=error.missing)
