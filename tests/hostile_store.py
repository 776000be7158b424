"""A hostile c10d store for the fuzz tests: a proxy between the ranks and a real ``TCPStore``
that replaces the values the kit writes with an attacker's bytes.

The ranks connect to the proxy (``MASTER_PORT`` is its port); every connection is pumped to
the real store in both directions. The client->server stream is decoded with the TCPStore
wire protocol (torch 2.13's, as ``benchmarks/store_traffic.py`` documents it: one type byte,
then fields; a key or a value is a u64 length and its bytes). A ``SET``, ``COMPARE_SET``
(its desired value), ``APPEND`` or ``MULTI_SET`` of a key that ``target`` matches has its
value replaced by the next of the attacker's ``payloads`` before it reaches the store: the
store then holds what an attacker who can write the key would have put there, at the moment
the kit meant a reader to find its own record. Everything else is forwarded as it came.

In ``record`` mode nothing is replaced: the proxy only lists the keys the kit wrote, so that a
test can fuzz each family of them in turn.
"""

from __future__ import annotations

import os
import re
import socket
import struct
import sys
import threading
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

# the wire protocol's one table: the store-traffic benchmark's, which documents it
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
from store_traffic import LAYOUTS, QUERY_NAMES  # noqa: E402

__all__ = ["HostileStore", "family", "KIT_KEY", "CodeRunningPickle"]

#: The kit's keys: group keys (``axd/...``, under whatever prefix the group's store adds) and
#: root keys (``axolotl_dist/<run>/...``, ``axolotl_dist/run``, an attempt's join and answer;
#: the store prefix adds a leading ``/``). torch's own keys under an attempt's prefix
#: (``axolotl_dist/attempt/<n>/...`` without ``axd/``) are not the kit's.
KIT_KEY = re.compile(r"(^|/)axd/|^/?axolotl_dist/(?!attempt/\d+/)")

_TYPES = {name: qtype for qtype, name in QUERY_NAMES.items()}
_SET, _COMPARE_SET, _APPEND, _MULTI_SET = (_TYPES[name] for name in
                                           ("SET", "COMPARE_SET", "APPEND", "MULTI_SET"))
#: Fields after the type byte, by type byte (u32, i64, blob, blobs: count + blobs, pairs:
#: count + 2 blobs).
_LAYOUTS: Dict[int, Tuple[str, ...]] = {qtype: LAYOUTS[name] for qtype, name in
                                        QUERY_NAMES.items()}


class CodeRunningPickle:
    """Pickled, an attacker's bytes: unpickling them creates ``path`` (the test's canary)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Tuple[object, Tuple[str, str]]:
        return (open, (self.path, "w"))


def family(key: str) -> str:
    """A key with its numbers, digests and run id made placeholders: ``axd/zf/3/1a2b/error``
    -> ``axd/zf/#/*/error``."""
    key = key[key.index("axd/"):] if "axd/" in key else key.lstrip("/")
    parts = []
    for part in key.split("/"):
        if part.isdigit():
            parts.append("#")
        elif re.fullmatch(r"[0-9a-f]{6,}|[0-9a-f-]{20,}", part):
            parts.append("*")
        else:
            parts.append(part)
    return "/".join(parts)


class _Query:
    """One decoded query: its type, its fields (ints or bytes, lists for blobs and pairs)."""

    def __init__(self, qtype: int, fields: List[object], end: int) -> None:
        self.qtype, self.fields, self.end = qtype, fields, end

    def encode(self) -> bytes:
        out = bytearray([self.qtype])
        for kind, value in zip(_LAYOUTS[self.qtype], self.fields):
            if kind == "u32":
                out += struct.pack("<I", value)
            elif kind == "i64":
                out += struct.pack("<q", value)
            elif kind == "blob":
                out += struct.pack("<Q", len(value)) + value  # type: ignore[arg-type]
            else:
                items = value  # type: ignore[assignment]
                out += struct.pack("<Q", len(items) // (2 if kind == "pairs" else 1))
                for item in items:  # type: ignore[union-attr]
                    out += struct.pack("<Q", len(item)) + item
        return bytes(out)


def _decode(buf: bytearray) -> Optional[_Query]:
    """The query at the start of ``buf``, or None while it is incomplete."""
    if not buf:
        return None
    qtype, at, fields = buf[0], 1, []
    if qtype not in _LAYOUTS:
        raise ValueError(f"unknown TCPStore query type {qtype}")

    def blob(pos: int) -> Optional[Tuple[int, bytes]]:
        if len(buf) < pos + 8:
            return None
        size = struct.unpack_from("<Q", buf, pos)[0]
        if len(buf) < pos + 8 + size:
            return None
        return pos + 8 + size, bytes(buf[pos + 8:pos + 8 + size])

    for kind in _LAYOUTS[qtype]:
        if kind in ("u32", "i64"):
            width = 4 if kind == "u32" else 8
            if len(buf) < at + width:
                return None
            fields.append(struct.unpack_from("<I" if kind == "u32" else "<q", buf, at)[0])
            at += width
        elif kind == "blob":
            got = blob(at)
            if got is None:
                return None
            at, value = got
            fields.append(value)
        else:
            if len(buf) < at + 8:
                return None
            count = struct.unpack_from("<Q", buf, at)[0] * (2 if kind == "pairs" else 1)
            at += 8
            items = []
            for _ in range(count):
                got = blob(at)
                if got is None:
                    return None
                at, value = got
                items.append(value)
            fields.append(items)
    return _Query(qtype, fields, at)


class HostileStore:
    """A real ``TCPStore`` on 127.0.0.1 behind a rewriting proxy (see the module docstring).

    ``target``: which keys to attack (a function of the key; None: none, record only);
    ``payloads``: the attacker's values, used in turn. ``port`` is the proxy's (give it to the
    ranks), ``store_port`` the real store's (for a reader that should see what is stored)."""

    def __init__(self, world_size: int, target: Optional[Callable[[str], bool]] = None,
                 payloads: Sequence[bytes] = (b"",), forge_first: Optional[float] = None) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        self.store = dist.TCPStore("127.0.0.1", 0, world_size, True, timedelta(seconds=60),
                                   wait_for_workers=False)
        self.store_port = self.store.port
        self.target, self.payloads = target, list(payloads)
        #: not None: forge instead of replace (see :meth:`_forge`), holding the genuine write
        #: back this many seconds
        self.forge_first = forge_first
        self.forged: Set[str] = set()
        self.lock = threading.Lock()
        #: Every kit key written through the proxy, and the attacked ones with what was put.
        self.written: Set[str] = set()
        self.attacked: List[Tuple[str, int]] = []  # (key, payload index)
        self.bytes_sent = 0
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(256)
        self.port = self.listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _next_payload(self, key: str) -> bytes:
        with self.lock:
            index = len(self.attacked) % len(self.payloads)
            self.attacked.append((key, index))
            payload = self.payloads[index]
            self.bytes_sent += len(payload)
            return payload

    def _rewrite(self, query: _Query) -> _Query:
        """The query as the attacker lets it reach the store."""
        if query.qtype in (_SET, _COMPARE_SET, _APPEND):
            key = query.fields[0].decode(errors="replace")  # type: ignore[union-attr]
            if not KIT_KEY.search(key):
                return query
            with self.lock:
                self.written.add(key)
            if self.target is not None and self.target(key):
                if self.forge_first is not None:
                    self._forge(key, query.fields[-1])  # type: ignore[arg-type]
                else:
                    query.fields[-1] = self._next_payload(key)
        elif query.qtype == _MULTI_SET:
            items = list(query.fields[0])  # type: ignore[call-overload]
            for i in range(0, len(items), 2):
                key = items[i].decode(errors="replace")
                if KIT_KEY.search(key):
                    with self.lock:
                        self.written.add(key)
                    if self.target is not None and self.target(key):
                        if self.forge_first is not None:
                            self._forge(key, items[i + 1])
                        else:
                            items[i + 1] = self._next_payload(key)
            query.fields[0] = items
        return query

    def _forge(self, key: str, genuine: bytes) -> None:
        """The first write of ``key``: the attacker's record goes in first (the next payload,
        or, for an empty payload, the genuine value with its seal stripped or replaced by
        another's), and the genuine write waits :attr:`forge_first` seconds (a slow writer
        whose readers look in the meantime)."""
        if genuine.lstrip(b"-").isdigit():
            return  # a counter's compare_set, not a record
        with self.lock:
            if key in self.forged:
                return
            self.forged.add(key)
        payload = self._next_payload(key) or _unsealed(genuine, len(self.forged))
        api_key = key[1:] if key.startswith("/") else key  # torch's client adds the "/"
        self.store.set(api_key, payload)
        self.store.check([api_key])  # a round trip: the set is in before the genuine write
        import time
        time.sleep(self.forge_first)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            server = socket.create_connection(("127.0.0.1", self.store_port), timeout=30)
            server.settimeout(None)
        except OSError:
            client.close()
            return
        for sock in (client, server):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_pump, args=(server, client), daemon=True).start()
        buf = bytearray()
        try:
            while True:
                chunk = client.recv(65536)
                if not chunk:
                    break
                buf += chunk
                out = bytearray()
                while True:
                    query = _decode(buf)
                    if query is None:
                        break
                    out += self._rewrite(query).encode()
                    del buf[:query.end]
                if out:
                    server.sendall(out)
        except OSError:
            pass
        finally:
            _shut(server)

    def close(self) -> None:
        self._closed = True
        try:
            self.listener.close()
        except OSError:
            pass
        self.store = None


#: A sealed record's head: its mark, a 22-character tag, a colon (the kit's seals module).
_SEAL = re.compile(rb"^\x1fs1:[A-Za-z0-9_-]{22}:")


#: Every digit one up (9 to 0): a record of the same shape that says something else.
_SHIFTED = bytes.maketrans(b"0123456789", b"1234567890")


def _unsealed(genuine: bytes, n: int) -> bytes:
    """What a stranger who read the kit's record could write in its place, by ``n % 3``: its
    content with every digit changed (another rank, pid, attempt, tag, time), without a seal
    (1) or with a seal that is not the run's (2); or bytes that are no record (0)."""
    body = _SEAL.sub(b"", genuine).translate(_SHIFTED)
    return (b"\x00garbage\xff", body, b"\x1fs1:" + b"A" * 22 + b":" + body)[n % 3]


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while True:
            chunk = source.recv(65536)
            if not chunk:
                break
            sink.sendall(chunk)
    except OSError:
        pass
    finally:
        _shut(sink)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
