"""A ``@pytest.mark.distributed`` test's call: its body on every rank, one account of the run.

The pytest plugin (``pytest_axolotl_dist``, outside the package so that a session without a
marked test imports no torch) hands each marked test's call here. The test function runs on
forked ranks through :func:`.run_distributed_outcomes` with the fixture values the test
process computed; a rank whose body raises leaves a note (what kind of end, and pytest's own
rendering of its traceback, assertion rewriting included) in a directory of the test's own,
then raises on, so its peers learn of the failure as in any run. The notes and the outcomes
become one finding: pass, skip, xfail, or a failure whose message says each rank's part once.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tempfile
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple

from .._runtime.base.text import ranks_text, tags_rank
from ._harness import run_distributed_outcomes
from ._outcomes import RankOutcome

__all__ = ["GRACE", "MarkedResult", "run", "on_rank", "summarize", "LabelledLines"]

#: Seconds the other ranks get to end once one rank has failed, before they are killed.
GRACE = 3.0


class MarkedResult(NamedTuple):
    """A marked test's outcome from its ranks' notes and ends."""

    #: ``"pass"``, ``"skip"``, ``"xfail"`` or ``"fail"``
    kind: str
    #: the account: each failing rank's once, identical ones folded, then one line per rank
    #: stopped by the failure; on a timeout, where every rank was; a skip's or xfail's reason
    message: str = ""
    #: the message in one line, as pytest's short summary says a failure
    #: (``rank 1 of 2 failed: AssertionError: ...``)
    summary: str = ""
    #: ``(path, line)`` where the first failing rank's exception left the test's file
    site: Optional[Tuple[str, int]] = None


def run(item: Any, fn: Callable[..., Any], kwargs: Mapping[str, Any], *, world_size: int,
        store: str, backend: str, init: bool, timeout: float, timeout_source: str) -> None:
    """Run ``fn(**kwargs)`` (the test ``item``'s function) on ``world_size`` ranks; return if
    every rank passed, else skip, xfail or fail the test with :func:`summarize`'s message."""
    import pytest

    notes = tempfile.mkdtemp(prefix="axolotl-dist-pytest-")
    try:
        outcomes = run_distributed_outcomes(
            on_rank, world_size, args=(item, fn, dict(kwargs), notes), init=init,
            backend=backend, timeout=timeout, grace=GRACE, store=store)
        result = summarize(outcomes, _read_notes(notes), timeout, timeout_source)
    finally:
        shutil.rmtree(notes, ignore_errors=True)
    if result.kind == "skip":
        try:  # reported at the test's own line, as a skip marker is, not at this one
            skipped = pytest.skip.Exception(result.message, _use_item_location=True)
        except TypeError:  # a pytest before 7
            skipped = pytest.skip.Exception(result.message)
        raise skipped
    elif result.kind == "xfail":
        pytest.xfail(result.message)
    elif result.kind == "fail":
        failure = pytest.fail.Exception(result.message, pytrace=False)
        # the plugin's report hook makes the summary and site pytest's crash line
        failure.axolotl_dist_result = result  # type: ignore[attr-defined]
        raise failure


def on_rank(item: Any, fn: Callable[..., Any], kwargs: Dict[str, Any], notes: str) -> None:
    """A rank's body: the test function; what it raised is logged, then raised on. What it
    prints reaches pytest's capture line by line, each line labelled with the rank."""
    __tracebackhide__ = True  # pytest's rendering starts at the test function
    rank = os.environ.get("RANK", "0")
    sys.stdout = _labelled(sys.stdout, rank)
    sys.stderr = _labelled(sys.stderr, rank)
    try:
        fn(**kwargs)
    except BaseException as exc:
        _note(exc, item, fn, notes)
        raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def _labelled(stream: Any, rank: str) -> Any:
    """``stream`` as :class:`LabelledLines` where it writes to a file descriptor (pytest's
    ``--capture=fd``, the default, or ``-s``); as it is otherwise (``--capture=sys`` keeps a
    forked rank's output in the rank's own memory)."""
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):
        return stream
    return LabelledLines(stream, rank)


class LabelledLines(io.TextIOBase):
    """A text stream that writes each whole line to ``stream``'s file descriptor in one
    ``write()``, prefixed with ``label``: the ranks share pytest's capture file, and one
    ``write()`` of a line is never split by another process's, where buffered text is
    (``loading shardloading shard``). A line without its newline waits for it, or for
    :meth:`flush`. A line that names its rank already (the kit's log lines: ``[rank 1/2]``)
    is written as it is."""

    def __init__(self, stream: Any, rank: str) -> None:
        super().__init__()
        self._stream, self._pending = stream, b""
        self._label, self._rank = f"[rank {rank}] ".encode(), int(rank)
        stream.flush()
        self._fd = stream.fileno()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._stream, "encoding", None) or "utf-8"

    def write(self, text: str) -> int:
        data = self._pending + text.encode(self.encoding, "replace")
        *whole, self._pending = data.split(b"\n")
        if whole:
            self._write(b"".join(self._line(line) for line in whole))
        return len(text)

    def flush(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, b""
            self._write(self._line(pending))

    def _line(self, line: bytes) -> bytes:
        if not line.strip() or tags_rank(line, self._rank):  # a blank line, or a kit's log line
            return line + b"\n"
        return self._label + line + b"\n"

    def _write(self, data: bytes) -> None:
        while data:
            data = data[os.write(self._fd, data):]


def _note(exc: BaseException, item: Any, fn: Callable[..., Any], notes: str) -> None:
    """Write this rank's note: ``kind`` (skip, xfail, fail, or ``stopped``: another rank's
    failure or exit reached this one), ``text`` (the reason, or the rendered traceback),
    ``type`` (the exception's type name) and, for ``stopped``, ``cause`` (the rank that
    failed or left), ``how`` (how it did: an exception's type, ``exited``...) and ``waited``
    (``barrier at test_x.py:25``: where this rank was)."""
    import pytest

    rank = os.environ.get("RANK", "0")
    fields: Dict[str, Any] = {"type": type(exc).__name__, "message": _first_line(str(exc)),
                              "site": _site(exc, fn)}
    lost = _lost_peer(exc)
    if isinstance(exc, (pytest.skip.Exception, pytest.xfail.Exception)):
        kind = "xfail" if isinstance(exc, pytest.xfail.Exception) else "skip"
        text = str(exc.msg or "")
    elif lost is not None:
        kind = "stopped"
        site = _site(exc, fn)
        where = lost.where or _torch_call(exc) or "a collective"
        at = f" at {os.path.basename(site[0])}:{site[1]}" if site else ""
        text = (f"failed because {ranks_text(lost.ranks[:1])} did ({type(lost).__name__} in "
                f"{where}{at})")
        fields.update(cause=lost.ranks[0], how=lost.exc_type, waited=f"{where}{at}")
    else:
        kind = "fail"
        text = _rendered(exc, item)
    path = os.path.join(notes, f"rank{rank}.json")
    with open(path + ".part", "w") as fh:
        json.dump(dict(fields, kind=kind, text=text), fh)
    os.replace(path + ".part", path)


def _lost_peer(exc: BaseException) -> Any:
    """The :class:`~axolotl_dist.errors.RankFailedError` that ended this rank's test: ``exc``
    itself, or, for a raw ``torch.distributed`` collective that failed because a peer left
    (gloo's "Connection closed by peer"), the kit's diagnosis naming that peer; else None."""
    from .._runtime.base.groups import group_of
    from .._runtime.liveness.failures import diagnose_lost_peer
    from ..errors import AxolotlDistError, RankFailedError

    if isinstance(exc, RankFailedError):
        return exc
    if not isinstance(exc, RuntimeError) or isinstance(exc, AxolotlDistError):
        return None
    call = _torch_call(exc)
    if call is None:
        return None
    try:
        g = group_of(None, "the test")
        found = diagnose_lost_peer(exc, call, g) if g is not None else exc
    except Exception:  # noqa: BLE001 - no group or store left: the exception as it is
        return None
    return found if isinstance(found, RankFailedError) else None


def _torch_call(exc: BaseException) -> Optional[str]:
    """``torch.distributed.barrier``: the ``torch.distributed`` function ``exc`` went through
    first (a raw collective the test called), or None."""
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        # the public function, not the logging wrapper torch puts around it (c10d_logger)
        if code.co_filename.endswith(os.path.join("distributed", "distributed_c10d.py")):
            return f"torch.distributed.{code.co_name}"
        tb = tb.tb_next
    return None


def _internal(filename: str) -> Optional[str]:
    """``"kit"`` or ``"torch"`` for a file of this package or of torch, else None."""
    from .._runtime.base.tracebacks import kit_frame

    if kit_frame(filename):
        return "kit"
    return "torch" if filename.startswith(_TORCH_DIR) else None


def _torch_dir() -> str:
    import torch

    return os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


_TORCH_DIR = _torch_dir()


def _first_line(text: str, limit: int = 200) -> str:
    """The first line of ``text``, cut to ``limit`` characters."""
    line = text.strip().split("\n", 1)[0]
    return line if len(line) <= limit else line[:limit - 3] + "..."


def _site(exc: BaseException, fn: Callable[..., Any]) -> Optional[Tuple[str, int]]:
    """``(path, line)`` of the innermost frame in the test's file that ``exc`` went through."""
    code = getattr(fn, "__code__", None)
    filename = code.co_filename if code is not None else None
    found = None
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            found = (filename, tb.tb_lineno)
        tb = tb.tb_next
    return found


def _rendered(exc: BaseException, item: Any) -> str:
    """pytest's own rendering of ``exc`` as the failure of the test ``item`` (its traceback
    cut to the test function, ``--tb``, ``--showlocals``, fixture values), as text; the
    frames of the kit and of torch below the user's last one are left out (the user's line
    and the error say what they did)."""
    import pytest

    cut = _user_end(exc.__traceback__)
    below = cut.tb_next if cut is not None else None
    try:
        if cut is not None:
            cut.tb_next = None
        info = pytest.ExceptionInfo.from_exception(exc)
        rendering = item.repr_failure(info)
        if isinstance(rendering, str):
            return rendering
        # str() of it strips the first line's indent: written out as pytest's terminal does
        from _pytest._io import TerminalWriter

        out = io.StringIO()
        rendering.toterminal(TerminalWriter(file=out))
        return out.getvalue()
    except Exception:  # noqa: BLE001 - an older or newer pytest: the plain traceback
        import traceback

        return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    finally:
        if cut is not None:
            cut.tb_next = below


def _user_end(tb: Any) -> Any:
    """The last entry of traceback ``tb`` in the user's code when every entry after it is the
    kit's or torch's (where to cut it); None if there is nothing to cut."""
    last_user, internal_after = None, False
    while tb is not None:
        if _internal(tb.tb_frame.f_code.co_filename) is None:
            last_user, internal_after = tb, False
        else:
            internal_after = True
        tb = tb.tb_next
    return last_user if internal_after else None


def _read_notes(notes: str) -> Dict[int, Dict[str, Any]]:
    found = {}
    for name in os.listdir(notes):
        if name.startswith("rank") and name.endswith(".json"):
            try:
                with open(os.path.join(notes, name)) as fh:
                    found[int(name[4:-5])] = json.load(fh)
            except (OSError, ValueError):
                continue
    return found


def _groups(items: List[Tuple[int, str]]) -> List[Tuple[List[int], str]]:
    """``(ranks, text)`` with the ranks of identical texts together, in the order each text
    first appears."""
    groups: Dict[str, List[int]] = {}
    for rank, text in items:
        groups.setdefault(text, []).append(rank)
    return [(ranks, text) for text, ranks in groups.items()]


def _folded(items: List[Tuple[int, str]]) -> List[Tuple[str, str]]:
    """``(ranks label, text)`` with the ranks of identical texts folded (``ranks 0-2``)."""
    return [(ranks_text(ranks), text) for ranks, text in _groups(items)]


def _ended(outcome: RankOutcome) -> Tuple[str, str]:
    """How a rank that left no note ended (it raised outside the test body, or died): what
    happened, in one line, and its traceback (or "")."""
    text = outcome.describe()
    text = text.split(": ", 1)[1] if text.startswith(f"rank {outcome.rank}: ") else text
    first, _, rest = text.partition("\n")
    return first, rest


#: Errors every rank of one mismatch raises, each in its own words: told once.
_MISMATCHES = ("CollectiveMismatchError", "TensorMismatchError")


def _passed(outcomes: List[RankOutcome], notes: Mapping[int, Mapping[str, Any]],
            rank: Any) -> bool:
    """Whether ``rank`` finished its test body without an exception."""
    return (isinstance(rank, int) and 0 <= rank < len(outcomes) and outcomes[rank].ok
            and rank not in notes)


def _one_mismatch(failed: List[Tuple[int, str]], notes: Mapping[int, Mapping[str, Any]]
                  ) -> Tuple[List[Tuple[int, str]], List[Tuple[int, str]]]:
    """``failed`` with a mismatch error that several ranks raised told by its first rank
    only, and a line for each other rank (its own call site)."""
    kinds = [notes.get(rank, {}).get("type") for rank, _ in failed]
    mismatch = next((k for k in kinds if k in _MISMATCHES), None)
    if mismatch is None or kinds.count(mismatch) < 2:
        return failed, []
    kept: List[Tuple[int, str]] = []
    same: List[Tuple[int, str]] = []
    first: Optional[int] = None
    for (rank, text), kind in zip(failed, kinds):
        if kind != mismatch:
            kept.append((rank, text))
        elif first is None:
            first = rank
            kept.append((rank, text))
        else:
            site = notes[rank].get("site")
            at = f" at {os.path.basename(site[0])}:{site[1]}" if site else ""
            same.append((rank, f"failed with the same {mismatch}{at} (told by "
                               f"{ranks_text([first])} above)"))
    return kept, same


class _Outcomes:
    """Each rank's outcome and note, sorted into what a finding tells: the failed ranks (with
    their exception in one line and their test's line), the ranks still running at the
    timeout, one line for each other rank (stopped, skipped, xfailed)."""

    def __init__(self, outcomes: List[RankOutcome], notes: Mapping[int, Mapping[str, Any]]
                 ) -> None:
        self.outcomes, self.notes, self.world = outcomes, notes, len(outcomes)
        self.failed: List[Tuple[int, str]] = []
        self.crash: Dict[int, str] = {}  # a failed rank's exception in one line
        self.sites: List[Tuple[str, int]] = []
        self.lines: List[Tuple[int, str]] = []  # one per rank: stopped, killed, skipped...
        self.skips: List[Tuple[int, str]] = []
        self.xfails: List[Tuple[int, str]] = []
        self.stuck: List[RankOutcome] = []
        for o in outcomes:
            note: Optional[Mapping[str, Any]] = notes.get(o.rank)
            if not (o.ok and note is None):
                self._add(o, note)
        self.lines += [(r, f"skipped: {t}") for r, t in self.skips] + \
            [(r, f"xfailed: {t}") for r, t in self.xfails]

    def _add(self, o: RankOutcome, note: Optional[Mapping[str, Any]]) -> None:
        if o.timed_out and (note is None or note["kind"] == "stopped"):
            self.stuck.append(o)  # a note the kill of a peer prompted is not what it was doing
        elif note is None:
            first, rest = _ended(o)
            self._fail(o.rank, f"({first})" + (f":\n{rest}" if rest else ""), first, None)
        elif note["kind"] == "fail":
            kind = note.get("type", "an exception")
            self._fail(o.rank, f"({kind}):\n{note['text']}",
                       f"{kind}: {note['message']}" if note.get("message") else kind,
                       note.get("site"))
        elif note["kind"] == "stopped" and _passed(self.outcomes, self.notes, note.get("cause")):
            # not a failure of the peer: it finished its test while this rank still waited
            told = (f"waiting in {note['waited']} for {ranks_text([note['cause']])}, which "
                    "passed and returned: every rank must make the same collective calls")
            self._fail(o.rank, f"({told})", told, note.get("site"))
        elif note["kind"] == "stopped":
            self.lines.append((o.rank, note["text"]))
        else:
            (self.skips if note["kind"] == "skip" else self.xfails).append((o.rank, note["text"]))

    def _fail(self, rank: int, text: str, crash: str, site: Any) -> None:
        self.failed.append((rank, text))
        self.crash[rank] = crash
        if site:
            self.sites.append((site[0], site[1]))


def summarize(outcomes: List[RankOutcome], notes: Mapping[int, Mapping[str, Any]],
            timeout: float, timeout_source: str) -> MarkedResult:
    """The :class:`MarkedResult` of a marked test's run from each rank's ``outcomes`` and
    ``notes``; ``timeout`` and where it came from for the account of a hang."""
    tally = _Outcomes(outcomes, notes)
    if tally.failed:
        return _failure(tally)
    if tally.stuck:
        return _hang(tally, timeout, timeout_source)
    if tally.xfails or tally.skips:
        chosen = tally.xfails or tally.skips
        reason = "; ".join(f"{text} ({who})" if len(outcomes) > 1 else text
                           for who, text in _folded(chosen))
        return MarkedResult("xfail" if tally.xfails else "skip", reason, reason)
    if tally.lines:  # stopped by a failure no rank accounts for
        told = [f"{who}: {text}" for who, text in _folded(sorted(tally.lines))]
        return MarkedResult("fail", "\n".join(told), "; ".join(told))
    return MarkedResult("pass")


def _failure(tally: _Outcomes) -> MarkedResult:
    """Some rank failed: each failure once (ranks that failed alike folded, a mismatch told
    by its first rank), then a line for every other rank."""
    world, crash = tally.world, tally.crash
    failed, same = _one_mismatch(tally.failed, tally.notes)
    groups = _groups(failed)
    parts = [f"{ranks_text(ranks)} of {world} failed {text.rstrip()}" for ranks, text in groups]
    summary = "; ".join(f"{ranks_text(ranks)} of {world} failed: {crash[ranks[0]]}"
                        for ranks, _ in groups)
    lines = tally.lines + same + [
        (o.rank, f"still running {GRACE:g} s after the failure, killed: {o.where}")
        for o in tally.stuck]
    tail = [f"{who}: {text}" for who, text in _folded(sorted(lines))]
    return MarkedResult("fail", "\n\n".join(parts) + ("\n\n" + "\n".join(tail) if tail else ""),
                   summary, tally.sites[0] if tally.sites else None)


def _hang(tally: _Outcomes, timeout: float, timeout_source: str) -> MarkedResult:
    """No rank failed and some still ran at the timeout: where each was."""
    outcomes, notes, stuck = tally.outcomes, tally.notes, tally.stuck
    done = [o.rank for o in outcomes if o.ok and o.rank not in notes]
    where = [f"  {who}: {text}" for who, text in
             _folded([(o.rank, o.where or "not known") for o in stuck])]
    extra = [f"  {who}: {text}" for who, text in _folded(sorted(tally.lines))]
    if done:
        extra.append(f"  {ranks_text(done)}: finished")
    short = (f"timed out: {ranks_text([o.rank for o in stuck])} of {tally.world} still "
             f"running after {timeout:g} s ({timeout_source})")
    head = f"{short}; where each was, before every rank was killed:"
    return MarkedResult("fail", "\n".join([head, *where, *extra]), short)
