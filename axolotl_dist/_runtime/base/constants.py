"""What the signalling modules share: timing constants, this host's name, and the store
counter of long waits and published warnings (its layout is :mod:`..store.keys`'). The names and
defaults of the ``AXOLOTL_DIST_*`` variables are :mod:`axolotl_dist.env.variables`'.

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
    "STARTUP_LATE",
    "HOST",
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

#: Seconds after which rank 0 names a late rank in the handshake, with the start-up report on.
STARTUP_LATE = 5.0

#: This host's name, as peers record it.
HOST = socket.gethostname()

