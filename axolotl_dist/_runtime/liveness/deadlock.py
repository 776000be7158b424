"""Waits that can never end: the wait-for graph of every rank's kit wait.

A kit wait that runs past its first liveness look publishes what it is (:func:`describe`,
on the root store key :func:`..store.keys.long_wait`, one ``set``; cleared when it ends): its
**point** (the group, the kind of meeting and its number on that group: the group's ``n``-th kit
collective, ``zero_first`` block ``#n``...), its label (the helper, or the block's pairing
tag), whether the ranks it awaits must *arrive* at the point or *finish* it (a ``zero_first``
waiter needs its first rank to end the body), and this rank's progress on every group it
knows (how many collectives, blocks, ``do_n_at_a_time`` and ``shared_map`` calls it has
entered, and the first-run bodies it is inside).

The stall detector (global rank 0's heartbeat thread, while some rank waits: :mod:`.peers`) reads every
rank's description in the same ``multi_get`` as the heartbeats and builds the graph: waiting
rank ``r`` is blocked by awaited rank ``p`` when ``p`` is itself in a kit wait and has not
passed ``r``'s point (its counter is lower; or it is at the same number in a different
helper or block; or, for a *finish*, it is still inside that body, waiting elsewhere).
A rank is stuck when it is blocked by a stuck rank: the ranks from which a cycle of blocking
edges can be reached (a rank busy outside kit waits, or in a raw ``torch.distributed``
call, has no description: it may still move, so nothing that waits for it is stuck). A stuck
set seen in two rounds in a row, each rank in the same wait, is the finding: each of those
ranks raises :class:`~axolotl_dist.errors.CollectiveMismatchError` naming every rank's call
and what to change (:func:`explain`). docs/design/liveness.md, "Waits that can never end", has the
rules and what the graph cannot see.
"""

from __future__ import annotations

import itertools
import re
from types import MappingProxyType
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

from ..base.groups import Group
from ..base.state import GROUPS
from .liveness_state import SCOPES
from .progress import KINDS, Point, counters
from ..base.text import ranks_text
from ..store import records

__all__ = ["Point", "Stuck", "describe", "new_serial", "find_stuck",
           "explain", "DeadlockDetector", "CALLS_PER_RANK", "read_desc"]
_SERIALS = itertools.count(1)


def new_serial() -> int:
    """A number naming one wait of this process (the finding names the wait, not the rank)."""
    return next(_SERIALS)


def _name(g: Group) -> str:
    pg = g.pg_ref()
    name = getattr(pg, "group_name", None) if pg is not None else None
    return str(name) if name else ",".join(map(str, g.ranks))


def _pack(ranks: Sequence[int]) -> str:
    """``start:stop:step`` for an arithmetic run of ranks (a mesh dimension's group), else a
    comma list."""
    if len(ranks) >= 2:
        step = ranks[1] - ranks[0]
        if step > 0 and all(b - a == step for a, b in zip(ranks, ranks[1:])):
            return f"{ranks[0]}:{ranks[-1] + 1}:{step}"
    return ",".join(map(str, ranks))


def _unpack(text: str) -> List[int]:
    if ":" in text:
        start, stop, step = map(int, text.split(":"))
        return list(range(start, stop, step))
    return [int(r) for r in text.split(",") if r]


def describe(point: Point, serial: int, what: str, thread: int,
             awaits: Optional[Sequence[int]]) -> str:
    """The JSON a wait publishes (see the module docstring): ``what`` says it for people
    (``reduce_and_broadcast at prep.py:40``); ``thread``: the waiting thread (whose first-run
    bodies count); ``awaits``: the global ranks it waits for (None: every other group
    rank)."""
    g = point.group
    inside = [[_name(scope.group), scope.seq] for scope in SCOPES.open.get(thread) or []
              if scope.kind != "zero_only" and isinstance(scope.group, Group)]
    return records.document({
        "s": serial, "g": _name(g), "m": None if g.default else _pack(g.ranks),
        "r": g.ranks[g.rank], "k": KINDS.index(point.kind), "n": point.seq, "l": point.label,
        "f": int(point.finish), "a": None if awaits is None else list(awaits),
        "w": what, "c": {_name(h): counters(h) for h in list(GROUPS.groups.values())},
        "i": inside}, compact=True)


_DESC = MappingProxyType({"s": int, "g": str, "m": (str, type(None)), "r": int, "k": int,
                          "n": int, "l": str, "f": int, "a": (list, type(None)), "w": str,
                          "c": dict, "i": list})
_PACKED = re.compile(r"\d+:\d+:\d+|(\d+,)*\d*")


def read_desc(data: bytes) -> Dict[str, Any]:
    """A wait's description as :func:`describe` writes it, checked field by field;
    :class:`~..store.records.BadRecord` for anything else (the stall detector then leaves that wait
    unjudged)."""
    d = records.read_object(data, _DESC, "a wait's description")
    if not 0 <= d["k"] < len(KINDS) or d["m"] is not None and not _PACKED.fullmatch(d["m"]) \
            or d["m"] is not None and ":" in d["m"] and int(d["m"].split(":")[2]) == 0:
        raise records.BadRecord("a wait's description names no kind or group it could have")
    if d["a"] is not None:
        records.int_list(d["a"], "a wait's awaited ranks")
    for counts in d["c"].values():
        records.int_list(counts, "a group's counters")
        if len(counts) != len(KINDS):
            raise records.BadRecord("a group's counters are not one per kind")
    if not all(isinstance(x, list) and len(x) == 2 and isinstance(x[0], str)
               and type(x[1]) is int for x in d["i"]):
        raise records.BadRecord("a wait's enclosing blocks are not [group, seq] pairs")
    return d


# --- the graph ---------------------------------------------------------------------------------

def _blocks(d: Dict[str, Any], p: Dict[str, Any]) -> bool:
    """Whether waiting rank ``p`` (its description) keeps ``d``'s wait from ending."""
    counters = p["c"].get(d["g"])
    have = counters[d["k"]] if counters is not None else 0
    if have != d["n"]:
        return have < d["n"]  # not there yet (blocks); or past it (it met the others there)
    if p["g"] == d["g"] and p["k"] == d["k"] and p["n"] == d["n"]:
        return p["l"] != d["l"]  # the same meeting, unless another helper or block
    # at that number but waiting elsewhere: it left the point, or runs its body first
    return bool(d["f"]) and [d["g"], d["n"]] in p["i"]


def _awaited(d: Dict[str, Any], world: int) -> List[int]:
    if d["a"] is not None:
        return d["a"]
    members = range(world) if d["m"] is None else _unpack(d["m"])
    return [r for r in members if r != d["r"]]


class Stuck(NamedTuple):
    """The ranks of one meeting (the same wait on each) that can never leave it."""

    ranks: List[int]
    desc: Dict[str, Any]  # the first one's description (the others' differ in rank only)
    blockers: List[int]  # the stuck ranks that keep them there


def find_stuck(descs: Dict[int, Dict[str, Any]], world: int) -> List[Stuck]:
    """The stuck ranks among the waiting ones (``descs``: rank -> description), by meeting.
    Ranks in the same wait share one computation of their blocking peers and one node of
    the graph, so a world of ranks in one barrier costs one pass over the group."""
    nodes = _meetings(descs)
    node_of = {r: i for i, ranks in enumerate(nodes) for r in ranks}
    blockers: List[List[int]] = []
    for ranks in nodes:  # a rank's own node never blocks it: the same meeting
        d = descs[ranks[0]]
        blockers.append([p for p in _awaited(d, world) if p in descs and _blocks(d, descs[p])])
    alive = _in_cycles([{node_of[p] for p in peers} for peers in blockers])
    return [Stuck(sorted(nodes[i]), descs[nodes[i][0]],
                  sorted(p for p in blockers[i] if node_of[p] in alive)) for i in sorted(alive)]


def _meetings(descs: Dict[int, Dict[str, Any]]) -> List[List[int]]:
    """The waiting ranks grouped by the meeting they wait in (the same wait on each)."""
    meetings: Dict[Tuple[Any, ...], List[int]] = {}
    for rank, d in descs.items():
        key = (d["g"], d["k"], d["n"], d["l"], d["f"], d["m"],
               None if d["a"] is None else tuple(d["a"]))
        meetings.setdefault(key, []).append(rank)
    return list(meetings.values())


def _in_cycles(edges: List[Set[int]]) -> Set[int]:
    """The nodes that reach a cycle (``edges[i]``: the nodes that block node ``i``)."""
    alive = {i for i, peers in enumerate(edges) if peers}
    changed = True
    while changed:  # peel the nodes no stuck node blocks: what stays reaches a cycle
        changed = False
        for i in list(alive):
            if not edges[i] & alive:
                alive.discard(i)
                changed = True
    return alive


def _components(stuck: List[Stuck]) -> List[List[Stuck]]:
    """The stuck meetings split into independent deadlocks (linked by blocking ranks)."""
    node_of = {r: i for i, s in enumerate(stuck) for r in s.ranks}
    parent = list(range(len(stuck)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, s in enumerate(stuck):
        for p in s.blockers:
            parent[root(i)] = root(node_of[p])
    parts: Dict[int, List[Stuck]] = {}
    for i, s in enumerate(stuck):
        parts.setdefault(root(i), []).append(s)
    return sorted(parts.values(), key=lambda part: part[0].ranks[0])


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _group_words(d: Dict[str, Any]) -> str:
    if d["m"] is None:
        return "the default group"
    members = _unpack(d["m"])
    return f"the group of {ranks_text(members)}"


def _line(s: Stuck) -> str:
    d = s.desc
    if KINDS[d["k"]] == "collective":
        where = f"its {_ordinal(d['n'])} collective on {_group_words(d)}"
    else:
        where = f"on {_group_words(d)}"
    whom = f"for {ranks_text(s.blockers)}" + (" to finish it" if d["f"] else "")
    return f"  {ranks_text(s.ranks)}: {d['w']} ({where}), waiting {whom}"


def _advice(part: List[Stuck]) -> str:
    """What to change, from the shapes of the waits (the first that applies)."""
    kinds = {KINDS[s.desc["k"]] for s in part}
    if kinds & {"zero_first", "do_n_at_a_time", "shared_map", "checkpoint_dir"} and "collective" in kinds:
        block = sorted(kinds - {"collective"})[0]
        return (f"Some ranks are in a {block} call the others never entered (they went on to "
                f"a collective). Every rank must enter the same {block} calls in the same "
                "order: one under an `if` on the rank (`if ad.get_rank() == 1:`, `if "
                "ad.is_main_process():`) or inside @zero_only code runs on some ranks only. "
                "Move it out of the `if`, or make every rank reach it.")
    colls = [s.desc for s in part if KINDS[s.desc["k"]] == "collective"]
    if len({(d["g"], d["n"]) for d in colls}) < len(colls) and len({d["l"] for d in colls}) > 1:
        return ("The ranks are in different collectives at the same point: one of them is "
                "called on some ranks only (under `if ad.is_main_process():` or another `if` "
                "on the rank). Call it on every rank, outside the `if`; to log or save on "
                "the main rank only, compute the value on every rank first (e.g. "
                "compute_and_broadcast) and use it inside the `if`.")
    if colls:
        return ("The ranks have made different numbers of collectives on the group: a "
                "collective under an `if` on the rank ran on some ranks only, or the ranks "
                "call them in a different order. Every rank must make the same collectives in "
                "the same order.")
    return ("The ranks wait in kit calls that can never meet: one under an `if` on the rank, "
            "or the ranks reach them in a different order. Every rank must make the same "
            "calls in the same order (or give blocks meant to be one the same desc=).")


#: Up to this many stuck ranks, an error's ``calls`` names each; beyond, the first of each wait.
CALLS_PER_RANK = 64


def explain(stuck: List[Stuck]) -> List[Tuple[List[int], str, Dict[int, str], List[List[Any]]]]:
    """Per deadlock: its ranks, the message every one of them raises (a line per meeting),
    ``calls`` (rank -> its call) for :class:`~axolotl_dist.errors.CollectiveMismatchError`, and
    its parties (``[ranks, call]`` per wait: what a rank that learns of the deadlock from a
    peer's failure looks itself up in)."""
    out = []
    for part in _components(stuck):
        ranks = sorted(r for s in part for r in s.ranks)
        who = ranks_text(ranks).split(" ", 1)[1]
        text = (f"ranks {who} wait for each other in kit calls that can never meet:\n"
                + "\n".join(_line(s) for s in part) + "\n" + _advice(part))
        calls = {r: s.desc["w"] for s in part
                 for r in (s.ranks if len(ranks) <= CALLS_PER_RANK else s.ranks[:1])}
        out.append((ranks, text, calls, [[s.ranks, s.desc["w"]] for s in part]))
    return out


class DeadlockDetector:
    """The stall detector's memory between rounds: each rank's description (parsed once per change)
    and the stuck ranks of the last round, with the wait each was in."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.raw: Dict[int, bytes] = {}
        self.descs: Dict[int, Dict[str, Any]] = {}
        self.last: Dict[int, int] = {}  # rank -> serial, stuck in the last round
        self.marks: Dict[int, str] = {}  # rank -> its finding mark as published
        self.texts: List[List[Any]] = []  # per deadlock: [message, {rank: call}, parties]

    def round(self, values: Sequence[bytes]) -> Optional[Tuple[Dict[int, str], List[List[Any]]]]:
        """One round over every rank's description (``values``, by rank). When the finding
        changed: the marks to write (rank -> ``"serial|deadlock"``, ``""`` to clear) and every
        deadlock's ``[message, {rank: call}, [[ranks, call], ...]]``; else None."""
        self._read(values)
        marks, texts = self._finding()
        if marks == self.marks and texts == self.texts:
            return None
        changes = {r: "" for r in self.marks if r not in marks}
        changes.update({r: m for r, m in marks.items() if self.marks.get(r) != m})
        self.marks, self.texts = marks, texts
        return changes, texts

    def _finding(self) -> Tuple[Dict[int, str], List[List[Any]]]:
        """The marks (rank -> ``"serial|deadlock"``) and texts of the deadlocks found stuck in
        two rounds in a row on the same waits (a wait that moved on is not a deadlock)."""
        stuck = find_stuck(self.descs, self.world) if len(self.descs) > 1 else []
        now = {r: self.descs[r]["s"] for s in stuck for r in s.ranks}
        steady = {r: d for r, d in self.descs.items() if r in now and self.last.get(r) == now[r]}
        self.last = now
        confirmed = find_stuck(steady, self.world) if len(steady) > 1 else []
        marks: Dict[int, str] = {}
        texts: List[List[Any]] = []
        for i, (ranks, text, calls, parties) in enumerate(explain(confirmed)):
            texts.append([text, {str(r): c for r, c in calls.items()}, parties])
            marks.update({r: records.stuck_mark(steady[r]['s'], i) for r in ranks})
        return marks, texts

    def _read(self, values: Sequence[bytes]) -> None:
        """Parse the descriptions that changed since the last round (an empty one: none)."""
        for rank, value in enumerate(values):
            if value == self.raw.get(rank, b""):
                continue
            self.raw[rank] = value
            if not value:
                self.descs.pop(rank, None)
                continue
            try:
                self.descs[rank] = read_desc(value)
            except records.BadRecord:  # not the kit's: this rank's wait is not found
                self.descs.pop(rank, None)
