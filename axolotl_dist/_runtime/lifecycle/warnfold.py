"""Python warnings raised alike on several ranks, printed once, by rank 0, naming the ranks:
``05:40:01 WARNING py.warnings: [ranks 0-3] train.py:3: UserWarning: ...`` and the source
line, under launchers that do not fold their ranks' output themselves (torchrun,
``accelerate launch``, ``srun``, bare env vars).

:func:`install` (at ``import axolotl_dist``) replaces ``warnings.showwarning`` with :func:`show`
where the launcher's variables say several ranks, ``AXOLOTL_DIST_FOLD`` is not off and
``AXOLOTL_DIST_LAUNCHER_FOLDS`` is unset (``axolotl-dist`` folds its ranks' output itself).
A warning written to a file other than stderr goes to the function it replaced, and so does
every warning this module does not fold. What is folded is ``warnings.formatwarning``'s text
(file and line, category, message, source line): two warnings are alike when it is.

* Until this rank's heartbeat (:mod:`..liveness.peers`) runs, warnings are held; its start publishes
  them (:func:`started`). A process that ends, or holds one for :data:`HOLD_FOR` seconds,
  without a heartbeat prints them itself, as Python would.
* With a heartbeat, a rank above 0 publishes each warning on the heartbeat's store
  connection and prints nothing: two calls, ``append`` to :data:`..store.keys.WARN_LOG` and ``add``
  :data:`~..store.keys.WARNED` to :data:`~..store.keys.WAITERS`, whose answer says whether rank 0 still
  reads them (:data:`~..store.keys.UNREAD`: it ended; the rank then prints the warning itself).
* Rank 0 puts its own warnings in the pending table; its heartbeat, which reads
  ``keys.WAITERS`` every beat anyway, reads the log when the count of published warnings
  rose (:func:`read`; again every :data:`LOOK` s while one is pending), and prints one
  (:func:`tick`) once every rank raised it, or :data:`WINDOW` s after rank 0 received of it,
  naming the ranks so far; at rank 0's exit, after a last read, what is pending (:func:`close`).

The store's side is in docs/design/launching.md, "Warnings folded across ranks".
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ...env import variables
from ...env.variables import FOLD_ENV_VAR, LAUNCHER_FOLDS_ENV_VAR
from ..base.kitlog import KitLog
from ..base.state import RoomState, register
from ..liveness import heartbeat
from ..base.text import ranks_text
from ..store import keys, records, seals
from ..store.access import bounded, genuine
from ..base import hooks
from ... import env
from ...errors import DistributedEnvError

__all__ = ["HOLD_FOR", "WINDOW", "LOOK", "FoldedWarnings", "FOLD", "WarnFoldState",
           "install", "installed", "show", "started", "read", "pending", "tick", "close"]

#: Seconds a warning is held, without a heartbeat, before this process prints it itself.
HOLD_FOR = 10.0
#: Seconds rank 0 waits, after it received of a warning, for the ranks that have not raised it.
WINDOW = 1.0
#: Seconds between rank 0's looks for published warnings while one is pending.
LOOK = 0.25
#: Seconds rank 0's exit waits for its last read (what comes later, the last exit hook prints).
CLOSE_BOUND = 1.0

#: What a warning looks like to ``warnings.showwarning``: message, category, file, line, source.
Shown = Tuple[Any, Any, str, int, Optional[str]]

_LOG = KitLog("py.warnings")  # where rank 0 prints, as logging.captureWarnings would log
_MADE = threading.Lock()
_INSIDE = threading.local()  # a warning raised while this thread folds one is not folded


class FoldedWarnings:
    """The warnings this process holds (before its heartbeat) and, on rank 0, those pending:
    text -> (ranks that raised it, when rank 0 received of it)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: List[Tuple[Shown, str]] = []
        self.timer: Optional[threading.Timer] = None
        self.pending: Dict[str, Tuple[Set[int], float]] = {}
        self.world = 0  # the size of the world the heartbeat serves
        self.counted = self.log_read = 0  # rank 0: warnings read, and the log's bytes read
        self.ended = False  # exiting, or a forked child: print every warning as Python does


class WarnFoldState(RoomState):
    """``folding``: the Python warnings this process holds for folding before its heartbeat
    starts and, on rank 0, the ones it waits to print (:class:`FoldedWarnings`, made at the
    first use); kept by a reset, as a fact of the process that a fork keeps: ``warn_hook``
    (the ``warnings.showwarning`` the folding hook replaced; None: no hook)."""

    SURVIVES = ("warn_hook",)

    def __init__(self) -> None:
        self.folding: Optional[FoldedWarnings] = None
        self.warn_hook: Optional[Callable[..., Any]] = None


FOLD = register("warnfold", WarnFoldState())


def _warning_fold() -> FoldedWarnings:
    found = FOLD.folding
    if found is None:
        with _MADE:
            found = FOLD.folding
            if found is None:
                found = FOLD.folding = FoldedWarnings()
    return found


def install() -> None:
    """Replace ``warnings.showwarning`` with :func:`show` if this process is one rank of
    several and nothing else folds its output (once per process). A bad value of a variable
    installs nothing: ``init_distributed()`` raises it (``validate_env_vars``)."""
    if FOLD.warn_hook is not None:
        return
    try:
        if env.env_world_size() <= 1 or not variables.kit_switch(FOLD_ENV_VAR):
            return
    except DistributedEnvError:
        return
    launcher = variables.raw(LAUNCHER_FOLDS_ENV_VAR)
    if launcher is not None and variables.text(launcher).strip():
        return
    FOLD.warn_hook = warnings.showwarning
    warnings.showwarning = show
    atexit.register(_at_exit)  # before the kit's exit hook, so it runs after it
    os.register_at_fork(after_in_child=_forked)


def _forked() -> None:
    """A child forked from a rank (a data loader worker) folds nothing: it may end without
    its exit hooks (``os._exit``), and its warnings are its own."""
    FOLD.folding = FoldedWarnings()  # not the parent's: its lock may have been held at the fork
    FOLD.folding.ended = True


def installed() -> bool:
    """Whether this process folds its warnings."""
    return FOLD.warn_hook is not None


def _local(shown: Shown, file: Any = None) -> None:
    """Print a warning as the replaced ``showwarning`` would."""
    previous: Callable[..., Any] = FOLD.warn_hook or warnings.showwarning
    previous(*shown[:4], file, shown[4])


def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
         line: Optional[str] = None) -> None:
    """``warnings.showwarning`` while folding is installed."""
    shown: Shown = (message, category, filename, lineno, line)
    if (file is not None and file is not sys.stderr) or getattr(_INSIDE, "showing", False):
        _local(shown, file)
        return
    _INSIDE.showing = True
    try:
        _fold(shown)
    finally:
        _INSIDE.showing = False


def _fold(shown: Shown) -> None:
    text = warnings.formatwarning(*shown)
    folding = _warning_fold()
    with folding.lock:
        beat = heartbeat.BEAT.thread
        if beat is None and not folding.ended:  # no heartbeat yet: held for it
            folding.held.append((shown, text))
            if folding.timer is None:
                folding.timer = threading.Timer(HOLD_FOR, _expire, (folding,))
                folding.timer.daemon = True
                folding.timer.start()
            return
    if beat is None or not beat.thread.is_alive():  # ended, or its store is gone
        _local(shown)
    elif beat.rank == 0:
        _add(folding, text, 0)
        beat.wake.set()  # its thread looks for the other ranks' copies from now on
    elif not _publish(beat, [text]):
        _local(shown)


def _publish(beat: Any, texts: List[str]) -> bool:
    """Publish ``texts`` for rank 0; False where they were not, or rank 0 reads them no more
    (it ended) or the store is going: the caller prints them."""
    try:
        if not beat.store_usable():
            return False
        store = beat.base  # any thread: the group's connection (the heartbeat's may be lent)
        store.append(keys.WARN_LOG, "".join(records.warning_entry(beat.rank, seals.seal(
            _entry_key(beat.rank), text).decode()) for text in texts))
        return not store.add(keys.WAITERS, len(texts) * keys.WARNED) & keys.UNREAD
    except Exception:  # noqa: BLE001 - the store is going: printed here instead
        return False


def _expire(folding: FoldedWarnings) -> None:
    """:data:`HOLD_FOR` seconds passed without a heartbeat: print what is held."""
    with folding.lock:
        held, folding.held, folding.timer = folding.held, [], None
    for shown, _ in held:
        _local(shown)


def started(beat: Any) -> None:
    """A heartbeat started (``beat``: its :class:`~..liveness.heartbeat.Heartbeat`): publish what this
    process held (rank 0: pending)."""
    folding = _warning_fold()
    with folding.lock:
        folding.world = beat.world_size
        folding.counted = folding.log_read = 0  # this heartbeat reads the log from its start
        held, folding.held = folding.held, []
        if folding.timer is not None:
            folding.timer.cancel()
            folding.timer = None
    if not held:
        return
    if beat.rank == 0:
        for _, text in held:
            _add(folding, text, 0)
        beat.wake.set()
    elif not _publish(beat, [text for _, text in held]):
        for shown, _ in held:
            _local(shown)


def _add(folding: FoldedWarnings, text: str, rank: int) -> None:
    with folding.lock:
        group = folding.pending.get(text)
        if group is None:
            folding.pending[text] = ({rank}, time.monotonic())
        else:
            group[0].add(rank)


def read(beat: Any, value: int) -> None:
    """Rank 0's heartbeat ``beat``, having read ``value`` of ``keys.WAITERS``: add the warnings
    published since its last read to the pending table, if any (one ``get``)."""
    count = (value & (keys.UNREAD - 1)) >> 32
    folding = _warning_fold()
    if count <= folding.counted:
        return
    folding.counted = count
    log = beat.store.get(keys.WARN_LOG)
    data, folding.log_read = log[folding.log_read:], len(log)
    for rank, text in records.read_warning_entries(data):
        try:
            opened = genuine(_entry_key(rank), text.encode())
        except records.BadRecord:
            continue  # sealed, and this rank has no secret: not this run's either
        if opened is not None:  # else not this run's: said once, not shown
            _add(folding, opened.decode(errors="replace"), rank)


def _entry_key(rank: int) -> str:
    """What a warning entry of global ``rank`` is sealed for (entries share the log's key)."""
    return f"{keys.WARN_LOG}/{rank}"


def pending() -> bool:
    """Whether rank 0 has warnings to print (no lock: a hint for its heartbeat's cadence)."""
    folding = FOLD.folding
    return folding is not None and bool(folding.pending)


def _take(due: Callable[[Set[int], float], bool]) -> List[Tuple[str, Set[int]]]:
    folding = FOLD.folding
    if folding is None:
        return []
    with folding.lock:
        taken = [(text, ranks) for text, (ranks, first) in folding.pending.items()
                 if due(ranks, first)]
        for text, _ in taken:
            del folding.pending[text]
    return taken


def _print(groups: List[Tuple[str, Set[int]]]) -> None:
    for text, ranks in groups:
        _LOG.log(logging.WARNING, "%s", f"[{ranks_text(sorted(ranks))}] {text.rstrip()}")


def tick() -> None:
    """Rank 0's heartbeat: print the pending warnings every rank raised, or that waited
    :data:`WINDOW` seconds."""
    folding = FOLD.folding
    if folding is None or not folding.pending:
        return
    now, world = time.monotonic(), folding.world
    _print(_take(lambda ranks, first: len(ranks) >= world or now - first >= WINDOW))


def close(beat: Any) -> None:
    """A heartbeat ``beat`` stopped (its thread ended). Rank 0: say that it reads no more
    warnings (:data:`~..store.keys.UNREAD`), read those published before, and print every pending one,
    naming the ranks so far."""
    if beat.rank != 0:
        return
    if installed() and beat.store_usable():
        bounded(lambda: read(beat, beat.store.add(keys.WAITERS, keys.UNREAD)), CLOSE_BOUND)
    _flush()


def _flush() -> None:
    _print(_take(lambda ranks, first: True))


def _at_exit() -> None:
    """After the kit's exit hook: print what is still held or pending; hold nothing more."""
    folding = _warning_fold()
    with folding.lock:
        folding.ended = True
        held, folding.held = folding.held, []
        if folding.timer is not None:
            folding.timer.cancel()
            folding.timer = None
    for shown, _ in held:
        _local(shown)
    _flush()


class _OnHeartbeat:
    """This module's part on rank 0's heartbeat thread (a :class:`..base.hooks.HeartbeatTask`)."""

    look = LOOK
    started = staticmethod(started)
    read = staticmethod(read)
    pending = staticmethod(pending)
    tick = staticmethod(tick)
    close = staticmethod(close)


hooks.add_heartbeat_task(_OnHeartbeat())
