"""The one-node rendezvous: torch's c10d rendezvous whose two stores listen on 127.0.0.1 only.

torch's ``TCPStore`` server binds every interface when it opens its own socket, so under
``torchrun --standalone`` (and ``axolotl-dist`` before) a one-node run's stores were reachable
from the machine's other addresses. A ``TCPStore`` also takes a listening socket its caller
bound (``master_listen_fd``): this backend binds both of the launcher's stores that way, the
rendezvous' own and the one torch shares with the ranks (``MASTER_ADDR:MASTER_PORT``). It is
torch's c10d rendezvous otherwise (torch's handler,
:class:`~torch.distributed.elastic.rendezvous.c10d_rendezvous_backend.C10dRendezvousBackend`),
registered under :data:`BACKEND` and chosen by :mod:`._options` for a one-node run without a port.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any

__all__ = ["BACKEND", "PORT_CONF", "register", "loopback_store"]

#: The name the launcher gives torch's rendezvous registry for the one-node rendezvous.
BACKEND = "axolotl-dist-loopback"
#: The rendezvous option (``--rdzv-conf``) naming the ranks' store's port (``--master-port``).
PORT_CONF = "ranks_port"
_LOOPBACK = "127.0.0.1"
#: torch's timeout for the store it shares with the ranks (``TCPStore``'s default).
_RANKS_STORE_TIMEOUT = 300


def loopback_store(timeout: float, port: int = 0) -> Any:
    """A ``TCPStore`` server listening on 127.0.0.1 only, on ``port`` (0: one the OS picks)."""
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((_LOOPBACK, port))
        listener.listen(128)
        port = listener.getsockname()[1]
        return dist.TCPStore(_LOOPBACK, port, is_master=True, multi_tenant=True,
                             timeout=timedelta(seconds=timeout),
                             master_listen_fd=listener.detach())
    finally:
        listener.close()


def _create_handler(params: Any) -> Any:
    """torch's c10d rendezvous handler over a loopback store, whose shared store (the ranks')
    is made on loopback too."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend)
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

    class _Backend(C10dRendezvousBackend):
        @property
        def name(self) -> str:
            return BACKEND

    store = loopback_store(params.get_as_int("read_timeout", 60))
    handler = create_handler(store, _Backend(store, params.run_id), params)
    ranks_port = params.get_as_int(PORT_CONF, 0)
    # torch's handler makes the ranks' store in this one method (port 0, every interface)
    handler._create_tcp_store_server = (
        lambda addr, port: loopback_store(_RANKS_STORE_TIMEOUT, ranks_port))
    return handler


def register() -> None:
    """Make :data:`BACKEND` known to torch's rendezvous registry (once per process)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    try:
        rendezvous_handler_registry.register(BACKEND, _create_handler)
    except ValueError:  # already registered by this process
        pass
