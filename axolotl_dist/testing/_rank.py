"""The forked rank's side of the harness: its env, the gate, a store hosted in rank 0, and
the body that runs ``fn`` and sends its outcome back. Used by :mod:`._harness`."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import traceback
from datetime import timedelta
from typing import Any, Mapping, Optional

from .._runtime.base.procs import loopback_interface
from .._runtime.base.tracebacks import safe_str
from ..env import LAUNCHER_ENV_VARS
from ._probes import reset_process_state

__all__ = ["rank_env", "wait_for_siblings", "host_store", "child_main"]


def rank_env(rank: int, world_size: int, port: int, extra: Mapping[str, Optional[str]],
              agent_store: bool) -> None:
    for name in LAUNCHER_ENV_VARS:
        os.environ.pop(name, None)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if agent_store:
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    lo = loopback_interface()
    if lo is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    for name, value in extra.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = str(value)


def wait_for_siblings(gate: tuple) -> None:
    """Block until the parent has forked every rank (see ``run_distributed_outcomes``)."""
    go_read, go_write = gate
    os.close(go_write)
    if os.read(go_read, 1) != b"g":  # the parent gave up while forking
        os._exit(1)
    os.close(go_read)


def host_store(rank: int, world_size: int, port: int, listen_fd: Optional[int],
                pg_timeout: float) -> Any:
    """``store="rank0"``: rank 0 starts the store server on the inherited listening socket
    (``env://`` init then reuses it: torch makes rank 0's store multi-tenant); the other ranks
    close their copy of the socket. Returns the server to keep alive, or None."""
    if listen_fd is None:
        return None
    if rank != 0:
        os.close(listen_fd)
        return None
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, world_size, True, timedelta(seconds=pg_timeout),
                         wait_for_workers=False, multi_tenant=True, master_listen_fd=listen_fd)


def child_main(rank, world_size, port, fn, args, kwargs, env, init, backend, pg_timeout, conn,
                gate, listen_fd):
    """Body of a forked rank. Never returns: always ``os._exit``."""
    code = 0
    try:
        os.setpgid(0, 0)
    except OSError:  # pragma: no cover
        pass
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    wait_for_siblings(gate)
    message: tuple
    failure: Optional[BaseException] = None
    try:
        rank_env(rank, world_size, port, env, agent_store=listen_fd is None)
        reset_process_state()  # a forked rank starts knowing what a fresh process knows
        server = host_store(rank, world_size, port, listen_fd, pg_timeout)  # noqa: F841 - kept alive
        if init:
            from ..distributed import init_distributed

            init_distributed(backend=backend, timeout=timedelta(seconds=pg_timeout))
            if "gloo" in backend and world_size > 1:
                # gloo connects its mesh at init: a rank that finished its side and whose fn
                # returned at once could exit while a peer still reads the handshake
                # ("Connection closed by peer" there). Raw torch call: no debug-mode check.
                import torch.distributed as dist

                dist.barrier()
        value = fn(*args, **kwargs)
        message = ("ok", value)
    except BaseException as exc:  # noqa: BLE001 - report everything, including SystemExit
        tb = traceback.format_exc()
        try:
            pickled = pickle.dumps(exc)
            pickle.loads(pickled)
        except Exception:  # noqa: BLE001 - unpicklable: the text below still says what it was
            pickled = None
        message = ("err", pickled, f"{type(exc).__name__}: {safe_str(exc)}", tb)
        code = 1
        failure = None if isinstance(exc, SystemExit) else exc
    try:
        # Plain pickle, not multiprocessing's: torch's ForkingPickler would send tensors as
        # shared-memory handles that die with this process.
        try:
            data = pickle.dumps(message)
        except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable return value
            data = pickle.dumps(("err", None, f"{type(exc).__name__}: the return value of rank "
                                 f"{rank} could not be pickled for the test: {safe_str(exc)}",
                                 traceback.format_exc()))
            code = 1
        conn.send_bytes(data)
        conn.close()
    finally:
        try:  # what the kit does at a script's exit (an uncaught exception, or a normal end)
            from .._runtime.lifecycle.teardown import teardown

            teardown(failure)
        except Exception:  # noqa: BLE001
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


