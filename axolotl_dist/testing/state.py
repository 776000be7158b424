"""What a test may ask the kit about this process, and the one door to reset it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional

from .._runtime import state as _state
from .._runtime.procs import kill_tree, proc_state
from .._runtime.store import group_store
from ..debug import refresh_from_env as _refresh_debug

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup, Store

__all__ = ["reset_process_state", "store_of", "known_peers", "process_state", "kill_tree"]


def reset_process_state(*parts: str) -> None:
    """Make this process forget what the kit has learnt, as a fresh process would know nothing:
    everything, or only the named parts (``"groups"``, ``"failures"``, ``"peers"``,
    ``"heartbeat"``, ``"helpers"``, ``"debug"``, ``"blocks"``). Debug mode is then read again
    from ``AXOLOTL_DIST_DEBUG``. The harness calls it in every rank it forks. It stops no
    thread and destroys no group: call :func:`axolotl_dist.cleanup_distributed` for that."""
    _state.reset(*parts)
    if not parts or "debug" in parts:
        _refresh_debug()


def store_of(group: Optional["ProcessGroup"] = None) -> "Store":
    """The c10d store the kit signals through for ``group`` (default: the world), e.g. to
    check that a loop of helpers leaves no keys behind (``store_of().num_keys()``)."""
    return group_store(group)


def known_peers() -> Dict[int, Any]:
    """The peer records this process has seen so far, by global rank: ``(host, pid,
    launcher)`` of each rank, copied from the store by the heartbeat soon after init (a
    snapshot; no store call)."""
    return dict(_state.STATE.peers)


#: ``process_state(pid)``: ``"running"``, ``"stopped"`` or ``"gone"`` (a zombie counts as
#: gone) for a process on this host, None where ``/proc`` cannot tell.
process_state = proc_state
