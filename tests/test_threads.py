"""Threads: two threads of a rank on one group get a named error, never each other's values.

Real gloo ranks; each thread calls a helper 300 times with values that say which thread and
call they belong to, so a value that crossed between threads is seen."""

import re
import threading

import pytest
import torch.distributed as dist

import axolotl_dist as ad
from axolotl_dist.testing import run_distributed

CALLS = 300


def _call(helper, k, i, group=None):
    """Thread ``k``'s ``i``-th call, and the value it must return."""
    rank, ws = ad.get_rank(), ad.get_world_size()
    if helper == "reduce_and_broadcast":
        got = ad.reduce_and_broadcast(lambda: (k, i, rank), sorted, group=group)
        return got, [(k, i, r) for r in range(ws)]
    got = ad.gather_from_all_ranks(lambda: (k, i, rank), group=group)  # to rank 0
    return got, [(k, i, r) for r in range(ws)] if rank == 0 else None


def _threads(helper, count, own_groups=False):
    def body():
        groups = [dist.new_group(list(range(ad.get_world_size()))) if own_groups else None
                  for _ in range(count)]
        out = {}

        def work(k):
            wrong, right, errors = [], 0, []
            try:
                for i in range(CALLS):
                    got, want = _call(helper, k, i, groups[k])
                    if got == want:
                        right += 1
                    else:
                        wrong.append((i, got))
            except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
                errors.append(f"{type(exc).__name__}: {exc}")
            out[k] = (right, wrong, errors)

        threads = [threading.Thread(target=work, args=(k,), name=f"worker{k}") for k in range(count)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out
    return body


def test_a_thread_inside_its_own_function_is_named_at_its_helper_call_not_in_that_function():
    # the thread in flight is in the user's function (or any code the kit calls: linecache,
    # torch) when the other thread's call is checked: its site is still the helper call
    def body():
        started, release = threading.Event(), threading.Event()

        def slow():
            started.set()
            release.wait(20)
            return 1

        out = {}

        def hold():
            try:
                ad.reduce_and_broadcast(slow, sum)  # the holder's line
            except ad.ThreadConflictError as exc:
                out["holder"] = str(exc)

        thread = threading.Thread(target=hold, name="holder")
        thread.start()
        started.wait(20)
        try:
            ad.gather_from_all_ranks(lambda: 2)
        except ad.ThreadConflictError as exc:
            out["main"] = str(exc)
        release.set()
        thread.join(30)
        return out

    for out in run_distributed(body, 2, timeout=90):
        assert re.search(r"was called while reduce_and_broadcast\(\) at tests/test_threads\.py:\d+ "
                         r"in hold \(thread 'holder'\)", out["main"]), out
        assert "so its result may be the other call's" in out["holder"], out


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("helper", ["reduce_and_broadcast", "gather_from_all_ranks"])
def test_two_threads_on_one_group_get_a_named_error_and_never_each_others_values(ws, helper,
                                                                                  store):
    out = run_distributed(_threads(helper, 2), ws, store=store, timeout=90)
    conflicts = 0
    for rank, threads in enumerate(out):
        for k, (right, wrong, errors) in threads.items():
            assert wrong == [], (rank, k, wrong[:3])  # no value crossed between the threads
            for error in errors:
                if error.startswith("ThreadConflictError"):
                    conflicts += 1
                    assert re.search(rf"{helper}\(\) at tests/test_threads\.py:\d+ in _call "
                                     r"\(thread 'worker[01]'\)", error), error
                    assert "Call a group's collectives from one thread" in error, error
                else:  # a peer that stopped at its own conflict is named
                    assert error.startswith("RankFailedError: rank "), error
    assert conflicts >= 1, out


def test_the_error_names_both_threads_and_their_lines():
    out = run_distributed(_threads("reduce_and_broadcast", 2), 2, timeout=90)
    errors = [e for threads in out for _, _, errs in threads.values() for e in errs
              if e.startswith("ThreadConflictError")]
    second = [e for e in errors if "is running on the same process group" in e]
    first = [e for e in errors if "was still running when" in e]
    assert second, errors
    for error in second:
        assert re.search(r"reduce_and_broadcast\(\) at tests/test_threads\.py:\d+ in _call \(thread "
                         r"'worker(\d)'\) was called while reduce_and_broadcast\(\) at "
                         r"tests/test_threads\.py:\d+ in _call \(thread 'worker(?!\1)\d'\)", error), error
    for error in first:  # the call in flight raises too: its result may be the other's
        assert "so its result may be the other call's and is not returned" in error, error


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("helper", ["reduce_and_broadcast", "gather_from_all_ranks"])
def test_one_thread_that_is_not_the_main_thread_gets_every_value_right(ws, helper, store):
    out = run_distributed(_threads(helper, 1), ws, store=store, timeout=90)
    for rank, threads in enumerate(out):
        assert threads[0] == (CALLS, [], []), (rank, threads[0][1][:3], threads[0][2])


@pytest.mark.parametrize("ws", [2, 3])
def test_threads_with_a_group_each_get_every_value_right(ws):
    out = run_distributed(_threads("reduce_and_broadcast", 2, own_groups=True), ws, timeout=90)
    for rank, threads in enumerate(out):
        for k in (0, 1):
            assert threads[k] == (CALLS, [], []), (rank, k, threads[k][1][:3], threads[k][2])


# ------------------------------------------------------------- ordering blocks from two threads

def _blocks_from_two_threads(second):
    """Thread 'worker0' holds a zero_first block open (rank 0's body takes 1 s, the others wait
    for it); 0.2 s in, thread 'worker1' opens another block (``second == "block"``) or calls a
    helper 20 times (``"helper"``). Returns each thread's result or error text."""
    import time

    def body():
        out = {}

        def first():
            try:
                with ad.zero_first(desc="a"):
                    if ad.get_rank() == 0:
                        time.sleep(1.0)
                out[0] = "ok"
            except Exception as exc:  # noqa: BLE001 - recorded for the test to judge
                out[0] = f"{type(exc).__name__}: {exc}"

        def other():
            time.sleep(0.2)
            try:
                if second == "block":
                    with ad.zero_first(desc="b"):
                        pass
                    out[1] = "ok"
                else:
                    got = [ad.reduce_and_broadcast(lambda: (i, ad.get_rank()), sorted)
                           for i in range(20)]
                    want = [[(i, r) for r in range(ad.get_world_size())] for i in range(20)]
                    out[1] = "ok" if got == want else f"wrong: {got[:2]}"
            except Exception as exc:  # noqa: BLE001
                out[1] = f"{type(exc).__name__}: {exc}"

        threads = [threading.Thread(target=first, name="worker0"),
                   threading.Thread(target=other, name="worker1")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out
    return body


@pytest.mark.parametrize("ws", [2, 3])
def test_a_block_opened_while_another_thread_has_one_open_is_a_named_error(ws, store):
    out = run_distributed(_blocks_from_two_threads("block"), ws, store=store, timeout=90)
    for rank, threads in enumerate(out):
        assert threads[0] == "ok", (rank, threads)
        assert re.match(r"ThreadConflictError: the zero_first block 'b' at tests/test_threads\.py:"
                        r"\d+ in other \(thread 'worker1'\) was entered while the zero_first block "
                        r"'a' at tests/test_threads\.py:\d+ in first \(thread 'worker0'\) is open on "
                        r"the same process group\. A group's blocks are numbered in the order each "
                        r"rank enters them", threads[1]), (rank, threads[1])
        assert "Enter a group's zero_first / do_n_at_a_time blocks from one thread" in threads[1]


@pytest.mark.parametrize("ws", [2, 3])
def test_helpers_from_another_thread_during_a_block_are_fine(ws, store):
    out = run_distributed(_blocks_from_two_threads("helper"), ws, store=store, timeout=90)
    assert out == [{0: "ok", 1: "ok"}] * ws, out
