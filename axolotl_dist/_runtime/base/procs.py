"""Process utilities shared by the launcher, the rank bootstrap, the test harness and the
failure watch: process state from ``/proc``, children, killing a process tree, the loopback
interface, whether a local TCP port has a listener, and which machine (kernel boot and PID
namespace) this process runs in.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from typing import Dict, List, Optional, Tuple

from ...env.variables import is_decimal

__all__ = [
    "flush_standard_streams",
    "MACHINE",
    "proc_state",
    "alive",
    "process_table",
    "children",
    "descendants",
    "reap",
    "signal_tree",
    "kill_tree",
    "loopback_interface",
    "is_loopback",
    "listening",
]

#: TCP state code of a listening socket in ``/proc/net/tcp``.
_TCP_LISTEN = "0A"



def flush_standard_streams() -> None:
    """Flush ``sys.stdout`` and ``sys.stderr``, whatever they are now (a stream a user
    replaced or closed is left as it is)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - replaced, closed, or gone
            pass


#: This process's machine (kernel boot and PID namespace), whose pids it can see: defined with
#: the failure it identifies (:data:`axolotl_dist.errors.MACHINE`).
from ...errors import MACHINE  # noqa: E402 - re-exported for its readers


def _stat(pid: int) -> Optional[Tuple[str, int]]:
    """``(state letter, parent pid)`` from ``/proc/<pid>/stat``; None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        return fields[0].decode(), int(fields[1])
    except (OSError, IndexError, ValueError):
        return None


def proc_state(pid: int) -> Optional[str]:
    """``"gone"`` (no such process, or a zombie), ``"stopped"`` (SIGSTOP / traced) or
    ``"running"`` for a pid on this host; None when procfs cannot tell."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        return "running"
    stat = _stat(pid)
    if stat is None:
        return None
    if stat[0] in ("Z", "X"):
        return "gone"
    if stat[0] in ("T", "t"):
        return "stopped"
    return "running"


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a stopped process does; a zombie does not; without procfs, trust
    ``kill(pid, 0)``)."""
    return proc_state(pid) != "gone"


def process_table() -> Dict[int, Tuple[str, int]]:
    """Every readable process: pid -> ``(state letter, parent pid)`` (empty without procfs)."""
    try:
        entries = os.listdir("/proc")
    except OSError:  # pragma: no cover - no procfs
        return {}
    table = {}
    for entry in entries:
        if is_decimal(entry):
            stat = _stat(int(entry))
            if stat is not None:
                table[int(entry)] = stat
    return table


def children(pid: int) -> List[Tuple[int, str]]:
    """``pid``'s direct children as ``(pid, state letter)``."""
    return [(child, state) for child, (state, ppid) in process_table().items() if ppid == pid]


def descendants(pid: int) -> List[int]:
    """``pid``'s children, recursively (launchers put ranks in their own sessions)."""
    kids: Dict[int, List[int]] = {}
    for child, (_, ppid) in process_table().items():
        kids.setdefault(ppid, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def reap(pid: int) -> None:
    """Collect ``pid``'s exit status if it is an exited child of this process (never blocks)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except (ChildProcessError, OSError):
        pass


def signal_tree(pid: int, sig: int) -> None:
    """Send ``sig`` to ``pid``'s process group (where its children live), else to ``pid``."""
    for send in (lambda: os.killpg(pid, sig), lambda: os.kill(pid, sig)):
        try:
            send()
            return
        except (ProcessLookupError, PermissionError, OSError):
            pass


def kill_tree(pid: int) -> None:
    """SIGKILL ``pid``'s process group and every descendant (those in other sessions too)."""
    victims = descendants(pid)
    signal_tree(pid, signal.SIGKILL)
    for victim in victims:
        try:
            os.kill(victim, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, OSError):
            pass


def loopback_interface() -> Optional[str]:
    """The name of the loopback network interface (``lo`` on Linux, ``lo0`` on macOS)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):  # pragma: no cover
        return None
    for candidate in ("lo", "lo0"):
        if candidate in names:
            return candidate
    return None


def is_loopback(addr: Optional[str]) -> bool:
    """Whether ``addr`` (a host name or IP literal, e.g. ``MASTER_ADDR``) is this host's loopback."""
    if not addr:
        return False
    addr = addr.strip("[]").lower()
    return addr in ("localhost", "::1", "0:0:0:0:0:0:0:1") or addr.startswith("127.")


def beside_store() -> bool:
    """Whether this process runs where the world's store is served: ``MASTER_ADDR`` is
    loopback, or something in this network namespace listens on ``MASTER_PORT``."""
    port = os.environ.get("MASTER_PORT", "")
    return is_loopback(os.environ.get("MASTER_ADDR")) or (
        is_decimal(port) and bool(listening(int(port))))


def listening(port: int) -> Optional[bool]:
    """Whether some socket of this network namespace listens on TCP ``port`` (``/proc/net``);
    None where that cannot be read (not Linux)."""
    readable = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for line in lines:
            fields = line.split()  # sl, local address:port (hex), remote, state, ...
            if len(fields) > 3 and fields[3] == _TCP_LISTEN and \
                    int(fields[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False if readable else None
