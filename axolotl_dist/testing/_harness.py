"""The parent's side of the harness: the store, forking the ranks, collecting their outcomes,
and leaving nothing behind. :func:`run_distributed_outcomes` runs those steps in order."""

from __future__ import annotations

import os
import pickle
import signal
import socket
import time
import warnings
from datetime import timedelta
from multiprocessing import connection as mp_connection
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from .._runtime.base.procs import kill_tree, signal_tree
from .._runtime.base.tracebacks import safe_str
from .._runtime.liveness import where_report
from .._runtime.store import clients
from ._outcomes import STORE_PLACEMENTS, DistributedTestError, RankOutcome
from ._rank import child_main

__all__ = ["run_distributed", "run_distributed_outcomes"]

#: CPython 3.12+'s warning at a fork of a process with several threads (see _fork_ranks).
_FORK_WARNING = (r"This process \(pid=\d+\) is multi-threaded, use of fork\(\) may lead to "
                 r"deadlocks")


def _loopback_listener() -> socket.socket:
    """A listening IPv4 socket on 127.0.0.1 with a free port, for the store's server.

    Not torch's own (``TCPStore("127.0.0.1", 0, ...)``): that one listens on every interface,
    IPv6 included, so each connection reaches it from ``::ffff:127.0.0.1``, an address that
    ``/etc/hosts`` does not name, and its server looks the name up in DNS inside its event
    loop; where DNS drops the lookup the store answers nobody for the resolver's timeout (5 s:
    docs/design/liveness.md, "Connections"). Handed a socket of its own, it looks nothing up."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    return listener


class _Store:
    """Where the ranks' c10d store lives for one run (see ``store=``): a server in this process
    (``"parent"``), or a listening socket rank 0 inherits and serves on (``"rank0"``)."""

    def __init__(self, placement: str, world_size: int, pg_timeout: float) -> None:
        import torch.distributed as dist

        self.server: Any = None
        self.listener: Optional[socket.socket] = _loopback_listener()
        self.port = self.listener.getsockname()[1]
        if placement == "parent":  # the server owns the socket from here (and closes it)
            self.server = dist.TCPStore("127.0.0.1", self.port, world_size, True,
                                        timedelta(seconds=pg_timeout), wait_for_workers=False,
                                        master_listen_fd=self.listener.detach())
            self.listener = None

    def listen_fd(self) -> Optional[int]:
        return None if self.listener is None else self.listener.fileno()

    def handed_over(self) -> None:
        """Every rank is forked: rank 0 has its own copy of the listening socket."""
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def close(self) -> None:
        self.handed_over()
        self.server = None


def _fork_ranks(ctx: Any, world_size: int, store: _Store, fn: Callable[..., Any],
                args: Sequence[Any], kwargs: Mapping[str, Any],
                env: Optional[Mapping[str, Optional[str]]],
                rank_env: Optional[Callable[[int], Mapping[str, Optional[str]]]], init: bool,
                backend: str, pg_timeout: float, gate: tuple, procs: List[Any],
                conns: List[Any]) -> None:
    """Fork one process per rank (appended to ``procs``, with the read end of its result pipe
    to ``conns``, as each starts, so a failure part-way leaves nothing unaccounted for)."""
    for rank in range(world_size):
        extra: Dict[str, Optional[str]] = dict(env or {})
        if rank_env is not None:
            extra.update(rank_env(rank))
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=child_main,
            args=(rank, world_size, store.port, fn, args, kwargs, extra, init, backend,
                  pg_timeout, writer, gate, store.listen_fd()),
            daemon=False,
        )
        with warnings.catch_warnings():
            # CPython 3.12+ warns at every fork of a process with other threads (the store
            # server's, pytest-xdist's execnet I/O thread). This fork is safe: the child never
            # touches an object another thread owns (it connects a store of its own and ends in
            # os._exit, so no inherited object is ever destroyed), the locks it does take are
            # reinitialised at fork by CPython (GIL, imports, logging) and glibc (malloc), and
            # no rank resolves an address while another is forked (the gate below). Only that
            # warning is silenced, and only around this fork.
            warnings.filterwarnings("ignore", category=DeprecationWarning,
                                    message=_FORK_WARNING)
            proc.start()
        writer.close()
        procs.append(proc)
        conns.append(reader)


def _read_message(conn: Any, rank: int) -> tuple:
    """What a rank sent back: ``("ok", value)``, ``("err", pickled, text, traceback)``, or
    ``("died",)`` if its pipe closed without a message."""
    try:
        return pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return ("died",)
    except Exception as exc:  # noqa: BLE001 - a result we cannot unpickle
        return ("err", None, f"{type(exc).__name__}: the result of rank {rank} could not be "
                f"unpickled: {safe_str(exc)}", "")


def _outcome(rank: int, exitcode: Optional[int], message: tuple, elapsed: float) -> RankOutcome:
    """A rank's :class:`RankOutcome` from its exit code and the message it sent."""
    outcome = RankOutcome(rank=rank, exitcode=exitcode, elapsed=elapsed)
    if message[0] == "ok":
        outcome.value = message[1]
    elif message[0] == "died" and exitcode == 0:
        outcome.error = "exited with code 0 without reporting a result"
    elif message[0] == "err":
        outcome.exception = pickle.loads(message[1]) if message[1] is not None else None
        outcome.error, outcome.traceback = message[2], message[3]
    return outcome


def _collect(procs: List[Any], conns: List[Any], start: float, timeout: float,
             grace: Optional[float]) -> List[Optional[RankOutcome]]:
    """Wait for every rank's message and exit, until ``timeout`` (or ``grace`` seconds after
    the first failure); ranks still running then have no outcome (None)."""
    world_size = len(procs)
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
        # a rank's pipe until it reported, then its exit (its teardown runs after the report)
        waitables = [conns[r] if r not in messages else procs[r].sentinel
                     for r in range(world_size) if outcomes[r] is None]
        mp_connection.wait(waitables, timeout=min(1.0, limit - now))
        for rank in range(world_size):
            if outcomes[rank] is not None:
                continue
            outcome = _settle(rank, procs[rank], conns[rank], messages, reported, start)
            if outcome is None:
                continue
            outcomes[rank] = outcome
            if not outcome.ok and first_failure is None:
                first_failure = time.monotonic()
    return outcomes


def _settle(rank: int, proc: Any, conn: Any, messages: Dict[int, tuple],
            reported: Dict[int, float], start: float) -> Optional[RankOutcome]:
    """A rank's outcome once its process has exited, None while it runs; its message and the
    time it sent it go to ``messages`` and ``reported`` on the way."""
    if rank not in messages and conn.poll():
        messages[rank] = _read_message(conn, rank)
    if rank in messages and rank not in reported:
        reported[rank] = time.monotonic() - start  # its result, before its exit
    if proc.is_alive():
        return None
    messages.setdefault(rank, ("died",))
    proc.join(timeout=5.0)
    return _outcome(rank, proc.exitcode, messages[rank],
                    reported.get(rank, time.monotonic() - start))


def _ask_where(store: _Store, ranks: List[int]) -> Dict[int, str]:
    """Where each of ``ranks`` is, as the kit's where report says (its heartbeat answers
    within a few seconds); a line saying why not where the store cannot be asked."""
    if not ranks:
        return {}
    try:
        client = store.server
        if client is None:  # rank 0 hosts the store: ask it as any client would
            client = clients.connect("127.0.0.1", store.port, timeout=2.0,
                                         retry_refused=False)
        return where_report.where_each(client, ranks)
    except Exception as exc:  # noqa: BLE001 - the report must never stop the kill
        return {r: f"could not be asked ({type(exc).__name__}: {safe_str(exc)})" for r in ranks}


def _stop_stragglers(procs: List[Any], outcomes: List[Optional[RankOutcome]],
                     start: float, store: _Store) -> List[RankOutcome]:
    """SIGKILL every rank without an outcome (and its children), once the kit's where report
    said where each is; they count as timed out."""
    stuck = [r for r, o in enumerate(outcomes) if o is None]
    wheres = _ask_where(store, stuck)
    stopped_at = time.monotonic() - start
    for rank in stuck:  # frozen together first: none outlives a peer's kill to react to it
        signal_tree(procs[rank].pid, signal.SIGSTOP)
    for rank in stuck:
        kill_tree(procs[rank].pid)
    done: List[RankOutcome] = []
    for rank, proc in enumerate(procs):
        outcome = outcomes[rank]
        if outcome is None:
            proc.join(timeout=5.0)
            outcome = RankOutcome(rank=rank, timed_out=True, exitcode=proc.exitcode,
                                  elapsed=stopped_at, where=wheres.get(rank))
        done.append(outcome)
    return done


def _release(procs: List[Any], conns: List[Any], gate: tuple, store: _Store) -> None:
    """Leave nothing behind: every rank and whatever it started, pipes, the store."""
    for proc in procs:
        if proc.is_alive():  # pragma: no cover - only on an internal error
            kill_tree(proc.pid)
            proc.join(timeout=5.0)
        # ranks may have started their own children in their process group
        signal_tree(proc.pid, signal.SIGKILL)
    for conn in conns:
        conn.close()
    for fd in gate:
        os.close(fd)
    store.close()


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
    :param timeout: wall-clock seconds for the whole run; stragglers are SIGKILLed, once the
        kit's where report said where each is (:attr:`RankOutcome.where`; a few seconds).
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

    where = _Store(store, world_size, pg_timeout)
    procs: List[Any] = []
    conns: List[Any] = []
    # Ranks wait at this gate until all are forked: a rank that connects to the store while
    # the parent is still forking makes the store's thread resolve its address, and a fork
    # taken while that thread holds glibc's resolver lock leaves the next rank deadlocked
    # in getnameinfo() (seen intermittently under pytest-xdist on a busy machine).
    gate = os.pipe()
    start = time.monotonic()
    try:
        _fork_ranks(mp.get_context("fork"), world_size, where, fn, args, dict(kwargs or {}), env,
                    rank_env, init, backend, pg_timeout, gate, procs, conns)
        where.handed_over()
        os.write(gate[1], b"g" * world_size)
        outcomes = _collect(procs, conns, start, timeout, grace)
        return _stop_stragglers(procs, outcomes, start, where)
    finally:
        _release(procs, conns, gate, where)


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
