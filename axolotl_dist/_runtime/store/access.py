"""Store access: which c10d store, who hosts it, what a lost store looks like, and a worker
thread for store calls that must not block the caller.

The first floor of the signalling stack (store <- :mod:`..liveness.peers` <- :mod:`..liveness.stalls` <-
:mod:`..liveness.waits`): it knows nothing about peers. The store's host is torch's choice, not ours
(docs/design/decisions.md, decision 11): torchrun's agent, a test parent, or rank 0's own process.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

import torch.distributed as dist

from ...env.variables import AGENT_STORE_ENV_VAR
from . import records, seals
from .store_state import STORE
from ..base.kitlog import kit as log
from ..base import torch_messages
from ...errors import DistributedEnvError

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup, Store

    from ..base.groups import Group

T = TypeVar("T")

__all__ = [
    "start_worker",
    "group_store",
    "kit_store",
    "world_store",
    "agent_hosts_store",
    "store_host",
    "hosts_store",
    "store_address",
    "StoreHostGoneError",
    "is_store_error",
    "Job",
    "submit",
    "bounded",
    "checked",
    "checked_or_ignored",
    "counter",
    "parsed",
    "genuine",
    "ignore",
    "set_if_absent",
    "put",
]


def group_store(group: Optional["ProcessGroup"] = None) -> "Store":
    """The c10d store of ``group`` (default: the world's)."""
    from torch.distributed import distributed_c10d as c10d

    if group is None:
        return c10d._get_default_store()
    return c10d._get_process_group_store(group)


def kit_store(g: "Group") -> "Store":
    """The c10d store of the kit's group ``g``, looked up once per group."""
    connections = STORE.groups[g]
    if connections.store is None:
        connections.store = group_store(g.arg)
    return connections.store


def world_store() -> "Store":
    """The world's store, where heartbeats, peer records and exit records live."""
    return group_store(None)


def agent_hosts_store() -> bool:
    """Whether the launcher's agent hosts the store (torchrun, ``axolotl-dist``, ``accelerate
    launch`` set ``TORCHELASTIC_USE_AGENT_STORE=True``): it outlives every rank, and every
    attempt of a restarted run (:mod:`.attempts`)."""
    return os.environ.get(AGENT_STORE_ENV_VAR) == "True"


def store_host() -> Optional[int]:
    """The global rank whose process hosts the world store, or None if it lives elsewhere.

    torch's ``env://``/``tcp://`` rendezvous makes rank 0 host the ``TCPStore`` unless the
    launcher's agent hosts it (torchrun, ``axolotl-dist``, ``accelerate launch`` set
    ``TORCHELASTIC_USE_AGENT_STORE=True``); a file or in-memory store has no host process.
    """
    if agent_hosts_store():
        return None
    try:
        store = world_store()
    except Exception:  # noqa: BLE001 - no group
        return None
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return 0 if isinstance(store, dist.TCPStore) else None


def hosts_store() -> bool:
    """Whether this process hosts the world store (see :func:`store_host`)."""
    return dist.is_initialized() and store_host() == dist.get_rank()


def store_address() -> str:
    """``MASTER_ADDR:MASTER_PORT``, for messages."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f"{addr}:{port}" if addr and port else "its address"


class StoreHostGoneError(RuntimeError):
    """The store's host process is known to have ended: a store call was not even tried.

    Not only to save time. A call to a dead store usually fails at once, but torch's client may
    first try to reconnect, and that can wait for a reverse DNS lookup (glibc's resolver
    timeout, 5 s by default, where no resolver answers for 127.0.0.1), holding the
    connection's lock for every later call."""


def is_store_error(exc: BaseException) -> bool:
    """Whether ``exc`` says the store's connection is gone (not a timeout, not a bad key)."""
    network = getattr(dist, "DistNetworkError", None)
    if isinstance(exc, StoreHostGoneError) or (network is not None and isinstance(exc, network)):
        return True
    return torch_messages.store_gone(exc)


# --- the store worker ------------------------------------------------------------------------

class Job:
    """A store call handed to the store worker; ``done`` is set once it returned or raised."""

    __slots__ = ("fn", "done", "value", "error")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn, self.done = fn, threading.Event()
        self.value: Any = None
        self.error: Optional[BaseException] = None

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class _StoreWorker:
    """One daemon thread that makes a waiting rank's store calls.

    A store call blocks for as long as the store's host process is stopped (``SIGSTOP``, a
    debugger, a suspended job): torch applies no timeout to it. Made here, the waiting rank
    keeps its own clock: it warns about the silent host and raises at its ``timeout``.
    """

    def __init__(self) -> None:
        self._jobs: "queue.SimpleQueue[Job]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def start(self) -> bool:
        """Start the thread unless it runs; whether it runs now. Called while the run is
        alive (:func:`start_worker`): CPython 3.12.0-3.12.2 refuse a new thread once the
        interpreter is shutting down, where the exit hook makes its last store calls."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                thread = threading.Thread(target=self._run, name="axolotl-dist-store",
                                          daemon=True)
                try:
                    thread.start()
                except RuntimeError:  # "can't create new thread at interpreter shutdown"
                    return False
                self._thread = thread
            return True

    def submit(self, fn: Callable[[], Any]) -> Job:
        job = Job(fn)
        if self.start():
            self._jobs.put(job)
        else:  # no thread to be had: made here, without the worker's own clock
            try:
                job.value = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                job.error = exc
            job.done.set()
        return job

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job.value = job.fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                job.error = exc
            job.done.set()


_WORKER = _StoreWorker()


def start_worker() -> None:
    """Start the store worker now, while the run is alive, so that the exit path finds it
    running (no thread is started at interpreter shutdown)."""
    _WORKER.start()


def submit(fn: Callable[[], Any]) -> Job:
    """Run ``fn`` (a store call) on the store worker; wait on the returned job's ``done``."""
    return _WORKER.submit(fn)


def bounded(fn: Callable[[], Any], seconds: float, default: Any = None) -> Any:
    """``fn()`` made on the store worker; ``default`` if it has not answered within
    ``seconds`` (the store's host is stopped or unreachable) or raised. For calls that must not
    hold up an exit."""
    job = submit(fn)
    if not job.done.wait(seconds) or job.error is not None:
        return default
    return job.value


def checked(reader: Callable[[Any], T], data: Any, key: str, writer: Optional[int] = None) -> T:
    """``reader(data)`` (a :mod:`.records` reader of the value at store ``key``, unsealed:
    :mod:`.seals`); a record the kit did not write, or that carries no seal of this run's
    secret (a record the run needs now: tampering), is a
    :class:`~axolotl_dist.errors.DistributedEnvError` naming ``key`` and the rank it was
    written as (``writer``), not a :class:`.records.BadRecord`. Where the genuine record can
    still come, read it with :func:`checked_or_ignored`."""
    try:
        opened = seals.opened(key, data)
    except seals.NotThisRun as exc:
        raise DistributedEnvError(seals.not_this_run(key, exc)) from None
    except records.BadRecord as exc:
        raise DistributedEnvError(records.unreadable(key, writer, exc)) from None
    return parsed(reader, opened, key, writer)


def parsed(reader: Callable[[Any], T], data: bytes, key: str, writer: Optional[int] = None) -> T:
    """``reader(data)`` of a record already opened (:func:`set_if_absent`'s, :func:`genuine`'s), its
    :class:`.records.BadRecord` a :class:`~axolotl_dist.errors.DistributedEnvError` naming
    ``key``."""
    try:
        return reader(data)
    except records.BadRecord as exc:
        raise DistributedEnvError(records.unreadable(key, writer, exc)) from None


def counter(data: Any, key: str, what: str) -> int:
    """The count a counter of the kit's (a store integer, made by ``add``) holds; one that holds
    anything else is a :class:`~axolotl_dist.errors.DistributedEnvError` naming ``key``: only
    the kit's ``add`` writes there (counters carry no seal)."""
    return parsed(lambda raw: records.read_number(raw, what), data, key)


def checked_or_ignored(reader: Callable[[Any], T], data: Any, key: str,
                       writer: Optional[int] = None) -> Optional[T]:
    """:func:`checked`, but None for a record without this run's seal (ignored, said once per
    key, as if not there yet: the genuine record overwrites it)."""
    try:
        opened = seals.opened(key, data)
    except seals.NotThisRun as exc:
        ignore(key, exc)
        return None
    except records.BadRecord as exc:
        raise DistributedEnvError(records.unreadable(key, writer, exc)) from None
    return parsed(reader, opened, key, writer)


def genuine(key: str, data: Any) -> Optional[bytes]:
    """The value of the record ``data`` at store ``key``, or None where it carries no seal of
    this run's secret: ignored, as if not there yet (the genuine record overwrites it), and said
    once per key. :class:`.records.BadRecord` where it is sealed and this process has no
    secret."""
    try:
        return seals.opened(key, data)
    except seals.NotThisRun as exc:
        ignore(key, exc)
        return None


def ignore(key: str, exc: "seals.NotThisRun") -> None:
    """Say, once per key, that the record at store ``key`` is ignored: not this run's."""
    if key not in STORE.ignored:
        STORE.ignored.add(key)
        log.warning("ignored %s", seals.not_this_run(key, exc))


#: How many records without this run's seal :func:`set_if_absent` replaces before it gives up.
_SET_TRIES = 8


def set_if_absent(store: "Store", key: str, value: Any) -> bytes:
    """Write record ``value`` to store ``key`` unless one is there (``compare_set``: the first
    proposal wins); the winning record's value, unsealed. A record without this run's seal is
    no proposal: it is replaced (said once); past a few, a
    :class:`~axolotl_dist.errors.DistributedEnvError` names ``key``."""
    mine, expected = seals.seal(key, value), ""
    for _ in range(_SET_TRIES):
        have = store.compare_set(key, expected, mine)
        try:
            return seals.opened(key, have)
        except seals.NotThisRun as exc:
            ignore(key, exc)
            expected = have  # not this run's: ours goes in its place
        except records.BadRecord as exc:
            raise DistributedEnvError(records.unreadable(key, None, exc)) from None
    raise DistributedEnvError(seals.not_this_run(key, seals.NotThisRun(
        f"{_SET_TRIES} records without this run's seal replaced one another")))


def put(store: "Store", key: str, value: Any) -> None:
    """Write record ``value`` to store ``key``, sealed (:func:`.seals.seal`)."""
    store.set(key, seals.seal(key, value))
