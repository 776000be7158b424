"""What the signalling modules share: timing constants, this host's name, the names and
defaults of every ``AXOLOTL_DIST_*`` variable the kit reads (their table, with how each is
parsed, is :data:`.envvars.KIT_VARS`), and the store counter of long waits and published
warnings (:data:`..store.keys.WAITERS`).

A leaf: it imports nothing from the package, so :mod:`..store.access`, :mod:`..liveness.peers`, :mod:`..liveness.stalls`
and :mod:`..liveness.waits` can all read it without importing each other.
"""

from __future__ import annotations

import socket

__all__ = [
    "HEARTBEAT_INTERVAL",
    "LIVENESS_INTERVAL",
    "LOOK_INTERVAL",
    "LOOK_RANKS",
    "MAX_LOOK_INTERVAL",
    "look_interval",
    "SILENT_AFTER",
    "MAX_WAIT_LOG_INTERVAL",
    "HEARTBEAT_TIMEOUT_ENV_VAR",
    "WAIT_LOG_INTERVAL_ENV_VAR",
    "STARTUP_ENV_VAR",
    "CHECK_LAUNCH_ENV_VAR",
    "DEAD_PEER_EXIT_ENV_VAR",
    "STANDIN_ENV_VAR",
    "RETRY_SAME_FAILURE_ENV_VAR",
    "STARTUP_LATE",
    "STORE_LINGER_ENV_VAR",
    "AGENT_STORE_ENV_VAR",
    "DEBUG_ENV_VAR",
    "DEBUG_TIMEOUT_ENV_VAR",
    "DEFAULT_DEBUG_TIMEOUT",
    "DEFAULT_LOGGING_ENV_VAR",
    "SHARED_FS_ENV_VAR",
    "FOLD_ENV_VAR",
    "LOG_DIR_ENV_VAR",
    "LAUNCHER_FOLDS_ENV_VAR",
    "LAUNCHER_TTY_ENV_VAR",
    "LAUNCHER_PID_ENV_VAR",
    "END_DIR_ENV_VAR",
    "TRACE_ENV_VAR",
    "RUN_DIR_ENV_VAR",
    "SECRET_ENV_VAR",
    "SECRET_FILE_ENV_VAR",
    "SECRET_OFF",
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "DEFAULT_WAIT_LOG_INTERVAL",
    "DEFAULT_STORE_LINGER",
    "HOST",
    "LONG_WAITS",
    "UNMARKED_WAIT",
    "SLICE",
]

#: Seconds between two heartbeats of a rank (one store call each; the stall detector's rounds too).
HEARTBEAT_INTERVAL = 2.5
#: How often a waiting rank checks the ranks it waits for (seconds): their pids where they run
#: on this machine (no store call).
LIVENESS_INTERVAL = 0.5
#: Seconds a kit wait runs before it marks itself long (its count on the waiting key, its
#: description for the deadlock detector) and first looks at its peers: a barrier that ends
#: sooner makes no store call. A rank ending on a failure gives its peers at least this long
#: to mark themselves (``failures.await_peers_told``).
UNMARKED_WAIT = 0.25
#: Seconds of one blocking slice of a collective's wait: how long a signal may wait to be
#: handled. A slice ends the moment the collective completes; one that times out costs
#: microseconds.
SLICE = 0.05
#: How often a waiting rank reads the store about them (seconds): one store call; in worlds
#: of more than ``LOOK_RANKS`` ranks less often (:func:`look_interval`).
LOOK_INTERVAL = 1.0
#: World size per second of look interval beyond :data:`LOOK_INTERVAL`, and its upper bound:
#: every waiter's look is a request at the one store, so a world of 8,192 waiting ranks looks
#: every 4 s (keeping the kit's traffic under 10 % of a store's capacity: docs/performance.md).
LOOK_RANKS = 2048
MAX_LOOK_INTERVAL = 4.0


def look_interval(world_size: int) -> float:
    """Seconds between a waiting rank's looks at the store in a world of ``world_size``."""
    return min(MAX_LOOK_INTERVAL, max(LOOK_INTERVAL, world_size / LOOK_RANKS))

#: A heartbeat silent this long (seconds) is worth a warning.
SILENT_AFTER = 3.0 * HEARTBEAT_INTERVAL
#: The longest interval between two "still waiting" warnings (seconds).
MAX_WAIT_LOG_INTERVAL = 600.0

#: Seconds without a heartbeat after which a rank on another host counts as dead.
HEARTBEAT_TIMEOUT_ENV_VAR = "AXOLOTL_DIST_HEARTBEAT_TIMEOUT"
DEFAULT_HEARTBEAT_TIMEOUT = 15.0
#: Seconds a wait runs before its first warning (then at doubling intervals).
WAIT_LOG_INTERVAL_ENV_VAR = "AXOLOTL_DIST_WAIT_LOG_INTERVAL"
#: Switch: rank 0 logs where the start-up's time went, one table after init; rank 0 names the
#: ranks the kit's handshake still waits for after :data:`STARTUP_LATE` seconds.
STARTUP_ENV_VAR = "AXOLOTL_DIST_STARTUP"
#: Switch: ``0`` turns off the checks of the launch geometry (``srun`` or ``mpirun`` around a
#: per-node launcher, a ``RANK`` every task inherited, a loopback ``MASTER_ADDR`` on several hosts).
CHECK_LAUNCH_ENV_VAR = "AXOLOTL_DIST_CHECK_LAUNCH"
#: ``1``: gloo groups are treated as accelerator groups (the kit's own tests: tests/standin.py).
STANDIN_ENV_VAR = "AXOLOTL_DIST_STANDIN_DEVICE"
#: ``0``: a rank whose peer died is not ended by the kit (:mod:`..liveness.dead_peers`).
DEAD_PEER_EXIT_ENV_VAR = "AXOLOTL_DIST_DEAD_PEER_EXIT"
#: Switch: restart also when an attempt fails at start-up the way the attempt before did.
RETRY_SAME_FAILURE_ENV_VAR = "AXOLOTL_DIST_RETRY_SAME_FAILURE"
#: Seconds after which rank 0 names a late rank in the handshake, with the start-up report on.
STARTUP_LATE = 5.0
DEFAULT_WAIT_LOG_INTERVAL = 30.0
#: Seconds the store's host keeps a failure readable for its peers before it exits.
STORE_LINGER_ENV_VAR = "AXOLOTL_DIST_STORE_LINGER"
DEFAULT_STORE_LINGER = 5.0
#: Debug mode's switch, and seconds it waits for a missing rank after the last one arrived.
DEBUG_ENV_VAR = "AXOLOTL_DIST_DEBUG"
DEBUG_TIMEOUT_ENV_VAR = "AXOLOTL_DIST_DEBUG_TIMEOUT"
DEFAULT_DEBUG_TIMEOUT = 5.0
#: ``0`` turns off ``get_logger``'s stderr output while logging is unconfigured.
DEFAULT_LOGGING_ENV_VAR = "AXOLOTL_DIST_DEFAULT_LOGGING"
#: Whether all nodes share one filesystem (``get_fs_local_rank``, ``shared_map``).
SHARED_FS_ENV_VAR = "AXOLOTL_DIST_SHARED_FS"
#: Set by ``axolotl-dist`` for its ranks: the launcher's pid, and where a rank records its end.
LAUNCHER_PID_ENV_VAR = "AXOLOTL_DIST_LAUNCHER_PID"
END_DIR_ENV_VAR = "AXOLOTL_DIST_END_DIR"
#: ``0`` turns off folding of what several ranks print alike: ``axolotl-dist``'s (like
#: ``--no-fold``) and, under other launchers, the kit's folding of Python warnings.
FOLD_ENV_VAR = "AXOLOTL_DIST_FOLD"
#: A directory: ``axolotl-dist`` writes each rank's whole, unfolded output there (``--log-dir``).
LOG_DIR_ENV_VAR = "AXOLOTL_DIST_LOG_DIR"
#: Set by ``axolotl-dist`` for its ranks while it takes their output (folded, or kept with
#: ``--log-dir``): the address of its socket; the ranks then leave their warnings to it.
LAUNCHER_FOLDS_ENV_VAR = "AXOLOTL_DIST_LAUNCHER_FOLDS"
#: Set by ``axolotl-dist`` with the above where its own stdout or stderr is a terminal: which
#: (``1``, ``2``, ``1,2``) and its size (``1,2:24x80``); each rank's stream then is a
#: pseudo-terminal of that size.
LAUNCHER_TTY_ENV_VAR = "AXOLOTL_DIST_LAUNCHER_TTY"
#: A directory: every rank records its kit calls there for the timeline (off when unset).
TRACE_ENV_VAR = "AXOLOTL_DIST_TRACE"
#: A directory: where the runs of this host are recorded for ``axolotl-dist where`` (default
#: ``$XDG_RUNTIME_DIR/axolotl_dist/runs``, else ``<tmp>/axolotl_dist-<uid>/runs``).
RUN_DIR_ENV_VAR = "AXOLOTL_DIST_RUN_DIR"
#: The run's secret, which seals what the kit writes to the store and encrypts ``where``
#: answers (``axolotl-dist`` makes one for a one-node run), or a file holding it; the value
#: :data:`SECRET_OFF` runs without one.
SECRET_ENV_VAR = "AXOLOTL_DIST_SECRET"
SECRET_FILE_ENV_VAR = "AXOLOTL_DIST_SECRET_FILE"
SECRET_OFF = "off"
#: torch elastic's switch: ``True`` when the launcher's agent hosts the store.
AGENT_STORE_ENV_VAR = "TORCHELASTIC_USE_AGENT_STORE"

#: This host's name, as peers record it.
HOST = socket.gethostname()

LONG_WAITS = (1 << 32) - 1
