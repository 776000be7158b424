"""Failure and exit records through the c10d store, and naming the peer behind a failed
collective: what a rank that fails (or ends) leaves for the others, and how the store's host
keeps it readable for them (bounded by ``AXOLOTL_DIST_STORE_LINGER``) before its process exits.

Built on the signalling floors: :mod:`..store.access`, :mod:`.peers` and :mod:`.stalls`. The protocol
is in docs/design/failures.md, "Failure relay".
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence, Tuple

import torch.distributed as dist

from ..base.constants import HEARTBEAT_INTERVAL, SLICE, UNMARKED_WAIT, look_interval
from ...env.variables import STORE_LINGER_ENV_VAR, kit_seconds
from ..base import hooks
from ..base.groups import Group, default_pg, known_failure, remember_failure
from ..base.procs import MACHINE
from ..base.tracebacks import format_exception, safe_str, user_line
from ..store import keys, records
from ..store.access import checked, hosts_store, is_store_error, put, world_store
from .liveness_state import HEARTBEAT, WAITS
from .lost import lost_error
from .stalls import ASLEEP_SLOWDOWN, PeerChecker
from .peers import peer_record, store_answers, store_host_gone, store_lost_error
from .where_report import same_machine
from ...errors import AxolotlDistError, CollectiveMismatchError, RankFailedError

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import Store

__all__ = [
    "failure_report",
    "publish_error",
    "read_error",
    "host_exit_timeout",
    "await_readers",
    "publish_exit",
    "publish_exit_on",
    "mark_exited",
    "await_peers_exit",
    "diagnose_lost_peer",
]


# --- failure records -------------------------------------------------------------------------

def failure_report(rank: int, exc: BaseException, where: str) -> bytes:
    """A report of ``exc`` raised on ``rank`` in ``where``, with its traceback, for the other
    ranks (which raise the error :func:`..store.records.read_failure` reads from it). Call it
    in the ``except`` block that caught ``exc``; never raises. The traceback shows the user's frames, not the
    kit's; a message that cannot be had (``__str__`` raises) is ``<exception str() failed>``.
    It names this machine: a reader on the same machine leaves the traceback to this rank's
    own output (docs/faults.md, "One account of a failure")."""
    try:
        tb = format_exception(type(exc), exc, exc.__traceback__)
        return records.failure(RankFailedError(
            rank, type(exc).__name__, safe_str(exc), tb, where=where, machine=MACHINE,
            site=user_line(exc.__traceback__),
            deadlock=exc.deadlock if isinstance(exc, CollectiveMismatchError) else None))
    except Exception:  # noqa: BLE001 - a report must never hide the failure itself
        return records.failure(RankFailedError(rank, type(exc).__name__,
                                               "<exception str() failed>", where=where))


def publish_error(store: "Store", key: str, rank: int, exc: BaseException, where: str) -> None:
    """Store a failure report of ``rank`` under ``key`` (never raises)."""
    try:
        put(store, key, failure_report(rank, exc, where))
    except Exception:  # noqa: BLE001 - the store may be gone: nothing to report to
        pass


def read_error(store: "Store", key: str, me: Optional[int] = None) -> RankFailedError:
    """The :class:`RankFailedError` for a report stored with :func:`publish_error`; with ``me``
    (this rank's rank in the group), acknowledge it for :func:`await_readers`."""
    try:
        data = store.get(key)
        if me is not None:
            store.set(keys.ack(key, me), b"")
    except Exception as exc:  # noqa: BLE001
        if is_store_error(exc):
            raise store_lost_error(exc, "reading another rank's failure") from None
        raise
    return remember_failure(checked(records.read_failure, data, key))


def host_exit_timeout() -> float:
    """Seconds the store host keeps a failure readable for its peers (``AXOLOTL_DIST_STORE_LINGER``)."""
    return kit_seconds(STORE_LINGER_ENV_VAR)


def await_readers(store: "Store", key: str, readers: Sequence[int],
                  group: Optional[Group] = None) -> None:
    """If this process hosts the store, wait until every live group rank in ``readers`` has
    acknowledged the report under ``key`` (:func:`read_error` with ``me``), at most
    :func:`host_exit_timeout` seconds. Elsewhere a no-op: the store outlives this process.
    Never raises."""
    if not readers or not hosts_store():
        return
    try:
        ranks = group.ranks if group is not None else list(range(dist.get_world_size()))

        def left() -> List[int]:
            return [ranks[r] for r in readers if not store.check([keys.ack(key, r)])]

        _wait_for_readers(lambda: not left(), left, PeerChecker(world_store(), look_every=_EXIT_WAIT_CHECK),
                exits=True)
    except Exception:  # noqa: BLE001 - best effort: we are about to raise our own error
        pass


#: Seconds a failing store host keeps its store up after every rank copied its exit record:
#: calls already on the wire finish (a rank with the copy starts none: see peers.host_leaving).
_DRAIN = 0.1
#: Seconds between the store host's looks at the ranks it waits for at exit (at exit only: a rank
#: that died is usually known by its pid, without waiting for a heartbeat).
_EXIT_WAIT_CHECK = 0.05


def _wait_for_readers(done: Callable[[], bool], left: Callable[[], List[int]], checker: "PeerChecker",
            exits: bool, bound: Optional[float] = None, every: float = 0.005) -> None:
    """Poll until ``done()`` (every ``every`` seconds), or until every global rank in ``left()``
    is gone (found by ``checker``; with ``exits``, a rank that left an exit record counts as
    gone), at most ``bound`` seconds (default :func:`host_exit_timeout`)."""
    start = time.monotonic()
    bound = host_exit_timeout() if bound is None else bound
    deadline, next_check = start + bound, start  # a dead peer: known at once
    while time.monotonic() < deadline:
        if done():
            return
        now = time.monotonic()
        if now >= next_check:
            next_check = now + _EXIT_WAIT_CHECK
            waiting = left()
            if waiting and len(checker.find_lost(waiting, now, exits=exits)) == len(waiting):
                return
        time.sleep(every)


# --- exit records ----------------------------------------------------------------------------

#: Seconds a rank ending on a failure looks for peers in a kit wait even where it finds none:
#: a wait marks itself only after ``UNMARKED_WAIT`` (a collective's after its first slice,
#: and within one more slice of the mark being due).
_UNMARKED_COVER = UNMARKED_WAIT + 3 * SLICE


def failed_exit_grace(world_size: int) -> float:
    """Seconds a rank ending on a failure gives its peers to read its exit record before its
    process ends: under torchrun, ``axolotl-dist``, accelerate or ``mpirun`` the launcher stops
    the other ranks as soon as this process is gone, and a peer in a kit wait looks at the
    store every :func:`~..base.constants.look_interval` (:data:`~.stalls.ASLEEP_SLOWDOWN` of them
    where it blocks on a wake key); the rest lets it print its error."""
    return ASLEEP_SLOWDOWN * look_interval(world_size) + 0.25

def publish_exit(exc: Optional[BaseException]) -> Optional[Tuple["Store", int, bool]]:
    """Leave this process's exit record for the others: ``exc`` if it is ending on an uncaught
    exception, else a normal exit. Uses the heartbeat's connection (never opens a new one: a
    dead store would make that wait). Returns ``(store, rank, whether it records a failure)``
    if the record was written."""
    if HEARTBEAT.exit_store is None:  # the heartbeat's connection for the exit record
        return None
    store, rank, pg_ref = HEARTBEAT.exit_store
    if pg_ref() is not default_pg():
        return None  # a later group replaced the one this connection belongs to
    if store_host_gone():
        return None  # nobody left to tell (and a call could wait in torch's reconnect)
    if exc is None:
        exc = known_failure()  # it ended normally, but after hearing of a failure
    try:
        report = None if exc is None else records.failure(exc) if isinstance(
            exc, RankFailedError) else failure_report(rank, exc, "its script")  # relayed: kept
    except Exception:  # noqa: BLE001 - a report must never stop the exit
        return None
    return _written(store, rank, report, getattr(exc, "store_refused", False))


def publish_exit_on(store: "Store", rank: int,
                    error: RankFailedError) -> Optional[Tuple["Store", int, bool]]:
    """Leave this process's exit record, ending on another rank's failure ``error``, through
    ``store`` (a connection of this thread's own: the heartbeat's, where the main thread's is
    held by a call that never ends); as :func:`publish_exit` returns."""
    return _written(store, rank, records.failure(error), False)


def _written(store: "Store", rank: int, report: Optional[bytes],
             refused: bool) -> Optional[Tuple["Store", int, bool]]:
    """:func:`publish_exit`'s record written and counted: on ``store``, or where the store
    closed that connection alone (``refused``, or found here: it refused a request, a key the
    kit counts in overwritten by a process outside the job) and still answers, on a fresh
    one, where the peers find the record by the exit log and the key."""
    written = False
    for attempt in range(4):
        try:
            if refused and attempt == 0:
                raise _Refused()
            if not written:
                _write_exit(store, rank, report)
                written = True
            store.add(keys.EXITS, 1)  # counted: the peers' next look reads it
            return store, rank, report is not None
        except Exception as error:  # noqa: BLE001 - the store is gone: nobody left to tell
            if not isinstance(error, _Refused) and (not is_store_error(error) or not store_answers()):
                break
            try:
                store = store.clone()
            except Exception:  # noqa: BLE001 - a torch without clone, or the store went
                break
    return (store, rank, report is not None) if written else None


class _Refused(Exception):
    """This process's connection is known closed by the store: go to a fresh one."""


def _write_exit(store: "Store", rank: int, report: Optional[bytes]) -> None:
    """The exit record of ``rank`` (``report``: its failure, if any), and its line in the log."""
    if WAITS.abandoned_in:
        store.set(keys.exit_pending(rank), b"")  # first: a reader of the record sees it
    put(store, keys.exit_record(rank), records.exit_record(report, time.time()))
    store.append(keys.EXIT_LOG, f",{rank},")  # separated on both sides: bytes another
    # process appended cannot run into it


def mark_exited(record: Tuple["Store", int, bool]) -> None:
    """After this process's groups are destroyed: it will not touch the store again. One
    store call, this process's last: the store's host may end as soon as it is made."""
    store, rank, _ = record
    try:
        store.set(keys.gone(rank), b"")
    except Exception:  # noqa: BLE001
        pass


def await_peers_told(store: "Store", rank: int, world_size: int, relayed: bool = False) -> None:
    """For a rank that does not host the store, ending on a failure, before its last store call
    (:func:`mark_exited`): wait until no other rank is in a kit wait any more (each one there
    reads this rank's record within a look interval, raises naming it, and keeps its wait
    counted until its own exit: :func:`..store.keys.waiting`) or it is gone, at most
    :func:`failed_exit_grace` seconds, and at least :data:`_UNMARKED_COVER` (a wait just begun
    is not marked yet). A rank busy elsewhere is not waited for: it could not
    name this rank before a launcher stopped it anyway. ``relayed``: this rank ends on another
    rank's failure; it does not wait for a rank that has left its own exit record (that one
    told its account and is in its exit too: two such ranks would wait for each other until
    the bound, then both make their last store calls as the rank that failed first, which
    waits for them, ends, perhaps taking the store with it). Never raises."""
    others = [r for r in range(world_size) if r != rank]
    start = time.monotonic()
    deadline = start + failed_exit_grace(world_size)
    try:
        checker = PeerChecker(store, rank)
        while time.monotonic() < deadline:
            waiting = [r for r in others if store.add(keys.waiting(r), 0) > 0
                       and not store.check([keys.gone(r)])
                       and not (relayed and store.check([keys.exit_record(r)]))]
            if not waiting and time.monotonic() >= start + _UNMARKED_COVER:
                return  # (a peer that just began a wait marks it within the cover)
            if waiting and len(checker.find_lost(waiting, time.monotonic(),
                                                 exits=False)) == len(waiting):
                return
            time.sleep(_EXIT_WAIT_CHECK)
    except Exception:  # noqa: BLE001
        pass


def _tell_peers_first(error: RankFailedError) -> None:
    """The store's host learnt another rank's failure and is about to raise it: its script may
    catch it and end at once (``os._exit``, a crash), taking the store with it. First keep the
    store up for every rank in a kit wait (at least :data:`_UNMARKED_COVER`: a wait just begun
    is not marked yet) or in its exit: until it is gone, or found lost, at most
    :func:`host_exit_timeout` seconds; this rank's own wait does not count meanwhile. Such a
    rank reads that failure, names it, and makes its exit's store calls while the store still
    answers; a rank busy elsewhere is not waited for.
    Never raises."""
    if not hosts_store() or threading.current_thread() is not threading.main_thread():
        return
    try:
        store, rank, size = world_store(), dist.get_rank(), dist.get_world_size()
        others = [r for r in range(size) if r not in (rank, error.rank)]
        if not others:
            return
        start = time.monotonic()

        def left() -> List[int]:
            return [r for r in others if not store.check([keys.gone(r)])
                    and (store.add(keys.waiting(r), 0) > 0 or store.check([keys.exit_record(r)]))]

        # meanwhile this rank's own wait does not count: a rank ending on the same failure
        # would wait for it to read its record (await_peers_told) while it waits for that one
        mine = store.add(keys.waiting(rank), 0)
        store.add(keys.waiting(rank), -mine)
        try:
            # up to three calls per rank a look: one look per _EXIT_WAIT_CHECK, not every 5 ms
            _wait_for_readers(lambda: time.monotonic() >= start + _UNMARKED_COVER and not left(),
                              left, PeerChecker(store, rank, _EXIT_WAIT_CHECK), exits=False,
                              every=_EXIT_WAIT_CHECK)
        finally:
            store.add(keys.waiting(rank), mine)
    except Exception:  # noqa: BLE001 - no group or store any more: nobody to wait for
        return


hooks.on_peer_failure(_tell_peers_first)


def await_peers_exit(store: "Store", rank: int, world_size: int, failed: bool = False) -> None:
    """For the store host at exit: keep the store up until every other rank has finished its
    own exit teardown (:func:`mark_exited`, its last store call: it writes its exit record,
    reads others' and destroys its groups through the store) or is gone, at most
    :func:`host_exit_timeout` seconds. A rank that comes later still names the root cause: its
    heartbeat copied this rank's exit record. If this rank's record is a failure (``failed``:
    it is ending on an exception, Ctrl-C included), it waits only until every other rank has
    that copy (its heartbeat acknowledges it, within a heartbeat interval, and the rank makes
    no store call after that) or has marked itself gone: a rank told to stop does not wait for
    a peer busy elsewhere. A rank's exit record is not the end of its store calls, so it
    does not count as gone here (a call after the host ended makes torch print a C++ trace).
    Where the store refuses this rank's requests (a key the kit counts in overwritten by a
    process outside the job), it keeps the store up for :func:`host_exit_timeout` seconds all
    the same: the others then find the store answering and name that key themselves.
    Never raises."""
    others = [r for r in range(world_size) if r != rank]
    start = time.monotonic()
    try:
        def left() -> List[int]:
            return [r for r in others if not store.check([keys.gone(r)])]

        def copied() -> bool:
            return all(store.check([keys.gone(r)]) or store.check([keys.ack(keys.exit_record(rank), r)])
                       for r in others)

        if failed:
            _wait_for_readers(copied, left, PeerChecker(store, rank, _EXIT_WAIT_CHECK), exits=False)
            time.sleep(_DRAIN)  # store calls already in flight finish (none start after a copy)
        else:
            gone = [keys.gone(r) for r in others]
            _wait_for_readers(lambda: not gone or store.check(gone), left,
                    PeerChecker(store, rank, _EXIT_WAIT_CHECK), exits=False)
    except Exception as exc:  # noqa: BLE001
        if is_store_error(exc):
            time.sleep(max(0.0, start + host_exit_timeout() - time.monotonic()))


# --- collectives that failed -----------------------------------------------------------------

#: Seconds a failed collective waits for a peer on this machine to be found gone (its exit
#: record or its pid: usually at once).
_LOCAL_DIAGNOSIS = 3.0


def diagnose_lost_peer(exc: BaseException, what: str, group: Group) -> BaseException:
    """The error to raise for a collective of ``what`` that failed with ``exc``.

    If a peer of ``group`` is gone (an exit record, its process gone from this host, no
    heartbeat, or the store's host gone), a :class:`RankFailedError` naming it and how that was
    found (raise it ``from exc``); otherwise ``exc`` itself. Waits at most a few seconds for a
    peer that is still exiting (longer, up to the heartbeat timeout, for peers on other hosts).
    """
    if not dist.is_initialized() or isinstance(exc, AxolotlDistError):
        return exc  # the kit's own account (a mismatch found while waiting, a lost peer named)
    try:
        me = dist.get_rank()
        return _look_for_lost(PeerChecker(world_store(), me), [r for r in group.ranks if r != me],
                              what, exc)
    except Exception as store_exc:  # noqa: BLE001
        if is_store_error(store_exc):
            return store_lost_error(store_exc, what)
        if isinstance(store_exc, AxolotlDistError):
            # what the look found (a record no rank of the run wrote, named): clearer than
            # the backend's words
            return store_exc
        return exc


def _look_for_lost(checker: PeerChecker, ranks: List[int], what: str,
                   exc: BaseException) -> BaseException:
    """Look at ``ranks`` every 50 ms until one is found lost (the error naming it) or the
    diagnosis's time passes (``exc``): a few seconds where every peer is on this machine, the
    heartbeat timeout and a margin where one is not (this rank then counts itself among the
    waiters, so the stall detector's rounds look at the remote peers meanwhile)."""
    start = time.monotonic()
    limit: Optional[float] = None
    waiting = False
    try:
        while True:
            now = time.monotonic()
            lost = checker.find_lost(ranks, now, what)  # the store host first
            if not lost and limit is None and checker.read_exits_of(ranks):
                lost = checker.find_lost(ranks, now, what)  # the log did not name them
            if lost:
                return lost_error(lost, what)
            if limit is None:  # the first look fetched the peers' records
                waiting = not all(same_machine(peer_record(r)) for r in ranks)
                if waiting:
                    checker.store.add(keys.WAITERS, 1)
                limit = start + (checker.remote_timeout + 2 * HEARTBEAT_INTERVAL +
                                 checker.look_every + 1.0 if waiting else _LOCAL_DIAGNOSIS)
            if now >= limit:
                return exc
            time.sleep(0.05)
    finally:
        if waiting:
            checker.store.add(keys.WAITERS, -1)
