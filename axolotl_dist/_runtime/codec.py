"""Encoding of Python values for collectives: exact, and pickle-free for scalars.

Every value becomes a 4-slot int64 *header* and, for non-scalars, a uint8 *payload*:

========  ==================================  =======================================
kind      header slots                        payload
========  ==================================  =======================================
NONE      ``[0, 0, 0, 0]``                    none
BOOL      ``[1, value, 0, 0]``                none
INT       ``[2, value, 0, 0]`` (int64 range)  none
FLOAT     ``[3, float64 bits, 0, 0]``         none (exact: nan payloads, -0.0, inf)
PICKLE    ``[4, nbytes, 0, 0]``               pickled object (ints beyond int64 too)
TENSOR    ``[5, meta bytes, data bytes, 0]``  pickled (dtype, shape, device type) + raw bytes
ERROR     ``[6, nbytes, 0, 0]``               pickled failure report of the sending rank
========  ==================================  =======================================

Slot 3 is left 0 here: the value helpers put the sending helper's code in it
(:mod:`.headers`). So a scalar crosses in one small collective, and anything else in exactly two
(docs/design.md, "Value encoding").
"""

from __future__ import annotations

import ctypes
import pickle
import reprlib
import struct
from typing import Any, List, Optional, Tuple

import torch

from ..errors import RankFailedError, failure_report
from .tracebacks import safe_str

__all__ = ["HEADER_LEN", "Encoded", "encode", "encode_error", "decode",
           "scalar_header", "decode_scalar"]

HEADER_LEN = 4
NONE, BOOL, INT, FLOAT, PICKLE, TENSOR, ERROR = range(7)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_PACK_D, _UNPACK_Q = struct.Struct("<d").pack, struct.Struct("<q").unpack
_PACK_Q, _UNPACK_D = struct.Struct("<q").pack, struct.Struct("<d").unpack


class Encoded:
    """A value ready to send: its header and optional payload bytes."""

    __slots__ = ("header", "payload")

    def __init__(self, header: List[int], payload: Optional[torch.Tensor] = None) -> None:
        self.header = header
        self.payload = payload  # 1-D uint8 CPU tensor


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def tensor_bytes(payload: torch.Tensor) -> bytes:
    """The bytes of a 1-D uint8 tensor, without NumPy (the core needs torch alone).

    ``Tensor.numpy()`` raises where NumPy is not installed (a plain ``pip install
    axolotl-dist``); a copy of the CPU memory is the same bytes.
    """
    data = payload.detach().cpu().contiguous()
    if data.numel() == 0:
        return b""
    return ctypes.string_at(data.data_ptr(), data.numel() * data.element_size())


_REPR = reprlib.Repr()
_REPR.maxother = _REPR.maxstring = 80


def _short_repr(value: Any) -> str:
    try:
        return _REPR.repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the real error
        return f"<{type(value).__name__} object>"


def _pickle(value: Any, what: str) -> bytes:
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - pickle raises many types
        raise TypeError(
            f"{what} ({_short_repr(value)}, of type {type(value).__name__}) cannot be pickled "
            f"({type(exc).__name__}: "
            f"{safe_str(exc)}): return or pass plain data (numbers, strings, lists, dicts, tensors) or "
            "make the object picklable"
        ) from exc


_NONE_HEADER = (NONE, 0, 0, 0)
_TRUE_HEADER, _FALSE_HEADER = (BOOL, 1, 0, 0), (BOOL, 0, 0, 0)


def scalar_header(value: Any) -> Optional[Tuple[int, int, int, int]]:
    """The header of a payload-free value (None, bool, int64-range int, float), else None.

    The hot path of every helper: no allocation beyond the tuple, never raises.
    """
    kind = type(value)
    if kind is float:
        return (FLOAT, _UNPACK_Q(_PACK_D(value))[0], 0, 0)
    if kind is int:
        return (INT, value, 0, 0) if _INT64_MIN <= value <= _INT64_MAX else None
    if kind is bool:
        return _TRUE_HEADER if value else _FALSE_HEADER
    if value is None:
        return _NONE_HEADER
    return None


def decode_scalar(kind: int, value: int) -> Any:
    """Rebuild a payload-free value from its header's first two slots (``kind < PICKLE``)."""
    if kind == FLOAT:
        return _UNPACK_D(_PACK_Q(value))[0]
    if kind == INT:
        return value
    if kind == BOOL:
        return value != 0
    return None


def resolved(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with lazy conjugation and negation applied (a conjugate or negative view
    cannot be viewed as bytes or sent); the same tensor when there is nothing to resolve."""
    if tensor.is_conj():
        tensor = tensor.resolve_conj()
    if tensor.is_neg():
        tensor = tensor.resolve_neg()
    return tensor


def encode(value: Any, what: str = "value") -> Encoded:
    """Encode ``value``; raises ``TypeError`` naming ``what`` if it cannot be sent."""
    header = scalar_header(value)
    if header is not None:
        return Encoded(list(header))
    if isinstance(value, torch.Tensor) and type(value) is torch.Tensor and value.layout == torch.strided:
        flat = resolved(value.detach())
        meta = pickle.dumps((str(flat.dtype).replace("torch.", ""), tuple(flat.shape),
                             flat.device.type, value.requires_grad))
        if flat.device.type == "meta":
            return Encoded([TENSOR, len(meta), 0, 0], _bytes_tensor(meta))
        flat = flat.reshape(-1)
        if flat.device.type != "cpu":
            flat = flat.cpu()
        if flat.numel() and flat.element_size() > 0:
            data = flat.contiguous().view(torch.uint8)
        else:
            data = torch.empty(0, dtype=torch.uint8)
        payload = torch.cat([_bytes_tensor(meta), data])
        return Encoded([TENSOR, len(meta), int(data.numel()), 0], payload)
    data = _pickle(value, what)
    return Encoded([PICKLE, len(data), 0, 0], _bytes_tensor(data))


def encode_error(rank: int, exc: BaseException, where: str) -> Encoded:
    """Encode a failure report of ``rank`` (never raises)."""
    data = failure_report(rank, exc, where)
    return Encoded([ERROR, len(data), 0, 0], _bytes_tensor(data))


def payload_len(header: List[int]) -> int:
    """Bytes of payload that follow ``header`` (0 for scalars)."""
    kind = header[0]
    if kind == TENSOR:
        return header[1] + header[2]
    if kind in (PICKLE, ERROR):
        return header[1]
    return 0


def decode(header: List[int], payload: Optional[torch.Tensor], device: Optional[torch.device] = None) -> Any:
    """Rebuild a value; an ERROR header raises :class:`RankFailedError`."""
    kind = header[0]
    if kind == NONE:
        return None
    if kind == BOOL:
        return bool(header[1])
    if kind == INT:
        return int(header[1])
    if kind == FLOAT:
        return _UNPACK_D(_PACK_Q(header[1]))[0]
    assert payload is not None
    raw = tensor_bytes(payload) if kind != TENSOR else None
    if kind == PICKLE:
        return pickle.loads(raw)
    if kind == ERROR:
        raise RankFailedError.from_report(raw)
    if kind == TENSOR:
        meta_len, data_len = header[1], header[2]
        dtype_name, shape, device_type, requires_grad = pickle.loads(
            tensor_bytes(payload[:meta_len]))
        dtype = getattr(torch, dtype_name)
        target = _target_device(device_type, device)
        if device_type == "meta":
            return torch.empty(shape, dtype=dtype, device="meta")
        data = payload[meta_len:meta_len + data_len].cpu()
        if data_len:
            out = data.clone().view(dtype).reshape(shape)
        else:
            out = torch.empty(shape, dtype=dtype)
        if target.type != "cpu":
            out = out.to(target)
        if requires_grad:
            out.requires_grad_(True)
        return out
    raise ValueError(f"corrupt header {header}: ranks are running different helpers")


def _target_device(device_type: str, device: Optional[torch.device]) -> torch.device:
    if device is not None:
        return torch.device(device)
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if device_type in ("cpu", "meta"):
        return torch.device(device_type)
    try:
        return torch.device(device_type)
    except RuntimeError:  # pragma: no cover
        return torch.device("cpu")


def split_payloads(headers: List[List[int]], flat: torch.Tensor, stride: int) -> List[Optional[torch.Tensor]]:
    """Cut an all-gathered padded payload buffer into each rank's payload."""
    out: List[Optional[torch.Tensor]] = []
    for i, header in enumerate(headers):
        n = payload_len(header)
        out.append(flat[i * stride:i * stride + n] if n else None)
    return out


def first_error(headers: List[List[int]]) -> Optional[int]:
    """Index of the first rank whose header reports an error, else None."""
    for i, header in enumerate(headers):
        if header[0] == ERROR:
            return i
    return None

