"""Value helpers and object collectives: exact round trips (docs/design/decisions.md, decision 4), the single-rank
shape (decision 3), failure propagation (decision 6) and subgroups, with real gloo ranks.

The value matrix batches every (value, helper) check of one world size into one multi-process
run: each rank returns a comparable description of what it received, and the parent checks it.
"""

import math
import threading

import pytest
import torch
import torch.distributed as dist

import axolotl_dist as ad
from axolotl_dist.testing import run_distributed
from fixtures import NO_ENV


#: name -> (value, is a number all_reduce_value takes)
MATRIX = {
    "2**53+1": (2**53 + 1, True),  # float64 would round it to 2**53
    "2**63-1": (2**63 - 1, True),  # int64 max
    "-2**63": (-(2**63), True),  # int64 min
    "2**70": (2**70, True),  # beyond int64: the object path
    "7**20000": (7**20000, True),  # 16,902 digits: past the 4,300 of int <-> decimal text
    "16777217": (16_777_217, True),  # axolotl's float32 anchor
    "0.1": (0.1, True),
    "-0.0": (-0.0, True),
    "nan": (float("nan"), True),
    "inf": (float("inf"), True),
    "True": (True, True),
    "False": (False, True),
    "None": (None, False),
    "dict": ({"loss": 0.97, "n": [1, 2**64], "s": "é", "t": None}, False),
    "bf16": (torch.tensor([[1.5, -2.25], [3.0e38, 1e-3]], dtype=torch.bfloat16), True),
}


def describe(value):
    """A picklable, exactly comparable description: type, and bits for floats and tensors."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), value.device.type,
                value.view(torch.int16).tolist() if value.dtype == torch.bfloat16 else value.tolist())
    if isinstance(value, float):
        # .hex() keeps every bit, including the sign of zero; nan compares through "nan"
        return ("float", "nan" if math.isnan(value) else value.hex(), math.copysign(1.0, value))
    if isinstance(value, dict):
        return ("dict", sorted((k, describe(v)) for k, v in value.items()))
    if isinstance(value, list):
        return ("list", [describe(v) for v in value])
    return (type(value).__name__, value)


def _matrix_body():
    """Every value through every helper; returns {(value name, helper): description}."""
    rank, ws = ad.get_rank(), ad.get_world_size()
    last = ws - 1
    out = {}
    for name, (value, number) in MATRIX.items():
        decoy = "decoy"  # what non-source ranks pass: must be replaced by the source's value

        def rec(helper, got):
            out[(name, helper)] = describe(got)

        rec("synchronize_value", ad.synchronize_value(value if rank == 0 else decoy))
        rec("synchronize_value(src=last)", ad.synchronize_value(value if rank == last else decoy, src=last))
        rec("compute_and_broadcast", ad.compute_and_broadcast(lambda: value if rank == 0 else decoy))
        rec("compute_and_broadcast(src=last)",
            ad.compute_and_broadcast(lambda: value if rank == last else decoy, src=last))
        rec("gather_from_all_ranks", ad.gather_from_all_ranks(lambda: value))
        rec("gather_from_all_ranks(dst=last)", ad.gather_from_all_ranks(lambda: value, world_size=ws, dst=last))
        rec("gather_scalar_from_all_ranks", ad.gather_scalar_from_all_ranks(lambda: value))
        rec("gather_scalar_from_all_ranks(rank=last)",
            ad.gather_scalar_from_all_ranks(lambda: value, ws, rank=last))
        rec("reduce_and_broadcast", ad.reduce_and_broadcast(lambda: value, lambda xs: xs[last]))
        rec("reduce_and_broadcast(list)", ad.reduce_and_broadcast(lambda: value, list))
        rec("all_gather_object", ad.all_gather_object(value))
        rec("broadcast_object", ad.broadcast_object(value if rank == 0 else decoy))
        rec("broadcast_object(src=last)", ad.broadcast_object(value if rank == last else decoy, src=last))
        lst = [value, "tail"] if rank == 0 else [decoy]
        same = ad.broadcast_object_list(lst)
        rec("broadcast_object_list", lst)
        out[(name, "broadcast_object_list is in place")] = same is lst
        if number:
            for op in ("max", "min", "sum"):
                rec(f"all_reduce_value({op})", ad.all_reduce_value(value, op=op))
    out["synchronize_flag"] = [ad.synchronize_flag(flag if rank == 0 else not flag)
                               for flag in (True, False)]
    out["synchronize_flag(truthy)"] = ad.synchronize_flag(1 if rank == 0 else 0)
    return out


def _expected(name, helper, rank, ws):
    value, _ = MATRIX[name]
    last = ws - 1
    if helper.startswith("gather"):
        dst = last if "last" in helper else 0
        return describe([value] * ws) if rank == dst else describe(None)
    if helper in ("reduce_and_broadcast(list)", "all_gather_object"):
        return describe([value] * ws)
    if helper == "broadcast_object_list":
        return describe([value, "tail"])
    if helper.startswith("all_reduce_value"):
        op = helper[len("all_reduce_value("):-1]
        if isinstance(value, torch.Tensor):
            return describe(value * ws if op == "sum" else value)
        if op == "sum":
            total = value
            for _ in range(ws - 1):
                total = total + value  # python semantics, in rank order: exact ints, -0.0 kept
            return describe(total)
        return describe(value)
    return describe(value)


@pytest.mark.parametrize("ws", [2, 3])
def test_value_matrix_round_trips_exactly(ws):
    results = run_distributed(_matrix_body, ws, timeout=60)
    for rank, got in enumerate(results):
        for key, desc in got.items():
            if not isinstance(key, tuple):
                continue
            name, helper = key
            if helper == "broadcast_object_list is in place":
                assert desc is True
                continue
            assert desc == _expected(name, helper, rank, ws), f"{name} via {helper} on rank {rank}"
        assert got["synchronize_flag"] == [True, False]
        assert got["synchronize_flag(truthy)"] is True
    # the checks above must have covered every helper for every value
    helpers = {h for (_, h) in (k for k in results[0] if isinstance(k, tuple))}
    assert {"synchronize_value", "compute_and_broadcast", "gather_from_all_ranks",
            "gather_scalar_from_all_ranks", "reduce_and_broadcast", "all_gather_object",
            "broadcast_object", "broadcast_object_list", "all_reduce_value(max)",
            "all_reduce_value(min)", "all_reduce_value(sum)"} <= helpers
    assert len([k for k in results[0] if isinstance(k, tuple) and k[1] == "all_gather_object"]) == len(MATRIX)


def test_value_matrix_specific_anchors():
    """The anchors the issue names, spelled out (the matrix compares descriptions)."""

    def body():
        return (ad.compute_and_broadcast(lambda: 2**53 + 1), ad.compute_and_broadcast(lambda: -0.0),
                ad.gather_scalar_from_all_ranks(lambda: 16_777_217),
                ad.reduce_and_broadcast(lambda: 0.97, max),
                ad.all_reduce_value(2**63 - 1, op="sum"),
                ad.synchronize_value(torch.tensor([1.0039062], dtype=torch.bfloat16)))

    r0, r1 = run_distributed(body, 2)
    for big, negzero, _, eff, total, bf in (r0, r1):
        assert big == 9007199254740993 and type(big) is int
        assert negzero == 0.0 and math.copysign(1.0, negzero) == -1.0
        assert eff == 0.97  # not 0.9700000286 (float32)
        assert total == 2 * (2**63 - 1)  # no int64 overflow
        assert bf.dtype == torch.bfloat16 and bf.item() == torch.tensor(1.0039062, dtype=torch.bfloat16).item()
    assert r0[2] == [16_777_217, 16_777_217] and r1[2] is None


def _single_rank_shapes():
    """Every helper's result with one rank; the shape must be the multi-rank one."""
    t = torch.arange(3, dtype=torch.float64)
    lst = [1, 2]
    return {
        "synchronize_value": ad.synchronize_value(2**70),
        "synchronize_flag": ad.synchronize_flag(True),
        "all_reduce_value": ad.all_reduce_value(0.1, op="sum"),
        "all_reduce_value(tensor)": ad.all_reduce_value(t, op="max").tolist(),
        "compute_and_broadcast": ad.compute_and_broadcast(lambda: {"a": 1}),
        "gather_from_all_ranks": ad.gather_from_all_ranks(lambda: 5),
        "gather_from_all_ranks(world_size=1)": ad.gather_from_all_ranks(lambda: 5, world_size=1),
        "gather_scalar_from_all_ranks": ad.gather_scalar_from_all_ranks(lambda: 2.5),
        "reduce_and_broadcast": ad.reduce_and_broadcast(lambda: 3, lambda xs: ("got", xs)),
        "all_gather_object": ad.all_gather_object({"x": None}),
        "broadcast_object": ad.broadcast_object("obj"),
        "broadcast_object_list": (ad.broadcast_object_list(lst) is lst, lst),
        "all_gather": [x.tolist() for x in ad.all_gather(t)],
        "broadcast": ad.broadcast(t.clone()).tolist(),
        "all_reduce": ad.all_reduce(t.clone(), "sum").tolist(),
        "barrier": ad.barrier(),
        "initialized": dist.is_initialized(),
    }


SINGLE_EXPECTED = {
    "synchronize_value": 2**70,
    "synchronize_flag": True,
    "all_reduce_value": 0.1,
    "all_reduce_value(tensor)": [0.0, 1.0, 2.0],
    "compute_and_broadcast": {"a": 1},
    "gather_from_all_ranks": [5],
    "gather_from_all_ranks(world_size=1)": [5],
    "gather_scalar_from_all_ranks": [2.5],
    "reduce_and_broadcast": ("got", [3]),
    "all_gather_object": [{"x": None}],
    "broadcast_object": "obj",
    "broadcast_object_list": (True, [1, 2]),
    "all_gather": [[0.0, 1.0, 2.0]],
    "broadcast": [0.0, 1.0, 2.0],
    "all_reduce": [0.0, 1.0, 2.0],
    "barrier": None,
}


@pytest.mark.parametrize("init", [False, True], ids=["no-group", "group-of-1"])
def test_single_rank_helpers_return_the_multi_rank_shape(init):
    """No env, no group (plain ``python script.py``), and an initialized 1-rank group agree."""
    [got] = run_distributed(_single_rank_shapes, 1, init=init, env=NO_ENV)
    assert got == dict(SINGLE_EXPECTED, initialized=init)


def test_helpers_agree_on_1_2_3_ranks(world_size):
    """The everyday uses (token counts, batch counts, efficiency) on every world size."""

    def body():
        rank, ws = ad.get_rank(), ad.get_world_size()
        return {
            "tokens": ad.all_reduce_value(1000 * (rank + 1)),
            "batches": ad.reduce_and_broadcast(lambda: 10 - rank, min),
            "eff": ad.reduce_and_broadcast(lambda: 0.5 + rank / 100, max),
            "avg": ad.all_reduce_value(float(rank), op="avg"),
            "prod": ad.all_reduce_value(rank + 2, op="product"),
            "bor": ad.all_reduce_value(1 << rank, op="bor"),
            "max_tensor": ad.all_reduce_value(torch.tensor([rank, -rank]), op="max").tolist(),
            "gathered": ad.gather_from_all_ranks(lambda: (rank, "r%d" % rank)),
            "gathered_scalar": ad.gather_scalar_from_all_ranks(lambda: rank * 0.5, world_size=ws),
            "broadcast": ad.compute_and_broadcast(lambda: ["from", rank]),
            "objects": ad.all_gather_object({"rank": rank}),
            "flag": ad.synchronize_flag(rank == 0),
        }

    got = run_distributed(body, world_size, timeout=60)
    n = world_size
    for rank, res in enumerate(got):
        assert res["tokens"] == 1000 * n * (n + 1) // 2
        assert res["batches"] == 10 - (n - 1)
        assert res["eff"] == 0.5 + (n - 1) / 100
        assert res["avg"] == sum(range(n)) / n
        assert res["prod"] == math.prod(range(2, n + 2))
        assert res["bor"] == (1 << n) - 1
        assert res["max_tensor"] == [n - 1, 0]
        assert res["gathered"] == ([(r, "r%d" % r) for r in range(n)] if rank == 0 else None)
        assert res["gathered_scalar"] == ([r * 0.5 for r in range(n)] if rank == 0 else None)
        assert res["broadcast"] == ["from", 0]
        assert res["objects"] == [{"rank": r} for r in range(n)]
        assert res["flag"] is True


def test_value_helpers_on_a_subgroup_use_group_relative_ranks():
    """dist.new_group([1, 2]) on 3 ranks: src/dst are ranks *within* the subgroup."""

    def body():
        sub = dist.new_group([1, 2])
        rank = ad.get_rank()
        if rank == 0:
            return None
        return {
            "cab": ad.compute_and_broadcast(lambda: ("computed on", ad.get_rank()), src=1, group=sub),
            "sv": ad.synchronize_value(rank * 10, src=1, group=sub),
            "gather": ad.gather_from_all_ranks(lambda: rank, world_size=2, dst=1, group=sub),
            "gather_scalar": ad.gather_scalar_from_all_ranks(lambda: rank * 1.5, group=sub),
            "rab": ad.reduce_and_broadcast(lambda: rank, list, group=sub),
            "arv": ad.all_reduce_value(rank, op="sum", group=sub),
            "ago": ad.all_gather_object(str(rank), group=sub),
            "bo": ad.broadcast_object(rank, src=1, group=sub),
            "bol": ad.broadcast_object_list([rank], src=0, group=sub),
            "flag": ad.synchronize_flag(rank == 2, group=sub),
        }

    got = run_distributed(body, 3, timeout=60)
    assert got[0] is None
    for rank in (1, 2):
        res = got[rank]
        assert res["cab"] == ("computed on", 2)  # src=1 of the subgroup is global rank 2
        assert res["sv"] == 20
        assert res["gather"] == ([1, 2] if rank == 2 else None)
        assert res["gather_scalar"] == ([1.5, 3.0] if rank == 1 else None)
        assert res["rab"] == [1, 2]
        assert res["arv"] == 3
        assert res["ago"] == ["1", "2"]
        assert res["bo"] == 2
        assert res["bol"] == [1]
        assert res["flag"] is False  # group rank 0 (global 1) said False


def test_helpers_follow_the_group_of_each_call_and_a_recreated_default_group():
    """The per-group state is cached (the last one used on a fast path): alternating groups,
    scalar and payload rounds, and a destroyed group replaced by a new one (perhaps at the old
    one's address) must each use the right group's ranks and buffers."""

    def body():
        rank = ad.get_rank()
        sub = dist.new_group([1, 2])
        out = []
        for i in range(3):
            out.append(ad.gather_from_all_ranks(lambda: rank + i))
            if rank:
                out.append(ad.gather_from_all_ranks(lambda: rank * 10 + i, dst=1, group=sub))
            out.append(ad.reduce_and_broadcast(lambda: [rank] if i == 1 else rank, list))
        if rank:
            dist.destroy_process_group(sub)
        del sub
        sub = dist.new_group([0, 2])
        if rank != 1:
            out.append(ad.gather_from_all_ranks(lambda: -rank, dst=1, group=sub))
        return out

    got = run_distributed(body, 3, timeout=60)
    for rank, res in enumerate(got):
        want = []
        for i in range(3):
            want.append([i, 1 + i, 2 + i] if rank == 0 else None)
            if rank:
                want.append([10 + i, 20 + i] if rank == 2 else None)
            want.append([[0], [1], [2]] if i == 1 else [0, 1, 2])
        if rank != 1:
            want.append([0, -2] if rank == 2 else None)
        assert res == want, (rank, res)


class Boom(Exception):
    """The failing rank's own exception type (must come back as itself)."""


@pytest.mark.parametrize("ws", [2, 3])
def test_a_rank_arriving_later_than_a_wait_slice_gets_the_right_values(ws, store):
    """The kit waits for a collective in slices; a slice that times out must leave the
    collective (and the group) alive. A gloo receive's timed-out wait closed every connection
    of the group ("Application timeout caused pair closure"), which broke the value helpers'
    header exchange whenever a rank came 0.25 s late."""
    import time

    def body():
        rank = ad.get_rank()
        late = rank == ad.get_world_size() - 1
        got = []
        for step, call in enumerate([
                lambda: ad.reduce_and_broadcast(lambda: rank, sum),
                lambda: ad.gather_from_all_ranks(lambda: rank),
                lambda: ad.gather_scalar_from_all_ranks(lambda: rank * 0.5),
                lambda: ad.all_gather_object({"rank": rank}),
                lambda: ad.compute_and_broadcast(lambda: "from 0"),
                lambda: ad.all_reduce_value(rank, op="MAX"),
                lambda: ad.broadcast_object([1, 2], src=ad.get_world_size() - 1)]):
            if late and step % 2 == 0 or not late and step % 2 == 1:  # each side late in turn
                time.sleep(0.3)
            got.append(call())
        ad.barrier()
        return got

    ranks = list(range(ws))
    for rank, got in enumerate(run_distributed(body, ws, store=store, timeout=90)):
        assert got == [sum(ranks), ranks if rank == 0 else None,
                       [r * 0.5 for r in ranks] if rank == 0 else None,
                       [{"rank": r} for r in ranks], "from 0", ws - 1, [1, 2]], (rank, got)


@pytest.mark.parametrize("ws", [2, 3])
def test_failure_in_fn_raises_everywhere_naming_the_rank(ws, store):
    """fn raising on one rank: that rank raises its own exception, every other rank a
    RankFailedError naming it, promptly; and the ranks stay in step afterwards."""
    bad = ws - 1

    def body():
        rank = ad.get_rank()
        seen = {}

        def fail_on(who, msg):
            def fn():
                if rank == who:
                    raise Boom(msg)
                return rank
            return fn

        cases = {
            "compute_and_broadcast": lambda: ad.compute_and_broadcast(fail_on(0, "cab")),
            "compute_and_broadcast(src=bad)": lambda: ad.compute_and_broadcast(fail_on(bad, "cab2"), src=bad),
            "gather_from_all_ranks": lambda: ad.gather_from_all_ranks(fail_on(bad, "gfar")),
            "gather_scalar_from_all_ranks": lambda: ad.gather_scalar_from_all_ranks(fail_on(bad, "gsfar")),
            "reduce_and_broadcast": lambda: ad.reduce_and_broadcast(fail_on(bad, "rab"), sum),
            "reduce_and_broadcast(fail on 0)": lambda: ad.reduce_and_broadcast(fail_on(0, "rab0"), sum),
        }
        for name, call in cases.items():
            try:
                call()
                seen[name] = ("returned",)
            except ad.RankFailedError as exc:
                seen[name] = ("RankFailedError", exc.rank, exc.exc_type, exc.exc_message, exc.where,
                              "Boom" in str(exc) and f"rank {exc.rank}" in str(exc))
            except Boom as exc:
                seen[name] = ("Boom", str(exc))
        # still in step: the next collective pairs up correctly
        seen["after"] = ad.all_reduce_value(1)
        return seen

    t0 = __import__("time").monotonic()
    got = run_distributed(body, ws, timeout=60, store=store)
    assert __import__("time").monotonic() - t0 < 30  # promptly, not after a collective timeout
    failing = {"compute_and_broadcast": (0, "cab"), "compute_and_broadcast(src=bad)": (bad, "cab2"),
               "gather_from_all_ranks": (bad, "gfar"), "gather_scalar_from_all_ranks": (bad, "gsfar"),
               "reduce_and_broadcast": (bad, "rab"), "reduce_and_broadcast(fail on 0)": (0, "rab0")}
    for rank, seen in enumerate(got):
        assert seen["after"] == ws
        for name, (who, msg) in failing.items():
            if rank == who:
                assert seen[name] == ("Boom", msg), (name, rank)
            else:
                where = name.split("(")[0]
                assert seen[name] == ("RankFailedError", who, "Boom", msg, where, True), (name, rank)


def test_failure_carries_the_remote_traceback(store):
    def body():
        def fn():
            if ad.get_rank() == 1:
                {}["missing-key"]
            return 1

        try:
            ad.gather_from_all_ranks(fn)
        except ad.RankFailedError as exc:
            return exc.remote_traceback
        except KeyError as exc:
            return repr(exc)

    tb0, own = run_distributed(body, 2, store=store)
    assert own == "KeyError('missing-key')"
    assert "Traceback" in tb0 and "missing-key" in tb0 and "in fn" in tb0


@pytest.mark.parametrize("ws", [2, 3])
def test_unpicklable_value_fails_on_its_rank_and_is_reported_elsewhere(ws, store):
    """A lambda or a threading.Lock returned by fn (or passed as obj): TypeError naming the
    value on the failing rank, RankFailedError naming that rank on the others."""

    def body():
        rank = ad.get_rank()
        lock = threading.Lock()
        seen = {}
        cases = {
            "compute_and_broadcast": (0, lambda: ad.compute_and_broadcast(lambda: (lambda: 1))),
            "gather_from_all_ranks": (1, lambda: ad.gather_from_all_ranks(lambda: lock if rank == 1 else 1)),
            "reduce_and_broadcast": (1, lambda: ad.reduce_and_broadcast(lambda: lock if rank == 1 else 1, len)),
            "all_gather_object": (1, lambda: ad.all_gather_object(lock if rank == 1 else 1)),
            "broadcast_object": (0, lambda: ad.broadcast_object(lock if rank == 0 else None)),
            "synchronize_value": (0, lambda: ad.synchronize_value((lambda: 2) if rank == 0 else 0)),
        }
        for name, (_, call) in cases.items():
            try:
                call()
                seen[name] = ("returned",)
            except TypeError as exc:
                seen[name] = ("TypeError", str(exc))
            except ad.RankFailedError as exc:
                seen[name] = ("RankFailedError", exc.rank, exc.exc_type, str(exc))
        seen["after"] = ad.all_reduce_value(1)
        return seen, {n: who for n, (who, _) in cases.items()}

    got = run_distributed(body, ws, timeout=60, store=store)
    for rank, (seen, failing) in enumerate(got):
        assert seen["after"] == ws
        for name, who in failing.items():
            kind = "lock" if "lock" in repr(seen[name]) else "function"
            if rank == who:
                assert seen[name][0] == "TypeError", (name, seen[name])
                msg = seen[name][1]
                assert "cannot be pickled" in msg and f"of type {kind}" in msg
                assert "make the object picklable" in msg  # the fix
                assert ("_thread.lock object" in msg) if kind == "lock" else ("<function" in msg)
            else:
                assert seen[name][:3] == ("RankFailedError", who, "TypeError"), (name, rank, seen[name])
                assert f"rank {who} failed in {name}" in seen[name][3]


def test_value_helpers_pass_tensors_dtype_shape_and_requires_grad():
    def body():
        rank = ad.get_rank()
        src = torch.arange(6, dtype=torch.float16).view(2, 3).t()  # non-contiguous
        g = torch.ones(2, requires_grad=True)
        return (describe(ad.synchronize_value(src if rank == 0 else torch.zeros(1))),
                ad.broadcast_object(g if rank == 0 else None).requires_grad,
                [describe(x) for x in ad.all_gather_object(torch.full((rank + 1,), rank, dtype=torch.int8))],
                describe(ad.compute_and_broadcast(lambda: torch.tensor(True))),
                describe(ad.synchronize_value(torch.empty(0, 4, dtype=torch.int32))),
                describe(ad.synchronize_value(torch.ones(2, dtype=torch.float64), device="cpu")))

    for res in run_distributed(body, 2):
        assert res[0] == describe(torch.arange(6, dtype=torch.float16).view(2, 3).t())
        assert res[1] is True
        assert res[2] == [describe(torch.full((1,), 0, dtype=torch.int8)),
                          describe(torch.full((2,), 1, dtype=torch.int8))]
        assert res[3] == describe(torch.tensor(True))
        assert res[4] == describe(torch.empty(0, 4, dtype=torch.int32))
        assert res[5] == describe(torch.ones(2, dtype=torch.float64))


def test_env_that_disagrees_with_the_group_is_caught_by_value_helpers_too():
    """The helpers cache the group's rank; changing RANK in the env must still be noticed."""

    def body():
        import os

        first = ad.all_reduce_value(1)
        os.environ["RANK"] = str(1 - ad.get_rank())
        outcome = []
        for call in (lambda: ad.gather_from_all_ranks(lambda: 1), lambda: ad.compute_and_broadcast(lambda: 1)):
            with pytest.raises(ad.DistributedEnvError, match="RANK=.* disagrees with the initialized process group"):
                call()
            outcome.append("raised")
        os.environ["RANK"] = str(dist.get_rank())
        return first, outcome, ad.all_reduce_value(2)

    assert run_distributed(body, 2) == [(2, ["raised", "raised"], 4)] * 2


@pytest.mark.distributed(world_size=2)
def test_all_reduce_value_rejects_non_numbers_with_the_fix():
    with pytest.raises(TypeError, match=r"all_reduce_value\(value='x'\).*use reduce_and_broadcast"):
        ad.all_reduce_value("x")


def test_conjugate_and_negative_views_travel_exactly_through_every_helper():
    # lazy conjugate / negative views cannot be viewed as bytes or sent as they are
    def body():
        rank = ad.get_rank()
        conj = torch.tensor([1 + 2j, rank - 4j]).conj()
        neg = torch.tensor([1.5, float(rank)])._neg_view()
        want_conj = torch.tensor([1 - 2j, rank + 4j])
        want_neg = torch.tensor([-1.5, -float(rank)])
        got = {}
        for name, value, want in (("conj", conj, want_conj), ("neg", neg, want_neg)):
            assert value.is_conj() or value.is_neg()
            got[name] = {
                "compute_and_broadcast": ad.compute_and_broadcast(lambda: value),
                "gather_from_all_ranks": ad.gather_from_all_ranks(lambda: value),
                "gather_scalar_from_all_ranks": ad.gather_scalar_from_all_ranks(lambda: value),
                "reduce_and_broadcast": ad.reduce_and_broadcast(lambda: value, list),
                "all_gather_object": ad.all_gather_object(value),
                "broadcast_object": ad.broadcast_object(value),
                "broadcast_object_list": ad.broadcast_object_list([value]),
                "synchronize_value": ad.synchronize_value(value),
                "all_reduce_value": ad.all_reduce_value(value),
                "all_gather": ad.all_gather(value),
                "all_reduce": ad.all_reduce(value.clone()),
            }
            sent = value.clone()
            ad.broadcast(sent, src=0)
            got[name]["broadcast"] = sent
            got[name]["want"] = want
        return got

    outcomes = run_distributed(body, 3)
    for rank, got in enumerate(outcomes):
        for name in ("conj", "neg"):
            per = got[name]
            rank0 = outcomes[0][name]["want"]
            every = [o[name]["want"] for o in outcomes]
            total = sum(every[1:], every[0])
            expect = {
                "compute_and_broadcast": rank0, "broadcast_object": rank0,
                "broadcast_object_list": [rank0], "synchronize_value": rank0,
                "broadcast": rank0, "all_gather_object": every, "all_gather": every,
                "reduce_and_broadcast": every, "all_reduce_value": total, "all_reduce": total,
                "gather_from_all_ranks": every if rank == 0 else None,
                "gather_scalar_from_all_ranks": every if rank == 0 else None,
            }
            for helper, want in expect.items():
                have = per[helper]
                if want is None:
                    assert have is None, (name, helper)
                    continue
                pairs = zip(have, want) if isinstance(want, list) else [(have, want)]
                for h, w in pairs:  # logical values (a pickled view may stay a view)
                    assert h.dtype == w.dtype and torch.equal(h, w), (name, helper, h, w)
@pytest.mark.parametrize("call, message", [
    (lambda: ad.compute_and_broadcast(42),
     r"compute_and_broadcast\(fn=42\): fn must be a function .*pass a function, e\.g\. `lambda: 42`"),
    (lambda: ad.gather_from_all_ranks(3.5),
     r"gather_from_all_ranks\(fn=3\.5\): .*e\.g\. `lambda: 3\.5`"),
    (lambda: ad.gather_scalar_from_all_ranks("x"),
     r"gather_scalar_from_all_ranks\(fn='x'\): .*e\.g\. `lambda: 'x'`"),
    (lambda: ad.reduce_and_broadcast(7, sum),
     r"reduce_and_broadcast\(fn1=7\): fn1 must be a function .*`lambda: 7`"),
    (lambda: ad.reduce_and_broadcast(lambda: 7, [1]),
     r"reduce_and_broadcast\(fn2=\[1\]\): fn2 must be a function that combines .*e\.g\. sum"),
])
def test_value_helpers_given_a_value_instead_of_a_function_say_what_to_pass(call, message):
    with pytest.raises(TypeError, match=message):
        call()


@pytest.mark.distributed(world_size=2)
def test_value_helper_given_a_value_fails_on_every_rank_before_communicating():
    with pytest.raises(TypeError, match="e.g. `lambda: 42`"):
        ad.compute_and_broadcast(42)
    assert ad.reduce_and_broadcast(lambda: 1, sum) == 2  # the group is still in step
