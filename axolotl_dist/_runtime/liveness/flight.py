"""torch's own collectives, as its flight recorder saw them: this rank's position in each
process group's sequence, and what every rank's positions say together.

torch (2.12 and later) records every collective a gloo or NCCL process group issues, DDP's and
FSDP's included, in a ring buffer per process (``TORCH_FR_BUFFER_SIZE`` entries, 2,000 unless
set; 0 turns it off). Each entry has its group, its sequence number in that group, the op,
the input shapes and dtypes, and whether it finished. A rank that answers a where request
(:mod:`.where_report`) reads its own buffer, in the process, and keeps one entry per group:
the last collective it issued. Nothing is read while nobody asks.

From every rank's last entry per group, :func:`findings` says who is behind and who mismatched:
ranks waiting in collective #N while another rank's last is #N-1 (it never issued #N: its
place says where it is instead), or ranks whose #N are different ops, shapes or dtypes. See
docs/design/liveness.md, "Where every rank is".
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..base.text import ranks_text
from ..store import records

__all__ = ["positions", "check_positions", "describe_position", "findings", "group_label",
           "group_name", "what", "ahead_of", "unchecked_finding", "recorded", "arrivals"]

#: torch's names of its dtypes in the recorder, as ``torch.<name>`` spells them.
_DTYPES = MappingProxyType({
    "Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16",
    "Long": "int64", "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8",
    "Bool": "bool", "ComplexFloat": "complex64", "ComplexDouble": "complex128"})
#: Ops whose inputs must have the same shapes on every rank of the group.
_SAME_SHAPES = frozenset({"all_reduce", "allreduce", "broadcast", "reduce", "all_gather",
                          "allgather", "gather", "reduce_scatter", "allreduce_coalesced"})
#: A group member's position before its first collective on the group.
_NONE: Mapping[str, Any] = MappingProxyType(
    {"seq": 0, "op": "none", "shapes": [], "dtypes": [], "done": True})
#: The fields of one group's position, as :func:`positions` writes them.
_FIELDS = MappingProxyType(
    {"seq": int, "op": str, "shapes": list, "dtypes": list, "done": bool, "ranks": list})


def _dump() -> Optional[Dict[str, Any]]:
    """torch's recorder of this process as a dict, or None where this torch has none (torch
    is imported here, in a rank that answers, not where a report is only read)."""
    import torch

    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace_json", None)
    if dump is None:
        return None
    try:  # every entry (onlyActive=False): NCCL marks finished ones, which must stay, both
        # for a group's last collective and for the timeline's spans
        return records.read_local(dump(True, False))
    except Exception:  # noqa: BLE001 - a recorder that cannot dump leaves the report as it was
        return None


def _members() -> Dict[str, List[int]]:
    """Each live process group's name -> its global ranks, from torch's own registry."""
    from torch.distributed import distributed_c10d

    world = distributed_c10d._world
    out = {}
    try:
        for pg, name in list(world.pg_names.items()):
            ranks = world.pg_group_ranks.get(pg)
            if ranks is not None:
                out[str(name)] = sorted(int(r) for r in ranks)
    except Exception:  # noqa: BLE001 - the main thread changed the registry meanwhile
        return out
    return out


def positions() -> Optional[Dict[str, Dict[str, Any]]]:
    """This rank's last collective per process group (group name -> ``{"seq", "op", "shapes",
    "dtypes", "done", "ranks"}``), or None where torch records none (too old, or
    ``TORCH_FR_BUFFER_SIZE=0``). Point-to-point entries are left out: they have no place in a
    group's collective sequence. The entries come oldest first."""
    dump = _dump()
    if dump is None or not dump.get("entries"):
        return None
    members = _members()
    last: Dict[str, Dict[str, Any]] = {}
    for entry in dump["entries"]:
        if entry.get("is_p2p"):
            continue
        name = _group_of(entry)
        if members and name not in members:
            continue  # a destroyed group's entries stay in the buffer
        # the newest entry wins: a group made again under the same name (a process that
        # re-initialized) starts from #1
        last[name] = dict(_position(entry), ranks=members.get(name, []), done=_finished(entry))
    return last or None


def _finished(entry: Mapping[str, Any]) -> bool:
    """Whether a recorder entry's collective finished (retired, or marked completed)."""
    return bool(entry.get("retired")) or entry.get("state") == "completed"


def _group_of(entry: Mapping[str, Any]) -> str:
    """The name of the process group a recorder entry belongs to."""
    return str((entry.get("process_group") or ["?"])[0])


def _position(entry: Mapping[str, Any]) -> Dict[str, Any]:
    """A recorder entry's number in its group, op, input shapes and dtypes."""
    return {"seq": int(entry.get("collective_seq_id", 0)),
            "op": str(entry.get("profiling_name", "?")).split(":")[-1],
            "shapes": [[int(n) for n in s] for s in entry.get("input_sizes") or []],
            "dtypes": [_DTYPES.get(d, str(d).lower()) for d in entry.get("input_dtypes") or []]}


def check_positions(value: Any) -> None:
    """Raise :class:`~..store.records.BadRecord` where ``value`` is not what :func:`positions`
    writes: a rank's answer is checked field by field before a report reads it."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise records.BadRecord("torch's positions are not an object")
    for name, pos in value.items():
        what = f"torch's position on group {name!r}"
        records.check_fields(pos, _FIELDS, what)
        records.int_list(pos["ranks"], f"{what}'s ranks")
        for shape in pos["shapes"]:
            records.int_list(shape, f"{what}'s shapes")
        if not all(isinstance(d, str) for d in pos["dtypes"]):
            raise records.BadRecord(f"{what}'s dtypes are not text")


def group_label(name: str, ranks: List[int]) -> str:
    """``the default group`` or ``group 3 (ranks 1, 2)``."""
    if name == "0":
        return "the default group"
    return f"group {name} (ranks {', '.join(map(str, ranks))})" if ranks else f"group {name}"


def _tensors(pos: Mapping[str, Any]) -> str:
    """``float32[4096]`` (``, ``-joined for several inputs; empty for none)."""
    return ", ".join(f"{d}[{', '.join(map(str, s))}]"
                     for d, s in zip(pos["dtypes"], pos["shapes"]))


def what(pos: Mapping[str, Any], seq: bool = False) -> str:
    """``all_reduce (float32[4096])``; ``all_reduce #57 (float32[4096])`` with ``seq``."""
    tensors = _tensors(pos)
    return pos["op"] + (f" #{pos['seq']}" if seq else "") + (f" ({tensors})" if tensors else "")


def describe_position(found: Optional[Dict[str, Dict[str, Any]]]) -> str:
    """What a rank's report line says of its torch collectives: the ones it waits in, else
    its last one (empty where torch records none)."""
    if not found:
        return ""
    pending = [(n, p) for n, p in sorted(found.items()) if not p["done"]]
    if pending:
        return "; in torch's " + "; ".join(
            f"{what(p, seq=True)} on {group_label(n, p['ranks'])}, not finished" for n, p in pending)
    name, pos = max(found.items(), key=lambda item: (item[0] == "0", item[1]["seq"]))
    return f"; torch's last: {what(pos, seq=True)} on {group_label(name, pos['ranks'])}, finished"


def _kind(pos: Mapping[str, Any]) -> Tuple[Any, ...]:
    """What must agree across ranks at one sequence number."""
    shapes = tuple(map(tuple, pos["shapes"])) if pos["op"] in _SAME_SHAPES else None
    return pos["op"], shapes, tuple(pos["dtypes"])


def _mismatch(label: str, top: int, by_rank: Dict[int, Dict[str, Any]],
              lines: Callable[[int], str]) -> List[str]:
    """The finding where the ranks' collective ``#top`` differs in op, shapes or dtypes."""
    there: Dict[Tuple[Any, ...], List[int]] = {}
    for rank, pos in sorted(by_rank.items()):
        if pos["seq"] == top:
            there.setdefault(_kind(pos), []).append(rank)
    if len(there) < 2:
        return []
    parts = [f"{what(by_rank[rs[0]])} on {ranks_text(rs)}{lines(rs[0])}" for rs in there.values()]
    return [f"torch's collective #{top} on {label} differs across ranks: " + "; ".join(parts)
            + ". Every rank must issue the same collectives in the same order with the same "
            "shapes and dtypes: one of these calls runs on some ranks only (an `if` on the "
            "rank, or a loop of a different length)."]


def _behind(label: str, top: int, by_rank: Dict[int, Dict[str, Any]],
            lines: Callable[[int], str], places: Callable[[int], str]) -> List[str]:
    """The finding where some ranks' last collective is older than ``#top``: who waits in
    ``#top``, and where each rank that never issued it is instead (a busy rank, ``seq`` -1:
    it did not answer, see :func:`findings`)."""
    behind = {r: p for r, p in by_rank.items() if p["seq"] < top}
    if not behind:
        return []
    waiting = sorted(r for r, p in by_rank.items() if p["seq"] == top and not p["done"])
    ahead = [r for r, p in sorted(by_rank.items()) if p["seq"] == top]
    head = (f"{ranks_text(waiting)} wait in torch's {what(by_rank[waiting[0]], seq=True)} on {label}"
            f"{lines(waiting[0])}" if waiting else
            f"{ranks_text(ahead)} issued torch's {what(by_rank[ahead[0]], seq=True)} on {label}")
    return [head + "; " + "; ".join(_tails(top, behind, places))]


def _tails(top: int, behind: Dict[int, Dict[str, Any]], places: Callable[[int], str]) -> List[str]:
    """Where the ranks that never issued ``#top`` are, ranks in the same place together."""
    where: Dict[Tuple[int, str, str], List[int]] = {}
    for rank in sorted(behind):
        seq = behind[rank]["seq"]
        where.setdefault((seq, behind[rank]["op"], places(rank) if seq >= 0 else ""),
                         []).append(rank)
    tails = []
    for (seq, op, place), rs in where.items():
        one = len(rs) == 1
        its, it_is = ("its", "it is") if one else ("their", "they are")
        if seq < 0:
            tails.append(f"{ranks_text(rs)} did not answer: {its} {'process runs' if one else 'processes run'}"
                         f" but {its} heartbeat got no turn (Python code holding the GIL), so "
                         f"{it_is} not in #{top}")
            continue
        last = f"{its} last was #{seq} ({op})" if seq else "none issued on this group yet"
        tails.append(f"{ranks_text(rs)} never issued #{top}: {last}, {it_is} {place}")
    return tails


def _group_findings(name: str, by_rank: Dict[int, Dict[str, Any]],
                    lines: Callable[[int], str], places: Callable[[int], str]) -> List[str]:
    """The findings of one group: a mismatch at its newest sequence number, then the ranks
    that never issued it. None where no rank waits in a collective of the group."""
    if all(p["done"] for p in by_rank.values()):
        return []
    top = max(p["seq"] for p in by_rank.values())
    label = group_label(name, next(iter(by_rank.values()))["ranks"])
    return (_mismatch(label, top, by_rank, lines)
            + _behind(label, top, by_rank, lines, places))


def findings(found: Dict[int, Optional[Dict[str, Dict[str, Any]]]],
             lines: Callable[[int], str], places: Callable[[int], str],
             busy: Sequence[int] = ()) -> List[str]:
    """Every group's findings from the ranks' positions (rank -> :func:`positions`):
    ``lines(rank)`` is `` at train.py:88`` (the user's line a rank is at, or empty),
    ``places(rank)`` where a rank is (``in evaluate at train.py:120``); ``busy``: ranks that
    did not answer while their process runs (a rank inside a collective waits in C++ and
    answers at once: these are in Python, holding the GIL, not in the group's collective)."""
    groups: Dict[str, Dict[int, Dict[str, Any]]] = {}
    for rank, mine in found.items():
        for name, pos in (mine or {}).items():
            groups.setdefault(name, {})[rank] = pos
    for by_rank in groups.values():  # members that answered but issued none on it yet
        members = next(iter(by_rank.values()))["ranks"]
        for rank in members:
            if found.get(rank) is not None and rank not in by_rank:
                by_rank[rank] = dict(_NONE, ranks=members)
            elif rank in busy and rank not in found:
                by_rank[rank] = dict(_NONE, seq=-1, ranks=members)
    out = []
    for name in sorted(groups, key=lambda n: (n != "0", n)):
        out += _group_findings(name, groups[name], lines, places)
    return out


# --- debug mode: ranks in a collective no checked call issued --------------------------------

def group_name(pg: Any) -> Optional[str]:
    """torch's name of process group ``pg`` as its recorder's entries carry it (``"0"``: the
    default group); None for a group torch does not know (any more)."""
    from torch.distributed import distributed_c10d

    try:
        name = distributed_c10d._world.pg_names.get(pg)
    except Exception:  # noqa: BLE001 - an object torch cannot look up
        return None
    return None if name is None else str(name)


def ahead_of(name: str, mine: int, found: Dict[int, Optional[Dict[str, Dict[str, Any]]]]
             ) -> Dict[int, Dict[str, Any]]:
    """The ranks (of ``found``: rank -> :func:`positions`) whose last collective on group
    ``name`` is past ``mine``, this rank's last: collectives this rank never issued."""
    return {rank: pos[name] for rank, pos in sorted(found.items())
            if pos and name in pos and pos[name]["seq"] > mine}


def unchecked_finding(label: str, mine: int, call: str, ahead: Dict[int, Dict[str, Any]],
                      lines: Callable[[int], str]) -> str:
    """Debug mode's finding where ranks sit in torch collectives past ``mine`` (:func:`ahead_of`)
    while this rank is at a checked ``call`` (``rank 2: torch.distributed.barrier() at
    train.py:22``): no checked call issued them, so the ranks can never meet."""
    by_what: Dict[Tuple[str, str], List[int]] = {}
    for rank, pos in ahead.items():
        by_what.setdefault((what(pos, seq=True), lines(rank)), []).append(rank)
    theirs = "; ".join(f"{ranks_text(rs)} {'is' if len(rs) == 1 else 'are'} in torch's {w} on "
                       f"{label}{line}" for (w, line), rs in by_what.items())
    return (f"torch's collective #{mine + 1} on {label} differs across ranks: {theirs}, which "
            f"no checked call issued (DDP's gradient all-reduce in backward(), FSDP's "
            f"all-gathers, another call inside torch); {call}, its last torch collective "
            f"#{mine}. The ranks can never meet: every rank must issue the same collectives "
            "in the same order (a loop that ran a different number of times, DDP with a batch "
            "fewer on some ranks, or an `if` on the rank)")


def recorded(since_ns: int) -> List[Dict[str, Any]]:
    """torch's recorded collectives created at or after ``since_ns`` (its wall clock, ns),
    oldest first, for the timeline: ``{"group", "seq", "name", "t", "d", "done"}``, ``d`` the
    nanoseconds to its completion where the backend stamps one (NCCL with timing), else 0;
    ``done``: it finished. The buffer keeps the last ``TORCH_FR_BUFFER_SIZE`` only;
    point-to-point ones are left out."""
    dump = _dump()
    out = []
    for entry in (dump or {}).get("entries") or []:
        created = int(entry.get("time_created_ns") or 0)
        if entry.get("is_p2p") or created < since_ns:
            continue
        done = int(entry.get("time_discovered_completed_ns") or 0)
        pos = _position(entry)
        out.append({"group": _group_of(entry), "seq": pos["seq"], "name": what(pos, seq=True),
                    "t": created, "d": done - created if done > created else 0,
                    "done": _finished(entry)})
    return out


def arrivals(before_ns: int, keep: int) -> Dict[str, Tuple[List[int], List[Tuple[int, int]]]]:
    """When this rank issued its last ``keep`` collectives of each live process group issued
    before ``before_ns`` (torch's wall clock, ns): group name -> (its global ranks, ``[(seq,
    ns), ...]`` oldest first), for the straggler report (:mod:`.stragglers`). Point-to-point
    entries are left out; a torch without the recorder gives none."""
    members = _members()
    out: Dict[str, Tuple[List[int], List[Tuple[int, int]]]] = {}
    for entry in (_dump() or {}).get("entries") or []:
        name, created = _group_of(entry), int(entry.get("time_created_ns") or 0)
        if entry.get("is_p2p") or name not in members or not 0 < created < before_ns:
            continue
        out.setdefault(name, (members[name], []))[1].append(
            (int(entry.get("collective_seq_id", 0)), created))
    return {name: (ranks, issued[-keep:]) for name, (ranks, issued) in out.items()}
