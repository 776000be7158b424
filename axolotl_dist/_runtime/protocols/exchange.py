"""How the kit's collectives run: values encoded, headers exchanged, works waited for.

**Encoding**: :mod:`.encoding` (every value a 4-slot header and, for non-scalars, a
payload; a device tensor's bytes stay on its device).

**The header exchange.** On CPU (gloo) with at most :data:`~.headers.A2A_MAX_RANKS` ranks it is
one all-to-all (each rank sends its header to every other rank directly: one message per pair
and direction, where gloo's ring all-gather spends several notifications per rank); beyond
that many ranks the all-gather's ``O(ranks)`` messages win. An accelerator group's headers
and payloads travel on its CPU channel (:func:`~..base.groups.channel_of`), its tensors'
bytes on its device: nothing the host reads crosses the device. Not point-to-point
``send``/``recv``: a gloo receive whose wait times out closes every connection of the group ("Application timeout caused pair
closure"), so the kit's sliced, interruptible wait would kill the group whenever a rank
arrives more than a slice late; a collective's timed-out wait leaves it running. The buffers
and the group's own collectives live on the :class:`~..base.groups.Group`.

**Running a collective** (:func:`run`): issue it, wait for it (on CPU a first blocking slice,
then the watching wait of :mod:`..liveness.waits`), and turn a failure caused by a lost peer into a
:class:`~axolotl_dist.errors.RankFailedError` naming that peer: the one place of the kit where
that translation happens.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from ..base import torch_messages
from ..base.callsite import call_site
from ..base.groups import Group, channel_of
from ..liveness.progress import PROGRESS
from .blocks import BLOCKS
from .timeline import TIMELINE
from ..liveness import waits
from ..liveness.failures import diagnose_lost_peer
from . import timeline
from .codes import CODES, ROOTED, mismatch_error
from .headers import HEADER_LEN, HEADERS
from .encoding import (DEVICE, ERROR, NONE, PICKLE, Encoded, decode, decode_scalar,
                       encode_result, payload_len)
from .zero_first import confirm_all

__all__ = ["HEADER_LEN", "run", "exchange", "broadcast_value", "all_gather_values",
           "all_gather_into", "SLICE"]

# --- running a collective --------------------------------------------------------------------

#: Seconds of one blocking slice of a wait: how long a signal may wait to be handled. A slice
#: ends the moment the collective completes; each one that times out costs a few microseconds.
SLICE = waits.SLICE
_SLICE = timedelta(seconds=SLICE)


def run(g: Group, what: str, issue: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """Issue a collective (``issue(*args, **kwargs)``, which returns its work) on ``g`` and
    wait for it.

    On CPU the wait is a first blocking slice, then, if the collective is not done, the
    watching wait of :mod:`..liveness.waits` (interruptible, naming lost peers, saying where the others
    are); before the slice the ``zero_first`` blocks left unconfirmed are confirmed, so the
    store read overlaps the collective. On an accelerator group the collective is issued in
    torch's synchronous form (``async_op=False``): queued on the device's stream, nothing
    waited for on the host, no work object kept. A failure caused by a lost peer raises
    :class:`~axolotl_dist.errors.RankFailedError` naming it (``what``: the helper)."""
    work = None
    next(PROGRESS.counts[g]["collective"])  # advance(g, "collective"), without its frame
    try:
        if g.channel is not None:  # an accelerator group (not g.cpu: a property is a frame)
            kwargs["async_op"] = False
            issue(*args, **kwargs)
            return
        work = issue(*args, **kwargs)
        if BLOCKS.unconfirmed:  # see Kind.confirm_in_wait in .helpers
            confirm_all()
        try:
            work.wait(_SLICE)
            return
        except RuntimeError as exc:
            if not torch_messages.timed_out(exc):
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
    """Every rank's header (this rank's is in ``hdr_arr`` of the group's header buffers),
    flat, in group-rank order; every rank's whole frame is in its ``all_arr``. CPU only."""
    h = HEADERS.buffers[g]
    if h.a2a is not None:
        h.a2a_arr[:] = h.hdr_arr * g.size  # this rank's frame for every rank
        run(g, what, h.a2a, g.pg_ref(), h.hdr_all, h.a2a_in, _NO_SPLITS, _NO_SPLITS, h.a2a_opts)
    else:
        # the group's own all_gather_single: what dist.all_gather_single runs after its checks
        run(g, what, h.allgather, g.pg_ref(), h.hdr_all, h.hdr, h.opts)
    if h.frame == HEADER_LEN:
        return h.all_arr.tolist()
    frame, flat = h.frame, []
    for at in range(0, frame * g.size, frame):
        flat += h.all_arr[at:at + HEADER_LEN]
    return flat


_NO_SPLITS: List[int] = []  # equal splits
# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns).
all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _broadcast(g: Group, buffer: torch.Tensor, src: int, what: str) -> None:
    """Broadcast ``buffer`` (int64 or uint8, on ``g.device``) from group rank ``src``: on CPU
    through the group's own broadcast, on accelerators through ``dist.broadcast``."""
    if g.cpu:
        h = HEADERS.buffers[g]
        h.bcast_opts.rootRank = src
        run(g, what, h.bcast, g.pg_ref(), [buffer], h.bcast_opts)
    else:
        run(g, what, dist.broadcast, buffer, group=g.pg_ref(), group_src=src, async_op=True)


# --- the value helpers' engine ---------------------------------------------------------------

_I64, _U8 = torch.int64, torch.uint8


def broadcast_value(g: Optional[Group], fn: Callable[[], Any], src: int, where: str,
                    device: Optional[torch.device] = None) -> Any:
    """Run ``fn`` on group rank ``src`` only and return its result on every rank (one process,
    ``g`` None: ``fn()``, a tensor moved to ``device``).

    ``where`` is the public helper's name: its code and ``src`` travel in the header's slot 3,
    and every rank of a round where another helper (or another ``src``) met this one raises
    :class:`CollectiveMismatchError`. The headers' round is :func:`exchange` (every rank's
    header, as every helper's), the rest a broadcast from ``src``."""
    if g is None:
        value = fn()
        return value.to(device) if device is not None and isinstance(value, torch.Tensor) \
            else value
    code = CODES[where] | (src << 8 if where in ROOTED else 0)  # helper_code, inline
    own: Optional[BaseException] = None
    encoded: Optional[Encoded] = None
    g_data, on = g, None
    if g.channel is not None:  # an accelerator group: values keep their bytes on its device,
        on, g = g.device, channel_of(g)  # headers and payloads travel on its CPU channel
    a = HEADERS.buffers[g].hdr_arr
    value = None
    if g.rank == src:
        mine, encoded, own, value = encode_result(fn, g.rank, where, on)
        a[0], a[1], a[2] = mine[0], mine[1], mine[2]
    else:
        a[0] = a[1] = a[2] = NONE
    a[3] = code
    flat = exchange(g, where)
    if flat[3::HEADER_LEN].count(code) != g.size:  # another helper, or another src
        raise mismatch_error(dict(enumerate(flat[3::HEADER_LEN])), g.rank, lambda: str(call_site()))
    values = flat[src * HEADER_LEN:(src + 1) * HEADER_LEN]
    if values[0] >= PICKLE:  # more than the header holds, or src's fn raised
        return _broadcast_rest(g, g_data, values, encoded, own, src, where, device)
    if g.rank != src:
        return decode_scalar(values[0], values[1])
    if TIMELINE.recorder is not None:
        timeline.add_bytes(HEADER_LEN * 8)
    return value  # the scalar itself: what its header decodes to on the other ranks


def _broadcast_rest(g: Group, g_data: Group, values: List[int], encoded: Optional[Encoded],
                    own: Optional[BaseException], src: int, where: str,
                    device: Optional[torch.device]) -> Any:
    """:func:`broadcast_value` past the header (``g``: the CPU channel of ``g_data``): the
    payload from ``src``, then, for a DEVICE value, its bytes on ``g_data``'s device; src's
    own exception raised there, a decoded report elsewhere."""
    payload = _broadcast_payload(g, values, encoded, own, src, where)
    if own is not None:
        raise own
    data = None
    if values[0] == DEVICE:
        data = encoded.data if encoded is not None else \
            torch.empty(values[2], dtype=_U8, device=g_data.device)
        _broadcast(g_data, data, src, where)
    if TIMELINE.recorder is not None and g.rank == src:
        timeline.add_bytes(HEADER_LEN * 8 + payload.numel() + values[2] * (values[0] == DEVICE))
    return decode(values, payload, device, data)


def _broadcast_payload(g: Group, values: List[int], encoded: Optional[Encoded],
                       own: Optional[BaseException], src: int, where: str) -> torch.Tensor:
    """The second round of :func:`broadcast_value`, where ``src`` sent more than its header
    holds (a pickle, a tensor, an error report, a device tensor's description): its bytes,
    on every rank, on the host."""
    if encoded is not None:
        payload = encoded.payload
    else:
        payload = torch.empty(payload_len(values), dtype=_U8)
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
    g_data, on = g, None
    if g.channel is not None:  # see broadcast_value
        on, g = g.device, channel_of(g)
    code = CODES[where] | ((decode_on or 0) << 8 if where in ROOTED else 0)  # helper_code
    header, encoded, own, _ = encode_result(fn, g.rank, where, on)
    if TIMELINE.recorder is not None:
        _add_sent_bytes(encoded)
    a = HEADERS.buffers[g].hdr_arr
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
    return _gather_payloads(g, flat, encoded, own, device, decode_on, where, g_data)


def _add_sent_bytes(encoded: Optional[Encoded]) -> None:
    """Count on the timeline what this rank sends in an all-gather: its header, its payload."""
    payload = encoded.payload if encoded is not None else None
    timeline.add_bytes(HEADER_LEN * 8 + (payload.numel() if payload is not None else 0))


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
                     decode_on: Optional[int], where: str, g_data: Group
                     ) -> Optional[List[Any]]:
    """Second round of :func:`all_gather_values` (``g``: the CPU channel of ``g_data``): some
    rank sent a payload or an error report; where some rank sent a DEVICE value, a third
    round, on ``g_data``'s device."""
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
    datas = _gather_device_data(g_data, headers, encoded, where)
    if decode_on is not None and g.rank != decode_on:
        return None
    return [decode(h, p, device, d) for h, p, d in zip(headers, payloads, datas)]


def _gather_device_data(g: Group, headers: List[List[int]], encoded: Optional[Encoded],
                        where: str) -> List[Optional[torch.Tensor]]:
    """Each rank's DEVICE value's bytes (None for the others): one all-gather on ``g``'s
    device of a slot as long as the longest (16-byte aligned, so each rank's view as any dtype
    starts aligned); no round where no rank sent one."""
    sizes = [h[2] if h[0] == DEVICE else -1 for h in headers]
    if max(sizes) < 0:
        return [None] * len(headers)
    stride = max(-(-max(sizes) // 16) * 16, 16)
    mine = torch.empty(stride, dtype=_U8, device=g.device)
    if encoded is not None and encoded.data is not None and encoded.data.numel():
        mine[:encoded.data.numel()].copy_(encoded.data)
    out = torch.empty(g.size * stride, dtype=_U8, device=g.device)
    run(g, where, all_gather_into, out, mine, group=g.pg_ref(), async_op=True)
    return [out[r * stride:r * stride + n] if n >= 0 else None for r, n in enumerate(sizes)]
