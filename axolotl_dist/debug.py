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
  seconds without a new rank arriving, default 5), or within about 4 s if its process is gone,
  together with the last checked call it made. Like ``torch.distributed.monitored_barrier``,
  but for every helper, and independent of the group's collective timeout.

A check costs a few store round trips per rank at any world size (about 0.5-0.8 ms per call on
one host), so keep debug mode for hunting bugs. Off, the only cost is one wrapper call and one
global lookup per helper call, about 0.1-0.2 us (``benchmarks/debug.py``).
Calls made by a helper inside another (``synchronize_flag`` uses ``synchronize_value``) are
checked once, under the outer name. The ranks that go first in ``zero_first`` do not wait at
the check (the others wait for them, and blocks nest): they compare when their outermost block
ends. The store protocol is in :mod:`axolotl_dist._runtime.debug_check`.
"""

from __future__ import annotations

import functools
import inspect
import threading
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, Optional, TypeVar, Union

from ._runtime import constants as _constants, debug_check as _debug_check
from ._runtime import envvars as _envvars, groups as _groups
from ._runtime import guards as _guards, threads as _threads, trace as _trace
from ._runtime.blocks import confirm_all
from ._runtime.callsite import call_site
from ._runtime.state import STATE as _STATE
from .errors import CollectiveMismatchError, DistributedConfigError, DistributedEnvError

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
    "checked_calls",
    "checked",
]

#: The switch; seconds a rank waits, after the last rank to arrive, before naming the ranks
#: still missing (names and defaults of every kit variable: ``_runtime/constants.py``).
DEBUG_ENV_VAR = _constants.DEBUG_ENV_VAR
DEBUG_TIMEOUT_ENV_VAR = _constants.DEBUG_TIMEOUT_ENV_VAR
DEFAULT_DEBUG_TIMEOUT = _constants.DEFAULT_DEBUG_TIMEOUT

F = TypeVar("F", bound=Callable[..., Any])

# --- switching it on and off ------------------------------------------------------------------

# debug mode's switches live in the process state (:mod:`axolotl_dist._runtime.state`)


def _parse_env() -> None:
    _STATE.debug_env_error = None
    try:
        _STATE.debug_on = _envvars.kit_switch(DEBUG_ENV_VAR)
    except DistributedEnvError as exc:  # raise on the first helper call, not at import
        _STATE.debug_on, _STATE.debug_env_error = True, str(exc)


def refresh_from_env() -> None:
    """Re-read :data:`DEBUG_ENV_VAR` unless :func:`enable_debug`/:func:`disable_debug` decided."""
    if not _STATE.debug_explicit:
        _parse_env()


def _set(on: bool, timeout: Optional[float], explicit: bool, env_error: Optional[str]) -> None:
    _STATE.debug_on, _STATE.debug_timeout = on, timeout
    _STATE.debug_explicit, _STATE.debug_env_error = explicit, env_error


def enable_debug(timeout: Optional[float] = None) -> None:
    """Turn debug mode on in this process (every rank must turn it on, like the env var).

    :param timeout: seconds to wait, after the last rank arrived, for ranks still missing
        (default: ``AXOLOTL_DIST_DEBUG_TIMEOUT`` or 5).
    """
    if timeout is not None:
        _check_timeout(timeout, "enable_debug(timeout=...)")
    _set(True, timeout, True, None)


def disable_debug() -> None:
    """Turn debug mode off in this process (whatever the env var says)."""
    _set(False, None, True, None)


def is_debug_enabled() -> bool:
    """Whether helpers check their calls across ranks (see :mod:`axolotl_dist.debug`).

    Raises the :class:`~axolotl_dist.errors.DistributedEnvError` every helper raises while
    ``AXOLOTL_DIST_DEBUG`` holds a value that is not a switch (unless :func:`enable_debug` /
    :func:`disable_debug` decided): both readers of the switch agree."""
    if _STATE.debug_env_error is not None:
        raise DistributedEnvError(_STATE.debug_env_error)
    return _STATE.debug_on


def checked_calls(group: Optional["ProcessGroup"] = None) -> int:
    """How many calls debug mode has checked on ``group`` (default: the default group) in this
    process so far; 0 without a process group. Every rank checks the same calls, so the counts
    agree across ranks; a helper that calls another helper is checked once."""
    state = _groups.state_of(group)
    return 0 if state is None else state.seq.get(_debug_check.SEQUENCE_KIND, 0)


@contextmanager
def debug_mode(timeout: Optional[float] = None) -> Iterator[None]:
    """Debug mode on inside the block, restored to its previous state after it."""
    saved = (_STATE.debug_on, _STATE.debug_timeout, _STATE.debug_explicit, _STATE.debug_env_error)
    enable_debug(timeout)
    try:
        yield
    finally:
        _set(*saved)


def _check_timeout(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise DistributedConfigError(f"{name}={value!r} must be a positive number of seconds")
    return float(value)


def debug_timeout() -> float:
    """The debug timeout in effect, in seconds."""
    if _STATE.debug_timeout is not None:
        return _STATE.debug_timeout
    return _envvars.kit_seconds(DEBUG_TIMEOUT_ENV_VAR)


_parse_env()

# --- the decorator the helpers wear -------------------------------------------------------------

def checked(name: str, describe: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None,
            *, group_arg: Union[str, Callable[[Dict[str, Any]], Any]] = "group",
            waits: Optional[Callable[[Dict[str, Any]], bool]] = None,
            confirms: bool = True, confirm_in_wait: bool = False, refuse_in_scopes: bool = True,
            one_thread: bool = True, traced: bool = True) -> Callable[[F], F]:
    """Mark ``fn`` as a communicating helper that debug mode checks before it runs.

    :param name: the helper's public name, as shown in errors.
    :param describe: maps the bound arguments (defaults applied) to the values that must agree
        across ranks, e.g. ``{"src": 0, "tensor": "float32[4, 2]"}``; it must not raise.
    :param group_arg: the name of the process-group parameter, or a function of the bound
        arguments returning the group.
    :param waits: whether this rank waits for the others' records (default: always). False
        for a rank the others wait for inside the helper (``zero_first``'s first ranks): it
        publishes its record and compares later, so nested blocks cannot deadlock the check.
    :param confirms: first confirm that every rank reached the ``zero_first`` blocks this rank
        ran first and left unconfirmed (see :func:`axolotl_dist._runtime.blocks.settle`): the
        others must not be stuck in a block that does not pair when a collective needs them.
        False for ``zero_first`` itself, which settles its own.
    :param confirm_in_wait: on a CPU (gloo) group with debug mode off, confirm them inside
        the wait for the helper's first collective instead of before the call
        (:func:`axolotl_dist._runtime.works.wait`: the store read then overlaps the
        collective's own latency; a rank stuck in a block that does not pair keeps the
        collective from completing, so the mismatch is still found). Only for helpers whose
        every wait for other ranks on CPU is a collective's wait through that function.
    :param refuse_in_scopes: raise at once when called where the other ranks cannot join
        (inside a ``zero_first`` body this rank runs first, inside ``zero_only`` code: see
        :mod:`axolotl_dist._runtime.guards`). False for ``zero_first``.
    :param one_thread: raise :class:`~axolotl_dist.errors.ThreadConflictError` when another
        thread of this rank is in a helper on the same group (see
        :mod:`axolotl_dist._runtime.threads`). False for the ordering blocks: they signal
        through the store, not the group's collectives, and check their own numbering
        (:func:`axolotl_dist._runtime.threads.enter_block`).
    :param traced: while tracing is on (:mod:`axolotl_dist.tracing`), record the call as a span
        (the outermost kit call of a thread only). False for ``zero_first``, whose block records
        its body and its wait itself.
    """

    def decorate(fn: F) -> F:
        signature = inspect.signature(fn)
        find_group = _group_finder(signature, group_arg)

        def run(args: tuple, kwargs: dict) -> Any:
            if not _STATE.debug_on:
                return fn(*args, **kwargs)
            return _call_checked(fn, signature, name, describe, group_arg, waits, args, kwargs)

        def traced_run(args: tuple, kwargs: dict) -> Any:
            recorder = _STATE.trace
            if recorder is None or not traced:
                return run(args, kwargs)
            return _trace.helper_span(recorder, name, find_group(args, kwargs), call_site,
                                      lambda: run(args, kwargs), args, kwargs)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if _STATE.guarded and refuse_in_scopes:
                _refuse_in_scopes(name, signature, group_arg, args, kwargs)
            if confirms and _STATE.unconfirmed:
                if not (confirm_in_wait and _confirmed_in_wait(find_group(args, kwargs))):
                    confirm_all()
            if not one_thread:
                if _STATE.trace is not None:
                    return traced_run(args, kwargs)
                if not _STATE.debug_on:
                    return fn(*args, **kwargs)
                return _call_checked(fn, signature, name, describe, group_arg, waits, args, kwargs)
            me = _get_ident()
            calls = _STATE.calls
            outer = calls.get(me)
            # recorded before the check: of two threads entering at once, at least one sees
            # the other (both may, and both raise; neither call has run)
            calls[me] = (name, (signature, group_arg, args, kwargs), outer)
            try:
                if len(calls) > 1:  # another thread is in a helper
                    _check_threads(name, signature, group_arg, args, kwargs)
                if _STATE.trace is not None:
                    result = traced_run(args, kwargs)
                elif not _STATE.debug_on:
                    result = fn(*args, **kwargs)
                else:
                    result = _call_checked(fn, signature, name, describe, group_arg, waits, args,
                                           kwargs)
            except BaseException:
                _STATE.crossed.pop(me, None)  # it raised anyway
                raise
            finally:
                if outer is None:
                    calls.pop(me, None)
                else:
                    calls[me] = outer
            if _STATE.crossed and me in _STATE.crossed:
                raise _threads.crossed_error(me)
            return result

        return wrapper  # type: ignore[return-value]

    return decorate


_get_ident = threading.get_ident


def _confirmed_in_wait(group: Any) -> bool:
    """Whether a ``confirm_in_wait`` helper on ``group`` leaves the unconfirmed blocks to its
    first collective's wait (see :func:`checked`): gloo groups, debug mode off."""
    if _STATE.debug_on:
        return False  # the debug check would wait for a rank stuck in the block first
    try:
        return _groups.is_cpu(group)
    except Exception:  # noqa: BLE001 - not a usable group: the helper raises its own error
        return False
_NO_GROUP = object()
GroupArg = Union[str, Callable[[Dict[str, Any]], Any]]


def _group_finder(signature: inspect.Signature, group_arg: GroupArg
                  ) -> Callable[[tuple, dict], Any]:
    """A fast ``(args, kwargs) -> group`` for a helper (for its trace span): the group
    parameter by keyword or position without binding every argument, else by binding."""
    if isinstance(group_arg, str) and group_arg in signature.parameters:
        names = list(signature.parameters)
        position = names.index(group_arg)
        default = signature.parameters[group_arg].default
        default = None if default is inspect.Parameter.empty else default

        def find(args: tuple, kwargs: dict) -> Any:
            if group_arg in kwargs:
                return kwargs[group_arg]
            return args[position] if len(args) > position else default
        return find

    def bind(args: tuple, kwargs: dict) -> Any:
        group = _group_of(signature, group_arg, args, kwargs)
        return None if group is _NO_GROUP else group
    return bind


def _group_of(signature: inspect.Signature, group_arg: GroupArg, args: tuple,
              kwargs: dict) -> Any:
    """The group a helper call names (None: the default group), or ``_NO_GROUP`` if the
    arguments do not bind (the helper raises its own TypeError)."""
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return _NO_GROUP
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    return group_arg(arguments) if callable(group_arg) else arguments.get(group_arg)


def _refuse_in_scopes(name: str, signature: inspect.Signature, group_arg: GroupArg, args: tuple,
                      kwargs: dict) -> None:
    """Raise if ``name`` is called where the other ranks of its group cannot join it."""
    group = _group_of(signature, group_arg, args, kwargs)
    if group is _NO_GROUP:
        return
    try:
        _guards.check(name, group, lambda: str(call_site()))
    except CollectiveMismatchError as exc:
        raise exc.with_traceback(None)  # the user's frames matter, not the check's


def _check_threads(name: str, signature: inspect.Signature, group_arg: GroupArg, args: tuple,
                   kwargs: dict) -> None:
    """Raise if another thread is in a helper on this call's group."""
    group = _group_of(signature, group_arg, args, kwargs)
    if group is _NO_GROUP:
        return
    try:
        _threads.check(name, group, _group_of)
    except CollectiveMismatchError as exc:
        raise exc.with_traceback(None)


def _call_checked(fn: Callable[..., Any], signature: inspect.Signature, name: str,
                  describe: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]],
                  group_arg: Union[str, Callable[[Dict[str, Any]], Any]],
                  waits: Optional[Callable[[Dict[str, Any]], bool]], args: tuple, kwargs: dict) -> Any:
    inside = _STATE.inside
    if inside.helper:  # a helper called by a helper: checked by the outer one
        return fn(*args, **kwargs)
    if _STATE.debug_env_error is not None:
        raise DistributedEnvError(_STATE.debug_env_error)
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
            _debug_check.check(name, agree, group, _call_site(),
                               wait=waits is None or waits(arguments), timeout=debug_timeout())
        except CollectiveMismatchError as exc:
            raise exc.with_traceback(None)  # the user's frames matter, not the check's
    inside.helper = True
    try:
        return fn(*args, **kwargs)
    finally:
        inside.helper = False


def _communicates(group: Optional["ProcessGroup"]) -> bool:
    from .ranks import get_world_size, is_initialized

    return is_initialized() and get_world_size(group) > 1


def _call_site() -> str:
    """``file:line in function: code`` of the innermost frame outside this package."""
    return call_site().with_code()


@contextmanager
def first_rank_block(group: Optional["ProcessGroup"]) -> Iterator[None]:
    """Wrap the body of a ``zero_first`` block on a rank that goes first (no-op when off)."""
    if not _STATE.debug_on or not _communicates(group):
        yield
        return
    with _debug_check.first_rank_block(group, debug_timeout()):
        yield


# --- describing arguments (used by the helpers' ``describe`` functions) -----------------------

def tensor_signature(value: Any) -> str:
    """``"float32[4, 2]"`` for a tensor; the type name for anything else."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')}{list(value.shape)}"
    return type(value).__name__


