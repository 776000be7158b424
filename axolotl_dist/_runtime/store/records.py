"""What the kit writes into the c10d store, encoded and decoded in one place: every record's
bytes are made here and read back here, nowhere else (``tests/test_structure.py`` checks
that no other module of the runtime imports ``pickle`` or ``json`` to do it; the value
helpers' own encoding, which crosses collectives, is :mod:`..protocols.exchange`'s).

=================  =========================================  =================================
record             key (:mod:`.keys`)                         encoding
=================  =========================================  =================================
failure report     a block's ``error``, an exit record's       the fields of a
                   report, shared_map's ``error/<rank>``       ``RankFailedError`` (pickled)
exit record        ``axd/exit/<rank>``                          ``(report or None, time)``
                                                               (pickled)
peer record        ``axolotl_dist/<run>/who/<rank>``            ``host|pid|machine|by_store|``
                                                               ``launcher``
document           the run note, the judge's verdicts, a       JSON
                   snapshot of where a rank is, a long
                   wait's description, shared_map's entries
stuck mark         ``axolotl_dist/<run>/stuck/<rank>``          ``serial|deadlock index``
block site         a block's ``site``                          ``rank|tag|desc|site``
block report       a block's ``error`` / ``mismatch``           ``(publisher, error)`` (pickled)
call record        debug mode's ``c/<rank>``, ``abort``         the record object (pickled)
warning entry      ``axd/warn_log``                             ``rank<TAB>text<RS>`` appended
clock              ``axd/clk/.../pong``                         rank 0's clock, decimal
=================  =========================================  =================================

Which of these may be unpickled (and the plan to make them plain data) is the trust model's
business (docs/design.md, "Store keys"); that change is one module's.
"""

from __future__ import annotations

import json
import pickle
from typing import Any, List, Optional, Tuple

__all__ = [
    "failure", "read_failure", "exit_record", "read_exit", "peer", "read_peer", "document",
    "read_document", "stuck_mark", "read_stuck_mark", "site", "read_site", "block_report",
    "read_block_report", "call_record", "read_call_record", "warning_entry",
    "read_warning_entries", "WARNING_END", "clock", "read_clock",
]


# --- failures and exits ----------------------------------------------------------------------

def failure(fields: tuple) -> bytes:
    """A failure report: the fields of a ``RankFailedError`` (``errors.RankFailedError``'s
    ``to_report`` calls this)."""
    return pickle.dumps(fields)


def read_failure(data: bytes) -> tuple:
    """The fields of a failure report made by :func:`failure`."""
    return tuple(pickle.loads(data))


def exit_record(report: Optional[bytes], when: float) -> bytes:
    """A rank's exit record: the failure it exits on (a report, or None) and the time."""
    return pickle.dumps((report, when))


def read_exit(data: bytes) -> Tuple[Optional[bytes], float]:
    """``(report or None, time)`` of an exit record made by :func:`exit_record`."""
    report, when = pickle.loads(data)
    return report, when


# --- peers -------------------------------------------------------------------------------------

def peer(host: str, pid: int, machine: str, by_store: bool, launcher: str) -> str:
    """A rank's record of itself."""
    return f"{host}|{pid}|{machine}|{int(by_store)}|{launcher}"


def read_peer(data: bytes) -> Optional[Tuple[str, int, str, bool, str]]:
    """``(host, pid, machine, by_store, launcher)`` of a :func:`peer` record, or None for a
    record this version cannot read."""
    parts = data.decode(errors="replace").split("|", 4)
    if len(parts) != 5 or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1]), parts[2], parts[3] == "1", parts[4]


# --- documents ---------------------------------------------------------------------------------

def document(obj: Any, compact: bool = False) -> str:
    """A JSON document (``compact``: no spaces, for records written often)."""
    return json.dumps(obj, separators=(",", ":")) if compact else json.dumps(obj)


def read_document(data: Optional[bytes], empty: Any = None) -> Any:
    """The value of a JSON document; ``empty`` (default ``{}``) for an empty or missing one."""
    if not data:
        return {} if empty is None else empty
    return json.loads(data)


def stuck_mark(serial: int, index: int) -> str:
    """The judge's mark on a wait that can never end: its serial and its deadlock's index."""
    return f"{serial}|{index}"


def read_stuck_mark(data: bytes) -> Tuple[str, str]:
    """``(serial, index)`` of a :func:`stuck_mark` as text (both empty for no mark)."""
    serial, _, index = data.decode().partition("|")
    return serial, index


# --- blocks ------------------------------------------------------------------------------------

def site(rank: int, tag: str, desc: Optional[str], where: str) -> str:
    """A block's pairing record: who wrote it, the tag it pairs by, its label and site."""
    return f"{rank}|{tag}|{desc or ''}|{where}"


def read_site(data: str) -> Tuple[int, str, Optional[str], str]:
    """``(rank, tag, desc or None, site)`` of a :func:`site` record (decoded text)."""
    rank, tag, desc, where = data.split("|", 3)
    return int(rank), tag, desc or None, where


def block_report(publisher: int, error: BaseException) -> bytes:
    """A block's failure or mismatch as its publisher stored it."""
    return pickle.dumps((publisher, error))


def read_block_report(data: bytes) -> Tuple[int, BaseException]:
    """``(publisher, error)`` of a :func:`block_report`."""
    publisher, error = pickle.loads(data)
    return publisher, error


# --- debug mode --------------------------------------------------------------------------------

def call_record(record: Any) -> bytes:
    """Debug mode's record of one rank's call, or the error a rank published on giving up."""
    return pickle.dumps(record)


def read_call_record(data: bytes) -> Any:
    """What :func:`call_record` stored."""
    return pickle.loads(data)


# --- warnings and clocks -----------------------------------------------------------------------

#: Ends each warning entry; a formatted warning never holds one.
WARNING_END = "\x1e"


def warning_entry(rank: int, text: str) -> str:
    """One Python warning a rank publishes for rank 0 to fold (appended to the log)."""
    return f"{rank}\t{text.replace(WARNING_END, ' ')}{WARNING_END}"


def read_warning_entries(data: bytes) -> List[Tuple[int, str]]:
    """``(rank, text)`` of every whole entry in ``data`` (a part of the warnings' log)."""
    found = []
    for entry in data.split(WARNING_END.encode()):
        rank, tab, text = entry.decode("utf-8", "replace").partition("\t")
        if tab and rank.isdigit():
            found.append((int(rank), text))
    return found


def clock(now: int) -> str:
    """Rank 0's clock in a clock-alignment round."""
    return str(now)


def read_clock(data: bytes) -> int:
    """The clock in a :func:`clock` value."""
    return int(data)
