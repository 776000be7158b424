"""The runs of this host, one small file each: where each run's c10d store is, so that
``axolotl-dist where`` finds a run without being told its address.

The directory is per user: ``AXOLOTL_DIST_RUN_DIR`` if set, else
``$XDG_RUNTIME_DIR/axolotl_dist/runs`` where that directory is set and writable, else
``<tempfile.gettempdir()>/axolotl_dist-<uid>/runs``. Each directory the kit names there is
mode 0700 and this user's alone: made with that mode, or, where it was there already, used
only if it is this user's, not a link and writable by nobody else (else refused:
:mod:`..base.private`). Where another user made the usual directory first, the kit uses
``$XDG_CACHE_HOME`` (or ``~/.cache``) ``/axolotl_dist/runs-<host>`` instead, said once.
A reader (``axolotl-dist where``) makes no directory. Each file, ``<run id>.json`` (mode 0600), holds the store's address
and port, the run id, the world size, the pid of the process that recorded it (the
``axolotl-dist`` launcher, or under other launchers the rank that recorded it at init), that
process's machine (:data:`..base.procs.MACHINE`), the script, the launcher's name and the
start time.

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
import socket
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

from ..base import procs
from ..base.callsite import short_path
from ...env.variables import (END_DIR_ENV_VAR, RUN_DIR_ENV_VAR, SECRET_ENV_VAR,
                              SECRET_FILE_ENV_VAR, SECRET_OFF, kit_path, is_decimal)
from ..base.kitlog import kit as log
from ..base.private import NotPrivateError, create_private, my_uid, private_dir, write_private
from .liveness_state import RUNS

__all__ = ["RUN_DIR_ENV_VAR", "run_dir", "record", "forget", "live_runs", "describe",
           "STORE_NOTE", "note_address", "NotPrivateError", "use_secret"]


#: This host's name, in the fallback run directory's (a home may be shared by several hosts).
_HOST = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:64] or "host"
#: What a user whose run directory is refused can do, besides what the refusal says.
_FIX = f"or set {RUN_DIR_ENV_VAR} to a directory of your own"


def _chains() -> List[List[str]]:
    """The directories to make and check, outermost first, the last of each the run directory:
    the usual one, then (unless ``AXOLOTL_DIST_RUN_DIR`` names one) the fallback in this user's
    home that no other user can make first."""
    chosen = kit_path(RUN_DIR_ENV_VAR)
    if chosen is not None:
        return [[os.path.abspath(chosen)]]
    xdg = os.environ.get("XDG_RUNTIME_DIR", "")
    if xdg and os.path.isdir(xdg) and os.access(xdg, os.W_OK | os.X_OK):
        base = os.path.join(xdg, "axolotl_dist")
    else:
        base = os.path.join(tempfile.gettempdir(), f"axolotl_dist-{max(my_uid(), 0)}")
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    home = os.path.join(cache, "axolotl_dist")
    return [[base, os.path.join(base, "runs")], [home, os.path.join(home, f"runs-{_HOST}")]]


def _verified(create: bool = True, warn: Optional[Callable[[str], None]] = None) -> str:
    """This user's run directory, every level the kit names checked to be this user's alone
    (:func:`..base.private.private_dir`), made where missing if ``create`` (else a missing one
    is FileNotFoundError). A usual directory that is refused (another user made it first)
    gives way to the fallback, said once. Raises :class:`~..base.private.NotPrivateError`
    where no directory is usable (or OSError). ``warn``: how to say it (default: a kit
    warning)."""
    chains = _chains()
    refused: Optional[NotPrivateError] = None
    for chain in chains:
        try:
            return _checked(chain, create)
        except NotPrivateError as exc:
            refused = refused or exc
            if chain is not chains[-1]:
                _say(f"{exc}; the kit records this user's runs in {chains[-1][-1]} instead",
                     warn)
    raise refused if refused is not None else FileNotFoundError(chains[-1][-1])


def _checked(chain: List[str], create: bool) -> str:
    """The last of ``chain``, each level made (if ``create``) and checked."""
    parent = os.path.dirname(chain[0])
    if create and parent and not os.path.isdir(parent):  # AXOLOTL_DIST_RUN_DIR's parents,
        os.makedirs(parent, exist_ok=True)               # ~/.cache: the user's own
    for level in chain:
        if not create and not os.path.isdir(level):
            raise FileNotFoundError(level)
        private_dir(level, _FIX)
    return chain[-1]


def run_dir(create: bool = True) -> Optional[str]:
    """This user's run directory on this host (``create``: made and checked, else only its
    path, the fallback's where the usual one is refused); None where none can be used (then
    nothing is recorded). A directory that is not this user's alone is refused, said once per
    process (a kit warning)."""
    try:
        if not create:
            try:
                return _verified(create=False)
            except Exception:  # noqa: BLE001 - none yet: the usual path, for messages
                return _chains()[0][-1]
        return _verified()
    except NotPrivateError as exc:
        _warn(exc, None)
        return None
    except Exception:  # noqa: BLE001 - no directory: nothing recorded, nothing listed
        return None


def _warn(exc: NotPrivateError, warn: Optional[Callable[[str], None]]) -> None:
    _say(f"{exc}; until then no run is recorded for `axolotl-dist where`", warn)


def _say(text: str, warn: Optional[Callable[[str], None]]) -> None:
    """Say ``text`` once per process, through ``warn`` (default: a kit warning)."""
    if text in RUNS.refused:
        return
    RUNS.refused.add(text)
    if warn is not None:
        warn(text)
    else:
        log.warning("%s", text)


def _file_name(run: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", run)[:64] + ".json"


def _live(entry: Dict[str, Any]) -> Optional[bool]:
    """Whether the recording process runs; None where this process cannot stall detector its pid
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
           script: Optional[str] = None, pid: Optional[int] = None,
           warn: Optional[Callable[[str], None]] = None) -> Optional[str]:
    """Record run ``run`` (its store at ``addr:port``) for this host; return the file's path,
    or None where nothing was written (no directory, or a live process recorded this run
    first). ``pid``: the process whose life the entry follows (default: this one); ``warn``:
    how to say that the run directory is refused (default: a kit warning). The file is mode
    0600 in a directory of mode 0700. Best effort: never raises."""
    tmp = None
    try:
        try:
            directory = _verified(warn=warn)
        except NotPrivateError as exc:
            _warn(exc, warn)
            return None
        pid = os.getpid() if pid is None else pid
        entry = _entry(run, addr, port, world, launcher, script, pid)
        path = os.path.join(directory, _file_name(run))
        tmp = f"{path}.{os.getpid()}.tmp"
        _remove(tmp)  # left by a recorder of the same pid that died
        with os.fdopen(create_private(tmp), "w") as fh:
            json.dump(entry, fh)
        if not _place(tmp, path):
            return None
        previous = RUNS.my_run.get("path")
        if previous and previous != path:
            forget(previous, RUNS.my_run.get("pid"))
        RUNS.my_run.update(path=path, pid=pid)
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
    entry = {"run": run, "addr": addr, "port": int(port), "world": int(world), "pid": pid,
             "machine": procs.MACHINE, "script": os.path.abspath(script) if os.path.exists(
                 script) else script, "launcher": launcher, "started": time.time()}
    entry.update(_secret_entry())
    return entry


def _secret_entry() -> Dict[str, str]:
    """How ``axolotl-dist where`` finds the run's secret (this file is this user's alone, as
    the ranks' environment is): the file that holds it, or the value."""
    path = kit_path(SECRET_FILE_ENV_VAR)
    if path is not None:
        return {"secret_file": os.path.abspath(path)}
    value = os.environ.get(SECRET_ENV_VAR, "").strip()
    return {"secret": value} if value and value.lower() != SECRET_OFF else {}


def use_secret(entry: Dict[str, Any]) -> None:
    """Take the secret of the run ``entry`` records for this process, unless it has one."""
    if os.environ.get(SECRET_ENV_VAR) or os.environ.get(SECRET_FILE_ENV_VAR):
        return
    if isinstance(entry.get("secret_file"), str):
        os.environ[SECRET_FILE_ENV_VAR] = entry["secret_file"]
    elif isinstance(entry.get("secret"), str):
        os.environ[SECRET_ENV_VAR] = entry["secret"]


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


def live_runs(warn: Optional[Callable[[str], None]] = None) -> List[Dict[str, Any]]:
    """The runs recorded on this host whose recording process still runs, oldest first; stale
    entries are removed on the way. Raises :class:`~..base.private.NotPrivateError` where
    the run directory is not this user's alone (nothing in it is read)."""
    try:
        directory = _verified(create=False, warn=warn)  # a reader makes nothing
    except NotPrivateError:
        raise
    except Exception:  # noqa: BLE001 - no directory: nothing listed
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
    if not addr or not port or not is_decimal(port) or local not in (None, "0"):
        return
    if not directory:
        record(run, addr, int(port), world, launcher)
        return
    try:
        write_private(os.path.join(directory, STORE_NOTE), json.dumps(
            {"addr": addr, "port": int(port), "run": run, "world": world}).encode())
    except (OSError, ValueError):  # pragma: no cover - the launcher then cannot ask
        pass
