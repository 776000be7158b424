"""A ``@pytest.mark.distributed`` test's call: its body on every rank, one account of the run.

The pytest plugin (``pytest_axolotl_dist``, outside the package so that a session without a
marked test imports no torch) hands each marked test's call here. The test function runs on
forked ranks through :func:`.run_distributed_outcomes` with the fixture values the test
process computed; a rank whose body raises leaves a note (what kind of end, and pytest's own
rendering of its traceback, assertion rewriting included) in a directory of the test's own,
then raises on, so its peers learn of the failure as in any run. The notes and the outcomes
become one verdict: pass, skip, xfail, or a failure whose message says each rank's part once.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Tuple

from .._runtime.base.text import ranks_text
from ._harness import run_distributed_outcomes
from ._outcomes import RankOutcome

__all__ = ["GRACE", "Verdict", "run", "on_rank", "account"]

#: Seconds the other ranks get to end once one rank has failed, before they are killed.
GRACE = 3.0


class Verdict(NamedTuple):
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
    every rank passed, else skip, xfail or fail the test with :func:`account`'s message."""
    import pytest

    notes = tempfile.mkdtemp(prefix="axolotl-dist-pytest-")
    try:
        outcomes = run_distributed_outcomes(
            on_rank, world_size, args=(item, fn, dict(kwargs), notes), init=init,
            backend=backend, timeout=timeout, grace=GRACE, store=store)
        verdict = account(outcomes, _read_notes(notes), timeout, timeout_source)
    finally:
        shutil.rmtree(notes, ignore_errors=True)
    if verdict.kind == "skip":
        pytest.skip(verdict.message)
    elif verdict.kind == "xfail":
        pytest.xfail(verdict.message)
    elif verdict.kind == "fail":
        failure = pytest.fail.Exception(verdict.message, pytrace=False)
        # the plugin's report hook makes the summary and site pytest's crash line
        failure.axolotl_dist_verdict = verdict  # type: ignore[attr-defined]
        raise failure


def on_rank(item: Any, fn: Callable[..., Any], kwargs: Dict[str, Any], notes: str) -> None:
    """A rank's body: the test function; what it raised is noted, then raised on."""
    __tracebackhide__ = True  # pytest's rendering starts at the test function
    try:
        fn(**kwargs)
    except BaseException as exc:
        _note(exc, item, fn, notes)
        raise


def _note(exc: BaseException, item: Any, fn: Callable[..., Any], notes: str) -> None:
    """Write this rank's note: ``kind`` (skip, xfail, fail, or ``stopped``: another rank's
    failure reached this one), ``text`` (the reason, or the rendered traceback) and ``type``
    (the exception's type name)."""
    import pytest

    from ..errors import RankFailedError

    rank = os.environ.get("RANK", "0")
    if isinstance(exc, (pytest.skip.Exception, pytest.xfail.Exception)):
        kind = "xfail" if isinstance(exc, pytest.xfail.Exception) else "skip"
        text = str(exc.msg or "")
    elif isinstance(exc, RankFailedError):
        kind = "stopped"
        site = _site(exc, fn)
        where = f" in {exc.where}" if exc.where else ""
        at = f" at {os.path.basename(site[0])}:{site[1]}" if site else ""
        text = (f"failed because {ranks_text(exc.ranks[:1])} did ({type(exc).__name__}{where}"
                f"{at})")
    else:
        kind = "fail"
        text = _rendered(exc, item)
    path = os.path.join(notes, f"rank{rank}.json")
    with open(path + ".part", "w") as fh:
        json.dump({"kind": kind, "text": text, "type": type(exc).__name__,
                   "message": _first_line(str(exc)), "site": _site(exc, fn)}, fh)
    os.replace(path + ".part", path)


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
    cut to the test function, ``--tb``, ``--showlocals``, fixture values), as text."""
    import pytest

    try:
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


def account(outcomes: List[RankOutcome], notes: Mapping[int, Mapping[str, Any]],
            timeout: float, timeout_source: str) -> Verdict:
    """The :class:`Verdict` of a marked test's run from each rank's ``outcomes`` and
    ``notes``; ``timeout`` and where it came from for the account of a hang."""
    world = len(outcomes)
    failed: List[Tuple[int, str]] = []
    crash: Dict[int, str] = {}  # a failed rank's exception in one line
    sites: List[Tuple[str, int]] = []
    lines: List[Tuple[int, str]] = []  # one line per rank: stopped, killed, skipped, finished
    skips: List[Tuple[int, str]] = []
    xfails: List[Tuple[int, str]] = []
    stuck: List[RankOutcome] = []
    for o in outcomes:
        note: Optional[Mapping[str, Any]] = notes.get(o.rank)
        if o.ok and note is None:
            continue
        if o.timed_out and (note is None or note["kind"] == "stopped"):
            stuck.append(o)  # a note the kill of a peer prompted is not what it was doing
        elif note is None:
            crash[o.rank], rest = _ended(o)
            failed.append((o.rank, f"({crash[o.rank]})" + (f":\n{rest}" if rest else "")))
        elif note["kind"] == "fail":
            kind = note.get("type", "an exception")
            failed.append((o.rank, f"({kind}):\n{note['text']}"))
            crash[o.rank] = f"{kind}: {note['message']}" if note.get("message") else kind
            sites += [tuple(note["site"])] if note.get("site") else []
        elif note["kind"] == "stopped":
            lines.append((o.rank, note["text"]))
        else:
            (skips if note["kind"] == "skip" else xfails).append((o.rank, note["text"]))
    lines += [(r, f"skipped: {t}") for r, t in skips] + [(r, f"xfailed: {t}") for r, t in xfails]
    if failed:
        groups = _groups(failed)
        parts = [f"{ranks_text(ranks)} of {world} failed {text.rstrip()}" for ranks, text in groups]
        summary = "; ".join(f"{ranks_text(ranks)} of {world} failed: {crash[ranks[0]]}"
                            for ranks, _ in groups)
        lines += [(o.rank, f"still running {GRACE:g} s after the failure, killed: {o.where}")
                  for o in stuck]
        tail = [f"{who}: {text}" for who, text in _folded(sorted(lines))]
        return Verdict("fail", "\n\n".join(parts) + ("\n\n" + "\n".join(tail) if tail else ""),
                       summary, sites[0] if sites else None)
    if stuck:
        done = [o.rank for o in outcomes if o.ok and o.rank not in notes]
        where = [f"  {who}: {text}" for who, text in
                 _folded([(o.rank, o.where or "not known") for o in stuck])]
        extra = [f"  {who}: {text}" for who, text in _folded(sorted(lines))]
        if done:
            extra.append(f"  {ranks_text(done)}: finished")
        short = (f"timed out: {ranks_text([o.rank for o in stuck])} of {world} still running "
                 f"after {timeout:g} s ({timeout_source})")
        head = f"{short}; where each was, before every rank was killed:"
        return Verdict("fail", "\n".join([head, *where, *extra]), short)
    if xfails or skips:
        chosen = xfails or skips
        reason = "; ".join(f"{text} ({who})" if len(outcomes) > 1 else text
                           for who, text in _folded(chosen))
        return Verdict("xfail" if xfails else "skip", reason, reason)
    if lines:  # stopped by a failure no rank accounts for
        told = [f"{who}: {text}" for who, text in _folded(sorted(lines))]
        return Verdict("fail", "\n".join(told), "; ".join(told))
    return Verdict("pass")
