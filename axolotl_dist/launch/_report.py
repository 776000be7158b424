"""The launcher's account of a failed run: which rank failed first (a rank that ended early,
even with exit code 0, before a rank that failed because of it), and the exit code the
launcher returns. One line per rank: a rank whose traceback went to the launcher's own stderr
(the usual case: ranks inherit it) is pointed to, "its traceback is above"; only a traceback
that went elsewhere (a script that replaced ``sys.stderr``, a user's excepthook that raised)
is shown from torch elastic's error file (docs/faults.md, "One account of a failure")."""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

from .._runtime.base.text import ranks_text
from ..env.variables import is_decimal

__all__ = ["PROG", "GUARDS_DIR", "RESTART_COUNT_ENV_VAR", "exit_code_of", "first_failure",
           "traceback_of", "read_ends", "report_failures", "attempt_dir", "attempts", "latest_attempt"]

PROG = "axolotl-dist"
#: Under the end directory: one empty file per guard pid, so the launcher does not report its
#: own helpers among the processes the ranks left behind (the ranks' bootstrap writes them).
GUARDS_DIR = "guards"
#: torch elastic's count of the restarts before a rank's attempt (0 on the first).
RESTART_COUNT_ENV_VAR = "TORCHELASTIC_RESTART_COUNT"
_NO_MESSAGE = "<NONE>"  # torch elastic's placeholder when a rank wrote no error file


def exit_code_of(exitcode: int) -> int:
    """A process's exit status as a shell reports it: 128 + signal for a signal death."""
    return 128 - exitcode if exitcode < 0 else exitcode


def _error_data(failure) -> dict:
    """The rank's error file contents, or {} if it wrote none (signal deaths, sys.exit)."""
    data = failure.error_file_data
    if not isinstance(data, dict) or not isinstance(data.get("message"), (dict, str)):
        return {}
    return {} if data.get("message") == _NO_MESSAGE else data


def _failure_time(failure) -> float:
    """When a failed rank ended: the time its error file records, else the end of the whole
    second torch saw it fail (a signal death leaves no finer time: rounded up, so a rank that
    the launcher stopped in the same second as another failed never looks the earlier)."""
    precise = (_error_data(failure).get("axolotl_dist") or {}).get("time")
    return float(precise) if precise is not None else int(failure.timestamp) + 1.0


#: Exceptions a rank raises because another rank failed or left: never a root cause.
_PEER_FAILED_TYPES = ("RankFailedError", "DistNetworkError")
#: gloo's words for a peer that left, in the ``RuntimeError`` a raw collective then raises.
_PEER_LEFT = ("Connection closed by peer", "Connection reset by peer")


def _is_secondary(failure) -> bool:
    """A failure caused by another rank's: killed by the launcher, or a peer-lost error.

    Judged by the exception's type, not by words anywhere in its message: a root cause (the
    kit's ``DistributedEnvError`` for a store it cannot use) may quote the torch error it
    comes from."""
    data = _error_data(failure)
    if failure.exitcode == -int(signal.SIGTERM) and not data:
        return True
    name = _exc_type(failure)
    if name in _PEER_FAILED_TYPES:
        return True
    return name in ("RuntimeError", "") and any(s in _message(failure) for s in _PEER_LEFT)


def first_failure(failures: Dict[int, object]) -> Tuple[int, object]:
    """``(global rank, ProcessFailure)`` of the rank that failed first.

    Failures caused by others (ranks the launcher stopped, ranks that lost a peer) come after
    root causes; then the earlier time, the lower rank.
    """
    order = {rank: i for i, rank in enumerate(failures)}
    return min(failures.items(), key=lambda item: (
        _is_secondary(item[1]), _failure_time(item[1]), order[item[0]]))


def traceback_of(failure) -> Optional[str]:
    """The traceback a failed rank wrote to its error file (its message if no traceback)."""
    message = _error_data(failure).get("message")
    if isinstance(message, dict):
        return (message.get("extraInfo") or {}).get("py_callstack") or message.get("message")
    return message if isinstance(message, str) else None


def read_ends(directory: Optional[str]) -> Dict[int, dict]:
    """Rank -> ``{"code", "time"}``: how and when each rank's script ended (see :mod:`._rank_main`)."""
    ends: Dict[int, dict] = {}
    if not directory or not os.path.isdir(directory):
        return ends
    for name in os.listdir(directory):
        if name.endswith(".json"):
            try:
                with open(os.path.join(directory, name)) as fh:
                    data = json.load(fh)
                ends[int(data["rank"])] = data
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return ends


def attempt_dir(base: str, attempt: int) -> str:
    """Where the ranks of attempt ``attempt`` (torch's restart count) record their ends, under
    the launcher's end directory ``base``: each attempt its own, so a restarted run never
    reads the records of the attempt before (``--max-restarts``)."""
    return os.path.join(base, str(int(attempt)))


def attempts(base: Optional[str]) -> List[int]:
    """The attempts whose ranks have recorded anything under ``base``, in order."""
    if not base or not os.path.isdir(base):
        return []
    return sorted(int(name) for name in os.listdir(base) if is_decimal(name))


def latest_attempt(base: str) -> str:
    """The end directory of the latest attempt that started (the first one's before any)."""
    found = attempts(base)
    return attempt_dir(base, found[-1] if found else 0)


def _ended_at(rank: int, failure, ends: Dict[int, dict]) -> float:
    """When a failed rank ended: its own record, its error file, else the whole second torch
    saw it fail (rounded up: a signal death leaves no finer time)."""
    if rank in ends:
        return float(ends[rank]["time"])
    return _failure_time(failure)


def _early_exit(failures: Dict[int, object], ends: Dict[int, dict]) -> Optional[Tuple[int, dict]]:
    """The rank whose script ended cleanly (exit code 0) before any rank failed, if one did.

    Its process may still be among ``failures``: killed by the launcher (a signal) while its
    exit hooks ran, after the others failed because it had left.
    """
    clean = [(data["time"], rank) for rank, data in ends.items()
             if data.get("code") == 0 and _stopped_after_its_end(rank, failures)]
    if not clean:
        return None
    when, rank = min(clean)
    others = [_ended_at(r, f, ends) for r, f in failures.items() if r != rank]
    return (rank, ends[rank]) if others and when < min(others) else None


def _stopped_after_its_end(rank: int, failures: Dict[int, object]) -> bool:
    """Whether a rank whose script ended with code 0 either exited cleanly (not a failure) or
    was only stopped by a signal afterwards."""
    failure = failures.get(rank)
    return failure is None or getattr(failure, "exitcode", 0) < 0


def _exc_type(failure) -> str:
    """The name of the exception a failed rank raised, from its error file ("" if unknown)."""
    data = _error_data(failure)
    name = (data.get("axolotl_dist") or {}).get("exc_type")
    if isinstance(name, str) and name:
        return name
    head = _message(failure).split(":", 1)[0].strip()
    return head if head.isidentifier() else ""


def _message(failure) -> str:
    """The ``Type: message`` line of a failed rank's error file ("" without one)."""
    message = _error_data(failure).get("message")
    text = message.get("message") if isinstance(message, dict) else message
    return text if isinstance(text, str) else ""


def _shown_above(failure) -> bool:
    """Whether the rank printed its traceback to this launcher's own stderr (its error file
    names the file it printed to: :mod:`._rank_main`; ``"launcher"`` where that was the
    launcher's output socket, :mod:`._output`), so the output above already holds it."""
    printed = (_error_data(failure).get("axolotl_dist") or {}).get("printed_to")
    try:
        st = os.fstat(sys.stderr.fileno())
    except (AttributeError, OSError, ValueError):
        return False
    return printed == "launcher" or (isinstance(printed, list) and printed == [st.st_dev, st.st_ino])


def _early_lines(early: Optional[Tuple[int, dict]], failures: Dict[int, object],
                 ends: Dict[int, dict], nodes: int, world_size: Optional[int],
                 local: Optional[Sequence[int]], attempt: str = "") -> List[str]:
    """The line naming the rank that exited with code 0 while others ran ([] if none did)."""
    if early is None:
        return []
    quitter, data = early
    if nodes > 1 and local is not None:
        ranks: Sequence[int] = list(local)
    else:
        ranks = range(world_size) if world_size else sorted(set(failures) | set(ends))
    running = [r for r in ranks
               if r != quitter and (r not in ends or ends[r]["time"] > data["time"])]
    here = " on this node" if nodes > 1 else ""
    return [f"{PROG}: {attempt}rank {quitter} (pid {data.get('pid', '?')}) exited with code 0 while "
            f"rank(s) {running}{here} were still running; the others needed it (a rank "
            "that returns or calls sys.exit early leaves its peers waiting in "
            "collectives)"]


def _how_it_ended(failure) -> Tuple[str, int]:
    """How a failed rank ended, in words, and the exit code the launcher returns for it."""
    code = exit_code_of(failure.exitcode)
    raised = f"raised {_exc_type(failure) or 'an exception'}"
    if failure.exitcode == -int(signal.SIGTERM) and _error_data(failure):
        # It raised (its error file is there) and was stopped by the launcher while exiting,
        # because another rank failed at about the same time: report the exception, exit 1
        # as the rank itself would have.
        return f"{raised} (and was stopped by the launcher while exiting)", 1
    if _error_data(failure) and failure.exitcode > 0:
        return f"{raised} and exited with code {failure.exitcode}", code
    if failure.exitcode < 0:
        try:
            return (f"was killed by signal {-failure.exitcode} "
                    f"({signal.Signals(-failure.exitcode).name})"), code
        except ValueError:
            return f"was killed by signal {-failure.exitcode}", code
    return f"exited with code {failure.exitcode}", code


def _stopped_silent(others: List[int], failures: Dict[int, object],
                    ends: Dict[int, dict]) -> List[int]:
    """The ranks of ``others`` that the launcher stopped before they said anything: no end
    record (their script had not ended) and no error file (they printed no traceback)."""
    return [r for r in others if r not in ends and not _error_data(failures[r])
            and getattr(failures[r], "exitcode", 0) == -int(signal.SIGTERM)]


def _closing_lines(rank: int, failures: Dict[int, object], tb: Optional[str],
                   code: int, ends: Dict[int, dict]) -> List[str]:
    """The lines after the failed rank's: its traceback (``tb``, where its output did not show
    it), a line for the ranks stopped before they said anything (each rank's output ends with
    a line that says why it ended), the other ranks the launcher stopped, the exit code."""
    lines: List[str] = []
    if tb:
        lines += [f"--- traceback of rank {rank} ---", tb.rstrip(), "---"]
    others = sorted(r for r in failures if r != rank)
    silent = _stopped_silent(others, failures, ends)
    if silent:
        lines.append(f"[{ranks_text(silent)}] stopped by {PROG} while still running, because "
                     f"rank {rank} failed first")
    if others:
        lines.append(f"{PROG}: stopped the other rank(s) {others}")
    lines.append(f"{PROG}: exit code {code}")
    return lines


def report_failures(failures: Dict[int, object], nodes: int, node_rank: int,
                    ends: Optional[Dict[int, dict]] = None, world_size: Optional[int] = None,
                    local: Optional[Sequence[int]] = None,
                    output: Optional[Callable[[int], str]] = None, attempt: str = "",
                    shown: Optional[Set[int]] = None, unsaved: Sequence[str] = ()) -> int:
    """Print the launcher's account of a failed run to stderr and return its exit code:
    the rank that ended first while others ran (``ends``: how each rank's script ended), the
    rank that failed first (its traceback only where its output did not show it), and the
    ranks stopped after it. ``local``: the global ranks this launcher started; with several
    nodes, only those are said to be running (the other nodes' ranks are their launchers' to
    report). ``output``: where a rank's own lines are, when the launcher took them
    (:mod:`._output`). ``attempt``: which attempt failed (``"attempt 2 of 2: "``), with
    ``--max-restarts``. ``shown``: the local ranks whose output is shown
    (``--local-ranks-filter``; None: all): a filtered rank's traceback is printed here.
    ``unsaved``: a line per checkpoint the ranks were saving when it failed (not committed)."""
    ends = ends or {}
    early = _early_exit(failures, ends)
    lines = _early_lines(early, failures, ends, nodes, world_size, local, attempt)
    if early is not None and early[0] in failures:  # stopped by us after its script ended
        failures = {r: f for r, f in failures.items() if r != early[0]}
    rank, failure = first_failure(failures)
    how, code = _how_it_ended(failure)
    tb = traceback_of(failure)
    above = bool(tb) and _shown_above(failure) and (shown is None or failure.local_rank in shown)
    where = f"local rank {failure.local_rank}" + (f" on node {node_rank}" if nodes > 1 else "")
    if above:  # its own output, above, holds the traceback: no second copy
        how += "; its traceback is above" + (f" ({output(rank)})" if output else "")
    if early is None:
        lines.append(f"{PROG}: {attempt}rank {rank} ({where}, pid {failure.pid}) failed first: "
                     f"it {how}")
    else:
        lines.append(f"{PROG}: then rank {rank} ({where}, pid {failure.pid}) failed: it {how}")
    lines += _closing_lines(rank, failures, tb if not above else None, code, ends)
    lines[-1:-1] = [f"{PROG}: {line}" for line in unsaved]  # before the exit code
    print("\n".join(lines), file=sys.stderr, flush=True)
    return code

