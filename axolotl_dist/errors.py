"""Public exceptions of :mod:`axolotl_dist`, all in one place.

Every error the kit raises on purpose derives from :class:`AxolotlDistError`, and also from
the builtin class a caller would expect (``ValueError`` for bad arguments, ``RuntimeError``
for environment and runtime problems), so ``except ValueError`` keeps working. They are plain
values: building one changes nothing (the kit records a failure of another rank where it
relays it, in ``axolotl_dist._runtime``).
"""

from __future__ import annotations

import os
import socket
import sys
from typing import Dict, List, Optional, Sequence, Tuple, Type

__all__ = [
    "AxolotlDistError",
    "DistributedConfigError",
    "DistributedEnvError",
    "MeshUsageError",
    "RankFailedError",
    "RankTimeoutError",
    "CollectiveMismatchError",
    "ThreadConflictError",
    "TensorMismatchError",
    "DistributedOperationException",
    "MACHINE",
]


#: A deadlock the kit found: its account, and ``(ranks, call)`` for each wait in it.
Deadlock = Tuple[str, List[Tuple[List[int], str]]]


class AxolotlDistError(Exception):
    """Base class of every exception raised on purpose by ``axolotl_dist``."""


class DistributedConfigError(AxolotlDistError, ValueError):
    """A configuration (parallel degrees, sharding spec, helper arguments) is invalid."""


class DistributedEnvError(AxolotlDistError, RuntimeError):
    """The launcher environment or the process group is missing, malformed or inconsistent."""


class MeshUsageError(DistributedConfigError, RuntimeError):
    """A device mesh was used in a way it does not support (a missing dim, built twice).

    A :class:`DistributedConfigError` that is also a ``RuntimeError``, which is what OLMo-core
    raised for these cases. Also importable from :mod:`axolotl_dist.parallel`.
    """


class RankFailedError(AxolotlDistError, RuntimeError):
    """Another rank failed while this rank was waiting for it.

    ``str(exc)`` is the account: ``rank 0 failed in barrier: ValueError: bad shard 17``. The
    failing rank's traceback follows it only where that rank ran on another machine, or it is
    not known where: a rank on this machine printed its own traceback to this machine's
    output (docs/faults.md, "One account of a failure"). It is always in
    :attr:`remote_traceback`.

    :ivar rank: the (group) rank that failed.
    :ivar exc_type: the name of the exception type raised there (``"died"`` if it vanished).
    :ivar exc_message: that exception's message.
    :ivar remote_traceback: the formatted traceback from the failing rank, if known.
    :ivar where: the helper or block this rank was in when it received of the failure.
    :ivar ranks: every rank known to have failed, the root cause first (``(rank,)`` usually).
    :ivar machine: the failing rank's machine (kernel boot and PID namespace), where known.
    :ivar backend_error: where a collective failed because of the lost rank, the first line of
        the backend's own error (``Connection reset by peer``); None otherwise.
    :ivar site: the failing rank's own innermost line (``train.py:88``), where known.
    :ivar deadlock: where the failing rank ended on a deadlock the kit found, that finding
        (a :class:`CollectiveMismatchError`'s ``deadlock``); None otherwise.
    """

    backend_error: Optional[str] = None

    def __init__(
        self,
        rank: int,
        exc_type: str,
        exc_message: str,
        remote_traceback: Optional[str] = None,
        *,
        where: str = "",
        ranks: Sequence[int] = (),
        machine: Optional[str] = None,
        site: Optional[str] = None,
        deadlock: Optional[Deadlock] = None,
    ) -> None:
        self.rank = rank
        self.exc_type = exc_type
        self.exc_message = exc_message
        self.remote_traceback = remote_traceback
        self.where = where
        self.ranks = tuple(dict.fromkeys((rank, *ranks)))
        self.machine = machine
        self.site = site
        self.deadlock = deadlock
        place = f" in {where}" if where else ""
        # an empty message shows no ": " (KeyboardInterrupt); notes appended to one start
        # with " (" or "; " and follow the type directly
        sep = "" if not exc_message or exc_message[0] in " ;" else ": "
        super().__init__(f"rank {rank} failed{place}: {exc_type}{sep}{exc_message}")

    def __str__(self) -> str:
        text = str(self.args[0]) if self.args else ""
        if not self.remote_traceback or _this_machine(self.machine):
            return text
        return "%s\n--- traceback from rank %d ---\n%s" % (text, self.rank,
                                                          self.remote_traceback.rstrip())

    def _fields(self) -> tuple:
        return (self.rank, self.exc_type, self.exc_message, self.remote_traceback, self.where,
                self.ranks, self.machine, self.site, self.deadlock)

    def __reduce__(self):  # keep the structured fields across pickling
        return (_rebuild_rank_failed, self._fields())



def _machine_id() -> str:
    """Which pids this process can see: the kernel's boot id and this process's PID namespace
    (``<boot id>/<namespace inode>``). Two processes with the same id see each other in
    ``/proc`` under the pids they recorded; a hostname proves nothing (containers and nodes
    often share one). Without procfs (not Linux: no PID namespaces), the hostname."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:  # pragma: no cover - no procfs
        return "host:" + socket.gethostname()


#: This process's machine (kernel boot and PID namespace; a pid namespace does not change
#: under a running process): what a :class:`RankFailedError`'s ``machine`` is compared with.
MACHINE = _machine_id()


def _this_machine(machine: Optional[str]) -> bool:
    """Whether ``machine`` is this process's (kernel boot and PID namespace)."""
    return machine is not None and machine == MACHINE


def _rebuild_rank_failed(rank, exc_type, exc_message, remote_traceback, where, ranks=(),
                         machine=None, site=None, deadlock=None):
    return RankFailedError(rank, exc_type, exc_message, remote_traceback, where=where, ranks=ranks,
                           machine=machine, site=site, deadlock=deadlock)


class RankTimeoutError(AxolotlDistError, TimeoutError):
    """This rank waited longer than its ``timeout`` for other ranks.

    :ivar waiting_for: the ranks that had not finished yet.
    """

    def __init__(self, message: str, waiting_for: Sequence[int] = ()) -> None:
        self.waiting_for = tuple(waiting_for)
        super().__init__(message)

    def __reduce__(self):
        return (RankTimeoutError, (self.args[0], self.waiting_for))


class CollectiveMismatchError(AxolotlDistError, RuntimeError):
    """Debug mode found ranks calling different helpers, the same helper incompatibly, or a
    rank that never arrived (see :mod:`axolotl_dist.debug`).

    :ivar calls: group rank -> ``"helper(args) at file:line ..."`` for every rank that arrived.
    :ivar missing: the group ranks that had not arrived (exited, or stuck elsewhere).
    :ivar deadlock: where this is a deadlock the kit found while the ranks waited (not debug
        mode's check): ``(account, parties)``, the account the message ends with and one
        ``(ranks, call)`` per wait of the deadlock (global ranks, the call as they describe
        it); None otherwise.
    """

    def __init__(self, message: str, calls: Optional[Dict[int, str]] = None,
                 missing: Sequence[int] = (), deadlock: Optional[Deadlock] = None) -> None:
        self.calls = dict(calls or {})
        self.missing = tuple(missing)
        self.deadlock = deadlock
        super().__init__(message)

    def __reduce__(self):
        return (CollectiveMismatchError, (self.args[0], self.calls, self.missing, self.deadlock))


class ThreadConflictError(CollectiveMismatchError):
    """Two threads of this rank called the kit's collectives on one process group at once.

    Collectives pair up across ranks by their order alone, so the threads' calls could cross
    (one thread getting the other's values) or wait for each other forever. Raised in the thread
    that called second, and in the first when its call returns (its result may be the other
    call's). One thread per group at a time; threads on different groups are fine.
    """

    def __reduce__(self):
        return (ThreadConflictError, (self.args[0], self.calls, self.missing, self.deadlock))


class TensorMismatchError(DistributedConfigError):
    """The ranks passed tensors one collective cannot pair: different structures, dtypes or
    shapes (``all_reduce`` of 3 elements on one rank and 4 on another, ``broadcast`` of a
    ``[2, 5]`` against a ``[1, 2, 5]``). Raised on every rank of the call, before the
    collective runs; the message names each rank's dtype and shape.

    A ``ValueError``. Where the script has imported accelerate, the instance raised is also an
    ``accelerate.utils.operations.DistributedOperationException`` (see :func:`tensor_mismatch`),
    so a ported ``except DistributedOperationException`` still catches it.
    """

    def __reduce__(self):
        return (tensor_mismatch, (self.args[0],))


#: accelerate's name for a shape mismatch between ranks (docs/porting.md).
DistributedOperationException = TensorMismatchError

#: accelerate's module that defines its ``DistributedOperationException``.
_ACCELERATE_OPERATIONS = "accelerate.utils.operations"
_WITH_ACCELERATES: Dict[type, Type[TensorMismatchError]] = {}


def tensor_mismatch(message: str) -> TensorMismatchError:
    """A :class:`TensorMismatchError`; where the script imported accelerate (its operations
    module is loaded: the kit never imports accelerate itself), one that is also accelerate's
    ``DistributedOperationException``."""
    theirs = getattr(sys.modules.get(_ACCELERATE_OPERATIONS), "DistributedOperationException",
                     None)
    if not isinstance(theirs, type) or not issubclass(theirs, BaseException):
        return TensorMismatchError(message)
    cls = _WITH_ACCELERATES.get(theirs)
    if cls is None:
        cls = type("TensorMismatchError", (TensorMismatchError, theirs),
                   {"__module__": __name__, "__doc__": TensorMismatchError.__doc__})
        _WITH_ACCELERATES[theirs] = cls
    return cls(message)
