"""How a value crosses between ranks: a 4-slot header and, for non-scalars, a payload.

**Encoding** (docs/design/helpers.md, "Value encoding"). Every value becomes a 4-slot int64 *header*
and, for non-scalars, a uint8 *payload*:

========  ==================================  =======================================
kind      header slots                        payload
========  ==================================  =======================================
NONE      ``[0, 0, 0, 0]``                    none
BOOL      ``[1, value, 0, 0]``                none
INT       ``[2, value, 0, 0]`` (int64 range)  none
FLOAT     ``[3, float64 bits, 0, 0]``         none (exact: nan payloads, -0.0, inf)
PICKLE    ``[4, nbytes, 0, 0]``               pickled object (only what the user passed as one)
TENSOR    ``[5, meta bytes, data bytes, 0]``  packed (dtype, device type, shape,
                                              requires_grad) + raw bytes
ERROR     ``[6, nbytes, 0, 0]``               the sending rank's failure report (JSON)
BIGINT    ``[7, nbytes, 0, 0]``               an int beyond int64, in hexadecimal
DEVICE    ``[8, meta bytes, data bytes, 0]``  the description alone; the bytes follow on
                                              the accelerator group's device
========  ==================================  =======================================

A tensor on an accelerator group's device type is a DEVICE value: its description crosses on
the host like any payload, its bytes in one more collective on the device (a broadcast or an
all-gather of the group itself), so a CUDA tensor never visits pageable host memory and the
host never waits for the GPU.

Slot 3 says which helper sent the header (:mod:`.codes`: the helper, registered where it is
decorated, and its source or destination rank), so ``reduce_and_broadcast`` on one rank
and ``compute_and_broadcast`` on another raise
:class:`~axolotl_dist.errors.CollectiveMismatchError` on every rank, naming both, without
debug mode and without another collective: every helper's header round is the same
collective (:func:`.exchange.exchange`: every rank's header to every rank, the broadcasts' included).
A scalar crosses in one small collective, anything else in exactly two (header, then
payload), a device tensor in three (its bytes on the device).
"""

from __future__ import annotations

import ctypes
import pickle
import reprlib
import struct
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch

from ..base import backends
from ..base.groups import remember_failure
from ..base.tracebacks import safe_str
from ..liveness.failures import failure_report
from ..store import records

__all__ = ["NONE", "BOOL", "INT", "FLOAT", "PICKLE", "TENSOR", "ERROR", "BIGINT", "DEVICE",
           "Encoded", "encode", "encode_error", "encode_result", "decode", "scalar_header",
           "decode_scalar", "payload_len", "tensor_bytes", "resolved"]

NONE, BOOL, INT, FLOAT, PICKLE, TENSOR, ERROR, BIGINT, DEVICE = range(9)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_PACK_D, _UNPACK_Q = struct.Struct("<d").pack, struct.Struct("<q").unpack
_PACK_Q, _UNPACK_D = struct.Struct("<q").pack, struct.Struct("<d").unpack


class Encoded(NamedTuple):
    """A value ready to send: its header, optional payload bytes (1-D uint8, CPU) and, for a
    DEVICE value, its bytes on the device (1-D uint8, a copy)."""

    header: List[int]
    payload: Optional[torch.Tensor] = None
    data: Optional[torch.Tensor] = None


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


def _pickle(value: Any, what: str) -> bytes:
    try:
        return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - pickle raises many types
        try:
            shown = _REPR.repr(value)
        except Exception:  # noqa: BLE001 - a broken __repr__ must not hide the real error
            shown = f"<{type(value).__name__} object>"
        raise TypeError(
            f"{what} ({shown}, of type {type(value).__name__}) cannot be pickled "
            f"({type(exc).__name__}: {safe_str(exc)}): return or pass plain data (numbers, "
            "strings, lists, dicts, tensors) or make the object picklable") from exc


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


def encode(value: Any, what: str = "value", device: Optional[torch.device] = None) -> Encoded:
    """Encode ``value``; raises ``TypeError`` naming ``what`` if it cannot be sent.

    ``device``: an accelerator group's device: a tensor on its device type is a DEVICE value
    (its bytes stay there, copied to ``device``)."""
    header = scalar_header(value)
    if header is not None:
        return Encoded(list(header))
    if isinstance(value, torch.Tensor) and type(value) is torch.Tensor and value.layout == torch.strided:
        flat = resolved(value.detach())
        meta = records.tensor_description(flat, value.requires_grad)
        if flat.device.type == "meta":
            return Encoded([TENSOR, len(meta), 0, 0], _bytes_tensor(meta))
        if device is not None and flat.device.type == device.type:
            return _device_value(flat, meta, device)
        flat = flat.reshape(-1)
        if flat.device.type != "cpu":
            flat = flat.cpu()
        if flat.numel() and flat.element_size() > 0:
            data = flat.contiguous().view(torch.uint8)
        else:
            data = torch.empty(0, dtype=torch.uint8)
        payload = torch.cat([_bytes_tensor(meta), data])
        return Encoded([TENSOR, len(meta), int(data.numel()), 0], payload)
    if type(value) is int:  # beyond int64: hexadecimal text, not a pickle
        data = records.bigint(value)
        return Encoded([BIGINT, len(data), 0, 0], _bytes_tensor(data))
    data = _pickle(value, what)
    return Encoded([PICKLE, len(data), 0, 0], _bytes_tensor(data))


def _device_value(flat: torch.Tensor, meta: bytes, device: torch.device) -> Encoded:
    """A DEVICE value: ``flat``'s description on the host, a copy of its bytes on ``device``
    (the result is the copy's view, never the user's tensor)."""
    nbytes = flat.numel() * flat.element_size()
    data = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if nbytes:  # reshape copies a non-contiguous tensor, so the bytes view always exists
        data.copy_(flat.reshape(-1).view(torch.uint8))
    return Encoded([DEVICE, len(meta), nbytes, 0], _bytes_tensor(meta), data)


def encode_error(rank: int, exc: BaseException, where: str) -> Encoded:
    """Encode a failure report of ``rank`` (never raises)."""
    data = failure_report(rank, exc, where)
    return Encoded([ERROR, len(data), 0, 0], _bytes_tensor(data))


def encode_result(fn: Callable[[], Any], rank: int, where: str, device: Optional[torch.device]
                  ) -> Tuple[Sequence[int], Optional[Encoded], Optional[BaseException], Any]:
    """Run ``fn`` (a value helper's, on ``rank``) and encode its result: ``(header, encoded,
    exception, value)``.

    ``encoded`` is None for a scalar (its header says everything; no object is built on this
    hot path), and ``value`` is then the scalar itself (the sender returns it as it is: what
    its header decodes to elsewhere); otherwise ``encoded`` carries the payload, or the failure
    report if ``fn`` raised ``exception`` (shipped to the other ranks, then re-raised there),
    and ``value`` is None. ``device``: an accelerator group's (its tensors' bytes stay
    there), else None.
    """
    try:
        value = fn()
        header = scalar_header(value)
        if header is not None:
            return header, None, None, value
        encoded = encode(value, f"the value returned by {where}'s fn on rank {rank}", device)
        return encoded.header, encoded, None, None
    except Exception as exc:  # noqa: BLE001 - shipped to the other ranks, then re-raised
        encoded = encode_error(rank, exc, where)
        return encoded.header, encoded, exc, None


def payload_len(header: List[int]) -> int:
    """Bytes of payload that follow ``header`` (0 for scalars)."""
    kind = header[0]
    if kind == TENSOR:
        return header[1] + header[2]
    if kind in (PICKLE, ERROR, BIGINT, DEVICE):
        return header[1]
    return 0


def decode(header: List[int], payload: Optional[torch.Tensor], device: Optional[torch.device] = None,
           data: Optional[torch.Tensor] = None) -> Any:
    """Rebuild a value; an ERROR header raises :class:`RankFailedError`. ``data``: a DEVICE
    value's bytes, on the device."""
    kind = header[0]
    if kind < PICKLE:
        return decode_scalar(kind, header[1])
    assert payload is not None
    if kind == TENSOR:
        return _host_tensor(header, payload, device)
    if kind == DEVICE:
        assert data is not None
        return _device_tensor(header, payload, data, device)
    raw = tensor_bytes(payload)
    if kind == PICKLE:
        return pickle.loads(raw)  # the user's object, as torch's object collectives do
    if kind == ERROR:
        raise remember_failure(records.read_failure(raw))
    if kind == BIGINT:
        return records.read_bigint(raw)
    raise ValueError(f"corrupt header {header}: ranks are running different helpers")


def _host_tensor(header: List[int], payload: torch.Tensor, device: Optional[torch.device]
                 ) -> torch.Tensor:
    """A TENSOR value: description and bytes both in ``payload`` (on the host), copied out,
    then moved to ``device`` (default: a device of the type it had on its rank)."""
    meta_len, data_len = header[1], header[2]
    dtype, shape, device_type, requires_grad = records.read_tensor_description(
        tensor_bytes(payload[:meta_len]), data_len)
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


def _device_tensor(header: List[int], payload: torch.Tensor, data: torch.Tensor,
                   device: Optional[torch.device]) -> torch.Tensor:
    """A DEVICE value: its description (``payload``, on the host) over its bytes (``data``,
    on the device), viewed in place, moved only where the caller asked for another
    ``device``."""
    dtype, shape, _, requires_grad = records.read_tensor_description(
        tensor_bytes(payload[:header[1]]), header[2])
    if header[2]:
        out = data[:header[2]].view(dtype).reshape(shape)
    else:
        out = torch.empty(shape, dtype=dtype, device=data.device)
    if device is not None:
        out = out.to(device)
    if requires_grad:
        out.requires_grad_(True)
    return out


def _target_device(device_type: str, device: Optional[torch.device]) -> torch.device:
    if device is not None:
        return torch.device(device)
    if device_type == "cuda" and backends.cuda_usable():
        return torch.device("cuda", torch.cuda.current_device())
    if device_type in ("cpu", "meta"):
        return torch.device(device_type)
    try:
        return torch.device(device_type)
    except RuntimeError:  # pragma: no cover
        return torch.device("cpu")
