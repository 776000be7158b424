"""The run's secret at work on the store: every record the kit writes is sealed with an HMAC
bound to its key, and a rank's ``where`` answer is encrypted (docs/design/store.md, "Trust model").

* :func:`seal`: ``value`` as written to store ``key``: unchanged without a secret; with one,
  :data:`MARK` + the first 16 bytes of HMAC-SHA256(run key, ``key`` NUL ``value``) (base64,
  22 characters) + ``:`` + ``value``. The seal names its key, so a record cannot be moved to
  another key; 27 bytes per record.
* :func:`opened`: the value a sealed record holds, or :class:`NotThisRun` where it carries no
  seal of this run's secret (a process outside the job wrote it), or
  :class:`~.records.BadRecord` where this process has no secret and the record is sealed.
* :func:`encrypt` / :func:`decrypt`: a ``where`` answer in the store, readable only by holders
  of the secret, with the standard library alone (no optional package: every install shows
  stacks, docs/design/store.md, "Trust model"): encrypt-then-MAC, the keystream SHAKE-256 of a key
  derived from the secret and a fresh 16-byte nonce (SHA-3's extendable output used as a
  keyed stream), the tag the first 16 bytes of HMAC-SHA256 under another derived key over the
  store key, the nonce and the ciphertext. A tampered, moved or foreign answer fails its tag.

The secret is :func:`~axolotl_dist.env.variables.kit_secret`'s (``AXOLOTL_DIST_SECRET``, or the file
``AXOLOTL_DIST_SECRET_FILE`` names; ``axolotl-dist`` makes one for a one-node run). Counters
(``add``) cannot be sealed; the protocols treat what one says as a hint and act on sealed
records.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import os
from typing import Optional, Tuple, Union

from ...env.variables import SECRET_ENV_VAR, kit_secret
from ..base.state import PerGroup, RoomState, register
from . import records

__all__ = ["MARK", "SEAL_BYTES", "NotThisRun", "run_key", "sealing", "SEALS", "SealsState",
           "seal", "opened",
           "not_this_run", "encrypt", "decrypt", "ENCRYPTED"]

#: What a sealed record starts with, and a sealed record's extra bytes.
MARK = b"\x1fs1:"
SEAL_BYTES = len(MARK) + 22 + 1
#: What an encrypted ``where`` answer starts with (base64 of nonce, ciphertext and tag follows).
ENCRYPTED = b"\x1fe2:"
_TAG = 16
_NONCE = 16
_SEAL_DOMAIN = b"axolotl_dist seal 1\0"
_STREAM_DOMAIN = b"axolotl_dist where stream 2\0"
_ANSWER_MAC_DOMAIN = b"axolotl_dist where tag 2\0"

Value = Union[bytes, str]


class NotThisRun(records.BadRecord):
    """A record without a valid seal of this run's secret: not written by this run."""


@functools.lru_cache(maxsize=4)
def _derived(secret: bytes, domain: bytes) -> bytes:
    return hashlib.sha256(domain + secret).digest()


def run_key() -> Optional[bytes]:
    """The key that seals this run's records, or None without a secret."""
    secret = kit_secret()
    return None if secret is None else _derived(secret, _SEAL_DOMAIN)


def sealing() -> bool:
    """Whether this process seals what it writes (it has the run's secret)."""
    return kit_secret() is not None


class SealsState(RoomState):
    """``groups``: whether each group's blocks seal their records, asked (:func:`sealing`) at
    the group's first block: the run's secret does not change while its groups live, and a
    block is on a loop's hot path (a lookup, no Python frame)."""

    def __init__(self) -> None:
        self.groups: PerGroup[bool] = PerGroup(lambda g: sealing())


SEALS = register("seals", SealsState())


def _tag(mac_key: bytes, key: str, value: bytes) -> bytes:
    mac = hmac.new(mac_key, key.encode() + b"\0" + value, hashlib.sha256).digest()[:_TAG]
    return base64.urlsafe_b64encode(mac).rstrip(b"=")


def _bytes(value: Value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def seal(key: str, value: Value) -> bytes:
    """``value`` as the kit writes it to store ``key`` (sealed where the run has a secret)."""
    data = _bytes(value)
    mac_key = run_key()
    if mac_key is None:
        return data
    return MARK + _tag(mac_key, key, data) + b":" + data


def opened(key: str, data: Value) -> bytes:
    """What the record ``data`` at store ``key`` holds. :class:`NotThisRun` where this run
    seals and ``data`` carries no valid seal; :class:`~.records.BadRecord` where it is sealed
    and this process has no secret."""
    data = _bytes(data)
    mac_key = run_key()
    sealed = data.startswith(MARK) and len(data) >= SEAL_BYTES and data[SEAL_BYTES - 1:SEAL_BYTES] == b":"
    if mac_key is None:
        if data.startswith(MARK):
            raise records.BadRecord(
                f"it is sealed with a run secret this process does not have: give every rank "
                f"(and `axolotl-dist where`) the run's {SECRET_ENV_VAR}")
        return data
    if not sealed:
        raise NotThisRun("it carries no seal of this run's secret")
    body = data[SEAL_BYTES:]
    if not hmac.compare_digest(data[len(MARK):SEAL_BYTES - 1], _tag(mac_key, key, body)):
        raise NotThisRun("its seal is not this run's (another secret, or another key's record)")
    return body


def not_this_run(key: str, exc: NotThisRun) -> str:
    """What a reader says of a record :func:`opened` refused."""
    return (f"the record at store key {key!r} was not written by this run ({exc}): a process "
            f"outside the job wrote it, or a rank was started without this run's "
            f"{SECRET_ENV_VAR} (every rank needs the same)")


# --- where answers ---------------------------------------------------------------------------

def _keys() -> Optional[Tuple[bytes, bytes]]:
    """The stream key and the tag key of this run's ``where`` answers (None without a secret)."""
    secret = kit_secret()
    if secret is None:
        return None
    return _derived(secret, _STREAM_DOMAIN), _derived(secret, _ANSWER_MAC_DOMAIN)


def _xor_stream(stream_key: bytes, nonce: bytes, data: bytes) -> bytes:
    """``data`` XOR the keystream of ``nonce`` (encrypts and decrypts alike)."""
    pad = hashlib.shake_256(stream_key + nonce).digest(len(data)) if data else b""
    return (int.from_bytes(data, "big") ^ int.from_bytes(pad, "big")).to_bytes(len(data), "big")


def _answer_tag(tag_key: bytes, key: str, nonce: bytes, body: bytes) -> bytes:
    return hmac.new(tag_key, key.encode() + b"\0" + nonce + body, hashlib.sha256).digest()[:_TAG]


def encrypt(key: str, value: Value) -> Optional[bytes]:
    """``value``, to be written to store ``key``, encrypted for holders of the run's secret;
    None without a secret."""
    pair = _keys()
    if pair is None:
        return None
    nonce = os.urandom(_NONCE)
    body = _xor_stream(pair[0], nonce, _bytes(value))
    token = nonce + body + _answer_tag(pair[1], key, nonce, body)
    return ENCRYPTED + base64.urlsafe_b64encode(token)


def decrypt(key: str, data: Value) -> bytes:
    """The plain text of an encrypted answer at store ``key``; :class:`NotThisRun` where it
    was not encrypted with this run's secret for this key, :class:`~.records.BadRecord` where
    this process has no secret."""
    data = _bytes(data)
    if not data.startswith(ENCRYPTED):
        raise NotThisRun("it is not encrypted with this run's secret")
    pair = _keys()
    if pair is None:
        raise records.BadRecord(f"it is encrypted with the run's secret: give `axolotl-dist "
                                f"where` the run's {SECRET_ENV_VAR}")
    try:
        token = base64.urlsafe_b64decode(data[len(ENCRYPTED):])
    except (ValueError, TypeError):
        raise NotThisRun("it is not an encrypted answer (not base64)") from None
    if len(token) < _NONCE + _TAG:
        raise NotThisRun(f"it is too short for an encrypted answer ({len(token)} bytes)")
    nonce, body, tag = token[:_NONCE], token[_NONCE:-_TAG], token[-_TAG:]
    if not hmac.compare_digest(tag, _answer_tag(pair[1], key, nonce, body)):
        raise NotThisRun("it was not encrypted with this run's secret for this key")
    return _xor_stream(pair[0], nonce, body)
