"""zero_first and do_n_at_a_time on real gloo ranks: order, nesting, failures, pairing, store keys."""

import logging
import os
import re
import signal
import time

import pytest

import axolotl_dist as ad
from axolotl_dist.testing import run_distributed, run_distributed_outcomes
from probes import count_store_calls

PG_TIMEOUT = 300.0  # the group's collective timeout: failures must surface long before it


def _stamp(tmp, rank, event):
    """Append ``rank event`` to the shared events file: one small ``O_APPEND`` write, so the
    file's line order is the order the ranks got there (no clocks compared)."""
    fd = os.open(os.path.join(tmp, "events"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, f"{rank} {event}\n".encode())
    finally:
        os.close(fd)


def _settled(count, before, limit=4, seconds=30.0):
    """The store's key count once the kit's background deletions have caught up (finished
    blocks' keys go one block late, on another thread), at most ``seconds`` later."""
    deadline = time.monotonic() + seconds
    now = count()
    while now - before > limit and time.monotonic() < deadline:
        time.sleep(0.01)
        now = count()
    return now


def _events(tmp):
    """``(position, rank, event)`` for every stamp, in the order they were written."""
    with open(os.path.join(tmp, "events")) as fh:
        rows = [line.split() for line in fh]
    return [(i, int(r), e) for i, (r, e) in enumerate(rows)]


# ---------------------------------------------------------------- zero_first ordering


@pytest.mark.parametrize("ws", [2, 3])
def test_zero_first_rank0_writes_file_others_read_it(tmp_path, ws):
    path = tmp_path / "cache.txt"

    def body():
        with ad.zero_first():
            if ad.get_rank() == 0:
                time.sleep(0.3)  # the others must really wait for this
                path.write_text("prepared by rank 0")
            return path.read_text()

    assert run_distributed(body, ws, timeout=60) == ["prepared by rank 0"] * ws


def test_zero_first_single_process_just_runs():
    ran = []
    with ad.zero_first():
        ran.append(1)
    with ad.zero_first(is_main=True, timeout=1):
        ran.append(2)
    assert ran == [1, 2]
    assert not ad.is_initialized()


def test_zero_first_many_consecutive_blocks_stay_paired(tmp_path):
    def body():
        seen = []
        for i in range(30):
            with ad.zero_first():
                if ad.get_rank() == 0:
                    (tmp_path / f"f{i}").write_text(str(i))
                seen.append(int((tmp_path / f"f{i}").read_text()))
        return seen

    assert run_distributed(body, 3, timeout=60) == [list(range(30))] * 3


@pytest.mark.parametrize("ws", [2, 3])
def test_zero_first_nested_two_levels(tmp_path, ws):
    def body():
        rank = ad.get_rank()
        with ad.zero_first():
            _stamp(tmp_path, rank, "outer-start")
            with ad.zero_first():
                _stamp(tmp_path, rank, "inner")
                time.sleep(0.1)
            _stamp(tmp_path, rank, "outer-end")
        return True

    run_distributed(body, ws, timeout=60)
    events = _events(tmp_path)
    t = {(r, e): ts for ts, r, e in events}
    for r in range(1, ws):
        # every other rank enters the outer block only after rank 0 left it entirely
        assert t[(r, "outer-start")] >= t[(0, "outer-end")]
        assert t[(r, "inner")] >= t[(0, "inner")]
    assert len(events) == 3 * ws


def test_zero_first_several_first_ranks_run_concurrently(tmp_path):
    # ranks 0 and 2 go first (e.g. one per filesystem); 1 and 3 wait for both of them
    def body():
        rank = ad.get_rank()
        with ad.zero_first(is_main=rank % 2 == 0):
            _stamp(tmp_path, rank, "start")
            if rank % 2 == 0:
                time.sleep(0.5 if rank == 0 else 1.0)
            _stamp(tmp_path, rank, "end")
        return rank

    assert run_distributed(body, 4, timeout=60) == [0, 1, 2, 3]
    t = {(r, e): ts for ts, r, e in _events(tmp_path)}
    assert t[(2, "start")] < t[(0, "end")] and t[(0, "start")] < t[(2, "end")]  # concurrent
    last_first = max(t[(0, "end")], t[(2, "end")])
    assert t[(1, "start")] >= last_first and t[(3, "start")] >= last_first


def test_zero_first_fs_local_rank_idiom(tmp_path):
    # two simulated nodes without a shared filesystem: local rank 0 of each node goes first
    def body():
        with ad.zero_first(is_main=ad.get_fs_local_rank() == 0):
            _stamp(tmp_path, ad.get_rank(), "body")
        return ad.get_fs_local_rank()

    env = lambda r: {"LOCAL_RANK": str(r % 2), "LOCAL_WORLD_SIZE": "2", "NODE_RANK": str(r // 2),
                     "AXOLOTL_DIST_SHARED_FS": "0"}
    assert run_distributed(body, 4, rank_env=env, timeout=60) == [0, 1, 0, 1]
    t = {r: ts for ts, r, _ in _events(tmp_path)}
    assert min(t[1], t[3]) >= max(t[0], t[2])


def test_zero_first_nested_explicit_is_main(tmp_path):
    def body():
        rank = ad.get_rank()
        with ad.zero_first(is_main=rank == 0):
            with ad.zero_first(is_main=rank in (0, 1)):
                _stamp(tmp_path, rank, "inner")
        return True

    run_distributed(body, 3, timeout=60)
    t = {r: ts for ts, r, _ in _events(tmp_path)}
    assert t[2] >= t[0] and t[1] >= t[0]


def test_zero_first_all_ranks_main_runs_without_waiting():
    def body():
        with ad.zero_first(is_main=True):
            return ad.get_rank()

    assert run_distributed(body, 3, timeout=60) == [0, 1, 2]


# ---------------------------------------------------------------- zero_first failures


@pytest.mark.parametrize("ws", [2, 3])
def test_zero_first_rank0_raises_others_raise_rank_failed_fast(ws, store):
    def body():
        with ad.zero_first():
            if ad.get_rank() == 0:
                raise ValueError("tokenizer exploded")
            return "ran the block"  # must not happen on other ranks

    start = time.monotonic()
    outcomes = run_distributed_outcomes(body, ws, timeout=60, pg_timeout=PG_TIMEOUT, store=store)
    assert isinstance(outcomes[0].exception, ValueError)
    for o in outcomes[1:]:
        assert isinstance(o.exception, ad.RankFailedError), o.describe()
        assert o.exception.rank == 0 and o.exception.exc_type == "ValueError"
        assert re.search(r"rank 0 failed in zero_first block #1 at \S*test_ordering\.py:\d+ in "
                         r"body: ValueError: tokenizer exploded", o.error), o.error
        assert "tokenizer exploded" in o.exception.remote_traceback
        assert o.value is None
    assert time.monotonic() - start < 5.0


def test_zero_first_explicit_first_rank_raises(store):
    def body():
        rank = ad.get_rank()
        with ad.zero_first(is_main=rank in (0, 1)):
            if rank == 1:
                raise KeyError("missing column")
        return "ok"

    outcomes = run_distributed_outcomes(body, 3, timeout=60, pg_timeout=PG_TIMEOUT, store=store)
    assert outcomes[0].value == "ok"
    assert isinstance(outcomes[1].exception, KeyError)
    assert isinstance(outcomes[2].exception, ad.RankFailedError)
    assert outcomes[2].exception.rank == 1
    assert outcomes[2].elapsed < 5.0


def test_an_extra_block_on_rank_0_is_named_not_the_rank_that_finished(store):
    # rank 0 alone enters a block; both then meet in a helper, and rank 1 finishes its script:
    # rank 0 learns that rank 1 never reached the block, and names its own block as the cause
    def body():
        if ad.get_rank() == 0:
            with ad.zero_first():  # an extra block, on rank 0 only
                pass
        return ad.reduce_and_broadcast(lambda: 1, sum)

    outcomes = run_distributed_outcomes(body, 2, timeout=60, pg_timeout=PG_TIMEOUT, store=store)
    assert outcomes[1].value == 2, outcomes[1].describe()
    error = outcomes[0].exception
    assert isinstance(error, ad.CollectiveMismatchError), outcomes[0].describe()
    assert not isinstance(error, ad.RankFailedError)
    assert re.search(r"zero_first block #1 at \S*test_ordering\.py:\d+ in body on rank 0 was "
                     r"never reached by rank\(s\) \[1\]: they finished their script and exited "
                     r"without entering it", str(error)), str(error)
    assert error.missing == (1,)
    assert outcomes[0].elapsed < 15.0


@pytest.mark.parametrize("ws", [2, 3])
def test_zero_first_rank0_killed_survivors_raise(ws, store):
    def body():
        with ad.zero_first():
            if ad.get_rank() == 0:
                time.sleep(0.5)
                os.kill(os.getpid(), signal.SIGKILL)
        return "survived"

    outcomes = run_distributed_outcomes(body, ws, timeout=60, pg_timeout=PG_TIMEOUT, store=store)
    assert outcomes[0].exitcode == -signal.SIGKILL
    for o in outcomes[1:]:
        assert isinstance(o.exception, ad.RankFailedError), o.describe()
        assert o.exception.rank == 0 and o.exception.exc_type == "died"
        if store == "rank0":  # the store died with it
            assert "rank 0 (the store host) died or exited" in o.error
        else:
            assert "exited without reporting an error" in o.error
        assert o.elapsed < 15.0


def test_zero_first_timeout_names_the_ranks_waited_for(store):
    def body():
        with ad.zero_first(timeout=1.0):
            if ad.get_rank() == 0:
                time.sleep(2.5)
        return "ok"

    outcomes = run_distributed_outcomes(body, 3, timeout=60, store=store)
    assert outcomes[0].value == "ok"
    for o in outcomes[1:]:
        assert isinstance(o.exception, ad.RankTimeoutError), o.describe()
        assert o.exception.waiting_for == (0,)
        assert "waiting 1 s for rank(s) [0] to finish zero_first block #1" in o.error
        assert o.elapsed < 3.5


def test_zero_first_wait_is_not_bound_by_collective_timeout():
    # the group's collective timeout is 2 s; rank 0 works 3 s; rank 1 must simply wait
    def body():
        with ad.zero_first():
            if ad.get_rank() == 0:
                time.sleep(3)
        ad.barrier()
        return "ok"

    assert run_distributed(body, 2, timeout=60, pg_timeout=2.0) == ["ok", "ok"]


def test_zero_first_waiting_rank_logs_whom_it_waits_for(tmp_path):
    def body():
        records = []
        handler = logging.Handler()
        handler.emit = lambda rec: records.append(rec.getMessage())
        logger = logging.getLogger("axolotl_dist")
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        with ad.zero_first():
            if ad.get_rank() == 0:
                time.sleep(1.5)
        return records

    out = run_distributed(body, 2, timeout=60, env={"AXOLOTL_DIST_WAIT_LOG_INTERVAL": "0.4"})
    assert out[0] == []
    assert any("rank 1 has waited" in m and "for rank(s) [0] to finish zero_first block #1" in m
               for m in out[1]), out[1]


def test_zero_first_bad_timeout():
    with pytest.raises(ValueError, match=r"zero_first\(timeout=-1\) must be a positive number of seconds"):
        with ad.zero_first(timeout=-1):
            pass


# ---------------------------------------------------------------- do_n_at_a_time


@pytest.mark.parametrize("ws,n", [(2, 1), (3, 1), (4, 2), (3, 2)])
def test_do_n_at_a_time_order(tmp_path, ws, n):
    def body():
        rank = ad.get_rank()

        def f():
            _stamp(tmp_path, rank, "start")
            time.sleep(0.2)
            _stamp(tmp_path, rank, "end")
            return rank * 10

        return ad.do_n_at_a_time(f, n=n)

    assert run_distributed(body, ws, timeout=60) == [r * 10 for r in range(ws)]
    events = sorted(_events(tmp_path))
    running, peak, calls = 0, 0, []
    for _, r, e in events:
        running += 1 if e == "start" else -1
        peak = max(peak, running)
        if e == "start":
            calls.append(r)
    assert sorted(calls) == list(range(ws))  # each rank called f exactly once
    assert peak <= n
    rounds = -(-ws // n)
    start = {r: ts for ts, r, e in events if e == "start"}
    end = {r: ts for ts, r, e in events if e == "end"}
    for r in range(ws):  # round k starts after every rank of the earlier rounds ended
        for q in range(ws):
            if q % rounds < r % rounds:
                assert start[r] >= end[q]


def test_do_n_at_a_time_defaults_to_one_rank_per_node(tmp_path):
    def body():
        return ad.do_n_at_a_time(lambda: _stamp(tmp_path, ad.get_rank(), "call") or ad.get_num_nodes())

    env = lambda r: {"LOCAL_RANK": str(r % 2), "LOCAL_WORLD_SIZE": "2", "NODE_RANK": str(r // 2)}
    assert run_distributed(body, 4, rank_env=env, timeout=60) == [2, 2, 2, 2]
    order = [r for _, r, _ in sorted(_events(tmp_path))]
    assert set(order[:2]) == {0, 2} and set(order[2:]) == {1, 3}


@pytest.mark.parametrize("failing", [0, 2])
def test_do_n_at_a_time_failure_raises_everywhere(failing, store):
    def body():
        def f():
            if ad.get_rank() == failing:
                raise OSError("disk full")
            return "ok"

        return ad.do_n_at_a_time(f, n=1)

    start = time.monotonic()
    outcomes = run_distributed_outcomes(body, 3, timeout=60, pg_timeout=PG_TIMEOUT, store=store)
    assert isinstance(outcomes[failing].exception, OSError)
    for o in outcomes:
        if o.rank != failing:
            assert isinstance(o.exception, ad.RankFailedError), o.describe()
            assert o.exception.rank == failing
            assert f"rank {failing} failed in do_n_at_a_time call #1: OSError: disk full" in o.error
    assert time.monotonic() - start < 10


def test_do_n_at_a_time_single_process_and_bad_arguments():
    assert ad.do_n_at_a_time(lambda: 7) == 7
    with pytest.raises(ValueError, match=r"do_n_at_a_time\(n=0\) must be >= 1"):
        ad.do_n_at_a_time(lambda: 7, n=0)
    with pytest.raises(ValueError, match=r"world_size=4\) disagrees with the actual world size 1"):
        ad.do_n_at_a_time(lambda: 7, world_size=4)

    def body():
        with pytest.raises(ValueError, match=r"do_n_at_a_time\(local_rank=0\) disagrees"):
            ad.do_n_at_a_time(lambda: 1, local_rank=0)
        return True

    outcomes = run_distributed_outcomes(body, 2, timeout=60)
    assert outcomes[1].value is True


# ---------------------------------------------------------------- compute_and_broadcast failure


def test_compute_and_broadcast_failure_reaches_other_ranks(store):
    def body():
        return ad.compute_and_broadcast(lambda: 1 / 0)

    outcomes = run_distributed_outcomes(body, 3, timeout=60, pg_timeout=PG_TIMEOUT, store=store)
    assert isinstance(outcomes[0].exception, ZeroDivisionError)
    for o in outcomes[1:]:
        assert isinstance(o.exception, ad.RankFailedError)
        assert "rank 0 failed in compute_and_broadcast: ZeroDivisionError" in o.error
        assert o.elapsed < 5




# ---------------------------------------------------------------- pairing, store keys, stops


def test_unpaired_zero_first_blocks_raise_on_both_ranks_naming_both_sites(store):
    # a zero_first inside a @zero_only function runs on rank 0 only, so rank 1's first block
    # would pair with it: both ranks must raise, naming both call sites (debug mode off)
    @ad.zero_only
    def prepare_on_main():
        with ad.zero_first():
            return "main-only block"

    def body():
        start = time.monotonic()
        try:
            prepare_on_main()
            with ad.zero_first():
                pass
        except ad.CollectiveMismatchError as exc:
            return str(exc), time.monotonic() - start
        return "no error", None

    outcomes = run_distributed_outcomes(body, 2, store=store, timeout=60, pg_timeout=PG_TIMEOUT)
    for o in outcomes:
        assert o.ok, o.describe()
        message, elapsed = o.value
        assert elapsed is not None and elapsed < 10.0, message
        assert "zero_first blocks do not pair: block #1" in message, message
        assert re.search(r"test_ordering\.py:\d+ in prepare_on_main on rank 0", message), message
        assert re.search(r"test_ordering\.py:\d+ in body on rank 1", message), message


def test_blocks_leave_no_keys_in_the_store(store):
    def body():
        from probes import store_of

        count = store_of().num_keys
        ad.barrier()
        before = count()
        ad.barrier()  # nobody starts a block (and adds keys) before every rank counted
        for _ in range(1000):
            with ad.zero_first():
                pass
        for _ in range(1000):
            ad.do_n_at_a_time(lambda: None, n=1)
        ad.barrier()
        after = _settled(count, before)
        ad.barrier()  # nobody leaves before both have counted
        return before, after

    for before, after in run_distributed(body, 2, store=store, timeout=120):
        assert after - before <= 4, (before, after)  # a constant, not per block


def test_stopped_first_rank_is_reported_and_the_wait_times_out(store, tmp_path):
    # rank 0 is stopped (SIGSTOP) inside its block; with store="rank0" the store stops with it
    pid_file = tmp_path / "rank0.pid"

    def body():
        rank = ad.get_rank()
        records = []
        handler = logging.Handler()
        handler.emit = lambda rec: records.append((time.monotonic(), rec.levelno, rec.getMessage()))
        logging.getLogger("axolotl_dist").addHandler(handler)
        start = time.monotonic()
        try:
            with ad.zero_first(timeout=3.0):
                if rank == 0:
                    pid_file.write_text(str(os.getpid()))
                    time.sleep(0.5)  # the others are waiting by now
                    os.kill(os.getpid(), signal.SIGSTOP)
        except ad.RankTimeoutError as exc:
            # the last survivor to time out ends rank 0 (earlier, a survivor still waiting
            # would rightly name rank 0's death instead of its own timeout)
            (tmp_path / f"timed-out-{rank}").touch()
            if len(list(tmp_path.glob("timed-out-*"))) == 2:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            return {"error": str(exc), "waiting_for": exc.waiting_for,
                    "elapsed": time.monotonic() - start,
                    "warnings": [(t - start, m) for t, lvl, m in records if lvl == logging.WARNING]}
        return "no timeout"

    outcomes = run_distributed_outcomes(body, 3, store=store, timeout=40, pg_timeout=PG_TIMEOUT)
    assert outcomes[0].exitcode == -signal.SIGKILL  # stopped, then killed by a survivor
    for o in outcomes[1:]:
        assert o.ok, o.describe()
        got = o.value
        assert got["waiting_for"] == (0,)
        assert 3.0 <= got["elapsed"] < 6.0, got
        stopped = [(t, m) for t, m in got["warnings"] if "rank 0" in m and "stopped" in m]
        assert stopped, got["warnings"]
        assert stopped[0][0] < 2 * 15.0, stopped  # within 2x the heartbeat timeout (15 s)
#: Above this many ranks a block's arrival bits and counts no longer fit one store integer.
WIDE = 32


def test_the_wide_block_layout_beyond_31_ranks(tmp_path):
    # above 31 ranks a block's arrival bits and counts move to separate keys: run ordering,
    # several first ranks, a failure and the cleanup on 32 real ranks
    def body():
        from probes import store_of

        rank = ad.get_rank()
        count = store_of().num_keys
        ad.barrier()
        before = count()
        ad.barrier()  # nobody starts a block (and adds keys) before every rank counted
        for i in range(3):
            with ad.zero_first():
                _stamp(tmp_path, rank, f"default-{i}")
            with ad.zero_first(is_main=rank != 1):
                _stamp(tmp_path, rank, f"explicit-{i}")
        ad.barrier()
        after = _settled(count, before)
        ad.barrier()
        failed = None  # rank 0, a first rank too, runs its own body and waits for nobody
        try:
            with ad.zero_first(is_main=rank in (0, 2)):
                if rank == 2:
                    raise KeyError("wide")
        except (KeyError, ad.RankFailedError) as exc:
            failed = type(exc).__name__, getattr(exc, "rank", None)
        return after - before, failed

    out = run_distributed(body, WIDE, timeout=120)
    for r, (grown, failed) in enumerate(out):
        # the last block of each kind keeps its two words (deleted one block late), the last
        # default block its wake key too if a waiter blocked in it
        assert grown <= 5, grown
        expected = {0: None, 2: ("KeyError", None)}.get(r, ("RankFailedError", 2))
        assert failed == expected, (r, failed)
    t = {(r, e): ts for ts, r, e in _events(tmp_path)}
    for i in range(3):
        for r in range(1, WIDE):
            assert t[(r, f"default-{i}")] >= t[(0, f"default-{i}")]
        firsts = max(t[(r, f"explicit-{i}")] for r in range(WIDE) if r != 1)
        assert t[(1, f"explicit-{i}")] >= firsts


def _store_connections():
    """This process's TCP connections to the store (``MASTER_PORT`` on 127.0.0.1), from
    /proc: the sockets it holds whose peer is that port."""
    port = int(os.environ["MASTER_PORT"])
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = 0
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as fh:
            next(fh)
            for row in fh:
                cols = row.split()
                remote_port = int(cols[2].rsplit(":", 1)[1], 16)
                if cols[3] == "01" and remote_port == port and cols[9] in inodes:  # ESTABLISHED
                    found += 1
    return found


@pytest.mark.parametrize("store", ["parent", "rank0"])
def test_a_rank_opens_one_store_connection_of_its_own_however_many_waits_sleep(store):
    # every connection costs the store's host a reverse name lookup in its event loop (W ranks
    # opening one each at once stalled the store for seconds at W >= 16): a rank adds one
    # connection to torch's, its heartbeat's, and the default group's key waiters borrow it
    def body():
        rank = ad.get_rank()
        ad.barrier()
        time.sleep(0.3)  # past every heartbeat's spread start (3 ranks: within 0.12 s)
        before = _store_connections()
        for _ in range(3):
            with ad.zero_first():
                if rank == 0:
                    time.sleep(1.0)  # the others block on the block's wake key
        ad.barrier()
        return before, _store_connections()

    def plain():
        import torch.distributed as dist

        dist.init_process_group("gloo")
        dist.barrier()
        return _store_connections()

    torch_own = run_distributed(plain, 3, store=store, timeout=60, init=False)
    out = run_distributed(body, 3, store=store, timeout=60)
    for rank in range(3):
        before, after = out[rank]
        assert before == after == torch_own[rank] + 1, (out, torch_own)


@pytest.mark.parametrize("store", ["parent", "rank0"])
def test_a_long_zero_first_wait_sleeps_instead_of_polling(store):
    # a waiter polls briefly, then blocks on the block's wake key (one compare_set to ask for it):
    # its block store calls do not grow with the wait, and rank 0's done wakes it at once
    def body():
        rank = ad.get_rank()
        with ad.zero_first():
            pass  # warm
        ad.barrier()
        with count_store_calls() as calls:
            with ad.zero_first():
                if rank == 0:
                    time.sleep(4.0)
                    done = time.time()
                else:
                    done = None
        released = time.time()
        return sum(calls.values()), calls, done, released

    out = run_distributed(body, 3, store=store, timeout=60)
    done = out[0][2]
    for rank in (1, 2):
        total, calls, _, released = out[rank]
        # polling every 50 ms for 4 s was ~100; with 20 inline polls and a look a second ~30;
        # now 15-17: 5 inline, the pairing check, the wake request, looks every 4 s, the wait's marks
        assert total <= 20, calls
        assert released - done < 0.5, released - done

