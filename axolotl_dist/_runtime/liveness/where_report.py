"""Where every rank is: each rank describes itself when asked, and a report of all ranks.

Nothing is collected while nobody asks. Each rank's heartbeat thread (:mod:`.peers`) bumps its
counter ``axolotl_dist/<run>/hb/<rank>`` every ``HEARTBEAT_INTERVAL`` seconds; the low 32
bits count beats, the bits above count requests. To ask, a requester adds ``1 << 32`` to the
counters of the ranks it wants; at its next beat a rank sees the request and writes a
snapshot of its main thread to ``axolotl_dist/<run>/where/<rank>`` (JSON). The keys sit at
the root of the c10d store, under no process group's prefix, so a client that only knows
``MASTER_ADDR:MASTER_PORT`` (``axolotl-dist where``, the launcher on ``SIGUSR1``) finds them
through ``axolotl_dist/run``, which names the run and its size. See docs/design/liveness.md, "Where every
rank is".

A snapshot holds the main thread's stack, the user's frames kept and the kit's folded into the
kit call they serve (``barrier at train.py:88``), the kit wait it is in (what, since when, for
which ranks), the ``zero_first`` blocks it is running first, and its last collective in each
of torch's process groups (:mod:`.flight`), from which the report says who is behind.
"""

from __future__ import annotations

import os
import shlex
import sys
import sysconfig
import threading
import time
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from ..base import hooks, procs
from ..base.callsite import PACKAGE_DIR, short_path
from ..base.constants import HEARTBEAT_INTERVAL, HOST
from ...env.variables import SECRET_ENV_VAR, is_decimal
from . import flight
from .liveness_state import RUNS, SCOPES, WAITS, Peer
from ..store import keys, records, seals
from ..store.access import genuine, ignore, put
from .peers import decode_peer, same_machine

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import Store

__all__ = ["REQUEST", "BEATS", "snapshot", "answer", "ask", "collect", "report", "where_command",
           "where", "where_each", "placed", "place", "collective_findings", "read_answer",
           "asked_by_the_run", "QUESTION_FRESH", "UNSEALED", "peer_records"]

#: What a requester adds to a rank's heartbeat counter; the beats part of the counter (their
#: layout: :func:`~..store.keys.heartbeat`).
REQUEST, BEATS = keys.REQUEST, keys.BEATS
#: Seconds a requester waits for the ranks' answers (a rank sees a request at its next beat).
ANSWER_WITHIN = HEARTBEAT_INTERVAL + 1.5
#: Seconds between a requester's looks for answers not in yet (each one ``multi_get``).
_ANSWER_POLL = 0.5
#: Seconds a sealed question stays good for (runs with a secret): a rank answers requests
#: made while it is this recent, each answer encrypted.
QUESTION_FRESH = 60.0
#: The answer a requester leaves in place before the first one (a rank's key made once).
_NO_ANSWER = b"{}"
#: The report's line on a run without a secret.
UNSEALED = (f"  note: this run has no secret ({SECRET_ENV_VAR}): anyone who can reach its "
            'store can read these stacks and write the kit\'s records (docs/design/store.md, '
            '"Trust model")')

_PACKAGE = PACKAGE_DIR
_TORCH_MARK = os.sep + "torch" + os.sep
#: Where library code lives (the standard library, site-packages): folded, like the kit's.
_LIBRARIES = tuple(sorted({os.path.join(p, "") for p in (
    sysconfig.get_paths().get(name) for name in ("stdlib", "platstdlib", "purelib", "platlib"))
    if p}, key=len, reverse=True))


# --- what a rank says about itself ---------------------------------------------------------


def _kind(filename: str) -> str:
    """``kit``, ``torch``, ``lib`` (the standard library, site-packages, frozen modules) or
    ``user``: the frames a report shows."""
    if filename.startswith(_PACKAGE):
        return "kit"
    if _TORCH_MARK in filename:
        return "torch"
    if filename.startswith("<") or filename.startswith(_LIBRARIES):
        return "lib"
    return "user"


_WRAPPERS = {"wrapper", "counted", "__call__", "inner", "decorate"}


def _label(frames: List[Tuple[str, int, str, str]]) -> Optional[str]:
    """The kit or torch call a run of library frames serves (``barrier``, ``zero_first``,
    ``torch.distributed.barrier``)."""
    for filename, _, name, qualname in frames:
        if name in _WRAPPERS:
            continue
        if qualname.startswith("_ZeroFirst."):
            return "zero_first"
        if _kind(filename) == "torch":
            module = os.path.basename(filename)[:-3]
            prefix = "torch.distributed" if module in ("distributed_c10d", "c10d_logger") else (
                f"torch.{module}")
            return f"{prefix}.{name}"
        return name
    return None


def _frames(frame: Any) -> List[Tuple[str, int, str, str]]:
    """``(file, line, function, qualified name)`` from the outermost frame in."""
    out = []
    while frame is not None:
        code = frame.f_code
        out.append((code.co_filename, frame.f_lineno, code.co_name,
                    getattr(code, "co_qualname", code.co_name)))
        frame = frame.f_back
    out.reverse()
    return out


def snapshot(rank: int) -> Dict[str, Any]:
    """This rank's main thread, as :func:`report` prints it (JSON-ready). From the innermost
    frame out: the library frames on top fold into the call they serve (``call``: ``barrier``,
    ``torch.distributed.barrier``); then the user's frames, innermost first (``user``: ``[file,
    line, function, what it calls there]``), library frames between them folded into the call
    (``map`` for a ``datasets`` map that calls the user's function), until a kit frame (the
    rank's bootstrap) or the bottom."""
    main = threading.main_thread().ident
    frames = _frames(sys._current_frames().get(main))  # outermost first
    i = len(frames)
    while i > 0 and _kind(frames[i - 1][0]) != "user":
        i -= 1
    call = _label(frames[i:]) if i < len(frames) else None
    user: List[List[Any]] = []
    callee = None
    j = i
    while j > 0 and len(user) < 4:
        filename, line, name, _ = frames[j - 1]
        kind = _kind(filename)
        if kind == "user":
            user.append([short_path(filename), line, name, callee])
            callee = name
        elif kind == "kit" and user:
            break  # the bootstrap or test harness that runs the user's code
        else:
            callee = _label(frames[j - 1:]) or name
        j -= 1
    entry = WAITS.waits.get(main)
    firsts = [scope.describe() for scope in SCOPES.open.get(main) or []
              if scope.kind != "zero_only"]
    return {
        "rank": rank, "pid": os.getpid(), "host": HOST, "time": time.time(),
        "user": user, "call": call,
        "wait": None if entry is None else {"what": entry.what, "since": entry.since,
                                            "ranks": list(entry.ranks)},
        "first_runs": firsts, "torch": flight.positions(),
    }


def answer(store: "Store", run: str, rank: int, request: int) -> None:
    """Write this rank's snapshot for request number ``request``: in a run with a secret, only
    for a recent question sealed with it (:func:`asked_by_the_run`), encrypted."""
    hooks.where_answer()  # e.g. torch's collectives so far onto the timeline
    data = snapshot(rank)
    data["request"] = request
    key = keys.where_answer(run, rank)
    document = records.document(data)
    encrypted = seals.encrypt(key, document)
    if encrypted is None:  # a run without a secret
        store.set(key, document)
    elif asked_by_the_run(store, run):
        store.set(key, encrypted)


def asked_by_the_run(store: "Store", run: str) -> bool:
    """Whether the run's last question (:func:`~..store.keys.where_question`) is sealed with its
    secret and at most :data:`QUESTION_FRESH` seconds old (a question not this run's is
    ignored, said once)."""
    key = keys.where_question(run)
    try:
        data = genuine(key, store.get(key)) if store.check([key]) else None
        asked_at = records.read_clock(data) / 1e9 if data is not None else None
    except records.BadRecord:
        return False
    return asked_at is not None and abs(time.time() - asked_at) <= QUESTION_FRESH


# --- asking -------------------------------------------------------------------------------

def ask(store: "Store", run: str, ranks: Sequence[int]) -> Dict[int, Tuple[int, int]]:
    """Ask ``ranks`` for their snapshot: rank -> (the request number to wait for, its beats
    now); one store call per rank, which also makes sure its answer's key exists (and in a
    run with a secret, one for the sealed question)."""
    if seals.sealing():
        put(store, keys.where_question(run), records.clock(time.time_ns()))
    asked = {}
    for r in ranks:
        value = store.add(keys.heartbeat(run, r), REQUEST)
        asked[r] = (keys.requests_of(value), value & BEATS)
        if (run, r) not in RUNS.answer_keys:  # made once, so one multi_get reads every answer
            key = keys.where_answer(run, r)
            store.compare_set(key, "", seals.seal(key, _NO_ANSWER))
            RUNS.answer_keys.add((run, r))
    return asked


def _opened_answer(key: str, data: bytes) -> Optional[bytes]:
    """The document of the answer at ``key`` (decrypted or unsealed); None where it is not
    this run's (ignored: the genuine one may still come). BadRecord where it cannot be read."""
    if data.startswith(seals.ENCRYPTED):
        try:
            return seals.decrypt(key, data)
        except seals.NotThisRun as exc:
            ignore(key, exc)
            return None
    return genuine(key, data)


_NUMBER = (int, float)
_ANSWER = MappingProxyType({"rank": int, "pid": int, "host": str, "time": _NUMBER,
                            "user": list, "call": (str, type(None)),
                            "wait": (dict, type(None)), "first_runs": list,
                            "torch": (dict, type(None)), "request": int})
_WAIT = MappingProxyType({"what": str, "since": _NUMBER, "ranks": list})


def read_answer(data: bytes) -> Dict[str, Any]:
    """A rank's answer as :func:`answer` writes it, checked field by field (``{}`` for the
    empty one :func:`ask` leaves); :class:`~..store.records.BadRecord` for anything else."""
    if data == _NO_ANSWER:
        return {}
    doc = records.check_fields(records.read_document(data), _ANSWER, "a rank's answer")
    for frame in doc["user"]:
        if not (isinstance(frame, list) and len(frame) == 4 and isinstance(frame[0], str)
                and type(frame[1]) is int and isinstance(frame[2], str)
                and isinstance(frame[3], (str, type(None)))):
            raise records.BadRecord("a rank's answer has a frame that is not [file, line, "
                                    "function, callee]")
    if not all(isinstance(text, str) for text in doc["first_runs"]):
        raise records.BadRecord("a rank's answer has blocks that are not text")
    flight.check_positions(doc["torch"])
    if doc["wait"] is not None:
        records.check_fields(doc["wait"], _WAIT, "a rank's wait")
        records.int_list(doc["wait"]["ranks"], "a rank's awaited ranks")
    return doc


def _beats(data: bytes) -> int:
    """The beats a heartbeat counter holds (0 for a value the kit's ``add`` did not leave)."""
    try:
        return records.read_number(data, "a heartbeat") & BEATS
    except records.BadRecord:
        return 0


def collect(store: "Store", run: str, wanted: Dict[int, Tuple[int, int]],
            within: float = ANSWER_WITHIN) -> Tuple[Dict[int, Dict[str, Any]], Dict[int, int]]:
    """The answers to ``wanted`` (:func:`ask`'s) that came within ``within`` seconds, and, for
    the ranks that did not answer, how many beats they made meanwhile. One ``multi_get`` of
    every answer and heartbeat per poll, however many ranks."""
    ranks = list(wanted)
    names = [keys.where_answer(run, r) for r in ranks] + [keys.heartbeat(run, r) for r in ranks]
    got: Dict[int, Dict[str, Any]] = {}
    beats: Dict[int, int] = {}
    deadline = time.monotonic() + within
    while True:
        values = store.multi_get(names)
        for i, rank in enumerate(ranks):
            beats[rank] = _beats(values[len(ranks) + i])
            if rank not in got:
                try:
                    opened = _opened_answer(names[i], values[i])
                    if opened is None:
                        continue
                    data = read_answer(opened)
                except records.BadRecord as exc:
                    data = {"unreadable": records.unreadable(names[i], rank, exc)}
                if "unreadable" in data or data.get("request", 0) >= wanted[rank][0]:
                    got[rank] = data
        if len(got) == len(wanted) or time.monotonic() >= deadline:
            break
        time.sleep(_ANSWER_POLL)
    silent = {r: beats[r] - wanted[r][1] for r in ranks if r not in got}
    return got, silent


# --- the report ---------------------------------------------------------------------------

def _user_line(data: Dict[str, Any]) -> str:
    """`` at train.py:88``: the user's innermost line in a rank's answer (empty without one)."""
    user = data.get("user") or []
    return f" at {user[0][0]}:{user[0][1]}" if user else ""


def _describe(data: Dict[str, Any], waiting: str = "") -> str:
    """Where one rank is; ``waiting`` (what a group of ranks waits for) follows its kit call."""
    if "unreadable" in data:
        return str(data["unreadable"])
    user = data.get("user") or []  # innermost first
    call = data.get("call")
    if call is not None:
        text = f"{call}{_user_line(data)}{waiting}"
        outer = user[1:3]
    elif user:
        text = f"in {user[0][2]}{_user_line(data)}"
        outer = user[1:3]
    else:
        text, outer = "in no Python frame (starting or exiting)", []
    for path, line, _, callee in outer:
        text += f" ← {callee} at {path}:{line}"
    firsts = data.get("first_runs") or []
    if firsts:
        text += f"; inside {firsts[-1]}, which it runs first (the others wait for its end)"
    return text + flight.describe_position(data.get("torch"))


def _waiting(answers: List[Dict[str, Any]], ranks: List[int], now: float) -> str:
    """What ``ranks``, in the same kit wait, wait for: the longest wait, and the ranks any of
    them awaits that are not among them (in a barrier, every rank awaits all the others: those
    not in it are the ones to look at)."""
    waits = [a["wait"] for a in answers if a.get("wait")]
    if not waits:
        return ""
    seconds = max(now - w["since"] for w in waits)
    missing = sorted(set().union(*(w.get("ranks") or [] for w in waits)) - set(ranks))
    whom = f" for rank(s) {missing}" if missing else ""
    return f" (waiting {seconds:.0f} s{whom})"


def placed(answers: Dict[int, Dict[str, Any]], silent: Dict[int, int],
           peers: Dict[int, Peer]) -> List[Tuple[List[int], str]]:
    """``(ranks, where they are)`` for each group of ranks in the same place, then one entry
    per rank that did not answer, with its process state where this process can see it
    (``peers``: their peer records)."""
    now = time.time()
    groups: Dict[str, List[int]] = {}
    for rank in sorted(answers):  # the same place: the same stack, call and kind of wait
        wait = answers[rank].get("wait") or {}
        key = _describe(answers[rank], f"\0{wait.get('what', '')}")
        groups.setdefault(key, []).append(rank)
    found = []
    for ranks in sorted(groups.values()):
        waiting = _waiting([answers[r] for r in ranks], ranks, now)
        found.append((ranks, _describe(answers[ranks[0]], waiting)))
    for rank in sorted(silent):
        record = peers.get(rank)
        host, pid = (record.host, record.pid) if record is not None else ("?", 0)
        state = procs.proc_state(pid) if same_machine(record) else None
        seen = ("it made no heartbeat meanwhile" if silent[rank] <= 0
                else f"its heartbeat went on ({silent[rank]} beat(s): busy holding the GIL?)")
        where = f"process {pid} on {host}" if pid else "its process"
        extra = {"stopped": ", stopped (SIGSTOP or a debugger)", "gone": ", gone",
                 "running": ", running"}.get(state or "", "")
        found.append(([rank], f"did not answer within {ANSWER_WITHIN:g} s ({where}{extra}; "
                              f"{seen})"))
    return found


def place(data: Dict[str, Any]) -> str:
    """Where a rank is, as a verdict names it: the user's function and line, then the call it
    is in there (``in evaluate at train.py:120, in torch.distributed.barrier``)."""
    user, call = data.get("user") or [], data.get("call")
    where = f"in {user[0][2]}{_user_line(data)}" if user else "in no Python frame of yours"
    return where + (f", in {call}" if call else "")


def collective_findings(answers: Dict[int, Dict[str, Any]], busy: Sequence[int] = ()) -> List[str]:
    """What torch's collectives say of the ranks (:func:`.flight.findings`), from their
    answers; ``busy``: the silent ranks whose process runs on this machine."""
    found = {r: a.get("torch") for r, a in answers.items() if "unreadable" not in a}
    return flight.findings(found, lambda r: _user_line(answers[r]),
                           lambda r: place(answers[r]), busy)


def report(answers: Dict[int, Dict[str, Any]], silent: Dict[int, int],
           peers: Dict[int, Peer]) -> str:
    """One line per group of ranks in the same place (:func:`placed`), then what torch's
    collectives say of them (:func:`collective_findings`), each line led by ``verdict:``."""
    lines = []
    for ranks, text in placed(answers, silent, peers):
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        lines.append(f"  {who}: {text}")
    busy = [r for r in silent if _running_here(peers.get(r))]
    lines += [f"  verdict: {text}" for text in collective_findings(answers, busy)]
    return "\n".join(lines)


def where_command() -> Optional[str]:
    """The command that shows where every rank of this process's run is, from its
    ``MASTER_ADDR`` / ``MASTER_PORT`` (None without them): ``axolotl-dist where --master-port
    P``, with ``--master-addr A`` unless ``A`` is loopback (where's default)."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if not is_decimal(port) or not addr:
        return None
    at = "" if procs.is_loopback(addr) else f"--master-addr {shlex.quote(addr)} "
    return f"axolotl-dist where {at}--master-port {port}"


#: The most ranks a run's note may name (torch's ranks are int32; no run has more).
_MAX_WORLD = 1 << 17


def _asked(store: "Store", ranks: Optional[Sequence[int]], within: float) -> Any:
    """``(answers, silent, peers)`` of the run whose root store is ``store``, or the line that
    says why there is none."""
    if not store.check([keys.RUN_NOTE]):
        return "no axolotl_dist run has registered with this store (yet)"
    try:
        info = records.read_document(seals.opened(keys.RUN_NOTE, store.get(keys.RUN_NOTE)))
        sealed = info.pop("sealed", False) if isinstance(info, dict) else False
        info = records.check_fields(info, {"run": str, "world": int}, "the run's note")
        run, world = records.read_run_id(info["run"].encode()), info["world"]
        if not 0 < world <= _MAX_WORLD:
            raise records.BadRecord(f"a world of {world} ranks")
    except seals.NotThisRun as exc:
        return seals.not_this_run(keys.RUN_NOTE, exc)
    except records.BadRecord as exc:
        return records.unreadable(keys.RUN_NOTE, None, exc)
    wanted = ask(store, run, ranks if ranks is not None else range(world))
    answers, silent = collect(store, run, wanted, within)
    return answers, silent, peer_records(store, run, silent), sealed


def peer_records(store: "Store", run: str, ranks: Sequence[int]) -> Dict[int, Peer]:
    """The peer records of ``ranks`` that exist (one or two store calls each)."""
    peers: Dict[int, Peer] = {}
    for rank in ranks:
        key = keys.who(run, rank)
        record = decode_peer(key, store.get(key)) if store.check([key]) else None
        if record is not None:
            peers[rank] = record
    return peers


def _running_here(record: Optional[Peer]) -> bool:
    """Whether a rank's process runs on this machine and is running (not stopped, not gone)."""
    return same_machine(record) and record is not None and procs.proc_state(record.pid) == "running"


def where(store: "Store", ranks: Optional[Sequence[int]] = None,
          within: float = ANSWER_WITHIN) -> str:
    """The report of the run whose root store is ``store`` (all ranks by default)."""
    found = _asked(store, ranks, within)
    if isinstance(found, str):
        return f"  {found}"
    *found, sealed = found
    return report(*found) + ("" if sealed else "\n" + UNSEALED)


def where_each(store: "Store", ranks: Sequence[int],
               within: float = ANSWER_WITHIN) -> Dict[int, str]:
    """Where each of ``ranks`` of the run whose root store is ``store`` is, by rank (what
    :func:`where` says of it, without the rank's label)."""
    found = _asked(store, ranks, within)
    if isinstance(found, str):
        return {r: found for r in ranks}
    answers, silent, peers, _ = found
    each = {}
    for rank in ranks:
        mine = ({rank: answers[rank]} if rank in answers else {},
                {rank: silent[rank]} if rank in silent else {})
        for _, text in placed(*mine, peers):
            each[rank] = text
    return each
