"""How ranks pair their blocks and helpers, and what a block costs in store calls.

* ``zero_first(desc=...)`` pairs blocks on different lines; without it, blocks that do not
  pair raise ``CollectiveMismatchError`` naming both sites (and how to pair them on purpose);
* an extra block on some ranks is named on every rank (2-4 ranks, both store placements);
* nested blocks each wait with their own ``timeout``;
* an empty block costs each rank at most one store call plus one read (the order of the
  ranks' calls set by the test), and a loop of blocks keeps the store's key count flat;
* two different value helpers meeting in one collective raise, naming both, without debug mode.
"""

import os
import re
import sys
import time

import pytest
import torch

import axolotl_dist as ad
from fixtures import run, subprocess_env
from axolotl_dist.testing import run_distributed, run_distributed_outcomes
from probes import count_store_calls, store_of

HERE = os.path.basename(__file__)
PG_TIMEOUT = 300.0


def _stamp(tmp, rank, event):
    """Append ``rank event`` to the shared events file (``O_APPEND``: line order = time order)."""
    fd = os.open(os.path.join(tmp, "events"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, f"{rank} {event}\n".encode())
    finally:
        os.close(fd)


def _order(tmp):
    with open(os.path.join(tmp, "events")) as fh:
        return [tuple(line.split()) for line in fh]


# ---------------------------------------------------------------- desc= pairs blocks


@pytest.mark.parametrize("ws", [2, 3])
def test_desc_pairs_blocks_on_different_lines(tmp_path, ws):
    def body():
        rank = ad.get_rank()
        if rank == 0:
            with ad.zero_first(desc="tokenize"):  # one line on rank 0 ...
                _stamp(tmp_path, rank, "tokenize")
        else:
            with ad.zero_first(desc="tokenize"):  # ... another on the others: one block
                _stamp(tmp_path, rank, "tokenize")
        with ad.main_process_first(desc="cache"):
            _stamp(tmp_path, rank, "cache")
        ad.do_n_at_a_time(lambda: _stamp(tmp_path, rank, "rounds"), n=1, desc="rounds")
        return ad.reduce_and_broadcast(lambda: 1, sum)

    assert run_distributed(body, ws, timeout=60) == [ws] * ws
    events = _order(tmp_path)
    for label in ("tokenize", "cache"):
        ranks = [int(r) for r, e in events if e == label]
        assert ranks[0] == 0 and sorted(ranks) == list(range(ws)), events


_NEXT_STEPS = {
    "barrier": lambda: ad.barrier(),
    "compute_and_broadcast": lambda: ad.compute_and_broadcast(lambda: 1.0),
    "gather_from_all_ranks": lambda: ad.gather_from_all_ranks(lambda: 1.0),
    "all_reduce": lambda: ad.all_reduce(torch.ones(2)),
}


@pytest.mark.parametrize("next_step", sorted(_NEXT_STEPS))
@pytest.mark.parametrize("debug", [False, True], ids=["debug-off", "debug-on"])
def test_blocks_on_different_lines_without_desc_name_both_sites_and_the_fix(next_step, debug):
    # rank 0, first, confirms its block at the script's next step: before the helper in
    # debug mode, inside the wait for the helper's collective without (a gloo group)
    def body():
        rank = ad.get_rank()
        try:
            if rank == 0:
                with ad.zero_first():
                    pass
            else:
                with ad.zero_first():
                    pass
            _NEXT_STEPS[next_step]()
        except ad.CollectiveMismatchError as exc:
            return str(exc)
        return "no error"

    env = {"AXOLOTL_DIST_DEBUG": "1"} if debug else None
    for message in run_distributed(body, 2, timeout=60, env=env):
        assert "zero_first blocks do not pair: block #1" in message, message
        assert len(re.findall(rf"{HERE}:\d+ in body on rank [01]", message)) == 2, message
        assert 'desc="..."' in message, message


UNPAIRED_SCRIPT = """
import axolotl_dist as ad

ad.init_distributed()
if ad.get_rank() == 0:
    with ad.zero_first():
        pass
else:
    with ad.zero_first():
        pass
ad.barrier()
"""


def test_a_mismatch_found_at_the_next_collective_is_told_once_per_rank(tmp_path):
    # rank 0 finds it while confirming its block in the barrier's wait; the exit must not
    # check the block again and log the same mismatch a second time (it did, as a warning)
    script = tmp_path / "prep.py"
    script.write_text(UNPAIRED_SCRIPT)
    code, _, err = run([sys.executable, "-m", "axolotl_dist.launch", "-n", "2", str(script)],
                       subprocess_env(tmp_path), 120, cwd=tmp_path)
    assert code == 1, err
    for rank, line in ((0, 11), (1, 9)):
        told = [ln for ln in err.splitlines()
                if ln.startswith(f"[rank {rank}] ") and "do not pair" in ln]
        assert len(told) == 1, err
        assert re.search(rf'^\[rank {rank}\]   File ".*prep\.py", line {line}, in <module>$', err,
                         re.M), err
    assert "not every rank reached" not in err, err


def test_desc_appears_in_messages_about_the_block():
    def body():
        try:
            with ad.zero_first(desc="tokenize", timeout=0.5):
                if ad.get_rank() == 0:
                    time.sleep(2)
        except ad.RankTimeoutError as exc:
            return str(exc)
        return None

    out = run_distributed(body, 2, timeout=60)
    assert "zero_first block #1 'tokenize' at" in out[1], out[1]


# ---------------------------------------------------------------- an extra block on some ranks


def _extra_block_on_rank0():
    """A zero_first inside a @zero_only function: only rank 0 has it."""
    @ad.zero_only
    def prepare_on_main():
        with ad.zero_first():
            return "main-only block"

    start = time.monotonic()
    try:
        prepare_on_main()
        with ad.zero_first():
            pass
    except ad.CollectiveMismatchError as exc:
        return str(exc), time.monotonic() - start
    return "no error", None


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_an_extra_block_on_rank0_is_named_on_every_rank(ws, store):
    outcomes = run_distributed_outcomes(_extra_block_on_rank0, ws, store=store, timeout=60,
                                        pg_timeout=PG_TIMEOUT)
    for o in outcomes:
        assert o.ok, o.describe()
        message, elapsed = o.value
        assert elapsed is not None and elapsed < 10.0, message
        assert "zero_first blocks do not pair: block #1" in message, message
        assert f"{HERE}:" in message and "in prepare_on_main on rank 0" in message, message
        assert re.search(r"in _extra_block_on_rank0 on rank \d", message), message


def _extra_block_on_rank1():
    """Rank 1 has an extra block; the others' blocks pair. The ranks whose wait it breaks
    raise at once (uncaught, as a script); a rank its pair released learns at its next
    collective."""
    rank = ad.get_rank()
    if rank == 1:
        with ad.zero_first():
            pass
    with ad.zero_first():
        pass
    try:
        ad.barrier()
    except ad.RankFailedError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize("ws", [3, 4])
def test_an_extra_block_on_another_rank_reaches_every_rank(ws, store):
    outcomes = run_distributed_outcomes(_extra_block_on_rank1, ws, store=store, timeout=60,
                                        pg_timeout=PG_TIMEOUT, grace=30)
    # Two checks can find it first, each naming the extra block: the blocks' pairing, or (on a
    # loaded machine, 1 full suite run in 4 this session) the wait-for graph of ranks 0-2
    said = ("zero_first blocks do not pair: block #1",
            "in a zero_first call the others never entered")
    for o in outcomes:
        if o.rank in (0, 1) or not o.ok:  # a wait it broke: the mismatch itself, uncaught
            assert o.exitcode == 1 and o.error.startswith("CollectiveMismatchError"), o.describe()
            assert any(s in o.error for s in said), o.error
        else:  # released by rank 0 before that: its barrier names the failure
            assert "CollectiveMismatchError" in o.value, o.value
            assert any(s in o.value for s in said), o.value


# ---------------------------------------------------------------- nested timeouts


def test_nested_blocks_wait_with_their_own_timeouts(store):
    def body():
        rank = ad.get_rank()
        start = time.monotonic()
        try:
            with ad.zero_first(timeout=60):
                if rank == 1:
                    time.sleep(4)  # rank 1 reaches the inner block late
                with ad.zero_first(timeout=1):
                    pass
            ad.barrier()  # rank 0 confirms both blocks here: the inner one times out first
        except (ad.RankTimeoutError, ad.RankFailedError) as exc:
            return str(exc), time.monotonic() - start
        return None, time.monotonic() - start

    out = run_distributed(body, 2, store=store, timeout=60)
    message, elapsed = out[0]
    assert message is not None and "zero_first block #2" in message, out
    assert "timeout=1" in message and elapsed < 3.5, out  # the inner block's own timeout


# ---------------------------------------------------------------- store calls and keys


def _hold_until_set(bit: int):
    """A ``StoreCalls.before`` hook: this rank's first call on a block's word 0 that is not
    the setting of its own bit (rank 0: its done; a waiter: its read after its arrival) waits
    until ``bit`` is set in the word, read on the uncounted store."""
    held = []

    def before(store, method, args):
        if held or method != "add" or args[0].count("/") != 3:
            return
        if args[1] == 0 or ad.get_rank() == 0:
            held.append(args[0])
            deadline = time.monotonic() + 30
            while not store.add(args[0], 0) & bit and time.monotonic() < deadline:
                time.sleep(0.001)
    return before


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_an_empty_block_costs_at_most_two_store_calls_per_rank(ws):
    def body():
        rank = ad.get_rank()
        with ad.zero_first():  # warm: the group's cache, the call site
            pass
        with count_store_calls() as calls:
            # the rank that comes second: its bit; rank 0's done also wakes the wake key of the
            # waiters asleep by then (blocks.py: WAKE_BIT)
            ad.barrier()
            if rank == 0:
                time.sleep(0.2)  # the others arrive first: rank 0's done sees every bit
            with ad.zero_first():
                pass
        late_first = calls.on()
        with count_store_calls() as calls:
            ad.barrier()
            if rank != 0:
                time.sleep(0.2)  # rank 0 is done first: a waiter's arrival releases it
            with ad.zero_first():
                pass
        late_waiter = calls.on()
        # both at once, in the order that costs most without a wait: a waiter arrives before
        # rank 0 is done (rank 0's done is held until the last waiter's bit is set) and reads
        # the word once after it (held until rank 0's bit is set)
        ad.barrier()
        with count_store_calls() as calls:
            calls.before = _hold_until_set(1 << (ad.get_world_size() - 1) if rank == 0 else 1)
            with ad.zero_first():
                pass
        together = calls.on()
        return late_first, late_waiter, together

    outcomes = run_distributed(body, ws, timeout=120)
    for rank, (late_first, late_waiter, together) in enumerate(outcomes):
        if rank == 0:
            assert late_first == 2, late_first  # its done and the wake-up
            assert together == 1, together  # its done (arrivals confirmed by it or later)
        else:
            assert late_waiter == 1, late_waiter  # its arrival, which releases it
        if rank == ws - 1:
            assert together == 2, together  # its arrival, its one read


@pytest.mark.parametrize("ws", [2, 3])
def test_a_loop_of_blocks_keeps_the_key_count_flat(ws, store):
    def body():
        count = store_of().num_keys
        ad.barrier()
        before = count()
        ad.barrier()  # nobody starts a block (and adds keys) before every rank counted
        peak = 0
        for i in range(1000):
            with ad.zero_first():
                pass
            if i % 50 == 0:
                peak = max(peak, count() - before)
        for _ in range(200):
            ad.do_n_at_a_time(lambda: None, n=1)
        ad.barrier()
        deadline = time.monotonic() + 5  # the background deletions catch up
        while count() - before > 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        after = count() - before
        ad.barrier()
        return peak, after

    for peak, after in run_distributed(body, ws, store=store, timeout=120):
        # the old blocks' keys go in the background, a few behind: each rank's backlog is
        # bounded (8 keys; then it deletes its own), so the count does not grow with blocks
        assert peak <= 8 * ws + 4 and after <= 4, (peak, after)


# ---------------------------------------------------------------- different helpers in one collective


@pytest.mark.parametrize("ws", [2, 3])
def test_different_value_helpers_in_one_collective_raise_naming_both(ws, store):
    def body():
        assert not ad.is_debug_enabled()
        try:
            if ad.get_rank() == 0:
                ad.reduce_and_broadcast(lambda: 1, sum)
            else:
                ad.gather_from_all_ranks(lambda: 1)
        except ad.CollectiveMismatchError as exc:
            return str(exc)
        return "no error"

    for message in run_distributed(body, ws, store=store, timeout=60):
        assert "rank 0: reduce_and_broadcast" in message, message
        assert "rank 1: gather_from_all_ranks(dst=0)" in message, message
        assert f"{HERE}:" in message and "AXOLOTL_DIST_DEBUG=1" in message, message


@pytest.mark.parametrize("ws", [2, 3])
def test_a_broadcast_meeting_another_helper_or_source_is_named_by_every_rank(ws):
    """Every helper's header round is the same collective (every rank's header to every rank),
    so the source of a broadcast learns of the mismatch too, and ranks that disagree on the
    source meet an error naming each rank's, not a hang."""
    def body():
        rank = ad.get_rank()
        out = []
        for call in (lambda: ad.compute_and_broadcast(lambda: 7) if rank == 0
                     else ad.broadcast_object(None),
                     lambda: ad.synchronize_value(torch.ones(2), src=min(rank, 1))):
            try:
                out.append(call())
            except ad.CollectiveMismatchError as exc:
                out.append(str(exc))
        return out

    for helpers, sources in run_distributed(body, ws, timeout=60):
        assert "rank 0: compute_and_broadcast(src=0), rank 1: broadcast_object(src=0)" \
            in helpers, helpers
        assert "rank 0: synchronize_value(src=0), rank 1: synchronize_value(src=1)" \
            in sources, sources
