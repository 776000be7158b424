"""Unit tests of the findings on torch's collectives (``_runtime/liveness/flight.py``): who is
behind, who mismatched, from every rank's last flight-recorder entry per group; and the
check a rank's answer passes before a report reads it. No process, no store, except the
one-process group that shows what torch's recorder gives this kit."""

from __future__ import annotations

import re
import time
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

from axolotl_dist._runtime.liveness.flight import (
    ahead_of, check_positions, describe_position, findings, group_name, positions,
    unchecked_finding)
from axolotl_dist._runtime.store.records import BadRecord
from axolotl_dist.testing import GPU_MARKS, run_distributed
from fixtures import free_port


def pos(seq: int, op: str = "all_reduce", shape: Optional[List[int]] = None,
        dtype: str = "float32", done: bool = False, ranks: Optional[List[int]] = None
        ) -> Dict[str, Any]:
    return {"seq": seq, "op": op, "shapes": [] if shape is None else [shape],
            "dtypes": [] if shape is None else [dtype], "done": done,
            "ranks": [0, 1, 2] if ranks is None else ranks}


def find(found: Dict[int, Any]) -> List[str]:
    return findings(found, lambda r: f" at train.py:{80 + r}",
                    lambda r: f"in evaluate at train.py:{120 + r}")


def test_a_rank_that_never_issued_the_collective_is_named_with_where_it_is():
    found = {0: {"0": pos(57, shape=[4096])}, 1: {"0": pos(57, shape=[4096])},
             2: {"0": pos(56, shape=[4096], done=True)}}
    assert find(found) == [
        "ranks 0, 1 wait in torch's all_reduce #57 (float32[4096]) on the default group at "
        "train.py:80; rank 2 never issued #57: its last was #56 (all_reduce), it is in "
        "evaluate at train.py:122"]


def test_different_ops_shapes_or_dtypes_at_one_sequence_number_are_a_mismatch():
    found = {0: {"0": pos(4, shape=[8])}, 1: {"0": pos(4, shape=[8])},
             2: {"0": pos(4, op="broadcast", shape=[8])}}
    (text,) = find(found)
    assert text.startswith(
        "torch's collective #4 on the default group differs across ranks: all_reduce "
        "(float32[8]) on ranks 0, 1 at train.py:80; broadcast (float32[8]) on rank 2 at "
        "train.py:82. Every rank must issue"), text
    shapes = {0: {"0": pos(4, shape=[8])}, 1: {"0": pos(4, shape=[9])}}
    assert "all_reduce (float32[8]) on rank 0" in find(shapes)[0]
    dtypes = {0: {"0": pos(4, shape=[8])}, 1: {"0": pos(4, shape=[8], dtype="bfloat16")}}
    assert "all_reduce (bfloat16[8]) on rank 1" in find(dtypes)[0]


def test_shapes_may_differ_where_the_op_allows_it():
    # scatter's source holds every rank's piece; all_to_all may split unevenly
    for op in ("scatter", "all_to_all"):
        found = {0: {"0": pos(4, op=op, shape=[8])}, 1: {"0": pos(4, op=op, shape=[4])}}
        assert find(found) == [], op


def test_nothing_is_said_where_no_rank_waits_in_a_collective():
    found = {0: {"0": pos(9, done=True)}, 1: {"0": pos(9, done=True)}}
    assert find(found) == []
    assert find({0: None, 1: None}) == []
    assert find({}) == []


def test_groups_are_read_each_on_its_own_members():
    sub = [1, 2]
    found = {0: {"0": pos(3, done=True)},
             1: {"0": pos(3, done=True), "1": pos(2, ranks=sub)},
             2: {"0": pos(3, done=True), "1": pos(1, done=True, ranks=sub)}}
    assert find(found) == [
        "rank 1 wait in torch's all_reduce #2 on group 1 (ranks 1, 2) at train.py:81; rank 2 "
        "never issued #2: its last was #1 (all_reduce), it is in evaluate at train.py:122"]


def test_a_member_that_issued_nothing_on_a_group_is_behind():
    found = {0: {"0": pos(1)}, 1: {"1": pos(5, done=True, ranks=[1])}, 2: {"0": pos(1)}}
    (text,) = find(found)
    assert "rank 1 never issued #1: none issued on this group yet, it is in evaluate" in text


def test_a_rank_line_names_the_collectives_it_waits_in_else_its_last():
    assert describe_position(None) == ""
    assert describe_position({"0": pos(3, shape=[2], done=True)}) == (
        "; torch's last: all_reduce #3 (float32[2]) on the default group, finished")
    assert describe_position({"0": pos(3, done=True), "4": pos(7, op="barrier", ranks=[0, 2])}) \
        == "; in torch's barrier #7 on group 4 (ranks 0, 2), not finished"


@pytest.mark.parametrize("bad", [
    [], {"0": []}, {"0": dict(pos(1), seq="1")}, {"0": dict(pos(1), seq=True)},
    {"0": dict(pos(1), extra=1)}, {"0": dict(pos(1), shapes=[["4"]])},
    {"0": dict(pos(1), dtypes=[4])}, {"0": dict(pos(1), ranks=[None])}])
def test_a_malformed_answer_is_refused(bad):
    with pytest.raises(BadRecord, match="torch's position"):
        check_positions(bad)
    check_positions(None)  # no recorder: nothing to check
    check_positions({"0": pos(1)})


def test_torchs_recorder_gives_this_process_its_last_collective_per_group():
    # twice: the recorder keeps a destroyed group's entries, and the new group, named "0"
    # again, counts from #1; its newest entry is the position
    for calls in (3, 2):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)
        try:
            t = torch.ones(3, dtype=torch.bfloat16)
            for _ in range(calls):
                dist.all_reduce(t)
            # gloo's worker marks the entry finished a moment after the call returned (under
            # load, after the read: done False in one run of the suite on 2 workers)
            deadline = time.monotonic() + 10
            found = positions()
            while not (found or {}).get("0", {}).get("done") and time.monotonic() < deadline:
                time.sleep(0.01)
                found = positions()
        finally:
            dist.destroy_process_group()
    assert found is not None, "this torch records no collectives"
    assert found["0"] == {"seq": 2, "op": "all_reduce", "shapes": [[3]],
                          "dtypes": ["bfloat16"], "done": True, "ranks": [0]}


def _recorded_body(device: str) -> Dict[str, Any]:
    before = (positions() or {}).get("0", {}).get("seq", 0)
    t = torch.ones(3, dtype=torch.bfloat16, device=device)
    for _ in range(2):
        dist.all_reduce(t)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    deadline = time.monotonic() + 10  # NCCL's entries finish when its watchdog sees them
    while True:
        got = dict((positions() or {}).get("0") or {})
        if got.get("done") or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    got["seq"] -= before
    got.pop("ranks", None)
    return got


@pytest.mark.parametrize("device,backend,ws", [
    pytest.param("cuda", "nccl", 1, marks=GPU_MARKS, id="cuda-nccl-1"),
    pytest.param("cpu", "gloo", 2, id="cpu-gloo-2")])
def test_each_rank_reads_its_last_collective_on_nccl_as_on_gloo(device, backend, ws):
    if backend == "nccl" and tuple(
            int(p) for p in re.findall(r"\d+", torch.__version__)[:2]) < (2, 12):
        # measured on an H200 with torch 2.11.0+cu130: 0 entries after two all_reduces,
        # with TORCH_FR_BUFFER_SIZE or TORCH_NCCL_TRACE_BUFFER_SIZE=2000 or without
        pytest.skip(f"torch {torch.__version__} is below setup.cfg's floor (2.12) and its "
                    f"recorder keeps no NCCL collectives")
    for got in run_distributed(_recorded_body, ws, args=(device,), backend=backend,
                               timeout=120):
        assert got == {"seq": 2, "op": "all_reduce", "shapes": [[3]], "dtypes": ["bfloat16"],
                       "done": True}, got


# --- debug mode: ranks in a collective no checked call issued ---------------------------------

def test_ranks_past_this_ranks_last_collective_are_ahead():
    found = {0: {"0": pos(9, shape=[36])}, 1: {"0": pos(9, shape=[36])},
             3: {"0": pos(8, done=True)}, 4: None, 5: {"7": pos(12, ranks=[5, 6])}}
    assert ahead_of("0", 8, found) == {0: pos(9, shape=[36]), 1: pos(9, shape=[36])}
    assert ahead_of("0", 9, found) == {}  # level with this rank: late, not elsewhere
    assert ahead_of("7", 0, found) == {5: pos(12, ranks=[5, 6])}


def test_the_unchecked_finding_names_both_sides_and_the_fix():
    ahead = {0: pos(9, shape=[36]), 1: pos(9, shape=[36]), 3: pos(10, op="broadcast", shape=[4])}
    text = unchecked_finding("the default group", 8, "rank 2 is at checked call #1 "
                             "torch.distributed.barrier() at train.py:22", ahead,
                             lambda r: " (in <module> at train.py:21)")
    assert text.startswith(
        "torch's collective #9 on the default group differs across ranks: ranks 0, 1 are in "
        "torch's all_reduce #9 (float32[36]) on the default group (in <module> at "
        "train.py:21); rank 3 is in torch's broadcast #10 (float32[4]) on the default group "
        "(in <module> at train.py:21), which no checked call issued (DDP's gradient "
        "all-reduce in backward(), "), text
    assert "; rank 2 is at checked call #1 torch.distributed.barrier() at train.py:22, its last " \
           "torch collective #8. The ranks can never meet" in text


def test_group_names_are_torchs_own(tmp_path):
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    try:
        assert group_name(dist.group.WORLD) == "0"
        sub = dist.new_group([0])
        assert group_name(sub) not in (None, "0")
        assert group_name(object()) is None
    finally:
        dist.destroy_process_group()


def test_a_rank_running_but_silent_is_not_in_the_collective():
    found = {0: {"0": pos(4, shape=[4096])}, 1: {"0": pos(4, shape=[4096])}}
    assert findings(found, lambda r: " at train.py:33", lambda r: "", busy=[2]) == [
        "ranks 0, 1 wait in torch's all_reduce #4 (float32[4096]) on the default group at "
        "train.py:33; rank 2 did not answer: its process runs but its heartbeat got no turn "
        "(Python code holding the GIL), so it is not in #4"]
    assert findings(found, lambda r: "", lambda r: "") == []  # without it: nobody behind
