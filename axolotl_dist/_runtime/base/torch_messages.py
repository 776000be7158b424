"""What torch says only in words: the one place the kit reads torch's error messages.

Where torch gives a fact a type of its own the kit checks the type (``DistNetworkError``, the
kit's own :class:`~axolotl_dist.errors.AxolotlDistError`). Four facts the kit acts on come
from torch's backends and its c10d store as a ``RuntimeError`` (or a subclass it also raises
for other causes) whose message alone says what happened:

* :func:`peer_lost`: a collective failed because a peer's connection went away (teardown
  then names the dead rank instead of printing the backend's socket error);
* :func:`store_gone`: a call to the c10d store failed because its connection is gone (not a
  timeout, not a missing key);
* :func:`timed_out`: a bounded ``Work.wait(timeout)`` slice ended with the collective still
  running (the kit's waits wait in such slices);
* :func:`address_in_use`: the store could not listen on ``MASTER_PORT`` (``EADDRINUSE``).

Matching text is fragile: a torch release may reword a message, and the kit would then
silently take a lost peer for a plain error or a timeout for a failure. So every pattern lives
here, each function names the messages it knows and the torch versions they were seen in, and
``tests/runtime/base/test_torch_messages.py`` provokes each message from the installed torch
and checks the function recognises it; CI runs it under every torch the kit supports (2.13
and 2.14.1), so a reworded message fails a test instead of a user's run. A new match on a
torch message belongs here, with such a test, never in the module that acts on it.
"""

from __future__ import annotations

import re

from .tracebacks import safe_str
from ...errors import AxolotlDistError

__all__ = ["peer_lost", "store_gone", "timed_out", "address_in_use"]

#: A collective's failure because a peer's connection went away.
_PEER_LOST = re.compile(r"Connection (closed|reset) by peer|Broken pipe|remote process exited"
                        r"|NCCL (communicator was aborted|error)", re.I)

#: A store call's failure because the store's connection is gone.
_STORE_GONE = ("Broken pipe", "Connection reset", "Connection was likely closed",
               "Connection refused")


def peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is a backend's error for a peer that went away (never the kit's own
    :class:`~axolotl_dist.errors.AxolotlDistError`, whose account may quote such a message).

    Known messages (case-insensitive), seen in torch 2.13 and 2.14.1:

    * gloo, a peer's process gone mid-collective: ``[.../gloo/transport/tcp/pair.cc:NNN]
      Connection closed by peer [127.0.0.1]:NNNN. This is typically caused by a remote worker
      crashing...``; ``Connection reset by peer``; ``Broken pipe`` (a send to it);
    * NCCL (not provoked without two GPUs; its parts are in torch 2.14.1's CUDA build and
      its ``libnccl``): ``NCCL communicator was aborted on rank N.``, ``NCCL error in:
      FILE:LINE, remote process exited or there was a network error, NCCL version X``."""
    return (isinstance(exc, RuntimeError) and not isinstance(exc, AxolotlDistError)
            and _PEER_LOST.search(safe_str(exc)) is not None)


def store_gone(exc: BaseException) -> bool:
    """Whether ``exc`` says, in words, that the c10d store's connection is gone (not a
    timeout, not a bad key). Torch 2.13 and 2.14.1 raise these as ``DistNetworkError``, which
    callers also check by type; the words cover a plain ``RuntimeError`` saying the same.

    Known messages, seen in torch 2.13 and 2.14.1: ``Broken pipe`` (a call after the store's
    host process ended); ``Failed to recv, got 0 bytes. Connection was likely closed. Did the
    remote server shutdown or crash?`` (the store's server closed); and ``Connection reset``,
    ``Connection refused`` (the socket's errors on a reconnect). Not a store's timeout:
    ``wait timeout after 200ms, keys: /k``."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in _STORE_GONE)


def timed_out(exc: BaseException) -> bool:
    """Whether ``exc`` is a wait slice that timed out (the collective is still running):
    ``timed out`` in the message of a ``RuntimeError``, any case.

    Known messages, seen in torch 2.13 and 2.14.1: gloo's ``Work.wait(timeout)`` past its
    timeout, ``Operation timed out!``. A store client that cannot connect says ``The client
    socket has timed out after 1000ms while trying to connect to (127.0.0.1, NNNN).``, which
    matches too (callers ask only about a collective's wait); a store's own wait says
    ``wait timeout after 200ms, keys: /k``, which does not."""
    return isinstance(exc, RuntimeError) and "timed out" in str(exc).lower()


def address_in_use(exc: BaseException) -> bool:
    """Whether ``exc`` is the store's server failing to listen on a port another program
    holds: ``EADDRINUSE`` in the message of a ``RuntimeError``.

    Known message, seen in torch 2.13 and 2.14.1 (a ``DistNetworkError``, from
    ``TCPStore(is_master=True)`` and from ``init_process_group`` on rank 0 alike): ``The
    server socket has failed to listen on any local network address. port: NNNN, useIpv6:
    false, code: -98, name: EADDRINUSE, message: address already in use``."""
    return isinstance(exc, RuntimeError) and "EADDRINUSE" in str(exc)
