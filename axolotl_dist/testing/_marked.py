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
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from .._runtime.base.text import ranks_text
from ._harness import run_distributed_outcomes
from ._outcomes import RankOutcome

__all__ = ["GRACE", "run", "on_rank", "account"]

#: Seconds the other ranks get to end once one rank has failed, before they are killed.
GRACE = 3.0


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
        verdict, message = account(outcomes, _read_notes(notes), timeout, timeout_source)
    finally:
        shutil.rmtree(notes, ignore_errors=True)
    if verdict == "skip":
        pytest.skip(message)
    elif verdict == "xfail":
        pytest.xfail(message)
    elif verdict == "fail":
        pytest.fail(message, pytrace=False)


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
        text = (f"failed because {ranks_text(exc.ranks[:1])} did ({type(exc).__name__}{where}"
                f"{f' at {site}' if site else ''})")
    else:
        kind = "fail"
        text = _rendered(exc, item)
    path = os.path.join(notes, f"rank{rank}.json")
    with open(path + ".part", "w") as fh:
        json.dump({"kind": kind, "text": text, "type": type(exc).__name__}, fh)
    os.replace(path + ".part", path)


def _site(exc: BaseException, fn: Callable[..., Any]) -> str:
    """``file:line`` of the innermost frame in the test's file that ``exc`` went through."""
    code = getattr(fn, "__code__", None)
    filename = code.co_filename if code is not None else None
    found = ""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == filename:
            found = f"{os.path.basename(filename)}:{tb.tb_lineno}"
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


def _read_notes(notes: str) -> Dict[int, Dict[str, str]]:
    found = {}
    for name in os.listdir(notes):
        if name.startswith("rank") and name.endswith(".json"):
            try:
                with open(os.path.join(notes, name)) as fh:
                    found[int(name[4:-5])] = json.load(fh)
            except (OSError, ValueError):
                continue
    return found


def _folded(items: List[Tuple[int, str]]) -> List[Tuple[str, str]]:
    """``(ranks label, text)`` with the ranks of identical texts folded (``ranks 0-2``), in
    the order each text first appears."""
    groups: Dict[str, List[int]] = {}
    for rank, text in items:
        groups.setdefault(text, []).append(rank)
    return [(ranks_text(ranks), text) for text, ranks in groups.items()]


def _end(outcome: RankOutcome) -> str:
    """How a rank that left no note ended (it raised outside the test body, or died):
    ``(what happened)`` and its traceback, if any."""
    text = outcome.describe()
    text = text.split(": ", 1)[1] if text.startswith(f"rank {outcome.rank}: ") else text
    first, _, rest = text.partition("\n")
    return f"({first})" + (f":\n{rest}" if rest else "")


def account(outcomes: List[RankOutcome], notes: Mapping[int, Mapping[str, str]],
            timeout: float, timeout_source: str) -> Tuple[str, str]:
    """``(verdict, message)``: ``"pass"``, ``"skip"``, ``"xfail"`` or ``"fail"``. A failing
    rank's account comes once, identical ones folded; ranks that failed because another did,
    or were killed after it, are one line each; on a timeout, where every rank was."""
    world = len(outcomes)
    failed: List[Tuple[int, str]] = []
    lines: List[Tuple[int, str]] = []  # one line per rank: stopped, killed, skipped, finished
    skips: List[Tuple[int, str]] = []
    xfails: List[Tuple[int, str]] = []
    stuck: List[RankOutcome] = []
    for o in outcomes:
        note: Optional[Mapping[str, str]] = notes.get(o.rank)
        if o.ok and note is None:
            continue
        if o.timed_out and (note is None or note["kind"] == "stopped"):
            stuck.append(o)  # a note the kill of a peer prompted is not what it was doing
        elif note is None:
            failed.append((o.rank, _end(o)))
        elif note["kind"] == "fail":
            failed.append((o.rank, f"({note.get('type', 'an exception')}):\n{note['text']}"))
        elif note["kind"] == "stopped":
            lines.append((o.rank, note["text"]))
        else:
            (skips if note["kind"] == "skip" else xfails).append((o.rank, note["text"]))
    lines += [(r, f"skipped: {t}") for r, t in skips] + [(r, f"xfailed: {t}") for r, t in xfails]
    if failed:
        parts = []
        for who, text in _folded(failed):
            parts.append(f"{who} of {world} failed {text.rstrip()}")
        lines += [(o.rank, f"still running {GRACE:g} s after the failure, killed: {o.where}")
                  for o in stuck]
        tail = [f"{who}: {text}" for who, text in _folded(sorted(lines))]
        return "fail", "\n\n".join(parts) + ("\n\n" + "\n".join(tail) if tail else "")
    if stuck:
        done = [o.rank for o in outcomes if o.ok and o.rank not in notes]
        where = [f"  {who}: {text}" for who, text in
                 _folded([(o.rank, o.where or "not known") for o in stuck])]
        extra = [f"  {who}: {text}" for who, text in _folded(sorted(lines))]
        if done:
            extra.append(f"  {ranks_text(done)}: finished")
        head = (f"timed out: {ranks_text([o.rank for o in stuck])} of {world} still running "
                f"after {timeout:g} s ({timeout_source}); where each was, before every rank "
                "was killed:")
        return "fail", "\n".join([head, *where, *extra])
    if xfails or skips:
        chosen = xfails or skips
        reason = "; ".join(f"{text} ({who})" if len(outcomes) > 1 else text
                           for who, text in _folded(chosen))
        return ("xfail" if xfails else "skip"), reason
    if lines:  # stopped by a failure no rank accounts for
        return "fail", "\n".join(f"{who}: {text}" for who, text in _folded(sorted(lines)))
    return "pass", ""
