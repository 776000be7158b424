"""The decorators every communicating kit call wears, one per kind of call.

* :func:`collective`: a helper whose body runs on the call's process group. The decorated
  function takes the kit's :class:`~..base.groups.Group` (None for one process without a
  process group) before its public parameters; the decorator gives the public function, whose
  signature lacks it. It registers the helper's header code (:mod:`.exchange`) and how its
  ranks synchronize (:mod:`.timeline`) where it is decorated.
* :func:`block`: ``zero_first``'s debug-mode check (``zero_first`` signals through the store and
  settles its own blocks; it has no wrapper while debug mode is off).
* :func:`rounds`: ``do_n_at_a_time``, a block that records its own waits.
* :func:`call`: any other call that communicates (``shared_map``, ``build_world_mesh``, the
  sharded tensors' collectives): it resolves its own group.

Around the body, every kind does what its :class:`Kind` says (cheap unless something is on):

* refuses a call the other ranks cannot join (inside a ``zero_first`` body this rank runs
  first, inside ``zero_only`` code: :mod:`..liveness.scopes`);
* confirms the ``zero_first`` blocks this rank left unconfirmed (:func:`.zero_first.confirm_all`),
  or leaves that to the helper's first collective's wait on gloo (``confirm_in_wait``);
* records the call in flight on this thread and raises
  :class:`~axolotl_dist.errors.ThreadConflictError` when another thread is in a helper on the
  same group (:mod:`.threads`);
* while tracing, records the call as a span (:mod:`.timeline`);
* in debug mode, checks through the store that every rank is in the same helper with
  compatible arguments (:mod:`.debug_checks`).

A collective's fast path (debug, tracing and exclusive scopes off, nothing unconfirmed, one thread) is
the group's resolution, a ``get_ident()``, a dict read, a tuple and a dict write and delete
(``benchmarks/debug.py`` measures it); anything on takes :meth:`_Spec.before` and
:meth:`_Spec.traced_run` (one wrapper for every kind but ``zero_first``'s: :func:`_wrapper`).
Debug mode's switches live on :data:`.protocols_state.DEBUG`; :mod:`axolotl_dist.debug` is their
public face.
"""

from __future__ import annotations

import functools
import inspect
import threading
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, NamedTuple, Optional, TypeVar, Union

from ...env import variables
from ..base.callsite import call_site
from ...env.variables import DEBUG_TIMEOUT_ENV_VAR
from ..base.groups import Group, group_of
from .blocks import BLOCKS
from .protocols_state import CALLS, DEBUG
from .timeline import TIMELINE
from ..liveness import scopes
from ..liveness.liveness_state import SCOPES
from . import codes, debug_checks, threads, timeline
from .zero_first import confirm_all
from ...errors import CollectiveMismatchError, DistributedEnvError

from typing import Concatenate, ParamSpec

__all__ = ["Kind", "collective", "block", "rounds", "call", "call_checked", "debug_timeout", "first_rank_block",
           "tensor_signature"]

P = ParamSpec("P")
R = TypeVar("R")
F = TypeVar("F", bound=Callable[..., Any])
GroupArg = Union[str, Callable[[Dict[str, Any]], Any]]
Agree = Optional[Callable[[Dict[str, Any]], Dict[str, Any]]]
_NO_GROUP = object()
_get_ident = threading.get_ident


class Kind(NamedTuple):
    """What the wrapper does around a kind of call (see the module docstring)."""

    #: confirm the ``zero_first`` blocks this rank left unconfirmed before the body
    confirms: bool = True
    #: ... or, on a gloo group with debug mode off, inside its first collective's wait
    #: (:func:`.exchange.run`: the store read overlaps the collective; a rank stuck in a block
    #: that does not pair keeps the collective from completing, so the mismatch is still found)
    confirm_in_wait: bool = False
    #: raise at once where the other ranks cannot join (:mod:`..liveness.scopes`)
    refuse_in_scopes: bool = True
    #: raise :class:`ThreadConflictError` when another thread is in a helper on the group
    one_thread: bool = True
    #: while tracing, record the call as a span (the outermost kit call of a thread only)
    traced: bool = True


#: A helper whose every wait for other ranks on CPU is a collective run by :func:`.exchange.run`.
COLLECTIVE = Kind(confirm_in_wait=True)
#: Another call that communicates: it resolves its own group.
CALL = Kind()
#: ``do_n_at_a_time``: its rounds signal through the store and check their own numbering.
ROUNDS = Kind(one_thread=False)
#: ``zero_first``: it settles its own blocks, pairs by call site, records its own body and wait.
BLOCK = Kind(confirms=False, refuse_in_scopes=False, one_thread=False, traced=False)


def debug_timeout() -> float:
    """The debug timeout in effect, in seconds."""
    if DEBUG.timeout is not None:
        return DEBUG.timeout
    return variables.kit_seconds(DEBUG_TIMEOUT_ENV_VAR)


class _Spec:
    """One decorated call: its name, kind, body and how to find its group."""

    def __init__(self, fn: Callable[..., Any], name: str, agree: Agree, kind: Kind,
                 on_group: bool, group_arg: GroupArg = "group",
                 waits: Optional[Callable[[Dict[str, Any]], bool]] = None) -> None:
        self.fn, self.name, self.agree, self.kind, self.on_group = fn, name, agree, kind, on_group
        self.group_arg, self.waits = group_arg, waits
        signature = inspect.signature(fn)
        if on_group:  # the public signature: without the Group the wrapper passes first
            signature = signature.replace(parameters=list(signature.parameters.values())[1:])
        self.signature = signature
        self.find_group = _group_finder(signature, group_arg)

    def record(self, args: tuple, kwargs: dict) -> tuple:
        """The call as :mod:`.threads` and the refusals read it."""
        return (self.signature, self.group_arg, args, kwargs)

    def body(self, g: Optional[Group], args: tuple, kwargs: dict) -> Any:
        return self.fn(g, *args, **kwargs) if self.on_group else self.fn(*args, **kwargs)

    def debug_body(self, *args: Any, **kwargs: Any) -> Any:
        """The body as debug mode's check calls it (the group resolved again)."""
        if not self.on_group:
            return self.fn(*args, **kwargs)
        return self.fn(group_of(self.find_group(args, kwargs), self.name), *args, **kwargs)

    def run(self, g: Optional[Group], args: tuple, kwargs: dict) -> Any:
        """The body, through debug mode's check when it is on."""
        if DEBUG.on:
            return call_checked(self.debug_body, self.signature, self.name, self.agree,
                                 self.group_arg, self.waits, args, kwargs)
        return self.body(g, args, kwargs)

    def traced_run(self, g: Optional[Group], args: tuple, kwargs: dict) -> Any:
        """:meth:`run`, recorded as a span while tracing."""
        recorder = TIMELINE.recorder
        if recorder is None or not self.kind.traced:
            return self.run(g, args, kwargs)
        if not self.on_group:
            try:
                g = group_of(self.find_group(args, kwargs), self.name)
            except Exception:  # noqa: BLE001 - the helper raises its own error
                return self.run(g, args, kwargs)
        return timeline.helper_span(recorder, self.name, g, call_site,
                                 lambda: self.run(g, args, kwargs), args, kwargs)

    def before(self, args: tuple, kwargs: dict, g: Optional[Group]) -> bool:
        """The steps the kind asks for before its body, when something is on (``g``: a
        collective's group, resolved already): refuse a call the other ranks cannot join,
        confirm the blocks left unconfirmed. False: nothing runs on a group (one process
        without a process group, debug mode off): the body runs locally, nothing else."""
        name, kind = self.name, self.kind
        if SCOPES.exclusive and kind.refuse_in_scopes:
            _refuse(name, self.record(args, kwargs),
                    lambda g: scopes.check(name, g, lambda: str(call_site())))
        if self.on_group and g is None and not DEBUG.on:
            return False
        if kind.confirms and BLOCKS.unconfirmed and not (
                kind.confirm_in_wait and _confirmed_in_wait(g, self.find_group(args, kwargs),
                                                            name)):
            confirm_all()
        return True


def _wrapper(spec: _Spec) -> Callable[..., Any]:
    """The public function of a collective or another call (not ``zero_first``, see
    :func:`block`): the call's group found, the kind's steps (:meth:`_Spec.before`), the body
    recorded as this thread's call in flight (:mod:`.threads`, unless the kind runs on several
    threads) and run, traced and checked if that is on (:meth:`_Spec.traced_run`).

    A collective's fast path (nothing on: no exclusive scope, debug mode, timeline or
    unconfirmed block) runs its body directly. Written as one function: each call is a Python
    frame on every helper's path (benchmarks/frames.py)."""
    name, body, one_thread, on_group = spec.name, spec.fn, spec.kind.one_thread, spec.on_group
    position = list(spec.signature.parameters).index("group") if on_group else -1
    blocks, scopes_state, debug = BLOCKS, SCOPES, DEBUG
    timeline_state, calls_state = TIMELINE, CALLS

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        g, direct = None, False
        if on_group:
            group = kwargs["group"] if "group" in kwargs else \
                args[position] if len(args) > position else None
            g = group_of(group, name)
            direct = not (scopes_state.exclusive or debug.on or blocks.unconfirmed
                          or timeline_state.recorder is not None)
        local = g is None if direct else not spec.before(args, kwargs, g)
        if local:
            return body(None, *args, **kwargs)  # one process: the engine's local path
        if not one_thread:
            return spec.traced_run(g, args, kwargs)
        me = _get_ident()
        calls = calls_state.calls
        outer = calls.get(me)
        # recorded before the check: of two threads entering at once, at least one sees
        # the other (both may, and both raise; neither call has run)
        call = (spec.signature, spec.group_arg, args, kwargs)  # spec.record's, without its frame
        calls[me] = (name, call, outer)
        try:
            if len(calls) > 1:  # another thread is in a helper
                _refuse(name, call, lambda g: threads.check(name, g, _call_group))
            result = body(g, *args, **kwargs) if direct else spec.traced_run(g, args, kwargs)
        except BaseException:
            calls_state.conflicts.pop(me, None)  # it raised anyway
            raise
        finally:
            if outer is None:
                calls.pop(me, None)
            else:
                calls[me] = outer
        if calls_state.conflicts and me in calls_state.conflicts:
            raise threads.conflict_error(me)
        return result

    return _named(wrapper, spec)


def _named(wrapper: Callable[..., Any], spec: _Spec) -> Callable[..., Any]:
    """``wrapper`` with ``spec``'s name, docs and public signature; its frames carry the
    helper's name (where-reports, profiles and tracebacks say "barrier", not "wrapper")."""
    fn = spec.fn
    functools.update_wrapper(wrapper, fn)
    wrapper.__signature__ = spec.signature  # type: ignore[attr-defined]
    if spec.on_group:
        hints = dict(getattr(fn, "__annotations__", {}))
        hints.pop(next(iter(inspect.signature(fn).parameters)), None)
        wrapper.__annotations__ = hints
    wrapper.__wrapped__ = spec.debug_body  # type: ignore[attr-defined]
    code = wrapper.__code__
    wrapper.__code__ = code.replace(co_name=fn.__name__, **(
        {"co_qualname": fn.__qualname__} if hasattr(code, "co_qualname") else {}))
    return wrapper


def collective(name: str, agree: Agree = None, *, root: Optional[str] = None,
               exchanges: bool = False, src: Union[str, int, None] = None
               ) -> Callable[[Callable[Concatenate[Optional[Group], P], R]], Callable[P, R]]:
    """Decorate a helper whose body runs on the call's group (see the module docstring).

    :param agree: maps the bound arguments (defaults applied) to the values that must agree
        across ranks, e.g. ``{"src": 0, "tensor": "float32[4, 2]"}`` (debug mode); it must not
        raise.
    :param exchanges: the body runs the value engine (:mod:`.exchange`): a header code is
        registered for ``name`` (``root``: the argument, ``"src"`` or ``"dst"``, whose rank
        the code carries, so ranks that disagree on it meet a mismatch error).
    :param src: the ranks wait for one rank: the name of its argument, or the rank itself
        (for the timeline; default: every rank waits for every other).
    """
    def decorate(fn: Callable[Concatenate[Optional[Group], P], R]) -> Callable[P, R]:
        spec = _Spec(fn, name, agree, COLLECTIVE, True)
        if exchanges:
            codes.register_helper(name, root)
        timeline.register_sync(name, spec.signature, src=src)
        return _wrapper(spec)  # type: ignore[return-value]
    return decorate


def block(name: str, agree: Agree, *, waits: Callable[[Dict[str, Any]], bool]
          ) -> Callable[[F], F]:
    """Debug mode's check of ``zero_first`` (see the module docstring): the decorated function
    runs once every rank's call was compared. ``zero_first`` calls it only while debug mode is
    on: its fast path has no wrapper. ``waits``: whether this rank waits for the others'
    records: False for a rank the others wait for inside the block (its first ranks), which
    publishes its record and compares later, so nested blocks cannot deadlock the check."""
    def decorate(fn: F) -> F:
        spec = _Spec(fn, name, agree, BLOCK, False, waits=waits)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return spec.run(None, args, kwargs)  # its kind has no step before the body

        return _named(wrapper, spec)  # type: ignore[return-value]
    return decorate


def rounds(name: str, agree: Agree, *, group_arg: GroupArg) -> Callable[[F], F]:
    """Decorate ``do_n_at_a_time`` (see the module docstring)."""
    return _decorate_call(name, agree, ROUNDS, group_arg, own_waits=True)


def call(name: str, agree: Agree = None, *, group_arg: GroupArg = "group",
         own_waits: bool = False) -> Callable[[F], F]:
    """Decorate another call that communicates and resolves its own group (see the module
    docstring). ``own_waits``: it records its waits itself, with the ranks waited for."""
    return _decorate_call(name, agree, CALL, group_arg, own_waits=own_waits)


def _decorate_call(name: str, agree: Agree, kind: Kind, group_arg: GroupArg,
             own_waits: bool) -> Callable[[F], F]:
    def decorate(fn: F) -> F:
        spec = _Spec(fn, name, agree, kind, False, group_arg)
        timeline.register_sync(name, spec.signature, own_waits=own_waits)
        return _wrapper(spec)  # type: ignore[return-value]
    return decorate


def _confirmed_in_wait(g: Optional[Group], group: Any, name: str) -> bool:
    """Whether a ``confirm_in_wait`` helper on ``g`` (or, not resolved yet, ``group``) leaves
    the unconfirmed blocks to its first collective's wait (see :func:`call_checked`): gloo groups,
    debug mode off."""
    if DEBUG.on:
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
    """Run ``check`` (:func:`..liveness.scopes.check` or :func:`.threads.check`) on the group of the
    call ``(signature, group_arg, args, kwargs)``; its error shows the user's frames."""
    group = _group_of_call(*call)
    if group is _NO_GROUP:
        return
    try:
        check(group_of(group, name))
    except CollectiveMismatchError as exc:
        raise exc.with_traceback(None)  # the user's frames matter, not the check's


def call_checked(fn: Callable[..., Any], signature: inspect.Signature, name: str,
                  describe: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]],
                  group_arg: GroupArg, waits: Optional[Callable[[Dict[str, Any]], bool]],
                  args: tuple, kwargs: dict) -> Any:
    inside = CALLS.inside
    if inside.helper:  # a helper called by a helper: checked by the outer one
        return fn(*args, **kwargs)
    if DEBUG.env_error is not None:
        raise DistributedEnvError(DEBUG.env_error)
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
            debug_checks.check(name, agree, g, call_site().with_code(),
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
    if not DEBUG.on or g.size <= 1:
        yield
        return
    with debug_checks.first_rank_block(g, debug_timeout()):
        yield


def tensor_signature(value: Any) -> str:
    """``"float32[4, 2]"`` for a tensor; the type name for anything else (debug mode's
    description of an argument that must agree across ranks)."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).replace('torch.', '')}{list(value.shape)}"
    return type(value).__name__
