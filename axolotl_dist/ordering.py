"""Rank-ordered blocks that never hang and never lie.

* :func:`zero_first`: the main rank(s) run the block first, then the others.
* :func:`zero_only`: run a block or a function on rank 0 only, and really skip it elsewhere.
* :func:`do_n_at_a_time`: call ``f`` on at most ``n`` ranks at a time.

They signal through the process group's store (see :mod:`axolotl_dist._runtime.liveness.waits`), not through
collectives: a waiting rank is bounded only by its own ``timeout`` (rank 0 may tokenize for
hours), hears within a fraction of a second that a rank it waits for raised
(:class:`~axolotl_dist.errors.RankFailedError` naming it), notices within seconds that it died,
and logs whom it waits for. Every rank of the group must enter the same blocks in the same
order, as with any collective (docs/design/decisions.md, decisions 6 and 14).
"""

from __future__ import annotations

import functools
import linecache
import os
import sys
from typing import (TYPE_CHECKING, Any, Callable, ContextManager, Generic, List, Optional,
                    ParamSpec, TypeVar, Union, overload)


from ._runtime.liveness.progress import PROGRESS, advance
from . import env as _env
from ._runtime.liveness import scopes as _scopes
from ._runtime.protocols import shared_fs as _shared_fs
from ._runtime.protocols import timeline as _timeline
from ._runtime.base.args import check_world_size
from ._runtime.protocols.rounds import run_in_rounds
from ._runtime.protocols.zero_first import ZeroFirstBlock, first_run_begin, first_run_end
from ._runtime.base.callsite import call_site, short_path
from ._runtime.protocols.helpers import block, first_rank_block, rounds
from ._runtime.base.groups import group_of
from ._runtime.base.state import PerGroup, RoomState, register
from ._runtime.protocols.protocols_state import DEBUG
from ._runtime.protocols.timeline import TIMELINE
from ._runtime.protocols.threads import enter_block, leave_block
from .debug import is_debug_enabled
from .ranks import get_fs_local_rank, get_local_rank, get_num_nodes, get_rank, is_main_process


if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = ["zero_first", "zero_only", "do_n_at_a_time"]

T = TypeVar("T")
P = ParamSpec("P")
R = TypeVar("R")
D = TypeVar("D")  # what a skipped @zero_only(default=...) call returns

#: A group's first rank(s) of a default block before the first block asked.
NOT_ASKED = object()


class OrderingState(RoomState):
    """``node_first``: a default ``zero_first``'s first rank(s) on each group, found at its
    first block (:func:`_node_first`): None (group rank 0 alone), or whether this rank is its
    node's first (several nodes, no shared filesystem)."""

    def __init__(self) -> None:
        self.node_first: PerGroup[Optional[bool]] = PerGroup(lambda g: None)


ORDERING = register("ordering", OrderingState())


def _goes_first(arguments: dict) -> bool:
    """Whether this rank runs a ``zero_first`` block first (debug mode: it must not wait)."""
    if arguments["is_main"] is not None:
        return bool(arguments["is_main"])
    g = group_of(arguments["group"], "zero_first")
    node_first = _node_first(g, arguments.get("path")) if g is not None else None
    return get_rank(arguments["group"]) == 0 if node_first is None else node_first


def _node_first(g: Any, path: Optional[str]) -> Optional[bool]:
    """A default block's first rank(s): None for group rank 0 alone; else whether this rank
    is its node's first (``get_fs_local_rank() == 0``), on the world group of several nodes
    that do not share a filesystem: ``AXOLOTL_DIST_SHARED_FS`` (or ``OLMO_SHARED_FS``) as set
    or as ``init_distributed`` probed it, or, for ``path=``, a probe of that path (once per
    run; an explicit setting wins). Cached on the group, but for ``path=``."""
    known = ORDERING.node_first.get(g, NOT_ASKED)
    if path is None and known is not NOT_ASKED:
        return known
    answer: Optional[bool] = None
    if g.default and _env.env_num_nodes(g.size) > 1:
        if path is not None and not _shared_fs.said():  # the init's probe is not the user's word
            shared = _shared_fs.shares(path, path, get_rank(), get_local_rank(),
                                        g.size) is not False
            answer = None if shared else get_local_rank() == 0  # path's own answer
        else:
            answer = None if _env.env_shared_filesystem() else get_fs_local_rank() == 0
    if path is None:
        ORDERING.node_first.put(g, answer)
    return answer


class _ZeroFirst:
    """The context manager :func:`zero_first` returns (a class, not a generator: a block is on
    the hot path of preprocessing loops, and a generator's frames cost it microseconds)."""

    __slots__ = ("is_main", "group", "timeout", "desc", "path", "block", "debug", "opened",
                 "t0")

    def __init__(self, is_main: Optional[bool], group: Optional["ProcessGroup"],
                 timeout: Optional[float], desc: Optional[str], path: Optional[str]) -> None:
        if timeout is not None and timeout <= 0:
            raise ValueError(f"zero_first(timeout={timeout}) must be a positive number of "
                             "seconds or None")
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"zero_first(path={path!r}) must be a directory path (str or "
                            "os.PathLike) or None")
        self.is_main, self.group, self.timeout, self.desc = is_main, group, timeout, desc
        self.path = os.fspath(path) if path is not None else None
        self.block: Optional[ZeroFirstBlock] = None
        self.debug: Any = None
        self.opened: Any = None  # the group's state while this thread has the block open
        self.t0 = 0  # when the body began, while tracing (a first rank)

    def __enter__(self) -> None:
        g = group_of(self.group, "zero_first")  # this rank, the size, the store
        if g is None or g.size == 1:
            return
        is_main = self.is_main
        if is_main is None:  # cached on the group after the first block (but for path=)
            known = ORDERING.node_first.get(g, NOT_ASKED)
            is_main = known if self.path is None and known is not NOT_ASKED else \
                _node_first(g, self.path)
        first = g.rank == 0 if is_main is None else bool(is_main)
        site = call_site()
        opened = self.opened = enter_block(g, "zero_first", site, self.desc)  # one thread
        try:
            seq = next(PROGRESS.counts[g]["zero_first"])  # advance(g, ...), without its frame
            block = self.block = ZeroFirstBlock(g, seq, site, self.desc, is_main is not None,
                                                first, self.timeout)
            if not first:
                if TIMELINE.recorder is None:
                    block.await_firsts()
                else:
                    _traced_wait(block)
                return
            first_run_begin(block)
            if TIMELINE.recorder is not None:
                self.t0 = _timeline.now()
            if DEBUG.on and is_debug_enabled():  # checked once the others are here
                self.debug = first_rank_block(g)
                self.debug.__enter__()
        except BaseException:
            self.opened = None
            leave_block(opened)
            raise

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        block = self.block
        if block is None or not block.first:
            if self.opened is not None:
                leave_block(self.opened)
            return False
        try:
            if self.t0:
                _timeline.body_span(_trace_name(block), self.t0, block.site, block.group,
                                 block.seq, exc_type.__name__ if exc_type is not None else "")
            if self.debug is not None:
                try:
                    self.debug.__exit__(exc_type, exc, tb)
                except BaseException as error:  # the debug check's own finding
                    exc_type, exc = type(error), error
                    if not isinstance(exc, Exception):
                        raise
                    first_run_end(block, ok=False)
                    block.fail(exc)
                    raise
            if exc_type is not None:
                first_run_end(block, ok=False)
                block.fail(exc if exc is not None else exc_type())
                return False
            block.done()
            first_run_end(block, ok=True)  # and settles the blocks finished inside it
            return False
        finally:
            leave_block(self.opened)


def _trace_name(block: ZeroFirstBlock) -> str:
    return "zero_first" + (f" {block.desc!r}" if block.desc else "")


def _traced_wait(block: ZeroFirstBlock) -> None:
    """A waiting rank's wait, recorded for the timeline with the first rank(s) it waits for
    (group rank 0; with ``is_main=`` given, the first ranks are not known here)."""
    t0, error = _timeline.now(), ""
    try:
        block.await_firsts()
    except BaseException as exc:
        error = type(exc).__name__
        raise
    finally:
        firsts = [] if block.explicit else [block.group.global_rank(0)]
        _timeline.wait_span(_trace_name(block), t0, firsts, block.site, block.group, block.seq, error)


def zero_first(
    is_main: Optional[bool] = None,
    *,
    group: Optional["ProcessGroup"] = None,
    timeout: Optional[float] = None,
    desc: Optional[str] = None,
    path: Optional[str] = None,
) -> ContextManager[None]:
    """Run the block on the main rank(s) first, then on every other rank.

    :param is_main: whether this rank goes first. Default: group rank 0 only; but on the world
        group of several nodes that do not share a filesystem, each node's first rank
        (``get_fs_local_rank() == 0``: a cache built on one node's disk is not on the
        others'). Whether they share one: ``AXOLOTL_DIST_SHARED_FS`` (or ``OLMO_SHARED_FS``,
        or ``init_distributed(shared_filesystem=)``) where set, else what
        ``init_distributed`` found in the datasets cache's directory, else ``path``'s. Pass
        e.g. ``get_fs_local_rank() == 0`` for one first rank per filesystem yourself; all of
        those run concurrently, and every other rank waits for all of them.
    :param path: the directory the block writes its cache to, when it is not the datasets
        cache: on several nodes, with no explicit setting, whether the nodes share it is
        probed once per run (every rank of the world must enter the block).
    :param group: the process group (default: the world).
    :param timeout: seconds a rank waits for the others before raising
        :class:`~axolotl_dist.errors.RankTimeoutError` (default: forever). The process
        group's collective timeout does not apply. Each nested block waits with its own.
    :param desc: a label for the block, shown in every message about it. When given, it pairs
        blocks across ranks instead of the call site: blocks on different lines with the same
        ``desc`` are one block (the branches of an ``if`` on the rank, a helper that wraps
        ``zero_first`` and is called from two places).

    If a first rank raises, it re-raises, and every waiting rank raises
    :class:`~axolotl_dist.errors.RankFailedError` naming it instead of running the block. A
    first rank does not wait before its body, and blocks may be nested. It confirms that every
    rank reached its block (what a barrier at the block's end would): several first ranks
    (explicit ``is_main``) when their outermost first-run block ends; the sole first rank
    (default) at once if every rank is already there, else at its next collective or block, so
    it is never more than one block ahead. Ranks pair blocks by call site (or ``desc``): a
    block entered by only some ranks raises
    :class:`~axolotl_dist.errors.CollectiveMismatchError`, naming both sites, on the ranks
    whose wait (or confirmation) it breaks; a rank released by the ranks it is paired with
    hears of it at its next collective. A single process just runs the block.

    On the group's rank 0, a Hugging Face ``datasets`` map in the body that writes no cache
    file the other ranks can load (an in-memory dataset, ``keep_in_memory=True``, a function
    ``datasets`` cannot hash) is said once per process, with the fix
    (docs/preprocessing.md, "A map that writes no cache").
    """
    if DEBUG.on:  # every rank's block compared first (the protocols' helpers.block)
        return _checked_zero_first(is_main, group=group, timeout=timeout, desc=desc, path=path)
    return _ZeroFirst(is_main, group, timeout, desc, path)


@block("zero_first", lambda a: {"is_main": "default (group rank 0)" if a["is_main"] is None
                                else "given per rank"}, waits=lambda a: not _goes_first(a))
def _checked_zero_first(is_main: Optional[bool] = None, *,
                        group: Optional["ProcessGroup"] = None, timeout: Optional[float] = None,
                        desc: Optional[str] = None, path: Optional[str] = None
                        ) -> ContextManager[None]:
    """:func:`zero_first` in debug mode, the block made once the ranks' calls agree."""
    return _ZeroFirst(is_main, group, timeout, desc, path)


class _SkipBlock(BaseException):
    """Raised by the trace hook at the first line of a skipped ``with zero_only():`` body."""


class _ZeroOnly(Generic[D]):
    """Both a decorator factory and a context manager; see :func:`zero_only`."""

    def __init__(self, default: D, group: Optional["ProcessGroup"] = None) -> None:
        self.default = default
        self.group = group
        self._stack: List[tuple] = []

    def __call__(self, fn: Callable[P, R]) -> Callable[P, Union[R, D]]:
        default, group = self.default, self.group

        code = getattr(fn, "__code__", None)
        where = (f"the @zero_only function {getattr(fn, '__qualname__', fn)}"
                 + (f" (defined at {short_path(code.co_filename)}:{code.co_firstlineno})"
                    if code is not None else ""))

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> Union[R, D]:
            if is_main_process(group):
                scope = _scopes.enter("zero_only", group, lambda: where)
                try:
                    return fn(*args, **kwargs)
                finally:
                    _scopes.leave(scope)
            return default

        return wrapper

    def __enter__(self) -> bool:
        main = is_main_process(self.group)
        if main:
            site = call_site()
            scope = _scopes.enter("zero_only", self.group,
                                  lambda: f"the `with zero_only():` block at {site}")
            self._stack.append((True, scope, None))
            return True
        frame = sys._getframe(1)
        old_global, old_local = sys.gettrace(), frame.f_trace

        def skip(frame_: Any, event: str, arg: Any) -> Any:
            # Not on a `try:` line: an exception raised there escapes the `with` statement
            # (CPython 3.11); the next line is inside the try, and a skip raised there leaves
            # it like any exception (unless a bare `except:` takes it).
            line = linecache.getline(frame_.f_code.co_filename, frame_.f_lineno).strip()
            if line.startswith("try") and line[3:].lstrip().startswith(":"):
                return skip
            raise _SkipBlock()

        self._stack.append((False, old_global, old_local))
        if old_global is None:
            sys.settrace(lambda *a: None)  # line events reach frame.f_trace only while tracing
        frame.f_trace = skip
        return False

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        main, old_global, old_local = self._stack.pop()
        if main:
            _scopes.leave(old_global)  # on the main rank, the slot holds the scope
            return False
        sys._getframe(1).f_trace = old_local
        sys.settrace(old_global)
        return exc_type is _SkipBlock


@overload
def zero_only(fn: Callable[P, R]) -> Callable[P, Optional[R]]: ...


@overload
def zero_only(fn: None = None, *, group: Optional["ProcessGroup"] = None) -> _ZeroOnly[None]: ...


@overload
def zero_only(fn: None = None, *, default: D, group: Optional["ProcessGroup"] = None) -> _ZeroOnly[D]: ...


def zero_only(fn: Optional[Callable[..., Any]] = None, *, default: Any = None,
              group: Optional["ProcessGroup"] = None) -> Any:
    """Run something on the main rank only, and really skip it on the others.

    * ``@zero_only`` / ``@zero_only(default=x)``: the function runs on rank 0 only and returns
      ``default`` (None) elsewhere. The rank is checked at each call, so decorating at import
      time, before init, is correct.
    * ``with zero_only():``: the body runs on rank 0 only. On other ranks a trace hook raises
      at the body's first line and ``__exit__`` swallows it, so the body never executes. It
      works under pytest, coverage and pdb (their tracer is restored on exit); a body written
      on the ``with`` line itself is not skipped. Where you prefer an explicit test, use
      ``with zero_only() as is_main: if is_main: ...`` or the decorator.

    Never communicates: no collective, no barrier.
    """
    if fn is not None:
        if not callable(fn):
            raise TypeError(f"zero_only() takes a function or keyword arguments, got {fn!r}")
        return _ZeroOnly(default, group)(fn)
    return _ZeroOnly(default, group)


@rounds("do_n_at_a_time", lambda a: {"n": a["n"]}, group_arg="process_group")
def do_n_at_a_time(
    f: Callable[[], T],
    *,
    n: Optional[int] = None,
    process_group: Optional["ProcessGroup"] = None,
    world_size: Optional[int] = None,
    local_rank: Optional[int] = None,
    timeout: Optional[float] = None,
    desc: Optional[str] = None,
) -> T:
    """Call ``f`` on every rank exactly once, from at most ``n`` ranks at a time.

    Ranks go in ``ceil(world_size / n)`` rounds; round ``k`` holds the ranks with
    ``rank % rounds == k`` (with node-contiguous ranks and the default ``n`` = number of nodes,
    one rank per node per round). Every rank returns its own result once all rounds are done.
    If any rank's ``f`` raises, that rank re-raises and all others raise
    :class:`~axolotl_dist.errors.RankFailedError`. ``local_rank`` is the rank within
    ``process_group`` (OLMo-core's naming). ``desc`` labels the call in messages and pairs
    calls across ranks instead of the call site, as for :func:`zero_first`.
    """
    g = group_of(process_group, "do_n_at_a_time")
    if g is None:
        check_world_size(world_size, 1, "do_n_at_a_time")
        if n is not None and n < 1:
            raise ValueError(f"do_n_at_a_time(n={n}) must be >= 1")
        return f()
    ws = check_world_size(world_size, g.size, "do_n_at_a_time")
    rank = g.rank
    if local_rank is not None and local_rank != rank:
        raise ValueError(
            f"do_n_at_a_time(local_rank={local_rank}) disagrees with this process's rank {rank} "
            "in the group: drop local_rank (it is inferred)")
    if n is None:
        n = get_num_nodes()
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"do_n_at_a_time(n={n!r}) must be an int >= 1 (ranks running f at once)")
    if ws == 1:
        return f()
    rounds = -(-ws // n)
    site = call_site()
    opened = enter_block(g, "do_n_at_a_time", site, desc)  # one thread numbers the blocks
    try:
        return run_in_rounds(f, g, advance(g, "do_n_at_a_time"), rounds, timeout, site, desc)
    finally:
        leave_block(opened)
