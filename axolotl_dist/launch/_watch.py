"""The launcher's watcher thread: signals the launcher's main thread cannot take, and notes.

While ``axolotl-dist`` waits for the other nodes, its main thread sits in torch's rendezvous,
in C++, where Python's signal handlers do not run: Ctrl-C and SIGTERM would wait for the
rendezvous timeout (15 minutes by default). Python's C-level handler still writes each signal
to a wakeup file descriptor (:func:`signal.set_wakeup_fd`); this thread reads it, so:

* a stop signal (``--signals-to-handle``: Ctrl-C, SIGTERM, SIGHUP, SIGQUIT by default) before
  any rank started, or after this node's ranks ended (torch
  elastic's exit barrier): the launcher says so and exits with ``128 + signal`` within a
  second. A signal that finds ranks running is the main thread's: it is back in Python, stops
  them and says so; the watcher then says nothing (it used to, once the stopped ranks were
  gone: a second, false account). :meth:`Watcher.claim` makes the two accounts exclusive;
* the run's entry in this host's run directory (:mod:`~axolotl_dist._runtime.liveness.runs`), for
  ``axolotl-dist where``: recorded once the first local rank has logged the store's address, removed
  at the end;
* ``SIGUSR1``: a report of where every rank is
  (:mod:`~axolotl_dist._runtime.liveness.where_report`), printed to the launcher's stderr; the run
  goes on. Not where the user lists SIGUSR1 in ``--signals-to-handle``: it is then theirs, forwarded
  to the ranks as torchrun does (``axolotl-dist where`` still reports);
* while no rank has started on a multi-node run, a note every ``AXOLOTL_DIST_WAIT_LOG_INTERVAL``
  seconds (default 30) says what the launcher waits for.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import time
from typing import Callable, Optional, Tuple

from .._runtime.base import procs
from .._runtime.liveness import runs, where_report
from .._runtime.store import clients
from ..env.variables import WAIT_LOG_INTERVAL_ENV_VAR, kit_seconds
from ._report import GUARDS_DIR, latest_attempt, read_ends

__all__ = ["Watcher", "STOP_SIGNALS"]

#: The signals that stop the launcher by default (torchrun's ``--signals-to-handle``).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
#: The signal that asks for the report of where every rank is, unless the user's.
REPORT_SIGNAL = signal.SIGUSR1
#: Seconds the main thread gets to take a stop signal itself before the watcher ends the
#: process (it can when it is in Python; in the rendezvous it is not).
_TAKE_OVER_AFTER = 1.0


def _say(prog: str, text: str) -> None:
    print(f"{prog}: {text}", file=sys.stderr, flush=True)


class Watcher:
    """See the module docstring. ``waiting_for`` says what the launcher waits for while no
    rank has started (None on a single node: nothing to wait for); ``note_dir`` is where this
    node's first local rank leaves the store's address (:func:`axolotl_dist._runtime.liveness.runs.note_address`),
    in the sub-directory of the latest attempt (:func:`._report.latest_attempt`);
    ``script`` and ``world`` describe the run in its entry in the run directory;
    ``stop_signals``: the signals that stop the run (``--signals-to-handle``); ``report``: take
    SIGUSR1 for the report of where every rank is (False where the user's list has it)."""

    def __init__(self, prog: str, end_dir: str, waiting_for: Optional[Callable[[], str]],
                 script: str = "?", world: int = 0, stop_signals: Tuple[int, ...] = STOP_SIGNALS,
                 report: bool = True) -> None:
        self.prog, self.end_dir, self.waiting_for = prog, end_dir, waiting_for
        self.stop_signals = tuple(int(s) for s in stop_signals)
        self.report = report and int(REPORT_SIGNAL) not in self.stop_signals
        self.script, self.world = script, world
        self._entry: Optional[str] = None  # the run's entry in the run directory, once logged
        self._claim = threading.Lock()
        self._claimed = False
        self._read, write = os.pipe()
        os.set_blocking(write, False)
        self._write = write
        self._old = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        if self.report:
            signal.signal(REPORT_SIGNAL, lambda signum, frame: None)  # the watcher answers it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="axolotl-dist-launcher-watch",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        signal.set_wakeup_fd(self._old)
        self._thread.join(timeout=2.0)
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass
        runs.forget(self._entry)

    def claim(self) -> bool:
        """Whether the caller is the first to account for a stop signal (the main thread's
        "stopped every rank", or this thread's own): one account, never two."""
        with self._claim:
            first, self._claimed = not self._claimed, True
            return first

    @property
    def note_dir(self) -> str:
        """The latest attempt's end directory (where its ranks record their ends)."""
        return latest_attempt(self.end_dir)

    def _record(self) -> None:
        """Once this node's first local rank logged the store's address, record the run."""
        try:
            with open(os.path.join(self.note_dir, runs.STORE_NOTE)) as fh:
                note = json.load(fh)
            run, addr, port = str(note["run"]), str(note["addr"]), int(note["port"])
        except (OSError, ValueError, KeyError, TypeError):
            return  # not yet
        self._entry = runs.record(run, addr, port, int(note.get("world") or self.world),
                                  self.prog, self.script,
                                  warn=lambda text: _say(self.prog, text)) or ""

    def _why_alone(self, since: float) -> Optional[str]:
        """Why this thread, not the main one, must stop the launcher on a signal sent at
        ``since`` (wall clock) that found no rank running: no rank had started, or this
        node's ranks had all ended before it (the main thread is in torch's rendezvous or its
        exit barrier, in C++). None where ranks ended after the signal: they were starting
        and the main thread, in Python, stopped them and says so."""
        ends = read_ends(self.note_dir)
        if ends:
            return "after this node's ranks ended" if all(
                float(e.get("time", 0.0)) < since for e in ends.values()) else None
        guards = os.path.join(self.note_dir, GUARDS_DIR)
        return None if os.path.isdir(guards) and os.listdir(guards) else "before any rank started"

    def _started(self) -> bool:
        return any(state != "Z" for _, state in procs.children(os.getpid()))

    def _ended(self) -> bool:
        """Whether a rank of this node has run and ended (its end record is here)."""
        return bool(read_ends(self.note_dir))

    def _run(self) -> None:
        start = time.monotonic()
        every = kit_seconds(WAIT_LOG_INTERVAL_ENV_VAR)
        next_note = start + every
        stop_sig, stop_at, stop_wall, running = 0, 0.0, 0.0, False
        while not self._stop.is_set():
            if self._entry is None:
                self._record()
            ready, _, _ = select.select([self._read], [], [], 0.2)
            now = time.monotonic()
            if ready:
                try:
                    data = os.read(self._read, 64)
                except OSError:
                    return
                stop_sig, stop_at, stop_wall, running = self._take_signals(
                    data, now, (stop_sig, stop_at, stop_wall, running))
            if stop_sig and not running and now - stop_at >= _TAKE_OVER_AFTER \
                    and not self._started():
                self._stop_alone(stop_sig, stop_wall)
                running = True  # the main thread's to account for
            if self.waiting_for is not None and now >= next_note and not stop_sig \
                    and not self._started():  # after a stop signal: only its account
                self._say_waiting(self.waiting_for, now - start)
                next_note = now + every

    def _take_signals(self, data: bytes, now: float, stop: Tuple[int, float, float, bool]
                      ) -> Tuple[int, float, float, bool]:
        """The stop state after the signals in ``data`` (SIGUSR1 is answered at once): the
        first stop signal, its monotonic (``now``) and wall time, and whether ranks were
        running then (the main thread stops them)."""
        for signum in data:
            if signum == REPORT_SIGNAL and self.report:
                self._report()
            elif signum in self.stop_signals and not stop[0]:
                stop = (signum, now, time.time(), self._started())
        return stop

    def _stop_alone(self, stop_sig: int, stop_wall: float) -> None:
        """End the launcher with ``128 + stop_sig``, saying why, where this thread must (see
        :meth:`_why_alone`) and the account is its own; return otherwise."""
        when = self._why_alone(stop_wall)
        if when is not None and self.claim():
            _say(self.prog, f"got {signal.Signals(stop_sig).name} {when}; stopping")
            runs.forget(self._entry)
            os._exit(128 + stop_sig)

    def _say_waiting(self, waiting_for: Callable[[], str], waited: float) -> None:
        """Say what the launcher has waited for these ``waited`` seconds, no rank running."""
        if self._ended():  # torch elastic's exit barrier: every node's agent waits
            # for the others to finish (node 0's agent hosts the ranks' store)
            _say(self.prog, "this node's ranks have ended; waiting for the other "
                 f"node(s) to finish ({waited:.0f} s so far; torch elastic's exit "
                 "barrier: node 0 keeps the ranks' store until every node is done; "
                 "Ctrl-C stops this node)")
        else:
            _say(self.prog, f"{waiting_for()} ({waited:.0f} s so far; Ctrl-C "
                 "stops)")

    def _report(self) -> None:
        path = os.path.join(self.note_dir, runs.STORE_NOTE)
        try:
            with open(path) as fh:
                note = json.load(fh)
        except (OSError, ValueError):
            _say(self.prog, "where every rank is (SIGUSR1): no rank has joined its process group "
                 "yet")
            return
        try:
            store = clients.connect(note["addr"], int(note["port"]), timeout=5.0)
            text = where_report.where(store)
        except Exception as exc:  # noqa: BLE001 - a report must never stop the launcher
            text = f"  could not ask the ranks ({type(exc).__name__}: {exc})"
        _say(self.prog, f"where every rank is (SIGUSR1; the run goes on):\n{text}")
