"""Store-based signalling between ranks: heartbeats and bounded, liveness-aware waits.

Rank-ordered blocks (:func:`~axolotl_dist.zero_first`, :func:`~axolotl_dist.do_n_at_a_time`)
signal through the process group's c10d store instead of collectives, so a wait is not bound
by the collective timeout, costs one store round trip when there is nothing to wait for, and
can watch the ranks it waits for:

* every process of a multi-rank group runs a daemon thread that bumps ``axd/hb/<rank>`` in the
  store every :data:`HEARTBEAT_INTERVAL` seconds (on its own store connection);
* a waiting rank polls with non-blocking ``add(key, 0)`` (no C++ timeout warnings), spinning
  briefly and then backing off to at most 0.25 s;
* when a watched rank's heartbeat stalls, a rank on the same host checks its pid (a dead or
  zombie process raises at once); for a rank on another host a stall longer than
  ``AXOLOTL_DIST_HEARTBEAT_TIMEOUT`` seconds (default 15) counts as death;
* waiting ranks log at INFO every ``AXOLOTL_DIST_WAIT_LOG_INTERVAL`` seconds (default 30) whom
  they wait for.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Sequence, Tuple

import torch.distributed as dist

from .errors import RankFailedError, RankTimeoutError, failure_report

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup, Store

__all__ = [
    "HEARTBEAT_INTERVAL",
    "HEARTBEAT_TIMEOUT_ENV_VAR",
    "WAIT_LOG_INTERVAL_ENV_VAR",
    "HOST",
    "Watch",
    "group_store",
    "next_sequence",
    "start_heartbeat",
    "stop_heartbeat",
    "poll_until",
    "publish_error",
    "read_error",
]

log = logging.getLogger("axolotl_dist")

HEARTBEAT_INTERVAL = 1.0
HEARTBEAT_TIMEOUT_ENV_VAR = "AXOLOTL_DIST_HEARTBEAT_TIMEOUT"
WAIT_LOG_INTERVAL_ENV_VAR = "AXOLOTL_DIST_WAIT_LOG_INTERVAL"
HOST = socket.gethostname()


def _float_env(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        from .errors import DistributedEnvError

        raise DistributedEnvError(f"{name}={raw!r} is not a number of seconds: set e.g. {name}={default:g}") from None
    return value


def group_store(group: Optional["ProcessGroup"] = None) -> "Store":
    """The c10d store of ``group`` (default: the world's)."""
    from torch.distributed import distributed_c10d as c10d

    if group is None:
        return c10d._get_default_store()
    return c10d._get_process_group_store(group)


# Weak keys: holding a process group past destroy_process_group() makes it die at interpreter
# exit, where gloo's threads abort the process.
_SEQ: "weakref.WeakKeyDictionary[Any, Dict[str, int]]" = weakref.WeakKeyDictionary()


def next_sequence(group: Optional["ProcessGroup"], kind: str) -> int:
    """A per-group, per-kind call counter; every rank of the group must call in the same order."""
    from torch.distributed import distributed_c10d as c10d

    pg = group if group is not None else c10d._world.default_pg
    counters = _SEQ.get(pg)
    if counters is None:
        counters = _SEQ[pg] = {}
    seq = counters[kind] = counters.get(kind, 0) + 1
    return seq


class _Heartbeat:
    def __init__(self, store: "Store", rank: int, interval: float) -> None:
        self.rank = rank
        self.stop = threading.Event()
        self.store = store
        self.interval = interval
        self.pg = dist.distributed_c10d._world.default_pg
        store.set(f"axd/who/{rank}", f"{HOST}:{os.getpid()}")
        store.add(f"axd/hb/{rank}", 1)
        self.thread = threading.Thread(target=self._run, name="axolotl-dist-heartbeat", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        key = f"axd/hb/{self.rank}"
        while not self.stop.wait(self.interval):
            if dist.distributed_c10d._world.default_pg is not self.pg:
                return  # the group this heartbeat belongs to is gone
            try:
                self.store.add(key, 1)
            except Exception:  # noqa: BLE001 - store gone: nothing to report to
                return


_HEARTBEAT: Optional[_Heartbeat] = None
_HB_LOCK = threading.Lock()


def start_heartbeat() -> None:
    """Start this process's heartbeat thread for the current default group (idempotent)."""
    global _HEARTBEAT
    pg = dist.distributed_c10d._world.default_pg
    if pg is None:
        return
    with _HB_LOCK:
        if _HEARTBEAT is not None and _HEARTBEAT.pg is pg and _HEARTBEAT.thread.is_alive():
            return
        if _HEARTBEAT is not None:
            _HEARTBEAT.stop.set()
        base = group_store()
        try:
            store = base.clone()
        except Exception:  # noqa: BLE001 - stores without clone (HashStore, FileStore)
            store = base
        _HEARTBEAT = _Heartbeat(store, dist.get_rank(), HEARTBEAT_INTERVAL)


def stop_heartbeat() -> None:
    """Stop the heartbeat thread, if any."""
    global _HEARTBEAT
    with _HB_LOCK:
        beat, _HEARTBEAT = _HEARTBEAT, None
    if beat is not None:
        beat.stop.set()
        if beat.thread is not threading.current_thread():
            # Wait for the thread to let go of its store connection: a TCPStore still in use
            # by a daemon thread when the interpreter exits aborts the process (SIGABRT).
            beat.thread.join(timeout=5.0)


def _proc_dead(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
        return state in (b"Z", b"X")
    except (OSError, IndexError):
        return False


class Watch:
    """Tracks the heartbeats of the global ranks a waiter depends on."""

    def __init__(self, store: "Store") -> None:
        self.store = store  # the world store, where heartbeats live
        self.seen: Dict[int, Tuple[int, float]] = {}
        self.remote_timeout = _float_env(HEARTBEAT_TIMEOUT_ENV_VAR, 15.0)

    def check(self, ranks: Sequence[int], now: float) -> None:
        for rank in ranks:
            beat = self.store.add(f"axd/hb/{rank}", 0)
            last = self.seen.get(rank)
            if last is None or last[0] != beat:
                self.seen[rank] = (beat, now)
                continue
            stalled = now - last[1]
            if beat == 0 or stalled < 2.5 * HEARTBEAT_INTERVAL:
                continue  # never started (not yet initialized here) or just slow
            who = self.store.multi_get([f"axd/who/{rank}"])[0].decode() if self.store.check(
                [f"axd/who/{rank}"]) else ""
            host, _, pid = who.rpartition(":")
            if host == HOST and pid.isdigit():
                if _proc_dead(int(pid)):
                    raise RankFailedError(
                        rank, "died", f"process {pid} on {host} exited without reporting an "
                        "error (it returned early, called exit, was killed by a signal or ran "
                        "out of memory)")
            elif stalled > self.remote_timeout:
                raise RankFailedError(
                    rank, "unresponsive", f"no heartbeat from {who or 'it'} for {stalled:.0f} s "
                    f"(raise {HEARTBEAT_TIMEOUT_ENV_VAR} if it is busy holding the GIL)")


def poll_until(
    ready: Callable[[], bool],
    *,
    watch: Callable[[], Sequence[int]],
    timeout: Optional[float],
    what: str,
    me: int,
) -> None:
    """Return once ``ready()`` is true; raise if a watched rank dies or ``timeout`` expires.

    :param ready: a cheap, non-blocking store probe.
    :param watch: the global ranks we are waiting for (re-evaluated at each liveness check).
    :param what: a description used in log lines and errors ("zero_first block #3").
    """
    if ready():
        return
    start = time.monotonic()
    watcher = Watch(group_store())
    log_every = _float_env(WAIT_LOG_INTERVAL_ENV_VAR, 30.0)
    next_log = start + log_every
    next_check = start + HEARTBEAT_INTERVAL
    spins, delay = 0, 0.0005
    while True:
        if spins < 20:
            spins += 1
        else:
            time.sleep(delay)
            delay = min(delay * 2, 0.05 if time.monotonic() - start < 10 else 0.25)
        if ready():
            return
        now = time.monotonic()
        if timeout is not None and now - start >= timeout:
            ranks = list(watch())
            raise RankTimeoutError(
                f"rank {me} gave up after waiting {timeout:g} s for rank(s) {ranks} to finish "
                f"{what} (timeout={timeout:g}); raise the timeout or find why they are slow",
                ranks,
            )
        if now >= next_check:
            next_check = now + HEARTBEAT_INTERVAL
            try:
                watcher.check(watch(), now)
            except RankFailedError as exc:
                exc.where = what
                raise RankFailedError(exc.rank, exc.exc_type, exc.exc_message, where=what) from None
        if now >= next_log:
            next_log = now + log_every
            log.info("rank %d has waited %.0f s for rank(s) %s to finish %s", me, now - start,
                     list(watch()), what)


def publish_error(store: "Store", key: str, rank: int, exc: BaseException, where: str) -> None:
    """Store a failure report of ``rank`` under ``key`` (never raises)."""
    try:
        store.set(key, failure_report(rank, exc, where))
    except Exception:  # noqa: BLE001 - the store may be gone: nothing to report to
        pass


def read_error(store: "Store", key: str) -> RankFailedError:
    """The :class:`RankFailedError` for a report stored with :func:`publish_error`."""
    return RankFailedError.from_report(store.get(key))
