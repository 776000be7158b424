"""The start-up report: where a run's start-up time went, rank by rank (``AXOLOTL_DIST_STARTUP``).

``init_distributed`` stamps each phase's end on this process's wall clock (:func:`stamp`);
with the report on, every rank then times one ``barrier`` (the first collective) and the
ranks gather their phases' durations to rank 0, which logs one table: per phase the median
over the ranks and the slowest rank with its host. Durations are differences of one
process's own stamps, so the nodes' clocks need not agree. The phases:

=================  ===========================================================================
launch             the launcher's process start to this process's start (``/proc``; under
                   ``axolotl-dist`` its pid from ``AXOLOTL_DIST_LAUNCHER_PID``, under torchrun,
                   accelerate, ``srun`` and ``mpirun`` the parent process); none under bare
                   env vars (the parent is the user's shell)
imports            this process's start to its ``init_distributed`` call
store connect      to a connection to the launcher's store (under its agent store only; else
                   it is part of the bootstrap, inside ``init_process_group``)
kit handshake      the attempt's number agreed (``_runtime/store/attempts.py``; agent store only)
group bootstrap    ``torch.distributed.init_process_group`` (the backend's connections)
kit services       the kit's start after it: its heartbeat, exit hook, the shared-filesystem
                   probe of several nodes
first collective   one ``barrier`` right after
=================  ===========================================================================
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from typing import Dict, List, Optional, Sequence, Tuple

from ..base.constants import HOST
from ...env.variables import LAUNCHER_PID_ENV_VAR, STARTUP_ENV_VAR, kit_switch, is_decimal
from ..base.groups import default_pg
from ..base.kitlog import kit as log
from ..liveness.peers import launcher_name
from .lifecycle_state import LIFECYCLE

__all__ = ["begin", "stamp", "wanted", "report", "PHASES", "initialized", "starting_up"]

#: (stamp that ends the phase, its name in the table); each begins where the one before ended.
PHASES: Tuple[Tuple[str, str], ...] = (
    ("process", "launch"), ("init", "imports"), ("store", "store connect"),
    ("handshake", "kit handshake"), ("bootstrap", "group bootstrap"),
    ("services", "kit services"), ("collective", "first collective"),
)


def wanted() -> bool:
    """Whether the start-up report is on (``AXOLOTL_DIST_STARTUP``)."""
    return kit_switch(STARTUP_ENV_VAR)


def stamp(name: str) -> None:
    """This process reached the end of phase ``name`` (see :data:`PHASES`) now."""
    LIFECYCLE.startup[name] = time.time()


def begin() -> None:
    """``init_distributed`` was called: stamp it, and, with the report on, this process's and
    its launcher's starts (read from ``/proc`` only then)."""
    stamp("init")
    if not wanted():
        return
    boot = _boot_time()
    if boot is None:
        return
    launcher = _launcher_pid()
    for name, pid in (("process", os.getpid()), ("launcher", launcher)):
        started = _started(pid, boot) if pid is not None else None
        if started is not None:
            LIFECYCLE.startup[name] = started


def _launcher_pid() -> Optional[int]:
    """The pid of the launcher that started this process; None under bare env vars."""
    name = launcher_name()
    if name == "env vars":
        return None
    given = os.environ.get(LAUNCHER_PID_ENV_VAR, "")
    return int(given) if name == "axolotl-dist" and is_decimal(given) else os.getppid()


def _boot_time() -> Optional[int]:
    """When the machine booted, in seconds since the epoch (``/proc/stat``); None where it
    cannot be read."""
    try:
        with open("/proc/stat", "rb") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _started(pid: int, boot: int) -> Optional[float]:
    """When process ``pid`` started, in seconds since the epoch (``/proc``, 10 ms steps), the
    machine having booted at ``boot``; None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def durations() -> List[float]:
    """This process's seconds per phase of :data:`PHASES` (NaN: a phase it did not go through)."""
    marks = LIFECYCLE.startup
    out, last = [], marks.get("launcher")
    for name, _ in PHASES:
        now = marks.get(name)
        out.append(now - last if now is not None and last is not None else float("nan"))
        last = now if now is not None else last
    return out


def report() -> None:
    """Time the first collective, gather every rank's phases on rank 0 and log the table there
    (every rank calls it, right after init, where :func:`wanted`)."""
    import torch.distributed as dist

    dist.barrier()
    stamp("collective")
    mine = (HOST, durations())
    everyone: List[Optional[Tuple[str, List[float]]]] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        log.emit(logging.INFO, "%s", table([e for e in everyone if e is not None]))


def table(ranks: Sequence[Tuple[str, List[float]]]) -> str:
    """The report for ``ranks`` (each ``(host, seconds per phase)``, in rank order)."""
    rows = [f"start-up of {len(ranks)} ranks ({STARTUP_ENV_VAR}=1), seconds:",
            f"  {'phase':<17}{'median':>8}  {'slowest':>8}  rank (host)"]
    totals: Dict[int, float] = {}
    for i, (_, name) in enumerate(PHASES):
        values = [(secs[i], r) for r, (_, secs) in enumerate(ranks) if not math.isnan(secs[i])]
        for secs, r in values:
            totals[r] = totals.get(r, 0.0) + secs
        rows.append(_row(name, values, ranks))
    rows.append(_row("in all", [(s, r) for r, s in totals.items()], ranks))
    return "\n".join(rows)


def _row(name: str, values: List[Tuple[float, int]], ranks: Sequence[Tuple[str, List[float]]]) -> str:
    """One line: the median of ``values`` (seconds, rank) and the slowest; ``-`` for none."""
    if not values:
        return f"  {name:<17}{'-':>8}  {'-':>8}"
    secs, rank = max(values)
    median = statistics.median(v for v, _ in values)
    return f"  {name:<17}{median:>8.2f}  {secs:>8.2f}  rank {rank} ({ranks[rank][0]})"


def _collectives() -> Optional[int]:
    """How many collectives the default process group has issued (torch's sequence number);
    None where there is no group, or its backend does not count."""
    pg = default_pg()
    if pg is None:
        return None
    try:
        return int(pg._get_sequence_number_for_group())
    except Exception:  # noqa: BLE001 - a backend without the count, a group torn down
        return None


def initialized() -> None:
    """``init_distributed`` returns: a failure before the group's next collective is still a
    start-up failure (:func:`starting_up`)."""
    LIFECYCLE.collectives_at_init = _collectives()


def starting_up() -> bool:
    """Whether this process is still starting up: no process group, or none of its
    collectives since ``init_distributed`` (the start-up report's own included in init);
    the restart policy of ``axolotl-dist`` stops a start-up failure that repeats."""
    count = _collectives()
    if count is None:
        return LIFECYCLE.collectives_at_init is None
    return count <= (LIFECYCLE.collectives_at_init or 0)
