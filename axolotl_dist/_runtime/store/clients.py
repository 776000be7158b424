"""Connections to a run's c10d store from outside its process groups.

:func:`connect` is how a requester that only knows ``MASTER_ADDR:MASTER_PORT`` (``axolotl-dist
where``, the launcher, the test harness) reaches the store, :func:`rendezvous_target` finds the
ranks' store behind a torch elastic rendezvous endpoint, and :func:`raw_store` unwraps a
group's (or torch elastic's) prefix to the store's root, where the kit's run-wide keys live.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import TYPE_CHECKING, List, Optional, Tuple

from . import keys
from ...env.variables import is_decimal

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import Store

__all__ = ["raw_store", "Refused", "connect", "rendezvous_target", "listens_widely"]

#: The kernel's tables of TCP sockets, and the state a listening socket has in them.
_TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_LISTEN = "0A"
#: IPv6's loopback address and IPv4-mapped addresses' head, as the tables write them (hex).
_LOOPBACK6, _MAPPED4 = "00000000000000000000000001000000", "0000000000000000FFFF0000"


def raw_store(store: "Store") -> "Store":
    """The store under every prefix (a group's, torch elastic's ``/worker``)."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


class Refused(OSError):
    """Nothing listens at the address :func:`connect` was given (connection refused)."""


def connect(addr: str, port: int, timeout: float = 10.0, retry_refused: bool = True) -> "Store":
    """A client of the c10d store at ``addr:port`` (no prefix). A plain TCP connection comes
    first, retried until ``timeout``: where nothing listens, that is one ``OSError`` naming
    the address, not torch's retry warnings with C++ stack traces. With ``retry_refused``
    False, a refused connection (nothing listens there now) raises :class:`Refused` at once;
    an address that does not answer at all is still waited for until ``timeout``."""
    import socket

    import torch.distributed as dist

    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((addr, port), timeout=max(0.1, deadline - time.monotonic())).close()
            break
        except OSError as exc:
            if isinstance(exc, ConnectionRefusedError) and not retry_refused:
                raise Refused(f"nothing listens at {addr}:{port} (connection refused)") from None
            if time.monotonic() >= deadline:
                raise OSError(f"nothing accepted a connection at {addr}:{port} within "
                              f"{timeout:g} s ({exc})") from None
            time.sleep(0.1)
    return dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout),
                         wait_for_workers=False)


def rendezvous_target(store: "Store") -> Optional[Tuple[str, int]]:
    """Where the ranks' store is, if ``store`` is a torch elastic rendezvous store (the
    ``--rdzv-endpoint`` a torchrun user knows) rather than the ranks' own store: the address
    its last round's agent of rank 0 left there; None otherwise. Keys are listed where the
    store can (torch 2.13 on); elsewhere torchrun's default run id ``none`` is tried."""
    if store.check([keys.RUN_NOTE]):
        return None
    rounds = []
    for key in _rendezvous_port_keys(store):
        prefix = keys.rendezvous_round(key)
        head, _, number = prefix.rpartition(".")
        if head and is_decimal(number):
            rounds.append((int(number), prefix))
    if not rounds:
        return None
    prefix = max(rounds)[1]
    port = store.get(keys.rendezvous_port(prefix)).decode(errors="replace")
    addr_key = keys.rendezvous_addr(prefix)
    addr = store.get(addr_key).decode(errors="replace") if store.check([addr_key]) else ""
    return (addr, int(port)) if is_decimal(port) and addr else None


def _rendezvous_port_keys(store: "Store") -> List[str]:
    """The port keys of every rendezvous round in ``store``: listed where the store can, else
    torchrun's default run id ``none``'s first rounds, looked up one by one."""
    lister = getattr(store, "list_keys", None)
    try:
        found = [k for k in lister() if keys.is_rendezvous_port(k)] if lister is not None else []
    except Exception:  # noqa: BLE001 - a store that cannot list
        found = []
    if not found:
        found = [keys.rendezvous_port(keys.rendezvous_prefix("none", r)) for r in range(16)]
        found = [k for k in found if store.check([k])]
    return found


def listens_widely(port: int) -> Optional[bool]:
    """Whether the TCP socket listening on ``port`` on this host accepts connections from other
    hosts (bound to every interface or to an external address): True or False where this host
    has such a socket (Linux's ``/proc/net/tcp*``), None where it has none (the store runs on
    another host) or the tables cannot be read."""
    found = []
    for table in _TCP_TABLES:
        try:
            with open(table) as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 3 and fields[3] == _LISTEN:
                addr, _, hex_port = fields[1].partition(":")
                if int(hex_port, 16) == port:
                    found.append(not _loopback(addr))
    return any(found) if found else None


def _loopback(addr: str) -> bool:
    """Whether a table's local address (IPv4 in 127.0.0.0/8, little-endian hex; IPv6 ``::1``
    or an IPv4-mapped 127 address) is reachable from this host alone."""
    ipv4 = addr if len(addr) == 8 else addr[24:] if addr.startswith(_MAPPED4) else ""
    return addr == _LOOPBACK6 or ipv4.endswith("7F")
