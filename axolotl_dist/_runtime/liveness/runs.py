"""The runs of this host, one small file each: where each run's c10d store is, so that
``axolotl-dist where`` finds a run without being told its address.

The directory is per user: ``AXOLOTL_DIST_RUN_DIR`` if set, else
``$XDG_RUNTIME_DIR/axolotl_dist/runs`` where that directory is set and writable, else
``<tempfile.gettempdir()>/axolotl_dist-<uid>/runs``. A directory the kit makes is mode 0700,
and one under the shared temporary directory is used only if it is this user's and not a
link. Each file, ``<run id>.json``, holds the store's address and port, the run id, the world
size, the pid of the process that recorded it (the ``axolotl-dist`` launcher, or under other
launchers the rank that recorded it at init), that process's machine
(:func:`..base.procs.machine_id`), the script, the launcher's name and the start time.

Who records: the ``axolotl-dist`` launcher once its first local rank told it the ranks' store
(:func:`note_address`); under other launchers, at the heartbeat's start, local rank 0,
or where no local rank is known, the first rank of this host to create the file. Recording
costs no store request and never fails a run (every error is swallowed). A file whose
recording process is gone is stale: :func:`live_runs` skips and removes it.
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from ..base import procs
from ..base.callsite import short_path
from ..base.constants import END_DIR_ENV_VAR, RUN_DIR_ENV_VAR
from ..base.envvars import kit_path
from ..base.state import STATE

__all__ = ["RUN_DIR_ENV_VAR", "run_dir", "record", "forget", "live_runs", "describe",
           "STORE_NOTE", "note_address"]



def _private(path: str) -> bool:
    """Make ``path`` (and missing parents) a directory; for one the kit makes under a shared
    directory, check that it is this user's own, not a link, and mode 0700."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or (hasattr(os, "getuid") and info.st_uid != os.getuid()):
        return False
    if info.st_mode & 0o077:
        os.chmod(path, 0o700)
    return True


def run_dir(create: bool = True) -> Optional[str]:
    """This user's run directory on this host (made if ``create``); None where none can be
    used (then nothing is recorded, and nothing listed)."""
    try:
        chosen = kit_path(RUN_DIR_ENV_VAR)
        if chosen is not None:
            if create:
                os.makedirs(chosen, mode=0o700, exist_ok=True)
            return chosen
        xdg = os.environ.get("XDG_RUNTIME_DIR", "")
        if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK | os.X_OK):
            path = os.path.join(xdg, "axolotl_dist", "runs")
            if not create:
                return path
            os.makedirs(path, mode=0o700, exist_ok=True)
            return path
        uid = os.getuid() if hasattr(os, "getuid") else 0
        base = os.path.join(tempfile.gettempdir(), f"axolotl_dist-{uid}")
        if not create:
            return os.path.join(base, "runs")
        if not _private(base):
            return None
        path = os.path.join(base, "runs")
        os.makedirs(path, mode=0o700, exist_ok=True)
        return path
    except Exception:  # noqa: BLE001 - no directory: nothing recorded, nothing listed
        return None


def _file_name(run: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", run)[:64] + ".json"


def _live(entry: Dict[str, Any]) -> Optional[bool]:
    """Whether the recording process runs; None where this process cannot judge its pid
    (another PID namespace sharing the directory)."""
    pid = entry.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    if entry.get("machine") != procs.MACHINE:
        return None
    return procs.alive(pid)


def _read(path: str) -> Optional[Dict[str, Any]]:
    try:
        with open(path) as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


def record(run: str, addr: str, port: int, world: int, launcher: str,
           script: Optional[str] = None, pid: Optional[int] = None) -> Optional[str]:
    """Record run ``run`` (its store at ``addr:port``) for this host; return the file's path,
    or None where nothing was written (no directory, or a live process recorded this run
    first). ``pid``: the process whose life the entry follows (default: this one). Best
    effort: never raises."""
    tmp = None
    try:
        directory = run_dir()
        if directory is None:
            return None
        pid = os.getpid() if pid is None else pid
        entry = _entry(run, addr, port, world, launcher, script, pid)
        path = os.path.join(directory, _file_name(run))
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(entry, fh)
        if not _place(tmp, path):
            return None
        previous = STATE.my_run.get("path")
        if previous and previous != path:
            forget(previous, STATE.my_run.get("pid"))
        STATE.my_run.update(path=path, pid=pid)
        return path
    except Exception:  # noqa: BLE001 - recording must never fail a run
        return None
    finally:
        if tmp is not None:
            _remove(tmp)


def _entry(run: str, addr: str, port: int, world: int, launcher: str, script: Optional[str],
           pid: int) -> Dict[str, Any]:
    """What a run's file says (``script``: default, this process's)."""
    if script is None:
        script = sys.argv[0] if sys.argv and sys.argv[0] else "?"
    return {"run": run, "addr": addr, "port": int(port), "world": int(world), "pid": pid,
            "machine": procs.MACHINE, "script": os.path.abspath(script) if os.path.exists(
                script) else script, "launcher": launcher, "started": time.time()}


def _place(tmp: str, path: str) -> bool:
    """Move the written entry ``tmp`` to ``path``, unless a live process recorded the run
    first (then False)."""
    try:
        os.link(tmp, path)  # whole, and the first recorder of the run wins
    except OSError as exc:  # there already (or no hard links on this filesystem)
        old = _read(path) if isinstance(exc, FileExistsError) or os.path.exists(path) else None
        if old is not None and _live(old) is not False:
            return False
        os.replace(tmp, path)  # a stale entry of the same name (or an unreadable one)
    return True


def forget(path: Optional[str], pid: Optional[int] = None) -> None:
    """Remove the entry at ``path`` if process ``pid`` (default: this one) recorded it."""
    if not path:
        return
    try:
        entry = _read(path)
        if entry is not None and entry.get("pid") == (os.getpid() if pid is None else pid) \
                and entry.get("machine") == procs.MACHINE:
            _remove(path)
    except OSError:
        pass


def live_runs() -> List[Dict[str, Any]]:
    """The runs recorded on this host whose recording process still runs, oldest first; stale
    entries are removed on the way."""
    directory = run_dir(create=False)
    if directory is None or not os.path.isdir(directory):
        return []
    found = []
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not name.endswith(".json"):
            if name.endswith(".tmp") and time.time() - _mtime(path) > 60:  # a writer died
                _remove(path)
            continue
        entry = _read(path)
        if entry is not None and "port" in entry and _live(entry) is not False:
            found.append(entry)
            continue
        if entry is not None or time.time() - _mtime(path) > 60:  # stale, or unreadable long
            _remove(path)
    return sorted(found, key=lambda e: e.get("started", 0.0))


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def describe(entry: Dict[str, Any], now: Optional[float] = None) -> str:
    """One line about a recorded run: its port, world size, script, pid and age."""
    age = max(0.0, (time.time() if now is None else now) - float(entry.get("started", 0.0)))
    ago = f"{age:.0f} s" if age < 120 else (f"{age / 60:.0f} min" if age < 7200 else
                                             f"{age / 3600:.1f} h")
    script = short_path(str(entry.get("script", "?")))
    return (f"port {entry.get('port')} on {entry.get('addr')}: {entry.get('world')} rank(s), "
            f"{script}, pid {entry.get('pid')} ({entry.get('launcher')}), started {ago} ago")


# --- the launcher's note ----------------------------------------------------------------------

#: The note a rank under ``axolotl-dist`` leaves in ``END_DIR_ENV_VAR`` for its launcher.
STORE_NOTE = "store.json"


def note_address(run: str, rank: int, world: int = 0, launcher: str = "env vars") -> None:
    """Say where the ranks' store is, for a requester that is not told (no store request;
    never raises). Under ``axolotl-dist``, the first local rank of each node tells its node's
    launcher (node 0's agent picked the port; another node's launcher has no other way to
    learn it), so ``SIGUSR1`` to any node's launcher can ask them, and the launcher records
    the run for ``axolotl-dist where`` (:func:`record`). Under other launchers, local rank 0
    (where no local rank is known, the first rank of this host) records the run itself."""
    directory = os.environ.get(END_DIR_ENV_VAR)
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    local = os.environ.get("LOCAL_RANK")
    if not addr or not port or not port.isdigit() or local not in (None, "0"):
        return
    if not directory:
        record(run, addr, int(port), world, launcher)
        return
    try:
        path = os.path.join(directory, STORE_NOTE)
        with open(path + ".tmp", "w") as fh:
            json.dump({"addr": addr, "port": int(port), "run": run, "world": world}, fh)
        os.replace(path + ".tmp", path)
    except (OSError, ValueError):  # pragma: no cover - the launcher then cannot ask
        pass
