"""Merging the ranks' trace files (:mod:`axolotl_dist._runtime.protocols.timeline`) into one
timeline: ``trace.json`` in the Chrome Trace Event format (opens in ui.perfetto.dev and
chrome://tracing), ``summary.txt`` (per call site: wall time, and for each rank the time it waited
and for whom) and, with matplotlib installed, ``timeline.png``.

Times move to rank 0's clock by each file's measured offset. Waits come from two places:

* recorded: the kit knew whom it waited for (a ``zero_first`` block's wait for its first
  rank, ``do_n_at_a_time`` rounds, ``shared_map`` parts): the span names them;
* computed: a collective or value helper is matched across ranks by its group and call
  number; a rank that arrived before the last one waited from its arrival to that rank's
  (``sync`` ``all``), or, for a broadcast, to its source's arrival (``src:k``).

A flow arrow runs from the rank that released a wait (the last to arrive, or the end of the
first rank's block) to each rank that waited. A rank whose file has no ``end`` line died
mid-run (SIGKILL, a crash): its row keeps every event up to its death and ends with an
instant event that says so. See docs/design/helpers.md, "Timeline".
"""

from __future__ import annotations

import glob
import json
import os
from collections import Counter, defaultdict
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from .._runtime.protocols.timeline import FILE_PREFIX, rank_file, rank_of_file
from . import _picture

__all__ = ["RankTrace", "load", "merge", "merge_at_exit", "announce", "Merged", "MIN_WAIT_US",
           "EXIT_WAIT"]

#: Waits shorter than this (µs) are not drawn (a collective's ordinary skew).
MIN_WAIT_US = 1000.0


class RankTrace:
    """One rank's file: its meta line, threads, groups, spans, and how it ended."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.meta: Dict[str, Any] = {}
        self.threads: Dict[int, str] = {}
        self.groups: Dict[str, List[int]] = {}
        self.spans: List[Dict[str, Any]] = []
        self.end: Optional[Dict[str, Any]] = None
        #: torch's collectives by (group, number): written again while open (a where answer)
        torch: Dict[Tuple[Any, Any], Dict[str, Any]] = {}
        with open(path) as fh:
            for line in fh:
                try:
                    event = json.loads(line)
                except ValueError:  # a line cut short by the process's death
                    continue
                kind = event.get("e")
                if kind == "meta":
                    self.meta = event
                elif kind == "thread":
                    self.threads[event["th"]] = event["name"]
                elif kind == "group":
                    self.groups[event["g"]] = event["ranks"]
                elif kind == "span" and event["k"].startswith("torch"):
                    torch[(event.get("g"), event.get("s"))] = event  # the last line wins
                elif kind == "span":
                    self.spans.append(event)
                elif kind == "end":
                    self.end = event
        self.spans += torch.values()
        self.last = max([int(self.meta.get("t", 0))] + [s["t"] + s["d"] for s in self.spans])
        self.rank = int(self.meta.get("rank", rank_of_file(path)))
        self.offset = int(self.meta.get("offset_ns", 0))

    def at(self, t: int) -> int:
        """Local time ``t`` on rank 0's clock (ns)."""
        return t + self.offset


def load(directory: str) -> List[RankTrace]:
    """Every rank file in ``directory``, by rank."""
    paths = glob.glob(os.path.join(directory, f"{FILE_PREFIX}*.jsonl"))
    traces = [RankTrace(p) for p in paths]
    return sorted((t for t in traces if t.meta), key=lambda t: t.rank)


class Merged(NamedTuple):
    """What :func:`merge` wrote, and the summary table it printed."""

    trace_json: str
    summary_txt: str
    timeline_png: Optional[str]
    summary: str
    events: List[Dict[str, Any]]
    #: Why no ``timeline.png`` was drawn although one was asked for (an extra is missing).
    png_note: Optional[str] = None

    def report(self) -> str:
        """Where the trace is (and the picture, or why there is none), then the summary."""
        return announce(self)


#: What a merge says when it cannot draw ``timeline.png``.
PNG_NEEDS_EXTRA = ("no timeline.png: drawing it needs matplotlib (pip install matplotlib, "
                   "or the 'trace' extra of axolotl-dist: pip install -e '.[trace]' in a clone)")


class _Wait(NamedTuple):
    rank: int
    th: int
    start: int  # ns, rank 0's clock
    end: int
    waited: Tuple[int, ...]
    label: str  # "name at site"
    releaser: Optional[Tuple[int, int, int]]  # (rank, thread, time) the release came from
    computed: bool  # from arrival times (else recorded by the kit as a span)


def _label(span: Dict[str, Any]) -> str:
    site = span.get("site")
    return f"{span['n']} at {site}" if site else span["n"]


def _helper_calls(traces: List[RankTrace]
                  ) -> Dict[Tuple[str, int], List[Tuple[RankTrace, Dict[str, Any]]]]:
    """Each collective or value helper call, by group and call number: the ranks' spans of it."""
    calls: Dict[Tuple[str, int], List[Tuple[RankTrace, Dict[str, Any]]]] = defaultdict(list)
    for tr in traces:
        for span in tr.spans:
            if span["k"] == "helper" and span.get("g") is not None:
                calls[(span["g"], span["s"])].append((tr, span))
    return calls


def _released_by(sync: str, ranks: List[int], arrived: Dict[int, Tuple[int, RankTrace, Any]],
                 rank: int) -> Optional[Tuple[int, int]]:
    """``(rank, arrival)`` of the rank whose arrival ends ``rank``'s wait in a call: its
    broadcast's source (``src:k``), else the last to arrive; None where the source is out of
    the group, is ``rank`` itself or never came."""
    if not sync.startswith("src:"):
        last_rank, (last, _, _) = max(arrived.items(), key=lambda kv: kv[1][0])
        return last_rank, last
    src_group_rank = int(sync[4:])
    if not 0 <= src_group_rank < len(ranks):
        return None
    source = ranks[src_group_rank]
    if source == rank or source not in arrived:
        return None
    return source, arrived[source][0]


def _computed_waits(traces: List[RankTrace]) -> List[_Wait]:
    """Waits inside collectives, from the arrival times of each call on every rank."""
    calls = _helper_calls(traces)
    members = {}
    for tr in traces:
        members.update(tr.groups)
    waits: List[_Wait] = []
    for (group, _), found in calls.items():
        ranks = members.get(group, [])
        arrived = {tr.rank: (tr.at(span["t"]), tr, span) for tr, span in found}
        missing = tuple(r for r in ranks if r not in arrived)
        sync = found[0][1].get("sync", "all")
        if sync == "none":  # the helper recorded its own waits
            continue
        for rank, (start, tr, span) in arrived.items():
            end = tr.at(span["t"] + span["d"])
            if missing:  # a rank never came (lost): the whole call was a wait for it
                if end - start >= MIN_WAIT_US * 1000:
                    waits.append(_Wait(rank, span["th"], start, end, missing, _label(span), None,
                                       True))
                continue
            released = _released_by(sync, ranks, arrived, rank)
            if released is None:
                continue
            last_rank, last = released
            if last_rank == rank or min(last, end) - start < MIN_WAIT_US * 1000:
                continue
            other = arrived[last_rank]
            waits.append(_Wait(rank, span["th"], start, min(last, end), (last_rank,),
                               _label(span), (last_rank, other[2]["th"], last), True))
    return waits


def _recorded_waits(traces: List[RankTrace]) -> List[_Wait]:
    """Waits the kit recorded with the ranks it waited for; the release comes from the end of
    the waited-for rank's block body with the same group and number, if there is one."""
    bodies: Dict[Tuple[str, str, int, int], Tuple[int, int]] = {}
    for tr in traces:
        for span in tr.spans:
            if span["k"] == "body" and span.get("g") is not None:
                key = (span["n"], span["g"], span["s"], tr.rank)
                bodies[key] = (span["th"], tr.at(span["t"] + span["d"]))
    waits = []
    for tr in traces:
        for span in tr.spans:
            if span["k"] != "wait":
                continue
            waited = tuple(span.get("w", ()))
            release = None
            for source in waited:
                body = bodies.get((span["n"], span.get("g"), span.get("s"), source))
                if body is not None and (release is None or body[1] > release[2]):
                    release = (source, body[0], body[1])
            waits.append(_Wait(tr.rank, span["th"], tr.at(span["t"]),
                               tr.at(span["t"] + span["d"]), waited, _label(span), release, False))
    return waits


def _calls_by_site(traces: List[RankTrace]) -> Dict[str, Dict[Any, List[int]]]:
    """Per call site (label), per call: the start and end times of every rank's span of it."""
    calls: Dict[str, Dict[Any, List[int]]] = defaultdict(lambda: defaultdict(list))
    for tr in traces:
        for span in tr.spans:
            if span["k"] in ("helper", "body", "wait", "user"):
                label = _label(span)
                instance = (span.get("g"), span.get("s")) if span.get("g") else (tr.rank, span["t"])
                calls[label][instance] += [tr.at(span["t"]), tr.at(span["t"] + span["d"])]
    return calls


def _wait_seconds(waits: List[_Wait]) -> Tuple[Dict[str, Dict[int, float]],
                                               Dict[str, Dict[int, Counter]]]:
    """Per call site and rank: the seconds it waited, and the seconds it waited for each rank."""
    waited: Dict[str, Dict[int, float]] = defaultdict(lambda: defaultdict(float))
    whom: Dict[str, Dict[int, Counter]] = defaultdict(lambda: defaultdict(Counter))
    for w in waits:
        waited[w.label][w.rank] += (w.end - w.start) / 1e9
        for r in w.waited:
            whom[w.label][w.rank][r] += (w.end - w.start) / 1e9
    return waited, whom


def _site_row(label: str, instances: Dict[Any, List[int]], ranks: List[int],
              waited: Dict[int, float], whom: Dict[int, Counter]) -> List[str]:
    """A call site's row of the summary: its label, calls, wall seconds, and each rank's wait
    with the (up to three) ranks it waited for most."""
    wall = sum(max(v) - min(v) for v in instances.values()) / 1e9
    row = [label, str(len(instances)), f"{wall:.3f}"]
    for r in ranks:
        seconds = waited.get(r, 0.0)
        if seconds <= 0:
            row.append("-")
            continue
        top = [str(k) for k, _ in whom[r].most_common(3)]
        row.append(f"{seconds:.3f} s for {', '.join(top)}")
    return row


def _open_collectives(traces: List[RankTrace]) -> List[str]:
    """A line per torch collective a rank was still in when it last wrote its file."""
    return [f"rank {tr.rank}: in torch's {span['n']}, not finished {span['d'] / 1e9:.1f} s "
            "after it was issued (its file's last look)"
            for tr in traces for span in tr.spans if span["k"] == "torch-open"]


def _findings(traces: List[RankTrace]) -> List[str]:
    """A line per finding the kit marked while the run went (a straggler named)."""
    return [span["n"] for tr in traces for span in tr.spans if span["k"] == "finding"]


def _summary(traces: List[RankTrace], waits: List[_Wait]) -> str:
    """Per call site: calls, wall time (first start to last end over the ranks, summed over
    calls), and each rank's total wait with the ranks it waited for most."""
    calls = _calls_by_site(traces)
    waited, whom = _wait_seconds(waits)
    ranks = [tr.rank for tr in traces]
    rows = [["call site", "calls", "wall s"] + [f"rank {r} waited" for r in ranks]]
    for label in sorted(calls, key=lambda k: min(min(v) for v in calls[k].values())):
        rows.append(_site_row(label, calls[label], ranks, waited[label], whom[label]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lost = [tr.rank for tr in traces if tr.end is None]
    if lost:
        lines.append(f"rank(s) {lost} ended without an exit record (killed or crashed): their "
                     "rows stop at their last event")
    lines += _open_collectives(traces) + _findings(traces)
    return "\n".join(lines) + "\n"


def _span_event(tr: RankTrace, span: Dict[str, Any], us: Callable[[int], float]) -> Dict[str, Any]:
    """One span of a rank as a Chrome trace event (``us``: a time on rank 0's clock in the
    trace's microseconds)."""
    args = {key: span[src] for key, src in (("site", "site"), ("group", "g"), ("call", "s"),
                                            ("bytes", "b"), ("waited_for", "w"), ("error", "err"))
            if src in span}
    name = span["n"] if span["k"] != "wait" else f"wait: {span['n']}"
    if span["k"] == "body":
        name = f"{span['n']} body"
    event = {"name": name, "cat": span["k"], "ph": "X", "pid": tr.rank, "tid": span["th"],
             "ts": us(tr.at(span["t"])), "dur": round(span["d"] / 1000.0, 3), "args": args}
    if span["k"] == "torch" and not span["d"]:  # issued; gloo stamps no completion
        del event["dur"]
        event.update(ph="i", s="t")
    elif span["k"] == "torch-open":  # not finished when the rank last wrote its file
        event.update(name=f"{span['n']}: not finished", cat="torch")
    elif span["k"] == "finding":  # the kit's finding (a straggler): a line across the ranks
        del event["dur"]
        event.update(ph="i", s="g")
    return event


def _events(traces: List[RankTrace], waits: List[_Wait], base: int) -> List[Dict[str, Any]]:
    def us(t: int) -> float:
        return round((t - base) / 1000.0, 3)

    events: List[Dict[str, Any]] = []
    for tr in traces:
        host, pid = tr.meta.get("host", "?"), tr.meta.get("pid", "?")
        state = "" if tr.end is not None else " - lost: no exit record"
        events.append({"name": "process_name", "ph": "M", "pid": tr.rank, "tid": 0,
                       "args": {"name": f"rank {tr.rank} ({host}, pid {pid}){state}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": tr.rank, "tid": 0,
                       "args": {"sort_index": tr.rank}})
        for th, name in tr.threads.items():
            events.append({"name": "thread_name", "ph": "M", "pid": tr.rank, "tid": th,
                           "args": {"name": name}})
        events += [_span_event(tr, span, us) for span in tr.spans]
        if tr.end is None:
            events.append({"name": "ended: rank lost (no exit record: killed or crashed)",
                           "cat": "lost", "ph": "i", "s": "p", "pid": tr.rank, "tid": 0,
                           "ts": us(tr.at(tr.last))})
        elif tr.end.get("error"):
            events.append({"name": f"exit on {tr.end['error']}", "cat": "exit", "ph": "i",
                           "s": "p", "pid": tr.rank, "tid": 0, "ts": us(tr.at(tr.end["t"]))})
    flow = 0
    for w in waits:
        if w.computed:  # a recorded wait is drawn from its own span above
            events.append({"name": f"wait: {w.label.split(' at ')[0]}", "cat": "wait",
                           "ph": "X", "pid": w.rank, "tid": w.th, "ts": us(w.start),
                           "dur": round((w.end - w.start) / 1000.0, 3),
                           "args": {"waited_for": list(w.waited), "in": w.label,
                                    "computed": "from the ranks' arrival times"}})
        if w.releaser is not None:
            flow += 1
            src_rank, src_th, at = w.releaser
            events.append({"name": "released", "cat": "release", "ph": "s", "id": flow,
                           "pid": src_rank, "tid": src_th, "ts": us(at)})
            events.append({"name": "released", "cat": "release", "ph": "f", "bp": "e",
                           "id": flow, "pid": w.rank, "tid": w.th, "ts": us(w.end)})
    return events


def merge(directory: str, png: bool = True) -> Merged:
    """Merge the rank files in ``directory`` into ``trace.json``, ``summary.txt`` and (with
    matplotlib, ``png``) ``timeline.png`` there."""
    traces = load(directory)
    if not traces:
        raise FileNotFoundError(f"no {FILE_PREFIX}<k>.jsonl trace files in {directory}")
    starts = [tr.at(int(tr.meta.get("t", 0))) for tr in traces]
    starts += [tr.at(span["t"]) for tr in traces for span in tr.spans]
    base = min(starts)
    waits = _recorded_waits(traces) + _computed_waits(traces)
    events = _events(traces, waits, base)
    bounds = {str(tr.rank): {"offset_us": tr.offset / 1000.0,
                             "error_bound_us": tr.meta.get("error_ns", 0) / 1000.0}
              for tr in traces}
    out = os.path.join(directory, "trace.json")
    with open(out + ".tmp", "w") as fh:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                   "otherData": {"clock": "each rank's monotonic clock moved to rank 0's",
                                 "clock_alignment": bounds}}, fh)
    os.replace(out + ".tmp", out)
    summary = _summary(traces, waits)
    summary_path = os.path.join(directory, "summary.txt")
    with open(summary_path, "w") as fh:
        fh.write(summary)
    picture: Optional[str] = None
    note: Optional[str] = None
    if png:
        try:
            picture = _picture.draw(traces, waits, base, os.path.join(directory, "timeline.png"))
        except ImportError:
            note = PNG_NEEDS_EXTRA
    return Merged(out, summary_path, picture, summary, events, note)


#: Seconds the merging rank waits at exit for the other ranks' files to end.
EXIT_WAIT = 2.0


def _ended(path: str) -> bool:
    """Whether a rank file has its ``end`` line, or its process is gone from this host."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.path.getsize(path) - 4096))
            tail = fh.read().decode(errors="replace")
        if '"e":"end"' in tail:
            return True
        with open(path) as fh:
            meta = json.loads(fh.readline())
    except (OSError, ValueError):
        return False
    from .._runtime.base import procs

    return meta.get("machine") == procs.MACHINE and procs.proc_state(meta["pid"]) == "gone"


def merge_at_exit(directory: str, world_size: int) -> Optional[Merged]:
    """Rank 0 at exit (no ``axolotl-dist`` launcher to do it): wait up to :data:`EXIT_WAIT`
    seconds for every rank's file to end, merge, and print where the trace is and the summary
    table to stderr. Never raises."""
    import sys
    import time

    try:
        paths = [rank_file(directory, r) for r in range(world_size)]
        deadline = time.monotonic() + EXIT_WAIT
        while time.monotonic() < deadline and not all(_ended(p) for p in paths if os.path.exists(p)):
            time.sleep(0.02)
        merged = merge(directory)
        sys.stderr.write(announce(merged))
        sys.stderr.flush()
        return merged
    except Exception as exc:  # noqa: BLE001 - a trace must never fail an exit
        sys.stderr.write(f"axolotl_dist: could not merge the trace in {directory}: "
                         f"{type(exc).__name__}: {exc}\n")
        return None


def announce(merged: Merged) -> str:
    picture = f", {merged.timeline_png}" if merged.timeline_png else ""
    note = f"axolotl_dist: {merged.png_note}\n" if merged.png_note else ""
    return (f"axolotl_dist: timeline of the kit's calls: {merged.trace_json} (open it in "
            f"https://ui.perfetto.dev or chrome://tracing){picture}\n{note}{merged.summary}")
