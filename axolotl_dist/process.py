"""Accelerate- and composer-style per-process helpers, on top of the kit's failure-safe blocks.

Names users of Hugging Face Accelerate (``PartialState`` / ``Accelerator``) and composer
already call:

* ordered blocks: :func:`main_process_first`, :func:`local_main_process_first` and composer's
  :func:`run_local_rank_zero_first`. They are :func:`~axolotl_dist.zero_first` underneath:
  no collective, the waiting ranks' wait is bounded only by ``timeout``, and if a first rank
  raises, every waiting rank raises :class:`~axolotl_dist.errors.RankFailedError` instead of
  hanging.
* decorators: :func:`on_main_process`, :func:`on_local_main_process`, :func:`on_last_process`,
  :func:`on_process` and :func:`on_local_process`. The rank is checked **at each call**, so
  decorating at import time, before the process group exists, is correct. On the other ranks the function is
  not called and the call returns None; a single process runs every decorated function.
* output: :func:`tqdm`, a progress bar shown on the main process only, and :func:`print`,
  which prints on the main process only.

None of these communicate, except the ordered blocks' store signalling.
"""

from __future__ import annotations

import builtins
import functools
import sys
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    ContextManager,
    Iterable,
    Iterator,
    Optional,
    ParamSpec,
    Protocol,
    TypeVar,
    Union,
    overload,
)

from ._runtime.base import kitlog as _kitlog
from .ordering import zero_first, zero_only
from .ranks import (get_local_rank, get_local_world_size, get_rank, get_world_size,
                    is_last_process, is_main_process)


if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = [
    "main_process_first",
    "local_main_process_first",
    "run_local_rank_zero_first",
    "on_main_process",
    "on_local_main_process",
    "on_last_process",
    "on_process",
    "on_local_process",
    "tqdm",
    "print",
    "ProgressBar",
]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)

#: What ``pip install`` brings tqdm (and the other Hugging Face libraries) with.
HF_EXTRA_HINT = ("pip install tqdm (or, in a clone of axolotl_dist, pip install -e '.[hf]' for "
                 "the whole Hugging Face stack)")


# ---------------------------------------------------------------------------- ordered blocks
def main_process_first(
    *, group: Optional["ProcessGroup"] = None, timeout: Optional[float] = None,
    desc: Optional[str] = None,
) -> ContextManager[None]:
    """Accelerate's ``main_process_first()``: the main process runs the block, then the others.

    Exactly :func:`~axolotl_dist.zero_first` (group rank 0 first): failure-safe, bounded only by
    ``timeout`` (seconds a waiting rank waits; default forever), nestable; ``desc`` labels the
    block and pairs it across ranks (as the HF Trainer's ``main_process_first(desc=...)``
    labels it). A single process just runs the block.
    """
    return zero_first(group=group, timeout=timeout, desc=desc)


def local_main_process_first(*, timeout: Optional[float] = None,
                             desc: Optional[str] = None) -> ContextManager[None]:
    """Accelerate's ``local_main_process_first()``: local rank 0 of every node first, then the rest.

    The local rank 0s run concurrently (one per node) and every other rank waits for all of
    them, with :func:`~axolotl_dist.zero_first`'s failure safety. On a filesystem shared by
    all nodes the local mains write concurrently: there, prefer :func:`main_process_first`
    (or ``zero_first(is_main=get_fs_local_rank() == 0)``). ``desc`` as for
    :func:`main_process_first`.
    """
    return zero_first(is_main=get_local_rank() == 0, timeout=timeout, desc=desc)


def run_local_rank_zero_first(*, timeout: Optional[float] = None,
                              desc: Optional[str] = None) -> ContextManager[None]:
    """composer's ``run_local_rank_zero_first()``: :func:`local_main_process_first` by its name.

    A failure in a local rank 0 raises on the waiting ranks (no hang), and a world of size 1
    just runs the block.
    """
    return local_main_process_first(timeout=timeout, desc=desc)


# ---------------------------------------------------------------------------- decorators
def _require_function(function: Any, decorator: str) -> None:
    if not callable(function):
        raise TypeError(
            f"{decorator} decorates a function, got {function!r} of type "
            f"{type(function).__name__}: write @ad.{decorator.split('(')[0]} above a def"
        )


def _check_index(index: Any, argument: str, decorator: str) -> int:
    if type(index) is not int or index < 0:
        raise ValueError(
            f"{decorator}({argument}={index!r}): {argument} must be an int >= 0 (a rank)")
    return index


def _run_where(function: Callable[P, R], should_run: Callable[[], bool]) -> Callable[P, Optional[R]]:
    """Wrap ``function`` so that it runs only where ``should_run()`` is true at call time."""

    @functools.wraps(function)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> Optional[R]:
        if should_run():
            return function(*args, **kwargs)
        return None

    return wrapper


def on_main_process(function: Callable[P, R]) -> Callable[P, Optional[R]]:
    """Run ``function`` on the main process (global rank 0) only; None elsewhere.

    The same as ``@zero_only``; the rank is checked at each call.
    """
    _require_function(function, "on_main_process")
    return zero_only(function)


def on_local_main_process(function: Callable[P, R]) -> Callable[P, Optional[R]]:
    """Run ``function`` on local rank 0 of every node only; None elsewhere (checked per call)."""
    _require_function(function, "on_local_main_process")
    return _run_where(function, lambda: get_local_rank() == 0)


def on_last_process(function: Callable[P, R]) -> Callable[P, Optional[R]]:
    """Run ``function`` on the last process (global rank world size - 1) only; None elsewhere."""
    _require_function(function, "on_last_process")
    return _run_where(function, is_last_process)


def _on_index(index: int, argument: str, decorator: str, rank: Callable[[], int],
              size: Callable[[], int]) -> Callable[[], bool]:
    """A per-call test ``rank() == index``; an index beyond a multi-process run's size raises."""

    def should_run() -> bool:
        n = size()
        if n == 1:
            return True  # a single process runs every decorated function (as Accelerate)
        if index >= n:
            raise ValueError(
                f"{decorator}({argument}={index}) can never run: this run has {n} processes "
                f"(indices 0..{n - 1}); pass an index in range")
        return rank() == index

    return should_run


def _index_decorator(
    function: Any, index: Optional[int], argument: str, decorator: str,
    rank: Callable[[], int], size: Callable[[], int],
) -> Any:
    """Shared body of :func:`on_process` / :func:`on_local_process` (both call styles)."""
    if index is None and function is not None and not callable(function):
        function, index = None, function  # on_process(1): the index, positionally
    if index is None:
        raise TypeError(f"{decorator}() needs {argument}=, e.g. @ad.{decorator}({argument}=1)")
    checked = _check_index(index, argument, decorator)

    def decorate(fn: Callable[P, R]) -> Callable[P, Optional[R]]:
        _require_function(fn, f"{decorator}({argument}={checked})")
        return _run_where(fn, _on_index(checked, argument, decorator, rank, size))

    return decorate if function is None else decorate(function)


@overload
def on_process(process_index: int, /) -> Callable[[Callable[P, R]], Callable[P, Optional[R]]]: ...


@overload
def on_process(*, process_index: int) -> Callable[[Callable[P, R]], Callable[P, Optional[R]]]: ...


@overload
def on_process(function: Callable[P, R], process_index: int) -> Callable[P, Optional[R]]: ...


def on_process(function: Any = None, process_index: Optional[int] = None) -> Any:
    """Run a function on global rank ``process_index`` only; None elsewhere (checked per call).

    ``@on_process(1)``, ``@on_process(process_index=1)`` or Accelerate's
    ``on_process(fn, process_index=1)``. An index at or beyond the world size raises
    ``ValueError`` at call time; a single process runs the function whatever the index.
    """
    return _index_decorator(function, process_index, "process_index", "on_process",
                            get_rank, get_world_size)


@overload
def on_local_process(local_process_index: int, /) -> Callable[[Callable[P, R]], Callable[P, Optional[R]]]: ...


@overload
def on_local_process(*, local_process_index: int) -> Callable[[Callable[P, R]], Callable[P, Optional[R]]]: ...


@overload
def on_local_process(function: Callable[P, R], local_process_index: int) -> Callable[P, Optional[R]]: ...


def on_local_process(function: Any = None, local_process_index: Optional[int] = None) -> Any:
    """Run a function on local rank ``local_process_index`` of every node only (checked per call).

    Call styles and errors as :func:`on_process`, against the local world size.
    """
    return _index_decorator(function, local_process_index, "local_process_index",
                            "on_local_process", get_local_rank, get_local_world_size)


# ---------------------------------------------------------------------------- output
class ProgressBar(Protocol[T_co]):
    """The part of a ``tqdm`` progress bar that :func:`tqdm` promises (for type checkers)."""

    disable: bool
    n: float

    def __iter__(self) -> Iterator[T_co]: ...

    def update(self, n: float = 1) -> Optional[bool]: ...

    def set_postfix(self, ordered_dict: Any = None, refresh: Optional[bool] = True, **kwargs: Any) -> None: ...

    def set_description(self, desc: Optional[str] = None, refresh: Optional[bool] = True) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> "ProgressBar[T_co]": ...

    def __exit__(self, *exc_info: Any) -> Optional[bool]: ...


@overload
def tqdm(iterable: Iterable[T], *args: Any, main_process_only: bool = True, **kwargs: Any) -> ProgressBar[T]: ...


@overload
def tqdm(iterable: None = None, *args: Any, main_process_only: bool = True, **kwargs: Any) -> ProgressBar[Any]: ...


def tqdm(iterable: Optional[Iterable[Any]] = None, *args: Any, main_process_only: bool = True,
         **kwargs: Any) -> Union[ProgressBar[Any], Any]:
    """A ``tqdm.auto.tqdm`` progress bar, disabled on every process but the main one.

    Takes tqdm's arguments. With ``main_process_only=False`` every process shows its bar.
    The main process is global rank 0 (Accelerate's ``tqdm`` uses local rank 0, one bar per
    node). Needs tqdm, which comes with the ``hf`` extra; without it this raises
    ``ImportError`` saying what to install.
    """
    try:
        from tqdm.auto import tqdm as tqdm_class
    except ImportError as exc:
        raise ImportError(f"axolotl_dist.tqdm needs the tqdm package: {HF_EXTRA_HINT}") from exc
    if main_process_only and not is_main_process():
        kwargs["disable"] = True
    return _kitlog.add_bar(tqdm_class(iterable, *args, **kwargs))


def print(*args: Any, **kwargs: Any) -> None:  # noqa: A001 - Accelerate's name
    """``print`` on the main process (global rank 0) only; the same arguments as ``print``.
    While a progress bar is on screen (:func:`tqdm`), the line is written above it."""
    if not is_main_process():
        return
    file = kwargs.get("file")
    if (file is None or file is sys.stdout or file is sys.stderr) and _kitlog.bars_open():
        sep, end = kwargs.get("sep", " "), kwargs.get("end", "\n")
        text = (" " if sep is None else sep).join(str(a) for a in args)
        _kitlog.bar_write(text, file or sys.stdout, "\n" if end is None else end)
        return
    builtins.print(*args, **kwargs)
