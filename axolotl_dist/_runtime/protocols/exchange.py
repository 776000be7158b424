"""How the kit's collectives run: values encoded, headers exchanged, works waited for.

**Encoding** (docs/design.md, "Value encoding"). Every value becomes a 4-slot int64 *header*
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
BIGINT    ``[7, nbytes, 0, 0]``               an int beyond int64, in decimal
========  ==================================  =======================================

Slot 3 says which helper sent the header (:mod:`.codes`: the helper, registered where it is
decorated, and for the gathers the destination rank), so ``reduce_and_broadcast`` on one rank
and ``gather_from_all_ranks`` on another raise
:class:`~axolotl_dist.errors.CollectiveMismatchError` on every rank, naming both, without
debug mode and without another collective. A scalar crosses in one small collective,
anything else in exactly two (header, then payload).

**The header exchange.** On CPU (gloo) with at most :data:`~.groups.A2A_MAX_RANKS` ranks it is
one all-to-all (each rank sends its header to every other rank directly: one message per pair
and direction, where gloo's ring all-gather spends several notifications per rank); beyond
that many ranks the all-gather's ``O(ranks)`` messages win. An accelerator group's values,
headers and payloads alike, travel on its CPU channel (:func:`~..base.groups.channel_of`):
nothing the host reads crosses the device. Not point-to-point ``send``/``recv``: a gloo receive whose
wait times out closes every connection of the group ("Application timeout caused pair
closure"), so the kit's sliced, interruptible wait would kill the group whenever a rank
arrives more than a slice late; a collective's timed-out wait leaves it running. The buffers
and the group's own collectives live on the :class:`~..base.groups.Group`.

**Running a collective** (:func:`run`): issue it, wait for it (on CPU a first blocking slice,
then the watching wait of :mod:`..liveness.waits`), and turn a failure caused by a lost peer into a
:class:`~axolotl_dist.errors.RankFailedError` naming that peer: the one place of the kit where
that translation happens.
"""

from __future__ import annotations

import ctypes
import pickle
import reprlib
import struct
from datetime import timedelta
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..base import backends
from ..base.callsite import call_site
from ..base.groups import HEADER_LEN, Group, channel_of, remember_failure
from .protocols_state import BLOCKS, TIMELINE
from ..base.tracebacks import safe_str
from ..liveness import waits
from ..store import records
from ..liveness.failures import diagnose_lost_peer, failure_report
from . import timeline
from .codes import CODES, GATHERS, mismatch_error
from .zero_first import confirm_all
from ...errors import RankFailedError

__all__ = ["HEADER_LEN", "Encoded", "encode", "encode_error", "decode", "scalar_header",
           "decode_scalar", "tensor_bytes", "resolved", "run", "broadcast_value",
           "all_gather_values", "all_gather_into", "SLICE"]

NONE, BOOL, INT, FLOAT, PICKLE, TENSOR, ERROR, BIGINT = range(8)
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_PACK_D, _UNPACK_Q = struct.Struct("<d").pack, struct.Struct("<q").unpack
_PACK_Q, _UNPACK_D = struct.Struct("<q").pack, struct.Struct("<d").unpack


class Encoded(NamedTuple):
    """A value ready to send: its header and optional payload bytes (1-D uint8, CPU)."""

    header: List[int]
    payload: Optional[torch.Tensor] = None


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


def encode(value: Any, what: str = "value") -> Encoded:
    """Encode ``value``; raises ``TypeError`` naming ``what`` if it cannot be sent."""
    header = scalar_header(value)
    if header is not None:
        return Encoded(list(header))
    if isinstance(value, torch.Tensor) and type(value) is torch.Tensor and value.layout == torch.strided:
        flat = resolved(value.detach())
        meta = records.tensor_description(flat, value.requires_grad)
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
    if type(value) is int:  # beyond int64: decimal text, not a pickle
        data = records.bigint(value)
        return Encoded([BIGINT, len(data), 0, 0], _bytes_tensor(data))
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
    if kind in (PICKLE, ERROR, BIGINT):
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
        return pickle.loads(raw)  # the user's object, as torch's object collectives do
    if kind == ERROR:
        raise remember_failure(RankFailedError.from_report(raw))
    if kind == BIGINT:
        return records.read_bigint(raw)
    if kind == TENSOR:
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
    raise ValueError(f"corrupt header {header}: ranks are running different helpers")


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


# --- running a collective --------------------------------------------------------------------

#: Seconds of one blocking slice of a wait: how long a signal may wait to be handled. A slice
#: ends the moment the collective completes; each one that times out costs a few microseconds.
SLICE = waits.SLICE
_SLICE = timedelta(seconds=SLICE)
_timed_out = waits.timed_out


def run(g: Group, what: str, issue: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Issue a collective (``issue(*args, **kwargs)``, which returns its work) on ``g`` and
    wait for it.

    On CPU the wait is a first blocking slice, then, if the collective is not done, the
    watching wait of :mod:`..liveness.waits` (interruptible, naming lost peers, saying where the others
    are); before the slice the ``zero_first`` blocks left unconfirmed are confirmed, so the
    store read overlaps the collective. A failure caused by a lost peer raises
    :class:`~axolotl_dist.errors.RankFailedError` naming it (``what``: the helper)."""
    work = None
    g.calls += 1  # the group's kit collectives, as every rank counts them (.deadlock)
    try:
        work = issue(*args, **kwargs)
        if not g.cpu:
            work.wait()
            return
        if BLOCKS.unconfirmed:  # see Kind.confirm_in_wait in .helpers
            confirm_all()
        try:
            work.wait(_SLICE)
            return
        except RuntimeError as exc:
            if not _timed_out(exc):
                raise
        waits.collective(work, g, what)
    except RuntimeError as exc:  # a peer is gone: name it
        if work is not None and g.cpu:
            waits.left(work, g, exc)
        error = waits.own_part(diagnose_lost_peer(exc, what, g), g, what)
        try:
            if error is exc:
                raise
            # not chained: the backend's socket error says less than the error naming the
            # rank; its first line stays on the error
            error.backend_error = (str(exc).splitlines() or [""])[0]  # type: ignore[union-attr]
            raise error from None
        finally:  # no frame <-> error cycle: the frames (and their tensors) die with the error
            error = exc = None  # type: ignore[assignment]
    except BaseException as exc:
        if work is not None and g.cpu:
            waits.left(work, g, exc)
        raise


def exchange(g: Group, what: str) -> List[int]:
    """Every rank's header (this rank's is in ``g.headers.hdr_arr``), flat, in group-rank order. CPU
    only."""
    if g.headers.a2a is not None:
        g.headers.a2a_arr[:] = g.headers.hdr_arr * g.size  # this rank's header for every rank
        run(g, what, g.headers.a2a, g.pg_ref(), g.headers.hdr_all, g.headers.a2a_in, _NO_SPLITS, _NO_SPLITS, g.headers.a2a_opts)
    else:
        # the group's own all_gather_single: what dist.all_gather_single runs after its checks
        run(g, what, g.headers.allgather, g.pg_ref(), g.headers.hdr_all, g.headers.hdr, g.headers.opts)
    return g.headers.all_arr.tolist()


_NO_SPLITS: List[int] = []  # equal splits
# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _broadcast(g: Group, buffer: torch.Tensor, src: int, what: str) -> None:
    """Broadcast ``buffer`` (int64 or uint8, on ``g.device``) from group rank ``src``: on CPU
    through the group's own broadcast, on accelerators through ``dist.broadcast``."""
    if g.cpu:
        g.headers.bcast_opts.rootRank = src
        run(g, what, g.headers.bcast, g.pg_ref(), [buffer], g.headers.bcast_opts)
    else:
        run(g, what, dist.broadcast, buffer, group=g.pg_ref(), group_src=src, async_op=True)


# --- the value helpers' engine ---------------------------------------------------------------

_I64, _U8 = torch.int64, torch.uint8


def _encode_result(fn: Callable[[], Any], rank: int, where: str
                   ) -> Tuple[Sequence[int], Optional[Encoded], Optional[BaseException]]:
    """Run ``fn`` and encode its result: ``(header, encoded, exception)``.

    ``encoded`` is None for a scalar (its header says everything; no object is built on this
    hot path); otherwise it carries the payload, or the failure report if ``fn`` raised
    ``exception`` (shipped to the other ranks, then re-raised here).
    """
    try:
        value = fn()
        header = scalar_header(value)
        if header is not None:
            return header, None, None
        encoded = encode(value, f"the value returned by {where}'s fn on rank {rank}")
        return encoded.header, encoded, None
    except Exception as exc:  # noqa: BLE001 - shipped to the other ranks, then re-raised
        encoded = encode_error(rank, exc, where)
        return encoded.header, encoded, exc


def broadcast_value(g: Optional[Group], fn: Callable[[], Any], src: int, where: str,
                    device: Optional[torch.device] = None) -> Any:
    """Run ``fn`` on group rank ``src`` only and return its result on every rank (one process,
    ``g`` None: ``fn()``, a tensor moved to ``device``).

    ``where`` is the public helper's name: its code travels in the header's slot 3, and a rank
    that receives another helper's header raises :class:`CollectiveMismatchError`."""
    if g is None:
        value = fn()
        return value.to(device) if device is not None and isinstance(value, torch.Tensor) \
            else value
    code = CODES[where]
    own: Optional[BaseException] = None
    encoded: Optional[Encoded] = None
    g = channel_of(g)  # values travel on the host: an accelerator group's CPU channel
    header = g.headers.hdr
    if g.rank == src:
        mine, encoded, own = _encode_result(fn, g.rank, where)
        a = g.headers.hdr_arr
        a[0], a[1], a[2] = mine[0], mine[1], mine[2]
        a[3] = code
    g.headers.bcast_opts.rootRank = src  # the group's own broadcast (see _broadcast), inline
    run(g, where, g.headers.bcast, g.pg_ref(), [header], g.headers.bcast_opts)
    values = header.tolist()
    if values[3] != code:  # src ran another helper
        del header  # the cached buffer: the traceback keeps this frame
        raise mismatch_error({src: values[3], g.rank: code}, g.rank, lambda: str(call_site()))
    payload = _broadcast_payload(g, values, encoded, own, src, where) \
        if values[0] >= PICKLE else None
    if own is not None:
        del header  # the cached buffer: the traceback keeps this frame (see await_released)
        raise own
    if TIMELINE.recorder is not None and g.rank == src:
        timeline.add_bytes(HEADER_LEN * 8 + (payload.numel() if payload is not None else 0))
    return decode(values, payload, device)


def _broadcast_payload(g: Group, values: List[int], encoded: Optional[Encoded],
                       own: Optional[BaseException], src: int, where: str) -> torch.Tensor:
    """The second round of :func:`broadcast_value`, where ``src`` sent more than its header
    holds (a pickle, a tensor, an error report): its bytes, on every rank."""
    if encoded is not None:
        payload = encoded.payload.to(g.device)
    else:
        payload = torch.empty(payload_len(values), dtype=_U8, device=g.device)
    try:
        _broadcast(g, payload, src, where)
    except Exception:
        if own is None:
            raise
        raise own from None  # see _gather_payloads
    return payload


def all_gather_values(g: Optional[Group], fn: Callable[[], Any], where: str,
                      device: Optional[torch.device] = None, decode_on: Optional[int] = None
                      ) -> Optional[List[Any]]:
    """Run ``fn`` on every rank and all-gather the results (exactly; one process, ``g`` None:
    ``[fn()]``).

    Failures anywhere raise on every rank. With ``decode_on`` only that group rank decodes the
    values (others return None after the same collectives).

    This is the latency-critical path of the gather/reduce helpers: when every rank's value is
    a scalar (the usual case) it is one header exchange, one ``tolist`` and a decode of the
    value slots, with no per-call tensor or list building beyond that.
    """
    if g is None:
        return [fn()]
    g = channel_of(g)  # values travel on the host: an accelerator group's CPU channel
    code = CODES[where] | ((decode_on or 0) << 8 if where in GATHERS else 0)  # helper_code
    header, encoded, own = _encode_result(fn, g.rank, where)
    if TIMELINE.recorder is not None:
        timeline.add_bytes(HEADER_LEN * 8 + (
            encoded.payload.numel() if encoded is not None and encoded.payload is not None else 0))
    a = g.headers.hdr_arr
    a[0], a[1], a[2] = header[0], header[1], header[2]
    a[3] = code
    flat = exchange(g, where)
    if flat[3::HEADER_LEN].count(code) != g.size:  # another helper met this one
        raise mismatch_error(dict(enumerate(flat[3::HEADER_LEN])), g.rank, lambda: str(call_site()))
    kinds = flat[0::HEADER_LEN]
    if max(kinds) < PICKLE:  # every rank sent a scalar: no payload, nothing failed
        if decode_on is not None and g.rank != decode_on:
            return None
        return [decode_scalar(k, v) for k, v in zip(kinds, flat[1::HEADER_LEN])]
    return _gather_payloads(g, flat, encoded, own, device, decode_on, where)


def _raise_a_failure(headers: List[List[int]], payloads: List[Optional[torch.Tensor]],
                     own: Optional[BaseException]) -> None:
    """Raise this rank's own exception, else the first failed rank's report, if a rank
    failed; return if none did."""
    failed = next((i for i, h in enumerate(headers) if h[0] == ERROR), None)
    if failed is None:
        return
    if own is not None:
        raise own
    decode(headers[failed], payloads[failed])  # raises RankFailedError


def _gather_payloads(g: Group, flat: List[int], encoded: Optional[Encoded],
                     own: Optional[BaseException], device: Optional[torch.device],
                     decode_on: Optional[int], where: str) -> Optional[List[Any]]:
    """Second round of :func:`all_gather_values`: some rank sent a payload or an error report."""
    n, ws, cdev = HEADER_LEN, g.size, g.device
    headers = [flat[i:i + n] for i in range(0, ws * n, n)]
    stride = max(payload_len(h) for h in headers)
    mine = torch.zeros(stride, dtype=_U8, device=cdev)
    if encoded is not None and encoded.payload is not None:
        mine[: encoded.payload.numel()] = encoded.payload.to(cdev)
    flat_payload = torch.empty(ws * stride, dtype=_U8, device=cdev)
    try:
        run(g, where, all_gather_into, flat_payload, mine, group=g.pg_ref(), async_op=True)
    except Exception:
        if own is None:
            raise
        # This rank's own exception is its account. A peer may have read the report, raised
        # it and exited before this rank's side of the collective completed; the lost peer's
        # exit record then names this rank's failure, which is not news here.
        raise own from None
    payloads = [flat_payload[i * stride:i * stride + n] if (n := payload_len(h)) else None
                for i, h in enumerate(headers)]
    _raise_a_failure(headers, payloads, own)
    if decode_on is not None and g.rank != decode_on:
        return None
    return [decode(h, p, device) for h, p in zip(headers, payloads)]
