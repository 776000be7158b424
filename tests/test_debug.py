"""Debug mode on real gloo ranks: mismatched helpers, arguments and missing ranks are named.

Every multi-rank scenario runs with a 300 s collective timeout and must make every surviving
rank raise :class:`CollectiveMismatchError` within 10 s, naming the ranks, the helpers and the
call sites (this file and the line of the call).
"""

import os
import sys
import time

import pytest
import torch

import axolotl_dist as ad
from axolotl_dist import debug as ad_debug
from axolotl_dist.testing import run_distributed, run_distributed_outcomes
from probes import reset_process_state

PG_TIMEOUT = 300.0
DEADLINE = 10.0  # seconds within which every surviving rank must raise
DEBUG_ENV = {"AXOLOTL_DIST_DEBUG": "1"}
HERE = os.path.basename(__file__)


def _next_line() -> int:
    """The line after the caller's: where the call under test is written."""
    return sys._getframe(1).f_lineno + 1


def _raises(call):
    """Run ``call``; return (seconds, message, calls, missing) of its debug error, or its result."""
    t0 = time.monotonic()
    try:
        result = call()
    except ad.CollectiveMismatchError as exc:
        return {"elapsed": time.monotonic() - t0, "message": str(exc), "calls": exc.calls,
                "missing": exc.missing}
    return {"result": result}


_STORE = {"placement": "parent"}


@pytest.fixture(autouse=True)
def _placement(store):
    """Every debug-mode scenario runs with the store in the test process and in rank 0."""
    _STORE["placement"] = store


def _run(body, ws, env=DEBUG_ENV, timeout=40.0):
    return run_distributed_outcomes(body, ws, env=env, timeout=timeout, pg_timeout=PG_TIMEOUT,
                                    store=_STORE["placement"])


def _assert_debug_error(outcome, *fragments):
    assert outcome.ok, outcome.describe()
    got = outcome.value
    assert "message" in got, f"rank {outcome.rank} raised nothing: {got}"
    assert got["elapsed"] < DEADLINE, got
    for fragment in fragments:
        assert fragment in got["message"], (fragment, got["message"])
    return got


# ---------------------------------------------------------------- the five scenarios


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_different_helpers_are_named_rank_by_rank(ws):
    def body():
        if ad.get_rank() == 1:
            line = _next_line()
            return line, _raises(lambda: ad.gather_from_all_ranks(lambda: 1))
        line = _next_line()
        return line, _raises(lambda: ad.compute_and_broadcast(lambda: 2))

    outcomes = _run(body, ws)
    lines = {o.rank: o.value[0] for o in outcomes}
    for o in outcomes:
        o.value = o.value[1]
        got = _assert_debug_error(
            o, "mismatched call #1",
            "rank 0: compute_and_broadcast(src=0)", "rank 1: gather_from_all_ranks(dst=0)",
            f"{HERE}:{lines[0]}", f"{HERE}:{lines[1]}", "called different helpers")
        assert sorted(got["calls"]) == list(range(ws))
        assert got["missing"] == ()
        for rank in range(2, ws):
            assert f"rank {rank}: compute_and_broadcast(src=0)" in got["message"]


@pytest.mark.parametrize("helper", ["compute_and_broadcast", "broadcast"])
@pytest.mark.parametrize("ws", [2, 3])
def test_broadcast_from_different_src(ws, helper):
    def body():
        src = 1 if ad.get_rank() == 1 else 0
        if helper == "broadcast":
            return _raises(lambda: ad.broadcast(torch.zeros(2), src=src))
        return _raises(lambda: ad.compute_and_broadcast(lambda: 1.5, src=src))

    for o in _run(body, ws):
        _assert_debug_error(o, "the ranks disagree on src", "rank 0: 0", "rank 1: 1",
                            f"rank 1: {helper}(src=1", f"rank 0: {helper}(src=0", HERE)


@pytest.mark.parametrize("ws", [2, 3])
def test_all_reduce_of_different_shapes_is_the_shape_checks_error_in_debug_mode_too(ws):
    """Debug mode agrees on the helper and its op; the shapes are the always-on shape check's
    (one error type for a shape mismatch, debug mode on or off: tests/test_shape_checks.py)."""
    def body():
        shape = (3,) if ad.get_rank() == 1 else (2,)
        try:
            ad.all_reduce(torch.ones(shape))
        except ad.TensorMismatchError as exc:
            return str(exc)
        return "returned"

    for o in _run(body, ws):
        assert o.ok, o.describe()
        assert "all_reduce: tensor differs across ranks: float32[2] on rank" in o.value, o.value
        assert "float32[3] on rank 1" in o.value, o.value


@pytest.mark.parametrize("ws", [2, 3])
def test_skipped_barrier_then_another_helper(ws):
    def body():
        rank = ad.get_rank()
        if rank != 1:
            line = _next_line()
            got = _raises(lambda: ad.barrier())
            if "result" not in got:
                return line, got
        line = _next_line()
        return line, _raises(lambda: ad.all_reduce(torch.ones(2)))

    outcomes = _run(body, ws)
    for o in outcomes:
        line, o.value = o.value
        _assert_debug_error(o, "rank 0: barrier()", "rank 1: all_reduce(", f"{HERE}:{line}",
                            "called different helpers")


@pytest.mark.parametrize("ws", [2, 3])
def test_skipped_barrier_while_stuck_elsewhere_is_named_after_debug_timeout(ws, store):
    # rank 1 skips the barrier and is busy (not in any helper): the others name it once the
    # debug timeout has passed, although the group's timeout is 300 s. One case keeps the
    # default (5 s); the others set AXOLOTL_DIST_DEBUG_TIMEOUT to 1.5 s.
    default = ws == 2 and store == "parent"
    limit = 5.0 if default else 1.5
    env = DEBUG_ENV if default else {**DEBUG_ENV, "AXOLOTL_DIST_DEBUG_TIMEOUT": str(limit)}

    def body():
        ad.barrier()  # a matched call: its site becomes rank 1's "last checked call"
        if ad.get_rank() == 1:
            time.sleep(limit + 3)
            return "stuck elsewhere"
        return _raises(ad.barrier)

    outcomes = _run(body, ws, env=env)
    assert outcomes[1].value == "stuck elsewhere"
    for o in outcomes:
        if o.rank == 1:
            continue
        got = _assert_debug_error(o, "rank(s) [1] did not reach call #2 (barrier())",
                                  f"within {limit:g} s", "its last checked call was #1 barrier()",
                                  HERE)
        assert got["elapsed"] >= limit - 0.5
        assert got["missing"] == (1,)


@pytest.mark.parametrize("ws", [2, 3])
def test_rank_that_exits_early_is_named(ws):
    def body():
        ad.barrier()
        if ad.get_rank() == 1:
            os._exit(0)  # leaves without a word: no exception, no cleanup
        return _raises(ad.barrier)

    outcomes = _run(body, ws)
    assert outcomes[1].exitcode == 0 and outcomes[1].value is None
    for o in outcomes:
        if o.rank != 1:
            got = _assert_debug_error(o, "rank(s) [1] exited before reaching call #2 (barrier())",
                                      "rank 1: exited", "its last checked call was #1 barrier()",
                                      "rank 0: barrier()\n      at ", HERE)
            assert got["missing"] == (1,)


# ---------------------------------------------------------------- more mismatches


def test_zero_first_against_barrier_and_do_n_at_a_time_n():
    def body():
        rank = ad.get_rank()

        def enter_zero_first():
            with ad.zero_first():
                return "entered"

        first = _raises(enter_zero_first if rank == 0 else ad.barrier)
        return first

    for o in _run(body, 2):
        _assert_debug_error(o, "rank 0: zero_first(is_main=default (group rank 0))",
                            "rank 1: barrier()")

    def body_n():
        return _raises(lambda: ad.do_n_at_a_time(lambda: 1, n=1 + ad.get_rank()))

    for o in _run(body_n, 2):
        _assert_debug_error(o, "the ranks disagree on n", "rank 0: 1", "rank 1: 2")


def test_value_helper_given_a_tensor_on_one_rank_and_a_number_on_another():
    def body():
        value = torch.ones(2) if ad.get_rank() == 0 else 1.0
        return _raises(lambda: ad.all_reduce_value(value))

    for o in _run(body, 2):
        _assert_debug_error(o, "the ranks disagree on value", "tensor float32[2]", "number")


def test_late_rank_learns_that_the_others_gave_up():
    def body():
        ad.barrier()
        if ad.get_rank() == 1:
            time.sleep(2.5)
        return _raises(ad.barrier)

    outcomes = _run(body, 2, env={**DEBUG_ENV, "AXOLOTL_DIST_DEBUG_TIMEOUT": "1"})
    _assert_debug_error(outcomes[0], "rank(s) [1] did not reach call #2", "within 1 s")
    late = _assert_debug_error(outcomes[1], "rank 1 reached barrier()",
                               "after another rank had given up waiting for it")
    assert late["elapsed"] < 1.0  # told at once, not after another timeout


# ---------------------------------------------------------------- matched calls work normally


@pytest.mark.parametrize("store", ["parent"])  # not a fault: one placement is enough
@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_matched_calls_return_the_same_values_as_without_debug_mode(ws):
    def body():
        rank = ad.get_rank()
        out = [
            ad.compute_and_broadcast(lambda: 0.1),
            ad.gather_from_all_ranks(lambda: rank, dst=0),
            ad.gather_scalar_from_all_ranks(lambda: 2**63 - 1, rank=0),
            ad.reduce_and_broadcast(lambda: rank, sum),
            ad.synchronize_value(rank + 7, src=0),
            ad.synchronize_flag(rank == 0),  # calls synchronize_value inside: checked once
            ad.all_reduce_value(rank + 1),
            ad.all_reduce_value(torch.ones(2), op="max").tolist(),
            ad.all_gather_object({"r": rank}),
            ad.broadcast_object({"x": None}),
            ad.broadcast_object_list([rank], src=0),
            ad.all_reduce(torch.full((2,), float(rank))).tolist(),
            ad.broadcast(torch.full((1,), float(rank)), src=ws - 1).tolist(),
            [t.tolist() for t in ad.all_gather(torch.arange(rank + 1))],
            ad.do_n_at_a_time(lambda: rank, n=2),
        ]
        with ad.zero_first():
            out.append("zf")
        with ad.zero_first(is_main=rank == ws - 1):
            out.append("zf2")
        ad.barrier()
        return out, ad.is_debug_enabled(), ad_debug.checked_calls()

    results = run_distributed(body, ws, env=DEBUG_ENV, timeout=60, pg_timeout=PG_TIMEOUT)
    plain = run_distributed(body, ws, timeout=60, pg_timeout=PG_TIMEOUT)
    for rank, ((out, on, checks), (out_plain, off, checks_plain)) in enumerate(zip(results, plain)):
        assert out == out_plain
        assert on and not off
        assert out[3] == sum(range(ws)) and out[6] == ws * (ws + 1) // 2
        assert out[1] == (list(range(ws)) if rank == 0 else None)
        # one check per helper call above (synchronize_flag and broadcast_object_list once each)
        assert checks == (18 if ws > 1 else 0) and checks_plain == 0


@pytest.mark.parametrize("store", ["parent"])  # not a fault: one placement is enough
def test_subgroup_calls_are_checked_within_the_subgroup():
    def body():
        import torch.distributed as dist

        sub = dist.new_group([0, 2])
        rank = ad.get_rank()
        if rank == 1:
            return "not a member"
        src = 0 if rank == 0 else 1  # group ranks 0 and 1 disagree
        ok = ad.all_reduce_value(rank, group=sub)
        return ok, _raises(lambda: ad.compute_and_broadcast(lambda: 3, src=src, group=sub))

    outcomes = _run(body, 3)
    assert outcomes[1].value == "not a member"
    for o in (outcomes[0], outcomes[2]):
        ok, o.value = o.value
        assert ok == 2
        _assert_debug_error(o, "the ranks disagree on src", "rank 1 (global 2)", "on group ")


@pytest.mark.parametrize("store", ["parent"])  # not a fault: one placement is enough
def test_debug_off_writes_nothing_to_the_store():
    def body():
        from probes import store_of

        ad.barrier()
        ad.compute_and_broadcast(lambda: 1)
        store = store_of()
        written = store.check(["axd/dbg/1/n"])
        torch.distributed.barrier()  # every rank has looked before any rank turns debug on
        with ad.debug_mode(timeout=3):
            on = ad.is_debug_enabled()
            ad.barrier()
        after = ad.is_debug_enabled(), store.check(["axd/dbg/1/n"])
        return written, on, after

    for written, on, after in run_distributed(body, 2, timeout=40):
        assert not written and on and after == (False, True)


# ---------------------------------------------------------------- switches and bad input


@pytest.mark.parametrize("store", ["parent"])  # not a fault: one placement is enough
def test_bad_env_value_names_the_variable():
    def body():
        return ad.barrier()

    outcomes = run_distributed_outcomes(body, 1, env={"AXOLOTL_DIST_DEBUG": "maybe"}, timeout=30)
    assert outcomes[0].error is not None
    assert "AXOLOTL_DIST_DEBUG='maybe' is not a switch" in outcomes[0].error
    assert "AXOLOTL_DIST_DEBUG=1" in outcomes[0].error


@pytest.mark.parametrize("store", ["parent"])  # not a fault: one placement is enough
def test_bad_debug_timeout_env_names_the_variable():
    def body():
        return ad.barrier()

    outcomes = run_distributed_outcomes(
        body, 2, env={**DEBUG_ENV, "AXOLOTL_DIST_DEBUG_TIMEOUT": "soon"}, timeout=30, grace=5)
    for o in outcomes:
        assert "AXOLOTL_DIST_DEBUG_TIMEOUT='soon' must be a positive number of seconds" in (o.error or "")


@pytest.mark.parametrize("store", ["parent"])  # not a fault: one placement is enough
@pytest.mark.parametrize("bad", [0, -1, "5", True])
def test_enable_debug_rejects_a_bad_timeout(bad):
    with pytest.raises(ad.DistributedConfigError, match=r"enable_debug\(timeout=\.\.\.\)=.* must be a positive"):
        ad.enable_debug(timeout=bad)
    assert not ad.is_debug_enabled()


@pytest.mark.parametrize("store", ["parent"])  # not a fault: one placement is enough
def test_switches_in_one_process(monkeypatch):
    assert not ad.is_debug_enabled()
    try:
        ad.enable_debug(timeout=2)
        assert ad.is_debug_enabled() and ad_debug.debug_timeout() == 2
        # single process, no group: helpers just run
        assert ad.compute_and_broadcast(lambda: 5) == 5
        assert ad.gather_from_all_ranks(lambda: 5) == [5]
        monkeypatch.setenv("AXOLOTL_DIST_DEBUG", "0")
        ad_debug.refresh_from_env()  # an explicit enable_debug() wins over the env
        assert ad.is_debug_enabled()
        ad.disable_debug()
        monkeypatch.setenv("AXOLOTL_DIST_DEBUG", "1")
        ad_debug.refresh_from_env()
        assert not ad.is_debug_enabled()
        with ad.debug_mode():
            assert ad.is_debug_enabled()
        assert not ad.is_debug_enabled()
    finally:
        monkeypatch.delenv("AXOLOTL_DIST_DEBUG", raising=False)
        reset_process_state("debug")  # off and undecided again, as a fresh process
    assert not ad.is_debug_enabled()
    monkeypatch.setenv("AXOLOTL_DIST_DEBUG_TIMEOUT", "7.5")
    assert ad_debug.debug_timeout() == 7.5


@pytest.mark.parametrize("store", ["parent"])  # not a fault: one placement is enough
def test_mismatch_error_keeps_its_fields_across_pickling():
    import pickle

    err = ad.CollectiveMismatchError("text", calls={0: "barrier() at x.py:1"}, missing=[1])
    back = pickle.loads(pickle.dumps(err))
    assert (str(back), back.calls, back.missing) == ("text", {0: "barrier() at x.py:1"}, (1,))
    assert isinstance(back, RuntimeError)


@pytest.mark.parametrize("store", ["parent"])  # not a fault: one placement is enough
def test_mesh_and_sharded_tensor_collectives_are_checked():
    def body():
        from axolotl_dist.parallel import DataParallelConfig, TensorParallelConfig

        rank = ad.get_rank()
        tp = TensorParallelConfig(degree=2 if rank == 0 else 1)
        mesh_error = _raises(lambda: ad.build_world_mesh(dp=DataParallelConfig(name="fsdp"), tp=tp))
        # matched flat-tensor collectives pass; a gather against a different dtype is named
        t = ad.ShardedFlatTensor.shard(torch.arange(6.0))
        full = t.gather().tolist()
        dtype = torch.float64 if rank == 1 else None
        flat_error = _raises(lambda: t.gather(dtype=dtype))
        return mesh_error, full, flat_error

    for o in _run(body, 2):
        mesh_error, full, flat_error = o.value
        assert full == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        o.value = mesh_error
        _assert_debug_error(o, "the ranks disagree on configs", "build_world_mesh(", "tp=")
        o.value = flat_error
        _assert_debug_error(o, "ShardedFlatTensor gather", "the ranks disagree on dtype",
                            "rank 0: float32", "rank 1: float64")


@pytest.mark.parametrize("store", ["parent"])  # not a fault: one placement is enough
def test_rank_hosting_the_store_exits():
    # without a launcher-hosted store (plain env:// init), rank 0 hosts it: when rank 0
    # leaves, the others' check fails on the store and says so instead of a raw network error
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    def body():
        ad.init_distributed(backend="gloo")
        ad.barrier()
        if ad.get_rank() == 0:
            os._exit(0)
        return _raises(ad.barrier)

    env = {**DEBUG_ENV, "TORCHELASTIC_USE_AGENT_STORE": None, "MASTER_PORT": str(port)}
    outcomes = run_distributed_outcomes(body, 2, init=False, env=env, timeout=40,
                                        pg_timeout=PG_TIMEOUT)
    got = _assert_debug_error(outcomes[1], "rank 0 (the store host) died or exited while this "
                              "rank checked call #2 (barrier()) on the default group")
    assert got["missing"] == (0,)


@pytest.mark.parametrize("store", ["parent"])  # not a fault: one placement is enough
@pytest.mark.parametrize("ws", [2, 3])
def test_nested_zero_first_blocks_and_a_collective_after_them(tmp_path, ws):
    # the first rank does not wait for the others' check inside zero_first (they wait for it):
    # nested blocks work in debug mode exactly as without it
    def body():
        rank = ad.get_rank()
        order = []
        with ad.zero_first():
            with ad.zero_first():
                order.append("inner")
                if rank == 0:
                    time.sleep(0.2)
                    (tmp_path / "made").write_text("x")
            order.append((tmp_path / "made").read_text())
        with ad.zero_first(is_main=rank == ws - 1):
            order.append("explicit")
        total = ad.all_reduce_value(rank)
        return order, total

    for order, total in run_distributed(body, ws, env=DEBUG_ENV, timeout=60, pg_timeout=PG_TIMEOUT):
        assert order == ["inner", "x", "explicit"] and total == sum(range(ws))


@pytest.mark.parametrize("ws", [2, 3])
def test_first_rank_of_zero_first_learns_of_a_mismatch_by_the_end_of_its_block(ws):
    def body():
        rank = ad.get_rank()
        if rank == 0:
            def run():
                with ad.zero_first():
                    time.sleep(0.5)  # the others reach their helper meanwhile, or before
                return "block finished"
            return _raises(run)
        if rank == 1:
            time.sleep(0.2)  # arrive after rank 0 has entered its block
        return _raises(ad.barrier)

    for o in _run(body, ws):
        _assert_debug_error(o, "rank 0: zero_first(is_main=default (group rank 0))",
                            "rank 1: barrier()", "called different helpers")


def test_collective_inside_a_zero_first_block_is_explained():
    def body():
        with ad.zero_first():
            if ad.get_rank() == 0:
                ad.barrier()  # the others wait for this block: a certain deadlock
        return "done"

    env = {**DEBUG_ENV, "AXOLOTL_DIST_DEBUG_TIMEOUT": "1"}
    outcomes = run_distributed_outcomes(body, 2, env=env, timeout=40, pg_timeout=PG_TIMEOUT,
                                        grace=10, store=_STORE["placement"])
    first, waiter = outcomes
    # refused at once, before debug mode's own check could time out (see tests/test_where.py)
    assert "CollectiveMismatchError" in first.error and "barrier() at" in first.error
    assert "inside zero_first block #1 at" in first.error and "which this rank runs first" in first.error
    assert "Move the call out of the block" in first.error
    # the waiting rank learns of it through zero_first's own failure report, naming rank 0
    assert "RankFailedError: rank 0 failed in zero_first block #1" in waiter.error
    assert "CollectiveMismatchError" in waiter.error
    assert first.elapsed < DEADLINE and waiter.elapsed < DEADLINE


@pytest.mark.parametrize("ws", [2, 3])
def test_rank_0_exiting_is_named_by_the_others(ws):
    # rank 0 watches the other ranks; every rank watches rank 0 itself
    def body():
        ad.barrier()
        if ad.get_rank() == 0:
            os._exit(0)
        return _raises(lambda: ad.all_reduce(torch.ones(1)))

    outcomes = _run(body, ws)
    for o in outcomes[1:]:
        if _STORE["placement"] == "rank0":  # os._exit: the store went with rank 0, no record
            got = _assert_debug_error(o, "rank 0 (the store host) died or exited while this "
                                      "rank checked call #2 (all_reduce(")
        else:
            got = _assert_debug_error(o, "rank(s) [0] exited before reaching call #2 (all_reduce(",
                                      "rank 0: exited", "its last checked call was #1 barrier()")
        assert got["missing"] == (0,)


@pytest.mark.parametrize("store", ["parent"])  # not a fault: one placement is enough
def test_a_switch_value_that_is_not_a_switch_raises_the_same_error_from_every_reader():
    """``is_debug_enabled()`` and every helper read AXOLOTL_DIST_DEBUG through one parser: they
    agree (``is_debug_enabled()`` said True while the helpers raised)."""
    def body():
        messages = []
        for call in (ad.is_debug_enabled, ad.barrier, lambda: ad.compute_and_broadcast(lambda: 1),
                     lambda: ad.reduce_and_broadcast(lambda: 1, sum), ad.validate_env_vars,
                     ad.init_distributed):
            try:
                call()
                messages.append("no error")
            except ad.DistributedEnvError as exc:
                messages.append(str(exc))
        return messages

    outcomes = run_distributed_outcomes(body, 1, env={"AXOLOTL_DIST_DEBUG": "yes please"},
                                        timeout=30, init=False)
    messages = outcomes[0].value
    assert messages == [messages[0]] * 6, messages
    assert messages[0] == ("AXOLOTL_DIST_DEBUG='yes please' is not a switch: set "
                           "AXOLOTL_DIST_DEBUG=1 to turn debug mode on or AXOLOTL_DIST_DEBUG=0 "
                           "(or unset it) to leave it off")
