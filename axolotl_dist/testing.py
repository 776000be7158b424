"""A multi-process test harness for code that uses torch.distributed, usable in your own tests.

:func:`run_distributed` runs ``fn`` on ``world_size`` local ranks and returns each rank's
return value, indexed by rank::

    from axolotl_dist.testing import run_distributed

    def test_sum():
        def body():
            import axolotl_dist as ad
            return ad.all_reduce_value(ad.get_rank() + 1)
        assert run_distributed(body, world_size=3) == [6, 6, 6]

How it works, and why it is fast and never hangs:

* Ranks are **forked** from the test process (no fresh interpreter, no pickling of ``fn``, so
  closures and lambdas work). Each rank runs in its own process group so the whole tree can
  be killed.
* ``store="parent"`` (default): the test process hosts the c10d ``TCPStore`` on ``127.0.0.1``
  with an OS-chosen port (no free-port race) and the ranks join it as clients, exactly as
  under ``torchrun`` (``TORCHELASTIC_USE_AGENT_STORE``). ``store="rank0"``: rank 0's own
  process hosts it, as with bare env vars, ``srun`` or ``mpirun``, so the store dies with
  rank 0 (the port is a socket the test process bound and rank 0 inherits: no race either).
  Every rank gets the launcher env contract (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ...).
* With ``init=True`` (default) each rank calls :func:`axolotl_dist.init_distributed` first (on
  gloo followed by one raw barrier, so every rank is connected before any ``fn`` runs) and
  destroys the group afterwards; with ``init=False`` ``fn`` gets the env and inits itself.
* A wall-clock ``timeout`` bounds the whole run: ranks still alive then are SIGKILLed with
  their children, and the error says which ranks were stuck. When one rank raises, the others
  get ``grace`` seconds to finish before they are killed, and the error shows the failing
  rank's traceback.

Use :func:`run_distributed_outcomes` to inspect failures instead of raising (for tests that
expect a rank to raise or die). POSIX only (fork).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing import connection as mp_connection
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch

from ._procs import kill_tree, loopback_interface, signal_tree
from .env import LAUNCHER_ENV_VARS as _LAUNCHER_ENV_VARS

__all__ = [
    "RankOutcome",
    "DistributedTestError",
    "run_distributed",
    "run_distributed_outcomes",
    "loopback_interface",
    "LAUNCHER_ENV_VARS",
    "STORE_PLACEMENTS",
    "requires_gpu",
    "requires_multi_gpu",
    "GPU_MARKS",
]

#: Variables the harness clears in each rank before setting its own, so an outer launcher
#: (pytest itself started under torchrun or srun) cannot leak into the ranks: the library's own
#: list, :data:`axolotl_dist.env.LAUNCHER_ENV_VARS`.
LAUNCHER_ENV_VARS: Sequence[str] = _LAUNCHER_ENV_VARS

#: The pytest markers below are built on first use, so the harness itself runs without pytest.
_MARKERS = ("requires_gpu", "requires_multi_gpu", "GPU_MARKS")


def __getattr__(name: str) -> Any:
    """``requires_gpu``, ``requires_multi_gpu`` and ``GPU_MARKS`` (pytest markers; they need
    pytest, imported here rather than with the module)."""
    if name not in _MARKERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import pytest

    has_cuda = torch.cuda.is_available()
    markers = {
        "requires_gpu": pytest.mark.skipif(not has_cuda, reason="requires a CUDA GPU"),
        "requires_multi_gpu": pytest.mark.skipif(
            not has_cuda or torch.cuda.device_count() < 2, reason="requires 2 or more CUDA GPUs"),
    }
    #: Apply to GPU tests: ``pytestmark = GPU_MARKS`` or ``parametrize(..., marks=GPU_MARKS)``.
    markers["GPU_MARKS"] = (pytest.mark.gpu, markers["requires_gpu"])
    globals().update(markers)
    return markers[name]


class DistributedTestError(AssertionError):
    """A rank raised, died or did not finish in time under :func:`run_distributed`."""


@dataclasses.dataclass
class RankOutcome:
    """What one rank did: its return value, or the exception it raised, or how it died."""

    rank: int
    value: Any = None
    #: The exception object if it could be pickled back, else None.
    exception: Optional[BaseException] = None
    #: ``"TypeName: message"`` of the exception, if one was raised.
    error: Optional[str] = None
    traceback: Optional[str] = None
    #: Process exit code; negative for a signal (-9 = SIGKILL); None if killed on timeout.
    exitcode: Optional[int] = None
    #: Seconds from the start of the run until this rank reported or died.
    elapsed: float = 0.0
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out and self.exitcode == 0

    def describe(self) -> str:
        if self.timed_out:
            return f"rank {self.rank}: did not finish in time (killed)"
        if self.error is not None:
            return f"rank {self.rank}: raised {self.error}\n{self.traceback or ''}".rstrip()
        if self.exitcode != 0:
            how = (f"killed by signal {-self.exitcode}" if self.exitcode and self.exitcode < 0
                   else f"exited with code {self.exitcode} before returning")
            return f"rank {self.rank}: {how}"
        return f"rank {self.rank}: ok"


#: Where :func:`run_distributed` puts the c10d store: the test process, or rank 0's process.
STORE_PLACEMENTS = ("parent", "rank0")


def _rank_env(rank: int, world_size: int, port: int, extra: Mapping[str, Optional[str]],
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


def _wait_for_siblings(gate: tuple) -> None:
    """Block until the parent has forked every rank (see ``run_distributed_outcomes``)."""
    go_read, go_write = gate
    os.close(go_write)
    if os.read(go_read, 1) != b"g":  # the parent gave up while forking
        os._exit(1)
    os.close(go_read)


def _host_store(rank: int, world_size: int, port: int, listen_fd: Optional[int],
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


def _child_main(rank, world_size, port, fn, args, kwargs, env, init, backend, pg_timeout, conn,
                gate, listen_fd):
    """Body of a forked rank. Never returns: always ``os._exit``."""
    code = 0
    try:
        os.setpgid(0, 0)
    except OSError:  # pragma: no cover
        pass
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _wait_for_siblings(gate)
    message: tuple
    failure: Optional[BaseException] = None
    try:
        _rank_env(rank, world_size, port, env, agent_store=listen_fd is None)
        server = _host_store(rank, world_size, port, listen_fd, pg_timeout)  # noqa: F841 - kept alive
        if init:
            from .distributed import init_distributed

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
        except Exception:  # noqa: BLE001
            pickled = None
        message = ("err", pickled, f"{type(exc).__name__}: {exc}", tb)
        code = 1
        failure = None if isinstance(exc, SystemExit) else exc
    try:
        # Plain pickle, not multiprocessing's: torch's ForkingPickler would send tensors as
        # shared-memory handles that die with this process.
        try:
            data = pickle.dumps(message)
        except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable return value
            data = pickle.dumps(("err", None, f"{type(exc).__name__}: the return value of rank "
                                 f"{rank} could not be pickled for the test: {exc}",
                                 traceback.format_exc()))
            code = 1
        conn.send_bytes(data)
        conn.close()
    finally:
        try:  # what the kit does at a script's exit (an uncaught exception, or a normal end)
            from ._teardown import teardown

            teardown(failure)
        except Exception:  # noqa: BLE001
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_distributed_outcomes(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    kwargs: Optional[Mapping[str, Any]] = None,
    env: Optional[Mapping[str, Optional[str]]] = None,
    rank_env: Optional[Callable[[int], Mapping[str, Optional[str]]]] = None,
    init: bool = True,
    backend: str = "gloo",
    timeout: float = 60.0,
    grace: Optional[float] = None,
    pg_timeout: float = 300.0,
    store: str = "parent",
) -> List[RankOutcome]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` forked ranks; return every rank's outcome.

    :param env: extra env vars for every rank (``None`` values delete a variable).
    :param rank_env: a function of the rank giving extra env vars for that rank.
    :param init: call :func:`axolotl_dist.init_distributed` in each rank before ``fn``.
    :param timeout: wall-clock seconds for the whole run; stragglers are SIGKILLed.
    :param grace: once a rank has failed, seconds the others get before they are killed
        (default: wait for them until ``timeout``).
    :param pg_timeout: the process group's collective timeout, seconds.
    :param store: ``"parent"`` (this process hosts the c10d store, as torchrun's agent does) or
        ``"rank0"`` (rank 0's process hosts it, as with bare env vars, srun or mpirun).
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if timeout <= 0:
        raise ValueError(f"timeout={timeout} must be > 0 seconds")
    if store not in STORE_PLACEMENTS:
        raise ValueError(f"store={store!r} must be one of {STORE_PLACEMENTS}")
    import multiprocessing as mp

    import torch.distributed as dist

    ctx = mp.get_context("fork")
    listener: Optional[socket.socket] = None
    server: Any = None
    if store == "parent":
        server = dist.TCPStore("127.0.0.1", 0, world_size, True, timedelta(seconds=pg_timeout),
                               wait_for_workers=False)
        port = server.port
    else:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        port = listener.getsockname()[1]
    kwargs = dict(kwargs or {})
    procs, conns = [], []
    # Ranks wait at this gate until all are forked: a rank that connects to the store while
    # the parent is still forking makes the store's thread resolve its address, and a fork
    # taken while that thread holds glibc's resolver lock leaves the next rank deadlocked
    # in getnameinfo() (seen intermittently under pytest-xdist on a busy machine).
    gate = os.pipe()
    start = time.monotonic()
    try:
        for rank in range(world_size):
            extra: Dict[str, Optional[str]] = dict(env or {})
            if rank_env is not None:
                extra.update(rank_env(rank))
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_child_main,
                args=(rank, world_size, port, fn, args, kwargs, extra, init, backend,
                      pg_timeout, writer, gate, None if listener is None else listener.fileno()),
                daemon=False,
            )
            proc.start()
            writer.close()
            procs.append(proc)
            conns.append(reader)
        if listener is not None:  # rank 0 has its own copy of the listening socket
            listener.close()
            listener = None
        os.write(gate[1], b"g" * world_size)
        outcomes: List[Optional[RankOutcome]] = [None] * world_size
        messages: Dict[int, tuple] = {}
        reported: Dict[int, float] = {}
        first_failure: Optional[float] = None
        deadline = start + timeout
        while any(o is None for o in outcomes):
            now = time.monotonic()
            limit = deadline if first_failure is None or grace is None else min(
                deadline, first_failure + grace)
            if now >= limit:
                break
            waitables: List[Any] = []
            for rank in range(world_size):
                if outcomes[rank] is None:
                    waitables.append(conns[rank] if rank not in messages else procs[rank].sentinel)
            mp_connection.wait(waitables, timeout=min(1.0, limit - now))
            for rank in range(world_size):
                if outcomes[rank] is not None:
                    continue
                if rank not in messages and conns[rank].poll():
                    try:
                        messages[rank] = pickle.loads(conns[rank].recv_bytes())
                    except (EOFError, OSError):
                        messages[rank] = ("died",)
                    except Exception as exc:  # noqa: BLE001 - a result we cannot unpickle
                        messages[rank] = ("err", None, f"{type(exc).__name__}: the result of "
                                          f"rank {rank} could not be unpickled: {exc}", "")
                proc = procs[rank]
                if rank in messages and rank not in reported:
                    reported[rank] = time.monotonic() - start  # its result, before its exit
                if not proc.is_alive():  # ended (after its exit teardown, if it reported)
                    if rank not in messages:
                        messages[rank] = ("died",)
                    proc.join(timeout=5.0)
                    outcome = RankOutcome(rank=rank, exitcode=proc.exitcode,
                                          elapsed=reported.get(rank, time.monotonic() - start))
                    msg = messages[rank]
                    if msg[0] == "ok":
                        outcome.value = msg[1]
                    elif msg[0] == "died" and outcome.exitcode == 0:
                        outcome.error = "exited with code 0 without reporting a result"
                    elif msg[0] == "err":
                        outcome.exception = pickle.loads(msg[1]) if msg[1] is not None else None
                        outcome.error, outcome.traceback = msg[2], msg[3]
                    outcomes[rank] = outcome
                    if not outcome.ok and first_failure is None:
                        first_failure = time.monotonic()
        for rank, proc in enumerate(procs):
            if outcomes[rank] is None:
                kill_tree(proc.pid)
                proc.join(timeout=5.0)
                outcomes[rank] = RankOutcome(rank=rank, timed_out=True, exitcode=proc.exitcode,
                                             elapsed=time.monotonic() - start)
        return [o for o in outcomes if o is not None]
    finally:
        for proc in procs:
            if proc.is_alive():  # pragma: no cover - only on an internal error above
                kill_tree(proc.pid)
                proc.join(timeout=5.0)
            # ranks may have started their own children in their process group
            signal_tree(proc.pid, signal.SIGKILL)
        for conn in conns:
            conn.close()
        for fd in gate:
            os.close(fd)
        if listener is not None:
            listener.close()
        del server


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: Sequence[Any] = (),
    kwargs: Optional[Mapping[str, Any]] = None,
    env: Optional[Mapping[str, Optional[str]]] = None,
    rank_env: Optional[Callable[[int], Mapping[str, Optional[str]]]] = None,
    init: bool = True,
    backend: str = "gloo",
    timeout: float = 60.0,
    grace: float = 3.0,
    pg_timeout: float = 300.0,
    store: str = "parent",
) -> List[Any]:
    """Run ``fn`` on ``world_size`` ranks and return the list of return values, by rank.

    Raises :class:`DistributedTestError` if any rank raises, dies or does not finish within
    ``timeout`` seconds, with the failing rank's traceback in the message. Other arguments as
    for :func:`run_distributed_outcomes`.
    """
    outcomes = run_distributed_outcomes(
        fn, world_size, args=args, kwargs=kwargs, env=env, rank_env=rank_env, init=init,
        backend=backend, timeout=timeout, grace=grace, pg_timeout=pg_timeout, store=store,
    )
    failed = [o for o in outcomes if not o.ok]
    if failed:
        # Show the rank that failed first (by time); timeouts after real failures.
        failed.sort(key=lambda o: (o.timed_out, o.elapsed))
        lines = [f"{len(failed)} of {world_size} rank(s) failed:"]
        lines += [o.describe() for o in failed]
        raise DistributedTestError("\n".join(lines))
    return [o.value for o in outcomes]
