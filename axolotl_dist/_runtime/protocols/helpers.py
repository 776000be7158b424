"""The wrapper every communicating helper wears: :func:`checked`.

Before a helper's body runs, the wrapper (cheap unless something is on):

* refuses a call the other ranks cannot join (inside a ``zero_first`` body this rank runs
  first, inside ``zero_only`` code: :mod:`.guards`);
* confirms the ``zero_first`` blocks this rank left unconfirmed (:func:`.zero_first.confirm_all`),
  or leaves that to the helper's first collective's wait on gloo (``confirm_in_wait``);
* records the call in flight on this thread and raises
  :class:`~axolotl_dist.errors.ThreadConflictError` when another thread is in a helper on the
  same group (:mod:`.threads`);
* while tracing, records the call as a span (:mod:`..base.recorder`);
* in debug mode, checks through the store that every rank is in the same helper with
  compatible arguments (:mod:`.crosscheck`).

The fast path (debug and tracing off, one thread) is a ``get_ident()``, a dict read, a tuple
and a dict write and delete (``benchmarks/debug.py`` measures it). Debug mode's switches live
on :data:`..base.state.STATE`; :mod:`axolotl_dist.debug` is their public face.
"""

from __future__ import annotations

import functools
import inspect
import threading
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, Optional, TypeVar, Union

from ..base import envvars
from ..base.callsite import call_site
from ..base.constants import DEBUG_TIMEOUT_ENV_VAR
from ..base.groups import Group, group_of
from ..base.state import STATE
from . import recorder as trace
from . import crosscheck as debug_check, guards, threads
from .zero_first import confirm_all
from ...errors import CollectiveMismatchError, DistributedEnvError

__all__ = ["checked", "debug_timeout", "first_rank_block", "tensor_signature"]

F = TypeVar("F", bound=Callable[..., Any])
GroupArg = Union[str, Callable[[Dict[str, Any]], Any]]
_NO_GROUP = object()
_get_ident = threading.get_ident


def debug_timeout() -> float:
    """The debug timeout in effect, in seconds."""
    if STATE.debug_timeout is not None:
        return STATE.debug_timeout
    return envvars.kit_seconds(DEBUG_TIMEOUT_ENV_VAR)


def checked(name: str, describe: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None,
            *, on_group: Optional[Callable[..., Any]] = None, group_arg: GroupArg = "group",
            waits: Optional[Callable[[Dict[str, Any]], bool]] = None,
            confirms: bool = True, confirm_in_wait: bool = False, refuse_in_scopes: bool = True,
            one_thread: bool = True, traced: bool = True) -> Callable[[F], F]:
    """Mark ``fn`` as a communicating helper (see the module docstring).

    :param name: the helper's public name, as shown in errors.
    :param describe: maps the bound arguments (defaults applied) to the values that must agree
        across ranks, e.g. ``{"src": 0, "tensor": "float32[4, 2]"}``; it must not raise.
    :param on_group: the helper's body on a process group: given, the wrapper resolves the
        call's group once (:func:`..base.groups.group_of`) and calls ``on_group(g, *args,
        **kwargs)`` with its :class:`~..base.groups.Group`, or, when there is none (one process
        without a process group), ``fn`` itself, which is then the helper's single-process
        behaviour: the one place where the kit takes that shortcut. Without it ``fn``
        resolves its own group.
    :param group_arg: the name of the process-group parameter, or a function of the bound
        arguments returning the group.
    :param waits: whether this rank waits for the others' records in debug mode (default:
        always). False for a rank the others wait for inside the helper (``zero_first``'s
        first ranks): it publishes its record and compares later, so nested blocks cannot
        deadlock the check.
    :param confirms: first confirm that every rank reached the ``zero_first`` blocks this rank
        ran first and left unconfirmed: the others must not be stuck in a block that does not
        pair when a collective needs them. False for the blocks, which settle their own.
    :param confirm_in_wait: on a CPU (gloo) group with debug mode off, confirm them inside
        the wait for the helper's first collective instead (:func:`.exchange.run`: the store
        read then overlaps the collective; a rank stuck in a block that does not pair keeps
        the collective from completing, so the mismatch is still found). Only for helpers
        whose every wait for other ranks on CPU is a collective run by that function.
    :param refuse_in_scopes: raise at once when called where the other ranks cannot join
        (:mod:`.guards`). False for the blocks.
    :param one_thread: raise :class:`~axolotl_dist.errors.ThreadConflictError` when another
        thread of this rank is in a helper on the same group (:mod:`.threads`). False for the
        blocks: they signal through the store and check their own numbering
        (:func:`.threads.enter_block`).
    :param traced: while tracing is on, record the call as a span (the outermost kit call of a
        thread only). False for the blocks, which record their body and wait themselves.
    """

    def decorate(fn: F) -> F:
        signature = inspect.signature(fn)
        find_group = _group_finder(signature, group_arg)
        grouped = on_group
        if grouped is None:
            body: Callable[..., Any] = fn
        else:
            def body(*args: Any, **kwargs: Any) -> Any:  # debug mode's path: resolve again
                g = group_of(find_group(args, kwargs), name)
                return fn(*args, **kwargs) if g is None else grouped(g, *args, **kwargs)

        def run(g: Optional[Group], args: tuple, kwargs: dict) -> Any:
            if STATE.debug_on:
                return _call_checked(body, signature, name, describe, group_arg, waits, args,
                                     kwargs)
            return grouped(g, *args, **kwargs) if grouped is not None else fn(*args, **kwargs)

        def traced_run(g: Optional[Group], args: tuple, kwargs: dict) -> Any:
            recorder = STATE.trace
            if recorder is None or not traced:
                return run(g, args, kwargs)
            if grouped is None:
                try:
                    g = group_of(find_group(args, kwargs), name)
                except Exception:  # noqa: BLE001 - the helper raises its own error
                    return run(g, args, kwargs)
            return trace.helper_span(recorder, name, g, call_site, lambda: run(g, args, kwargs),
                                     args, kwargs)

        # where the group argument is, for the fast path (a named parameter)
        gname = group_arg if isinstance(group_arg, str) and group_arg in signature.parameters \
            else None
        position = list(signature.parameters).index(gname) if gname is not None else -1

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            g = None
            if grouped is not None:
                if gname is None:
                    group = find_group(args, kwargs)
                elif gname in kwargs:
                    group = kwargs[gname]
                else:
                    group = args[position] if len(args) > position else None
                g = group_of(group, name)
            if STATE.guarded and refuse_in_scopes:
                _refuse(name, (signature, group_arg, args, kwargs),
                        lambda g: guards.check(name, g, lambda: str(call_site())))
            if grouped is not None and g is None and not STATE.debug_on:
                return fn(*args, **kwargs)  # one process: the helper's local body
            if confirms and STATE.unconfirmed:
                if not (confirm_in_wait and _confirmed_in_wait(g, find_group(args, kwargs), name)):
                    confirm_all()
            if not one_thread:
                if STATE.trace is not None:
                    return traced_run(g, args, kwargs)
                if not STATE.debug_on and grouped is None:
                    return fn(*args, **kwargs)
                return run(g, args, kwargs)
            me = _get_ident()
            calls = STATE.calls
            outer = calls.get(me)
            # recorded before the check: of two threads entering at once, at least one sees
            # the other (both may, and both raise; neither call has run)
            calls[me] = (name, (signature, group_arg, args, kwargs), outer)
            try:
                if len(calls) > 1:  # another thread is in a helper
                    _refuse(name, (signature, group_arg, args, kwargs),
                            lambda g: threads.check(name, g, _call_group))
                if STATE.trace is not None:
                    result = traced_run(g, args, kwargs)
                elif STATE.debug_on:
                    result = _call_checked(body, signature, name, describe, group_arg, waits,
                                           args, kwargs)
                elif grouped is not None:
                    result = grouped(g, *args, **kwargs)
                else:
                    result = fn(*args, **kwargs)
            except BaseException:
                STATE.crossed.pop(me, None)  # it raised anyway
                raise
            finally:
                if outer is None:
                    calls.pop(me, None)
                else:
                    calls[me] = outer
            if STATE.crossed and me in STATE.crossed:
                raise threads.crossed_error(me)
            return result

        wrapper.__wrapped__ = body  # type: ignore[attr-defined]
        # frames of the wrapper carry the helper's name (where-reports, profiles, tracebacks
        # say "barrier", not "wrapper"; the body on a group has another name)
        code = wrapper.__code__
        wrapper.__code__ = code.replace(co_name=fn.__name__, **(
            {"co_qualname": fn.__qualname__} if hasattr(code, "co_qualname") else {}))
        return wrapper  # type: ignore[return-value]

    return decorate


def _confirmed_in_wait(g: Optional[Group], group: Any, name: str) -> bool:
    """Whether a ``confirm_in_wait`` helper on ``g`` (or, not resolved yet, ``group``) leaves
    the unconfirmed blocks to its first collective's wait (see :func:`checked`): gloo groups,
    debug mode off."""
    if STATE.debug_on:
        return False  # the debug check would wait for a rank stuck in the block first
    if g is None:
        try:
            g = group_of(group, name)
        except Exception:  # noqa: BLE001 - not a usable group: the helper raises its own error
            return False
    return g is not None and g.cpu


def _group_finder(signature: inspect.Signature, group_arg: GroupArg
                  ) -> Callable[[tuple, dict], Any]:
    """A fast ``(args, kwargs) -> group`` for a helper: the group parameter by keyword or
    position without binding every argument, else by binding."""
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
        group = _group_of_call(signature, group_arg, args, kwargs)
        return None if group is _NO_GROUP else group
    return bind


def _group_of_call(signature: inspect.Signature, group_arg: GroupArg, args: tuple,
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


def _call_group(name: str, call: tuple) -> Optional[Group]:
    """The :class:`Group` of a recorded call (``(signature, group_arg, args, kwargs)``)."""
    group = _group_of_call(*call)
    if group is _NO_GROUP:
        raise TypeError("not a group")
    return group_of(group, name)


def _refuse(name: str, call: tuple, check: Callable[[Optional[Group]], None]) -> None:
    """Run ``check`` (:func:`.guards.check` or :func:`.threads.check`) on the group of the
    call ``(signature, group_arg, args, kwargs)``; its error shows the user's frames."""
    group = _group_of_call(*call)
    if group is _NO_GROUP:
        return
    try:
        check(group_of(group, name))
    except CollectiveMismatchError as exc:
        raise exc.with_traceback(None)  # the user's frames matter, not the check's


def _call_checked(fn: Callable[..., Any], signature: inspect.Signature, name: str,
                  describe: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]],
                  group_arg: GroupArg, waits: Optional[Callable[[Dict[str, Any]], bool]],
                  args: tuple, kwargs: dict) -> Any:
    inside = STATE.inside
    if inside.helper:  # a helper called by a helper: checked by the outer one
        return fn(*args, **kwargs)
    if STATE.debug_env_error is not None:
        raise DistributedEnvError(STATE.debug_env_error)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return fn(*args, **kwargs)  # let the helper raise its own TypeError
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    group = group_arg(arguments) if callable(group_arg) else arguments.get(group_arg)
    try:
        g = group_of(group, name)
    except Exception:  # noqa: BLE001 - no usable group: the helper raises its own error
        g = None
    if g is not None and g.size > 1:
        agree = describe(arguments) if describe is not None else {}
        try:
            debug_check.check(name, agree, g, call_site().with_code(),
                              wait=waits is None or waits(arguments), timeout=debug_timeout())
        except CollectiveMismatchError as exc:
            raise exc.with_traceback(None)  # the user's frames matter, not the check's
    inside.helper = True
    try:
        return fn(*args, **kwargs)
    finally:
        inside.helper = False


@contextmanager
def first_rank_block(g: Group) -> Iterator[None]:
    """Wrap the body of a ``zero_first`` block on a rank that goes first (no-op when off)."""
    if not STATE.debug_on or g.size <= 1:
        yield
        return
    with debug_check.first_rank_block(g, debug_timeout()):
        yield


def tensor_signature(value: Any) -> str:
    """``"float32[4, 2]"`` for a tensor; the type name for anything else (debug mode's
    description of an argument that must agree across ranks)."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')}{list(value.shape)}"
    return type(value).__name__
