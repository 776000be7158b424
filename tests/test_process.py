"""Accelerate- and composer-style names (axolotl_dist.process) on real gloo ranks.

Two simulated nodes of two ranks each (``LOCAL_RANK = rank % 2``) tell local from global
ranks apart. Ordering is checked with marker files, not timing: a rank that goes first checks
that no waiting rank has entered yet, a waiting rank checks that every first rank is done.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
from pathlib import Path
from typing import Callable, ContextManager, Dict, List, Optional

import pytest

import axolotl_dist as ad
from axolotl_dist.testing import run_distributed, run_distributed_outcomes


def two_nodes(rank: int) -> Dict[str, Optional[str]]:
    return {"LOCAL_RANK": str(rank % 2), "LOCAL_WORLD_SIZE": "2", "NODE_RANK": str(rank // 2)}


def _ordered(block: Callable[[], ContextManager[None]], firsts: List[int], directory: Path) -> None:
    """Enter ``block()`` and check the order with marker files in ``directory``."""
    rank = ad.get_rank()
    directory.mkdir(exist_ok=True)
    with block():
        if rank in firsts:
            time.sleep(0.3)  # a waiting rank that entered too early would see no marker yet
            (directory / f"first{rank}").touch()
            later = sorted(p.name for p in directory.glob("later*"))
            assert later == [], f"rank {rank} went first but {later} already entered"
        else:
            done = sorted(p.name for p in directory.glob("first*"))
            assert done == [f"first{r}" for r in firsts], f"rank {rank} entered after only {done}"
            (directory / f"later{rank}").touch()


def test_ordered_blocks_on_two_nodes(tmp_path: Path) -> None:
    def body() -> bool:
        _ordered(ad.main_process_first, [0], tmp_path / "main")
        _ordered(ad.local_main_process_first, [0, 2], tmp_path / "local")
        _ordered(ad.run_local_rank_zero_first, [0, 2], tmp_path / "composer")
        _ordered(lambda: ad.run_local_rank_zero_first(timeout=60), [0, 2], tmp_path / "timeout")
        return True

    assert run_distributed(body, 4, rank_env=two_nodes, timeout=90) == [True] * 4
    for name, count in (("main", 4), ("local", 4), ("composer", 4)):
        assert len(list((tmp_path / name).iterdir())) == count


def test_local_rank_zero_failure_raises_on_the_waiting_ranks_instead_of_hanging() -> None:
    def body() -> str:
        with ad.run_local_rank_zero_first():
            if ad.get_rank() == 2:
                raise OSError("disk full on node 1")
        return "ran"

    outcomes = run_distributed_outcomes(body, 4, rank_env=two_nodes, timeout=90)
    assert isinstance(outcomes[2].exception, OSError)
    assert outcomes[0].value == "ran"  # the other first rank finished its own block
    for waiting in (1, 3):
        exc = outcomes[waiting].exception
        assert isinstance(exc, ad.RankFailedError), outcomes[waiting].describe()
        assert exc.rank == 2 and "disk full on node 1" in str(exc)


def test_ordered_blocks_in_a_single_process_just_run() -> None:
    ran = []
    for block in (ad.main_process_first, ad.local_main_process_first, ad.run_local_rank_zero_first):
        with block():
            ran.append(block.__name__)
    assert len(ran) == 3


# Decorated here, in the test process (a single process, where every decorated function would
# run if the rank were decided when decorating, as Accelerate's PartialState does); called in
# the forked ranks, where the rank is checked at each call.
@ad.on_main_process
def _main(tag: str) -> str:
    return f"main:{tag}"


@ad.on_local_main_process
def _local_main() -> str:
    return "local-main"


@ad.on_last_process
def _last() -> str:
    return "last"


@ad.on_process(1)
def _one() -> str:
    return "one"


@ad.on_process(process_index=2)
def _two() -> str:
    return "two"


def _three() -> str:
    return "three"


_three_only = ad.on_process(_three, process_index=3)  # Accelerate's call style


@ad.on_local_process(local_process_index=1)
def _local_one() -> str:
    return "local-one"


@ad.on_local_process(0)
def _local_zero() -> str:
    return "local-zero"


@ad.on_process(7)
def _beyond() -> str:
    return "never"


def test_decorators_check_the_rank_at_each_call() -> None:
    def body() -> List[Optional[str]]:
        calls = [_main("x"), _local_main(), _last(), _one(), _two(), _three_only(), _local_one(),
                 _local_zero()]
        with pytest.raises(ValueError, match=r"on_process\(process_index=7\) can never run: this "
                                             r"run has 4 processes \(indices 0\.\.3\)"):
            _beyond()
        return calls

    got = run_distributed(body, 4, rank_env=two_nodes, init=False, timeout=60)
    assert got[0] == ["main:x", "local-main", None, None, None, None, None, "local-zero"]
    assert got[1] == [None, None, None, "one", None, None, "local-one", None]
    assert got[2] == [None, "local-main", None, None, "two", None, None, "local-zero"]
    assert got[3] == [None, None, "last", None, None, "three", "local-one", None]
    assert _beyond() == "never" and _one() == "one"  # a single process runs them all
    assert _main.__name__ == "_main" and _three_only.__name__ == "_three"  # functools.wraps


@pytest.mark.parametrize("make, error, message", [
    (lambda: ad.on_process(-1), ValueError, r"on_process\(process_index=-1\): process_index must be an int >= 0"),
    (lambda: ad.on_process("1"), ValueError, r"on_process\(process_index='1'\): process_index must be an int"),
    (lambda: ad.on_process(), TypeError, r"on_process\(\) needs process_index=, e\.g\. @ad\.on_process\(process_index=1\)"),
    (lambda: ad.on_local_process(local_process_index=True), ValueError,
     r"on_local_process\(local_process_index=True\): local_process_index must be an int >= 0"),
    (lambda: ad.on_main_process(42), TypeError, r"on_main_process decorates a function, got 42 of type int"),
    (lambda: ad.on_last_process("f"), TypeError, r"on_last_process decorates a function"),
    (lambda: ad.on_process(process_index=1)(3), TypeError,
     r"on_process\(process_index=1\) decorates a function, got 3"),
])
def test_decorator_misuse_names_the_argument(make: Callable[[], object], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        make()


def test_tqdm_and_print_show_on_the_main_process_only() -> None:
    pytest.importorskip("tqdm", reason="ad.tqdm needs the hf extra (or tqdm)")
    def body() -> List[object]:
        main_bar, every_bar = io.StringIO(), io.StringIO()
        with ad.tqdm(range(3), file=main_bar, desc="main-only") as bar:
            disabled = bar.disable  # tqdm sets disable once closed: read it while open
            items = list(bar)
        every = ad.tqdm(total=2, file=every_bar, main_process_only=False)
        every.update(2)
        every.close()
        kept_off = ad.tqdm(total=1, disable=True)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            ad.print("hello", ad.get_rank(), sep="-")
        return [items, disabled, "3/3" in main_bar.getvalue(), "2/2" in every_bar.getvalue(),
                kept_off.disable, printed.getvalue()]

    got = run_distributed(body, 2, init=False, timeout=60)
    assert got[0] == [[0, 1, 2], False, True, True, True, "hello-0\n"]
    assert got[1] == [[0, 1, 2], True, False, True, True, ""]


def test_tqdm_without_tqdm_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # as if tqdm were not installed
    with pytest.raises(ImportError, match=r"axolotl_dist\.tqdm needs the tqdm package: "
                                          r"pip install tqdm \(or, in a clone of axolotl_dist, "
                                          r"pip install -e '\.\[hf\]'"):
        ad.tqdm(range(2))


def test_print_is_not_star_exported() -> None:
    namespace: Dict[str, object] = {}
    exec("from axolotl_dist import *", namespace)
    assert "print" not in namespace and namespace["tqdm"] is ad.tqdm
    assert ad.print is not print and "print" not in ad.__all__
    assert not os.environ.get("RANK")  # the single-process checks above ran as rank 0 of 1
