"""What the kit writes into the c10d store, encoded and decoded in one place: every record's
bytes are made here and read back here, nowhere else (``tests/test_structure.py`` checks
that no other module of the runtime imports ``pickle`` or ``json`` to do it; the value
helpers' own encoding, which crosses collectives, is :mod:`..protocols.exchange`'s).

=================  =========================================  =================================
record             key (:mod:`.keys`)                         encoding
=================  =========================================  =================================
failure report     a block's ``error``, an exit record's       the fields of a
                   report, shared_map's ``error/<rank>``       ``RankFailedError`` (JSON)
exit record        ``axd/exit/<rank>``                          ``(report or None, time)``
                                                               (JSON)
peer record        ``axolotl_dist/<run>/who/<rank>``            ``host|pid|machine|by_store|``
                                                               ``launcher``
document           the run note, the stall detector's report, a       JSON
                   snapshot of where a rank is, a long
                   wait's description, shared_map's entries
stuck mark         ``axolotl_dist/<run>/stuck/<rank>``          ``serial|deadlock index``
block site         a block's ``site``                          ``rank|tag|desc|site``
mismatch           a block's ``mismatch``, debug mode's         publisher, message, calls,
                   ``abort``                                   missing ranks (JSON)
call record        debug mode's ``c/<rank>``                    the call's fields (JSON)
warning entry      ``axd/warn_log``                             ``rank<TAB>text<RS>`` appended
clock              ``axd/clk/.../pong``                         rank 0's clock, decimal
=================  =========================================  =================================

It also packs what the value helpers send beside a tensor's bytes (its description) and an
int beyond int64, which cross collectives (:mod:`..protocols.exchange` frames them).

Nothing here is pickled (docs/design/decisions.md, decision 19): a JSON record carries its version and
kind, is refused unread past :data:`MAX_RECORD` bytes, and is checked field by field; anything
else is a :class:`BadRecord`, which its reader turns into an error naming the key.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from ...env.variables import is_decimal
from ...errors import RankFailedError

__all__ = [
    "failure", "read_failure", "exit_record", "read_exit", "peer", "read_peer", "document",
    "read_document", "stuck_mark", "read_stuck_mark", "site", "read_site",
    "mismatch", "read_mismatch", "call_record", "read_call_record",
    "warning_entry", "VERSION", "MAX_RECORD", "BadRecord", "unreadable",
    "tensor_description", "read_tensor_description", "bigint", "read_bigint",
    "read_warning_entries", "WARNING_END", "clock", "read_clock", "read_number", "read_token",
    "read_object", "read_local", "check_fields", "int_list", "RUN_ID_LENGTH", "read_run_id",
    "read_deadlock",
]


# --- the plain encoding ----------------------------------------------------------------------

#: The version of the kit's records; a record of another version is refused, not guessed at.
VERSION = 1
#: The most bytes a record may hold (a report's traceback is most of it): more is refused
#: before it is parsed.
MAX_RECORD = 1 << 20


class BadRecord(ValueError):
    """A record this version of the kit did not write: truncated, too large, garbled, another
    version's or another program's (a reader names the key and the writer)."""


def unreadable(key: str, writer: Optional[int], exc: BadRecord) -> str:
    """What a reader says of a bad record: the key, who wrote it, why, and what it means."""
    who = f", written as rank {writer}'s," if writer is not None else ""
    return (f"the kit's record at store key {key!r}{who} is not one this version of "
            f"axolotl_dist writes ({exc}): every rank must run the same axolotl_dist, and "
            "only the job's own processes may write to its c10d store (MASTER_ADDR:MASTER_PORT "
            "reachable by others lets them; docs/design/store.md, \"Trust model\")")


def _encode(kind: str, body: Any) -> bytes:
    return json.dumps({"v": VERSION, "k": kind, "b": body}, separators=(",", ":")).encode()


def _decode(kind: str, data: Any) -> Any:
    """The body of a ``kind`` record; :class:`BadRecord` saying why for anything else."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise BadRecord(f"a {kind} record is bytes, got {type(data).__name__}")
    if len(data) > MAX_RECORD:
        raise BadRecord(f"{len(data)} bytes, over the {MAX_RECORD}-byte bound of a record")
    try:
        doc = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRecord(f"not a record of the kit ({len(data)} bytes that are not its JSON: "
                        f"{type(exc).__name__})") from None
    if not isinstance(doc, dict) or "b" not in doc:
        raise BadRecord("not a record of the kit (JSON without its fields)")
    if doc.get("v") != VERSION:
        raise BadRecord(f"a record of version {doc.get('v')!r}, this kit reads {VERSION}: every "
                        "rank must run the same axolotl_dist")
    if doc.get("k") != kind:
        raise BadRecord(f"a {doc.get('k')!r} record where a {kind} record belongs")
    return doc["b"]


def _check(kind: str, body: Any, types: Tuple[Any, ...]) -> list:
    """``body`` as a list of fields of the given types (``None`` allowed where a type is a
    tuple holding ``type(None)``)."""
    if not isinstance(body, list) or len(body) != len(types):
        raise BadRecord(f"a {kind} record has {len(types)} fields")
    for i, (value, want) in enumerate(zip(body, types)):
        if isinstance(value, bool) and want is int or not isinstance(value, want):
            raise BadRecord(f"field {i} of a {kind} record is {type(value).__name__}")
    return body


def _ints(kind: str, values: Any) -> Tuple[int, ...]:
    if not isinstance(values, list) or not all(type(v) is int for v in values):
        raise BadRecord(f"a {kind} record's ranks are not a list of ints")
    return tuple(values)


# --- failures and exits ----------------------------------------------------------------------

_OPT = (str, type(None))
_FAILURE = (int, str, str, _OPT, str, list, _OPT, _OPT, (list, type(None)))


def failure(error: RankFailedError) -> bytes:
    """A failure report: what another rank needs to raise ``error`` again (rank, exception
    type, message, traceback text, where, ranks, machine, the failing rank's own line, the
    deadlock it ended on: ``[account, [[ranks], call], ...]`` or null)."""
    deadlock = None if error.deadlock is None else [
        error.deadlock[0], [[list(ranks), call] for ranks, call in error.deadlock[1]]]
    return _encode("failure", [error.rank, error.exc_type, error.exc_message,
                               error.remote_traceback, error.where, list(error.ranks),
                               error.machine, error.site, deadlock])


def read_failure(data: bytes) -> RankFailedError:
    """The error a failure report made by :func:`failure` describes (:class:`BadRecord` if
    ``data`` is not one)."""
    rank, exc_type, message, tb, where, ranks, machine, site, deadlock = _check(
        "failure", _decode("failure", data), _FAILURE)
    return RankFailedError(rank, exc_type, message, tb, where=where,
                           ranks=_ints("failure", ranks), machine=machine, site=site,
                           deadlock=None if deadlock is None
                           else read_deadlock(deadlock, "failure record"))


def read_deadlock(value: Any, where: str) -> Tuple[str, List[Tuple[List[int], str]]]:
    """A deadlock as a record holds it (``[account, [[ranks], call], ...]``) as
    a :class:`~axolotl_dist.errors.CollectiveMismatchError`'s ``deadlock`` holds it; :class:`BadRecord`
    naming ``where`` it was read for any other shape."""
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
            and isinstance(value[1], list)
            and all(isinstance(p, list) and len(p) == 2 and isinstance(p[1], str)
                    for p in value[1])):
        raise BadRecord(f"the deadlock in a {where} is not [account, [[ranks], call], ...]")
    return value[0], [(list(_ints(where, ranks)), call) for ranks, call in value[1]]


def exit_record(report: Optional[bytes], when: float) -> bytes:
    """A rank's exit record: the failure it exits on (a report, or None) and the time."""
    return _encode("exit", [None if report is None else report.decode("utf-8"), when])


def read_exit(data: bytes) -> Tuple[Optional[bytes], float]:
    """``(report or None, time)`` of an exit record made by :func:`exit_record`."""
    report, when = _check("exit", _decode("exit", data), (_OPT, (int, float)))
    if report is not None:
        read_failure(report.encode("utf-8"))  # validated here, used later
    return (None if report is None else report.encode("utf-8")), float(when)


# --- the value helpers' payloads (they cross collectives, not the store) -----------------

#: Every dtype torch has, by its name as a tensor's description carries it (24 bytes, NUL
#: padded), with its item size: what a description may name (nothing else is looked up on
#: the torch module, whose ``__getattr__`` imports submodules).
_META = struct.Struct("<24s16sB?")
_DTYPES_BY_NAME = {str(d).replace("torch.", "").encode().ljust(24, b"\0"): (d, d.itemsize)
                   for d in vars(torch).values() if isinstance(d, torch.dtype)}
_NAME_OF_DTYPE = {d: name for name, (d, _) in _DTYPES_BY_NAME.items()}
_MAX_NDIM = 64


def tensor_description(flat: torch.Tensor, requires_grad: bool) -> bytes:
    """A tensor's description: dtype and device type names, number of dims, requires_grad,
    then the shape (int64 each)."""
    ndim = flat.dim()
    return _META.pack(_NAME_OF_DTYPE[flat.dtype], flat.device.type.encode(), ndim,
                      requires_grad) + struct.pack(f"<{ndim}q", *flat.shape)


def read_tensor_description(meta: bytes, data_len: int) -> Tuple[torch.dtype, List[int], str, bool]:
    """``(dtype, shape, device type, requires_grad)`` of a :func:`tensor_description`, checked
    against the bytes that follow it; :class:`BadRecord` for anything a rank of the kit would
    not have sent."""
    if len(meta) < _META.size:
        raise BadRecord(f"a tensor's description is {len(meta)} bytes, under {_META.size}")
    name, device, ndim, requires_grad = _META.unpack_from(meta)
    known = _DTYPES_BY_NAME.get(name)
    device_type = device.rstrip(b"\0").decode("ascii", "replace")
    if known is None or not device_type.isidentifier() or ndim > _MAX_NDIM \
            or len(meta) != _META.size + 8 * ndim:
        raise BadRecord("a tensor's description is not one the kit writes")
    shape = list(struct.unpack_from(f"<{ndim}q", meta, _META.size))
    if min(shape, default=0) < 0 or (device_type != "meta"
                                     and math.prod(shape) * known[1] != data_len):
        raise BadRecord(f"a tensor's description (shape {shape}) does not match its "
                         f"{data_len} bytes")
    return known[0], shape, device_type, bool(requires_grad)


#: The digits of a :func:`bigint`'s text.
_HEX_DIGITS = frozenset("0123456789abcdef")


def bigint(value: int) -> bytes:
    """An int beyond int64, as the value helpers send it: hexadecimal text, of any length
    (Python converts an int to or from decimal text of at most 4,300 digits)."""
    return format(value, "x").encode()


def read_bigint(raw: bytes) -> int:
    """The int of a :func:`bigint`; :class:`BadRecord` for anything else."""
    text = bytes(raw).decode("ascii", "replace")
    digits = text.removeprefix("-")  # one sign
    if not digits or not _HEX_DIGITS.issuperset(digits):
        raise BadRecord("an int's hexadecimal text is not one the kit writes")
    return int(text, 16)


def _decimal(data: bytes, digits: int, refusal: str) -> int:
    """The int whose decimal text (at most ``digits`` characters, a sign included) is
    ``data``; :class:`BadRecord` saying ``refusal`` for anything else (nothing longer is
    decoded)."""
    text = bytes(data[:digits + 1]).decode("ascii", "replace")
    if not 0 < len(data) <= digits or not is_decimal(text.removeprefix("-")):  # one sign
        raise BadRecord(refusal)
    return int(text)


# --- peers -------------------------------------------------------------------------------------

def peer(host: str, pid: int, machine: str, by_store: bool, launcher: str) -> str:
    """A rank's record of itself."""
    return f"{host}|{pid}|{machine}|{int(by_store)}|{launcher}"


def read_peer(data: bytes) -> Optional[Tuple[str, int, str, bool, str]]:
    """``(host, pid, machine, by_store, launcher)`` of a :func:`peer` record, or None for a
    record this version cannot read."""
    parts = data.decode(errors="replace").split("|", 4)
    if len(parts) != 5 or not is_decimal(parts[1]):
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
    if len(data) > MAX_RECORD:
        raise BadRecord(f"{len(data)} bytes, over the {MAX_RECORD}-byte bound of a record")
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRecord(f"not a JSON document ({type(exc).__name__})") from None


def read_local(text: str) -> Any:
    """The value of a JSON document this process made itself (torch's flight recorder's dump):
    no size bound, since it never crossed the store."""
    return json.loads(text)


def read_object(data: Optional[bytes], fields: Mapping[str, Any], what: str) -> Dict[str, Any]:
    """A JSON object with exactly ``fields`` (name -> a type or a tuple of types; an int is
    never a bool), as the kit writes ``what``: :class:`BadRecord` for anything else."""
    return check_fields(read_document(data, empty=b""), fields, what)


def check_fields(doc: Any, fields: Mapping[str, Any], what: str) -> Dict[str, Any]:
    """``doc`` (a decoded JSON value: a record, or an object inside one) as :func:`read_object`
    checks it."""
    if not isinstance(doc, dict) or set(doc) != set(fields):
        raise BadRecord(f"{what} is not a JSON object of the fields {sorted(fields)}")
    for name, want in fields.items():
        value = doc[name]
        if isinstance(value, bool) and want is int or not isinstance(value, want):
            raise BadRecord(f"{what}'s {name!r} is {type(value).__name__}")
    return doc


def int_list(value: Any, what: str) -> List[int]:
    """``value`` as a list of ints (never bools): :class:`BadRecord` for anything else."""
    if not isinstance(value, list) or not all(type(v) is int for v in value):
        raise BadRecord(f"{what} is not a list of ints")
    return value


def stuck_mark(serial: int, index: int) -> str:
    """The stall detector's mark on a wait that can never end: its serial and its deadlock's index."""
    return f"{serial}|{index}"


def read_stuck_mark(data: bytes) -> Tuple[str, str]:
    """``(serial, index)`` of a :func:`stuck_mark` as text (both empty for no mark)."""
    serial, _, index = data.decode("ascii", "replace").partition("|")
    if len(data) > 64 or not (serial == index == "" or is_decimal(serial) and is_decimal(index)):
        raise BadRecord("a wait's mark is not two numbers")
    return serial, index


# --- blocks ------------------------------------------------------------------------------------

def site(rank: int, tag: str, desc: Optional[str], where: str) -> str:
    """A block's pairing record: who wrote it, the tag it pairs by, its label and site."""
    return f"{rank}|{tag}|{desc or ''}|{where}"


def read_site(data: str) -> Tuple[int, str, Optional[str], str]:
    """``(rank, tag, desc or None, site)`` of a :func:`site` record (decoded text)."""
    parts = data.split("|", 3)
    if len(data) > MAX_RECORD or len(parts) != 4 or not is_decimal(parts[0]) \
            or len(parts[0]) > 9 or not parts[1].isalnum():
        raise BadRecord("a block's pairing record is not rank|tag|label|site")
    rank, tag, desc, where = parts
    return int(rank), tag, desc or None, where


def mismatch(error: Any, publisher: int = -1) -> bytes:
    """A ``CollectiveMismatchError`` (``error``) a rank publishes (a block's mismatch, debug mode giving
    up): its message, its calls and missing ranks, and who published it."""
    return _encode("mismatch", [publisher, str(error.args[0]) if error.args else "",
                                {str(k): v for k, v in error.calls.items()},
                                list(error.missing)])


def read_mismatch(data: bytes) -> Tuple[int, str, Dict[int, str], Tuple[int, ...]]:
    """``(publisher, message, calls, missing)`` of a :func:`mismatch` record: the arguments of
    the ``CollectiveMismatchError`` it describes, and who published it."""
    publisher, message, calls, missing = _check("mismatch", _decode("mismatch", data),
                                                (int, str, dict, list))
    if not all(is_decimal(k.removeprefix("-")) and isinstance(v, str) for k, v in calls.items()):
        raise BadRecord("a mismatch record's calls are not rank -> text")
    return (publisher, message, {int(k): v for k, v in calls.items()},
            _ints("mismatch", missing))


# --- debug mode --------------------------------------------------------------------------------

_CALL = (int, int, str, dict, str, int, str)


def call_record(fields: tuple) -> bytes:
    """Debug mode's record of one rank's call: rank, global rank, helper, the arguments that
    must agree (name -> a number, text, bool or None), call site, pid, host."""
    return _encode("call", list(fields))


def read_call_record(data: bytes) -> tuple:
    """The fields of a :func:`call_record`."""
    body = _check("call", _decode("call", data), _CALL)
    if not all(isinstance(v, (int, float, str, bool, type(None))) for v in body[3].values()):
        raise BadRecord("a call record's arguments are not plain values")
    return tuple(body)


# --- warnings and clocks -----------------------------------------------------------------------

#: Ends each warning entry; a formatted warning never holds one.
WARNING_END = "\x1e"


def warning_entry(rank: int, text: str) -> str:
    """One Python warning a rank publishes for rank 0 to fold (appended to the log; ended on
    both sides, so bytes another process appended cannot run into it)."""
    return f"{WARNING_END}{rank}\t{text.replace(WARNING_END, ' ')}{WARNING_END}"


def read_warning_entries(data: bytes) -> List[Tuple[int, str]]:
    """``(rank, text)`` of every whole entry in ``data`` (a part of the warnings' log)."""
    found = []
    for entry in data.split(WARNING_END.encode()):
        rank, tab, text = entry.decode("utf-8", "replace").partition("\t")
        if tab and is_decimal(rank):
            found.append((int(rank), text))
    return found


def clock(now: int) -> str:
    """Rank 0's clock in a clock-alignment round."""
    return str(now)


def read_clock(data: bytes) -> int:
    """The clock in a :func:`clock` value."""
    return read_number(data, "a clock")


def read_number(data: bytes, what: str) -> int:
    """The decimal int (at most 20 digits) the kit wrote as ``what`` (a counter's value, an
    attempt's number, a clock): :class:`BadRecord` for anything else."""
    return _decimal(data, 21, f"{what} is not a number")


#: Hex characters of a run id (the first rank's proposal at init, read back by every rank and
#: by ``axolotl-dist where``).
RUN_ID_LENGTH = 12


def read_run_id(data: bytes) -> str:
    """A run id as the ranks drew it: :class:`BadRecord` for anything else."""
    return read_token(data, "a run id", RUN_ID_LENGTH)


def read_token(data: bytes, what: str, length: int) -> str:
    """A hex token of ``length`` characters the kit drew (a run id, an attempt's join token):
    :class:`BadRecord` for anything else."""
    text = bytes(data[:length + 1]).decode("ascii", "replace")
    if len(data) != length or any(c not in "0123456789abcdef" for c in text):
        raise BadRecord(f"{what} is not {length} hex characters")
    return text
