"""Who holds a checkpoint root: one lease file per rank of each run that saves or resumes there,
so that the partial saves of runs that ended are removed and two live runs on one root are told
apart (docs/checkpoints.md, "What it guarantees"; used by :mod:`axolotl_dist.checkpoints`).

A rank's lease is ``<root>/.axolotl_dist_leases/<run>/<rank>.json``: the run's job, the rank's
host name, its machine (:data:`~..base.procs.MACHINE`: kernel boot and PID namespace), its
pid and the start time of that process (a pid the kernel gave again to another process is not
taken for it). It is written at the rank's first ``checkpoint_dir`` or ``latest_checkpoint`` on
the root and rewritten at each (its time is the run's last sign of life there).

A lease's state is known where its process can be seen: a rank on the lease's machine sees at
once whether its process still runs (:data:`ALIVE` or :data:`DEAD`); a rank elsewhere cannot
tell (:data:`UNKNOWN`). Every rank of the run that looks gives every lease a state, and the states
are pooled (:func:`pool`): a run is *over* when each of its leases was seen dead by some rank,
or when none was rewritten for :data:`STALE_AFTER` seconds, and no rank saw one of its
processes running; it is *live* when some rank did. Anything else is left alone: a live run's
files are never touched on a guess.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..base import procs

__all__ = ["LEASES_DIR", "STALE_AFTER", "ALIVE", "DEAD", "UNKNOWN", "process_start", "hold",
           "release", "read_run", "lease_state", "survey", "pool", "Holder", "View",
           "staging_dir", "staging_run", "stagings_by_run", "remove_run"]

#: The directory of a root's leases (not a ``step-`` name: never read as a checkpoint).
LEASES_DIR = ".axolotl_dist_leases"
#: Seconds after which a run none of whose leases was rewritten counts as over, wherever its
#: ranks ran (a save longer than this, with no other save or resume on the root, is the limit).
STALE_AFTER = 24 * 3600.0
ALIVE, DEAD, UNKNOWN = "alive", "dead", "unknown"

#: ``.step-<step>.staging-<job>.<run>-<seq>``: the staging directories of ``.checkpointing``,
#: named by :func:`staging_dir`.
_STAGING = re.compile(r"\.step-(\d+)\.staging-([A-Za-z0-9_-]*)\.([A-Za-z0-9]+)-(\d+)")

#: A run's holders as one rank found them: ``(job, [(rank, host, pid), ...], fresh)``.
Holder = Tuple[str, List[Tuple[int, str, int]], bool]
#: A run as one rank saw it: (lease rank -> :data:`ALIVE`, :data:`DEAD` or :data:`UNKNOWN`;
#: its :data:`Holder`).
View = Tuple[Dict[int, str], Holder]


def process_start(pid: int) -> Optional[int]:
    """When process ``pid`` started (clock ticks after boot, ``/proc/<pid>/stat``), or None
    where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return int(fh.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _run_dir(root: str, run: str) -> str:
    return os.path.join(root, LEASES_DIR, run)


def hold(root: str, job: str, run: str, rank: int) -> None:
    """Write (or rewrite) this process's lease on ``root`` as rank ``rank`` of ``run``."""
    directory = _run_dir(root, run)
    os.makedirs(directory, exist_ok=True)
    pid = os.getpid()
    lease = {"job": job, "run": run, "rank": rank, "host": socket.gethostname(),
             "machine": procs.MACHINE, "pid": pid, "start": process_start(pid),
             "time": time.time()}
    path = os.path.join(directory, f"{rank}.json")
    tmp = f"{path}.{pid}.tmp"
    with open(tmp, "w") as fh:
        json.dump(lease, fh)
    os.replace(tmp, path)


def release(root: str, run: str, rank: int) -> None:
    """Remove this rank's lease on ``root`` (a run that will not use it), and the run's
    directory of leases once empty."""
    directory = _run_dir(root, run)
    try:
        os.unlink(os.path.join(directory, f"{rank}.json"))
        os.rmdir(directory)
    except OSError:  # gone already, or another rank's lease is still there
        pass


def read_run(root: str, run: str) -> List[Dict[str, Any]]:
    """The leases of ``run`` on ``root`` that can be read, by rank (a torn or foreign file is
    skipped), their ``rank`` an int and ``time`` a float."""
    directory = _run_dir(root, run)
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    leases = []
    for name in names:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(directory, name)) as fh:
                lease = json.load(fh)
        except (OSError, ValueError):
            continue
        if isinstance(lease, dict) and isinstance(lease.get("pid"), int) and \
                all(isinstance(lease.get(key, 0), (int, float)) for key in ("rank", "time")):
            lease["rank"], lease["time"] = int(lease.get("rank", 0)), float(lease.get("time", 0))
            leases.append(lease)
    return sorted(leases, key=lambda lease: lease["rank"])


def lease_state(lease: Dict[str, Any]) -> str:
    """:data:`ALIVE`, :data:`DEAD` or :data:`UNKNOWN` for one lease, seen from here."""
    if lease.get("machine") != procs.MACHINE:
        return UNKNOWN
    pid = lease["pid"]
    if not procs.alive(pid):
        return DEAD
    start = lease.get("start")
    return ALIVE if start is None or process_start(pid) == start else DEAD


def survey(root: str, own_run: str, now: Optional[float] = None) -> Dict[str, View]:
    """This rank's view of the other runs holding ``root``: run -> (lease rank -> state; the
    run's :data:`Holder`). A staging directory of a run without leases (an older kit's) counts
    as that run's, with no lease: fresh while the directory changed in :data:`STALE_AFTER`."""
    now = time.time() if now is None else now
    try:
        runs = set(os.listdir(os.path.join(root, LEASES_DIR)))
    except OSError:
        runs = set()
    stagings = stagings_by_run(root)
    seen = {}
    for run in sorted(runs | set(stagings)):
        leases = read_run(root, run)
        if run == own_run or (run in runs and not leases):
            continue
        if leases:
            fresh = any(now - lease["time"] < STALE_AFTER for lease in leases)
        else:
            fresh = any(now - _mtime(path) < STALE_AFTER for path in stagings[run])
        holders = [(lease["rank"], str(lease.get("host", "?")), lease["pid"]) for lease in leases]
        states = {lease["rank"]: lease_state(lease) for lease in leases}
        job = str(leases[0].get("job", "")) if leases else ""
        seen[run] = (states, (job, holders, fresh))
    return seen


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def pool(views: Sequence[Dict[str, View]]) -> Tuple[Dict[str, List[int]], Dict[str, Holder]]:
    """Every rank's :func:`survey` of one root pooled (``views[r]``: group rank ``r``'s):
    ``(over, live)``. ``over``: run -> the ranks that remove what it left, one per filesystem
    holding its leases (ranks that saw the same leases share one; on a shared root, the first
    rank). ``live``: run -> its holder, where some rank saw one of its processes running."""
    over: Dict[str, List[int]] = {}
    live: Dict[str, Holder] = {}
    for run in sorted(set().union(*views)) if views else []:
        seers = [(r, view[run]) for r, view in enumerate(views) if run in view]
        states: Dict[int, set] = {}
        for _, (mine, _) in seers:
            for lease, state in mine.items():
                states.setdefault(lease, set()).add(state)
        if any(ALIVE in said for said in states.values()):
            live[run] = seers[0][1][1]
            continue
        fresh = any(holder[2] for _, (_, holder) in seers)
        if fresh and not (states and all(DEAD in said for said in states.values())):
            continue  # some lease no rank could see, or none: left alone until it is stale
        removers: Dict[Tuple[int, ...], int] = {}
        for r, (mine, _) in seers:
            removers.setdefault(tuple(sorted(mine)), r)
        over[run] = sorted(removers.values())
    return over, live


def staging_dir(root: str, step: int, job: str, run: str, seq: int) -> str:
    """Where call ``seq`` of run ``run`` (an attempt of job ``job``) writes checkpoint ``step``
    before its commit (:mod:`.checkpointing`); :func:`staging_run` reads the name back."""
    return os.path.join(root, f".step-{step}.staging-{job}.{run}-{seq}")


def staging_run(name: str) -> Optional[str]:
    """The run that a staging directory's ``name`` (:func:`staging_dir`'s) belongs to, or None
    for another name."""
    match = _STAGING.fullmatch(name)
    return match.group(3) if match else None


def stagings_by_run(root: str) -> Dict[str, List[str]]:
    """The staging directories under ``root`` by run: run -> their paths."""
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return {}
    found: Dict[str, List[str]] = {}
    for name in names:
        run = staging_run(name)
        if run is not None:
            found.setdefault(run, []).append(os.path.join(root, name))
    return found


def remove_run(root: str, run: str) -> List[str]:
    """Remove what ``run`` (over) left under ``root``: its staging directories, then its
    leases. Returns the staging directories that are gone."""
    found = stagings_by_run(root).get(run, [])
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(_run_dir(root, run), ignore_errors=True)
    return [path for path in found if not os.path.lexists(path)]  # a read-only root keeps them
