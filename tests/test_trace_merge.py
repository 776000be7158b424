"""Unit tests of the waits the trace merge computes from arrival times (``tracing/_merge.py``,
``_computed_waits``), through the public :func:`axolotl_dist.tracing.merge_trace` on rank files
written here: a collective's call is matched across ranks by group and call number; a rank
that arrived before the last one waited from its arrival to that rank's (``sync`` ``all``), or
for a broadcast to its source's (``src:k``, a group rank); a rank that never came makes the
whole call a wait for it; waits under ``MIN_WAIT_US`` (1 ms) are not drawn. Times move to rank
0's clock by each file's offset. No process: ``tests/test_trace.py`` records real runs.

(``tracing/_merge.py`` is a private module outside the unit trees, which alone may import
one: the computed waits are read back from ``trace.json``'s events, each a wait event with
``"computed"`` in its args, and the flow arrows from their releaser.)"""

from __future__ import annotations

import json
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import pytest

from axolotl_dist.tracing import merge_trace

MS = 1_000_000  # ns
SITE = "train.py:7"


class Wait(NamedTuple):
    rank: int
    th: int
    start: int  # ns, rank 0's clock
    end: int
    waited: Tuple[int, ...]
    label: str


def span(name: str, t: float, end: float, seq: int = 1, group: Optional[str] = "0",
         sync: Optional[str] = "all", th: int = 0, kind: str = "helper") -> dict:
    """A span as the recorder writes it; ``t`` and ``end`` in ms of the rank's own clock."""
    event = {"e": "span", "k": kind, "n": name, "t": round(t * MS), "d": round((end - t) * MS),
             "th": th, "site": SITE}
    if group is not None:
        event.update(g=group, s=seq)
    if sync is not None:
        event["sync"] = sync
    return event


def write_rank(directory, rank: int, spans: Sequence[dict], groups: Dict[str, List[int]],
               offset_ms: float = 0.0, ended: bool = True) -> None:
    offset = round(offset_ms * MS)
    lines: List[dict] = [{"e": "meta", "rank": rank, "world_size": 4, "host": "node-a",
                          "pid": 100 + rank, "machine": "m", "offset_ns": offset,
                          "error_ns": 0, "clock": "monotonic", "t": -offset}]  # 0 on rank 0's
    lines += [{"e": "thread", "th": th, "name": f"thread-{th}"}
              for th in sorted({s["th"] for s in spans} | {0})]
    lines += [{"e": "group", "g": name, "ranks": ranks} for name, ranks in groups.items()]
    lines += spans
    if ended:
        lines.append({"e": "end", "t": max([s["t"] + s["d"] for s in spans], default=0),
                      "error": ""})
    (directory / f"rank{rank}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def merged(tmp_path, ranks: Dict[int, Sequence[dict]],
           groups: Optional[Dict[str, List[int]]] = None,
           offsets: Optional[Dict[int, float]] = None):
    """Write the ranks' files (``ranks``: rank -> spans), merge; the computed waits, the flow
    arrows ``(releaser, waiter)`` as ``(rank, thread, ns)`` each, and the summary."""
    groups = groups or {"0": sorted(ranks)}
    for rank, spans in ranks.items():
        write_rank(tmp_path, rank, spans, groups, (offsets or {}).get(rank, 0.0))
    result = merge_trace(str(tmp_path), png=False)
    with open(result.trace_json) as fh:
        events = json.load(fh)["traceEvents"]
    assert events == result.events

    def ns(us: float) -> int:
        return round(us * 1000)

    waits = sorted(Wait(e["pid"], e["tid"], ns(e["ts"]), ns(e["ts"] + e["dur"]),
                        tuple(e["args"]["waited_for"]), e["args"]["in"])
                   for e in events if e.get("cat") == "wait" and "computed" in e.get("args", {}))
    starts = {e["id"]: (e["pid"], e["tid"], ns(e["ts"])) for e in events if e["ph"] == "s"}
    arrows = {(starts[e["id"]], (e["pid"], e["tid"], ns(e["ts"])))
              for e in events if e["ph"] == "f"}
    assert len(arrows) == len(starts)
    return waits, arrows, result.summary


def _label(name: str) -> str:
    return f"{name} at {SITE}"


def test_each_rank_waits_from_its_arrival_for_the_last_to_arrive(tmp_path):
    # rank 0 arrives last (not the highest rank), on its thread 3: it releases ranks 1 and 2
    waits, arrows, summary = merged(tmp_path, {
        0: [span("all_reduce", 30, 31, th=3)],
        1: [span("all_reduce", 0, 31)],
        2: [span("all_reduce", 10, 31.5)],
    })
    assert waits == [Wait(1, 0, 0, 30 * MS, (0,), _label("all_reduce")),
                     Wait(2, 0, 10 * MS, 30 * MS, (0,), _label("all_reduce"))]
    assert arrows == {((0, 3, 30 * MS), (1, 0, 30 * MS)), ((0, 3, 30 * MS), (2, 0, 30 * MS))}
    row = summary.splitlines()[1]
    assert row.split("  ")[0] == _label("all_reduce"), summary
    assert row.split()[3:] == ["1", "0.032", "-", "0.030", "s", "for", "0", "0.020", "s", "for",
                               "0"], summary


def test_each_call_has_its_own_last_arriver(tmp_path):
    # call 1: rank 1 comes late; call 2: rank 0; call 1 of group "1" has no skew at all
    groups = {"0": [0, 1], "1": [0, 1]}
    waits, arrows, _ = merged(tmp_path, {
        0: [span("barrier", 0, 21, seq=1), span("barrier", 60, 61, seq=2),
            span("broadcast", 70, 71, seq=1, group="1")],
        1: [span("barrier", 20, 21, seq=1), span("barrier", 40, 61, seq=2),
            span("broadcast", 70, 71, seq=1, group="1")],
    }, groups)
    assert waits == [Wait(0, 0, 0, 20 * MS, (1,), _label("barrier")),
                     Wait(1, 0, 40 * MS, 60 * MS, (0,), _label("barrier"))]
    assert arrows == {((1, 0, 20 * MS), (0, 0, 20 * MS)), ((0, 0, 60 * MS), (1, 0, 60 * MS))}


@pytest.mark.parametrize("late_ms, drawn", [(0.5, False), (0.999, False), (1.0, True),
                                            (1.001, True)])
def test_a_skew_under_a_millisecond_is_no_wait(tmp_path, late_ms, drawn):
    waits, arrows, _ = merged(tmp_path, {0: [span("all_reduce", 0, 5)],
                                         1: [span("all_reduce", late_ms, 5)]})
    expected = [Wait(0, 0, 0, round(late_ms * MS), (1,), _label("all_reduce"))] if drawn else []
    assert waits == expected
    assert len(arrows) == len(expected)


def test_a_rank_that_never_arrives_makes_the_whole_call_a_wait_for_it(tmp_path):
    # ranks 2 (its file has no span of call 2) and 3 (no file) never came: the call ended on
    # its own (a timeout) at each rank's end, and nothing released it; rank 1's call 3 and
    # rank 2's call 1 are under 1 ms: no wait
    groups = {"0": [0, 1, 2, 3]}
    waits, arrows, _ = merged(tmp_path, {
        0: [span("all_gather", 0, 100, seq=2), span("barrier", 200, 201, seq=3)],
        1: [span("all_gather", 5, 90, seq=2), span("barrier", 200.2, 200.7, seq=3)],
        2: [span("all_gather", 0, 0.9, seq=1)],  # a call no other rank made, under 1 ms
    }, groups)
    assert waits == [Wait(0, 0, 0, 100 * MS, (2, 3), _label("all_gather")),
                     Wait(0, 0, 200 * MS, 201 * MS, (2, 3), _label("barrier")),  # 1 ms: drawn
                     Wait(1, 0, 5 * MS, 90 * MS, (2, 3), _label("all_gather"))]
    assert arrows == set()


def test_a_broadcast_waits_for_its_source_not_the_last_to_arrive(tmp_path):
    # src:1 of group "0" is global rank 1: rank 0 waits for it, rank 2 came after it; the
    # source itself never waits. src:1 of group "5" ([1, 2]) is global rank 2
    groups = {"0": [0, 1, 2], "5": [1, 2]}
    waits, arrows, _ = merged(tmp_path, {
        0: [span("broadcast", 0, 21, sync="src:1")],
        1: [span("broadcast", 20, 21, sync="src:1"),
            span("broadcast", 100, 116, seq=1, group="5", sync="src:1")],
        2: [span("broadcast", 40, 41, sync="src:1"),
            span("broadcast", 115, 116, seq=1, group="5", sync="src:1")],
    }, groups)
    assert waits == [Wait(0, 0, 0, 20 * MS, (1,), _label("broadcast")),
                     Wait(1, 0, 100 * MS, 115 * MS, (2,), _label("broadcast"))]
    assert arrows == {((1, 0, 20 * MS), (0, 0, 20 * MS)), ((2, 0, 115 * MS), (1, 0, 115 * MS))}


@pytest.mark.parametrize("sync", ["src:3", "src:-1"])
def test_a_source_outside_the_group_gives_no_wait(tmp_path, sync):
    waits, arrows, _ = merged(tmp_path, {r: [span("broadcast", 10 * r, 30, sync=sync)]
                                         for r in range(3)})
    assert (waits, arrows) == ([], set())


def test_a_helper_that_records_its_own_waits_gets_none_computed_and_no_sync_is_all(tmp_path):
    groups = {"0": [0, 1, 2]}
    waits, _, _ = merged(tmp_path, {
        0: [span("shared_map", 0, 50, seq=1, sync="none"), span("barrier", 60, 81, seq=2,
                                                                 sync=None)],
        1: [span("shared_map", 40, 50, seq=1, sync="none"), span("barrier", 80, 81, seq=2,
                                                                  sync=None)],
        2: [span("barrier", 80, 81, seq=2, sync=None)],  # never in shared_map's call 1
    }, groups)
    assert waits == [Wait(0, 0, 60 * MS, 80 * MS, (1,), _label("barrier"))]


def test_clock_offsets_move_every_rank_to_rank_0s_clock(tmp_path):
    # call 1: on their own clocks rank 1 arrives first (5 ms) and rank 2 last (1015 ms); on
    # rank 0's, rank 1 arrives last (25 ms). Call 2 (rank 1 never came): each wait ends at the
    # rank's own end, moved too
    waits, arrows, _ = merged(tmp_path, {
        0: [span("all_reduce", 10, 40), span("barrier", 100, 150, seq=2)],
        1: [span("all_reduce", 5, 18)],
        2: [span("all_reduce", 1015, 1030), span("barrier", 1100, 1140, seq=2)],
    }, offsets={1: 20.0, 2: -1000.0})
    assert waits == [Wait(0, 0, 10 * MS, 25 * MS, (1,), _label("all_reduce")),
                     Wait(0, 0, 100 * MS, 150 * MS, (1,), _label("barrier")),
                     Wait(2, 0, 15 * MS, 25 * MS, (1,), _label("all_reduce")),
                     Wait(2, 0, 100 * MS, 140 * MS, (1,), _label("barrier"))]
    assert arrows == {((1, 0, 25 * MS), (0, 0, 25 * MS)), ((1, 0, 25 * MS), (2, 0, 25 * MS))}


def test_a_wait_ends_at_the_waiters_own_end_at_the_latest(tmp_path):
    # the clocks' error bound: rank 1's arrival lands after rank 0's span ended
    waits, arrows, _ = merged(tmp_path, {0: [span("all_reduce", 0, 20)],
                                         1: [span("all_reduce", 30, 31)]})
    assert waits == [Wait(0, 0, 0, 20 * MS, (1,), _label("all_reduce"))]
    assert arrows == {((1, 0, 30 * MS), (0, 0, 20 * MS))}


# a wait is drawn clipped at the waiter's own end: under MIN_WAIT_US as drawn, it is not drawn
# (before the fix, the unclipped length was tested: a 0.5 ms wait was drawn)
def test_a_wait_clipped_under_a_millisecond_is_not_drawn(tmp_path):
    waits, _, _ = merged(tmp_path, {0: [span("all_reduce", 0, 0.5)],
                                    1: [span("all_reduce", 5, 6)]})
    assert all(w.end - w.start >= MS for w in waits), waits


def test_one_rank_waits_for_nobody(tmp_path):
    waits, arrows, summary = merged(tmp_path, {0: [span("all_reduce", 0, 10, seq=1),
                                                   span("barrier", 20, 30, seq=2)]})
    assert (waits, arrows) == ([], set())
    assert summary.splitlines()[0].split()[-3:] == ["rank", "0", "waited"]
    assert all(line.split()[-1] == "-" for line in summary.splitlines()[1:]), summary


def test_no_rank_file_is_an_error_and_no_call_is_no_wait(tmp_path):
    with pytest.raises(FileNotFoundError, match="no rank<k>.jsonl trace files in"):
        merge_trace(str(tmp_path), png=False)
    # spans of no group (a user's, a helper's outside any group) are no collective's call,
    # nor are a block's body and waits (recorded waits, with a group and number of their own)
    waits, arrows, _ = merged(tmp_path, {
        0: [span("prepare", 0, 50, group=None, kind="user"), span("x", 0, 1, group=None),
            span("zero_first", 60, 90, sync=None, kind="body")],
        1: [span("prepare", 40, 50, group=None, kind="user"), span("x", 30, 31, group=None),
            span("zero_first", 70, 90, sync=None, kind="wait")],
        2: [span("zero_first", 60, 90, sync=None, kind="wait")],
        3: [],
    })
    assert (waits, arrows) == ([], set())
