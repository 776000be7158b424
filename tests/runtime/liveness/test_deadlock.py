"""Unit tests of the wait-for graph (``_runtime/liveness/deadlock.py``): which waiting ranks
can never leave their waits, and what they are told. Descriptions are built as
:func:`describe` writes them (read back through :func:`read_desc`); no process, no store."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

import pytest

from axolotl_dist._runtime.liveness.deadlock import explain, find_stuck, read_desc
from axolotl_dist._runtime.liveness.progress import KINDS
from axolotl_dist._runtime.store.records import BadRecord

WORLD = "0"  # the default group's name in a description


def desc(rank: int, kind: str, n: int, label: str, counters: Dict[str, List[int]],
         finish: bool = False, awaits: Optional[List[int]] = None, members: Optional[str] = None,
         group: str = WORLD, inside: Optional[List[list]] = None) -> Dict[str, Any]:
    """One rank's wait, through the same reader the judge uses."""
    raw = json.dumps({"s": 1, "g": group, "m": members, "r": rank, "k": KINDS.index(kind),
                      "n": n, "l": label, "f": int(finish), "a": awaits,
                      "w": f"{label} at prep.py:{10 + rank}", "c": counters,
                      "i": inside or []}).encode()
    return read_desc(raw)


def counts(collectives: int = 0, zero_first: int = 0) -> Dict[str, List[int]]:
    return {WORLD: [collectives, zero_first] + [0] * (len(KINDS) - 2)}


def test_a_barrier_every_rank_is_in_is_not_stuck():
    descs = {r: desc(r, "collective", 3, "barrier", counts(3)) for r in range(4)}
    assert find_stuck(descs, 4) == []


def test_a_rank_busy_outside_kit_waits_blocks_nobody_for_good():
    # rank 2 has no description: it may still arrive
    descs = {r: desc(r, "collective", 3, "barrier", counts(3)) for r in (0, 1, 3)}
    assert find_stuck(descs, 4) == []


def test_a_block_on_one_rank_and_a_collective_on_the_other_wait_for_each_other():
    descs = {0: desc(0, "zero_first", 1, "zf-tag", counts(2, 1)),
             1: desc(1, "collective", 3, "barrier", counts(3, 0))}
    stuck = find_stuck(descs, 2)
    assert [(s.ranks, s.blockers) for s in stuck] == [([0], [1]), ([1], [0])]
    [(ranks, text, calls, _)] = explain(stuck)
    assert ranks == [0, 1] and calls == {0: "zf-tag at prep.py:10", 1: "barrier at prep.py:11"}
    assert text.startswith("ranks 0, 1 wait for each other in kit calls that can never meet:")
    assert "Some ranks are in a zero_first call the others never entered" in text


def test_two_helpers_at_the_same_point_never_meet():
    descs = {0: desc(0, "collective", 5, "barrier", counts(5)),
             1: desc(1, "collective", 5, "all_reduce_value", counts(5))}
    [(_, text, _, _)] = explain(find_stuck(descs, 2))
    assert "different collectives at the same point" in text


def test_a_rank_already_past_the_point_does_not_block_it():
    # rank 1 made collective #5 with rank 0 and waits at #6: rank 0 at #5 waits for rank 2 only
    descs = {0: desc(0, "collective", 5, "barrier", counts(5), awaits=[2]),
             1: desc(1, "collective", 6, "barrier", counts(6), awaits=[0])}
    assert find_stuck(descs, 3) == []


def test_a_zero_first_waiter_is_blocked_by_its_first_rank_still_inside_the_body():
    # rank 0 runs block #1's body and waits in a barrier inside it; rank 1 waits for rank 0 to
    # finish the block, and never reaches the barrier
    descs = {0: desc(0, "collective", 2, "barrier", counts(2, 1), inside=[[WORLD, 1]]),
             1: desc(1, "zero_first", 1, "zf-tag", counts(1, 1), finish=True)}
    assert sorted(s.ranks[0] for s in find_stuck(descs, 2)) == [0, 1]


def test_waits_on_a_sub_group_look_at_its_members_only():
    # ranks 0 and 2 (group "0:4:2") in one barrier of their own; ranks 1 and 3 elsewhere
    sub = "g1"
    both = {WORLD: [1] + [0] * (len(KINDS) - 1), sub: [4] + [0] * (len(KINDS) - 1)}
    descs = {r: desc(r, "collective", 4, "barrier", both, group=sub, members="0:4:2")
             for r in (0, 2)}
    assert find_stuck(descs, 4) == []


@pytest.mark.parametrize("change, why", [
    ({"k": 9}, "names no kind"),
    ({"m": "0:4:0"}, "names no kind or group"),
    ({"c": {WORLD: [1, 2]}}, "not one per kind"),
    ({"i": [["0", "1"]]}, r"not \[group, seq\] pairs"),
    ({"r": "1"}, "a wait's description"),
])
def test_a_description_the_kit_did_not_write_is_refused(change, why):
    good = {"s": 1, "g": WORLD, "m": None, "r": 0, "k": 0, "n": 1, "l": "barrier", "f": 0,
            "a": None, "w": "barrier at x.py:1", "c": counts(1), "i": []}
    read_desc(json.dumps(good).encode())
    with pytest.raises(BadRecord, match=why):
        read_desc(json.dumps(dict(good, **change)).encode())
