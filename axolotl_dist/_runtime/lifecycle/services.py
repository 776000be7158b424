"""The kit's services, started at a process group's first use.

Once a group exists: the exit hook (:func:`..lifecycle.teardown.at_exit`) is registered, the
uncaught-exception hook that shows the user's frames is installed, the store worker thread is
started (the exit hook's store calls need it: no thread may start at shutdown), and on several
ranks this rank's heartbeat starts (:mod:`..liveness.heartbeat`). :func:`start_services` is
idempotent and cheap after its first call; :mod:`..base.groups` runs it at each group's first
use (:func:`..base.hooks.on_first_use`), and ``init_distributed`` runs it too.
"""

from __future__ import annotations

import atexit

import torch.distributed as dist

from ..base import hooks, tracebacks
from .lifecycle_state import LIFECYCLE
from ..liveness import heartbeat
from ..store import access
from . import teardown

__all__ = ["start_services"]


def start_services() -> None:
    """Once a group exists: register the exit hook, and on several ranks record this rank and
    start its heartbeat (idempotent; cheap after the first call)."""
    if not LIFECYCLE.exit_hook:
        LIFECYCLE.exit_hook = True
        atexit.register(teardown.at_exit)
        tracebacks.install()  # uncaught exceptions: the user's frames, not the kit's
        hooks.on_uncaught(teardown.peer_failure)  # ... and a peer's failure, not gloo's words
        access.start_worker()  # the exit hook's store calls need it: no thread at shutdown
    if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake":
        heartbeat.start_heartbeat()  # torch's fake group (layouts in one process): no peers


hooks.on_first_use(start_services)  # the first use of a group starts the services
