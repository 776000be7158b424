"""The ranks' output through the launcher: folded on screen, kept whole in ``--log-dir``.

The launcher listens on a Unix socket (an abstract name on Linux: nothing on disk) whose
address it gives its ranks in ``AXOLOTL_DIST_LAUNCHER_FOLDS``. Each rank, first thing in its
bootstrap (:func:`connect`), opens two connections, says which rank and stream each is, and
puts them in place of its stdout and stderr (file descriptors 1 and 2, so C code, subprocesses
and data loader workers write there too). One thread of the launcher (:class:`Output`) reads
every connection, hands the bytes to :class:`._fold.Folder` and writes what it returns to the
launcher's own stdout and stderr (stderr stays stderr), and, with a log directory, each rank's
every line, unfolded, to ``<dir>/rank<r>.log`` with its time and stream.

Nothing waits on the launcher's screen: a rank blocks only while the launcher has not read
what it wrote (the socket's buffer is full), and the thread reads at once. Should the thread
fail, it goes on copying bytes unfolded: a rank must never block on a dead reader.
"""

from __future__ import annotations

import os
import selectors
import socket
import sys
import tempfile
import threading
import time
import uuid
from typing import Dict, List, Optional, Tuple

from .._runtime.base.constants import LAUNCHER_FOLDS_ENV_VAR
from .._runtime.base.procs import flush_standard_streams
from ._fold import Folder

__all__ = ["Output", "connect", "log_name"]

_HEADER_MAX = 64
_READ = 1 << 16
#: How long :meth:`Output.close` reads what the ranks' processes left, at most (seconds);
#: it stops sooner once every connection ended, or nothing came for :data:`_QUIET`.
_DRAIN, _QUIET = 3.0, 0.2
_STREAMS = {1: b"stdout", 2: b"stderr"}
#: Seconds the thread lets the ranks' writes gather after a read (fewer, larger reads).
_GATHER = 0.002


def log_name(rank: int) -> str:
    """The file of rank ``rank``'s output in a log directory."""
    return f"rank{rank}.log"


def _address() -> Tuple[str, object]:
    """``(env text, bind address)`` of a fresh socket name: abstract on Linux, else a file."""
    name = f"axolotl_dist-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    if sys.platform.startswith("linux"):
        return "@" + name, "\0" + name
    path = os.path.join(tempfile.gettempdir(), name + ".sock")
    return path, path


def connect() -> bool:
    """In a rank started by ``axolotl-dist``: send this process's stdout and stderr to the
    launcher (see the module docstring). False where there is no launcher to send them to."""
    text = os.environ.get(LAUNCHER_FOLDS_ENV_VAR, "")
    if not text:
        return False
    where = "\0" + text[1:] if text.startswith("@") else text
    rank = os.environ.get("RANK", "0").strip() or "0"
    socks: List[socket.socket] = []
    try:
        for fd in (1, 2):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            socks.append(sock)
            sock.connect(where)
            sock.sendall(f"{int(rank)} {fd}\n".encode())
    except (OSError, ValueError):  # no launcher listening: keep the inherited streams
        for sock in socks:
            sock.close()
        return False
    flush_standard_streams()
    for fd, sock in zip((1, 2), socks):
        os.dup2(sock.fileno(), fd)
        sock.close()
    return True


class _Conn:
    __slots__ = ("sock", "head", "rank", "fd")

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.head, self.rank, self.fd = sock, b"", -1, 0


class _Log:
    """One rank's whole output, line by line, with the time and the stream."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "wb")
        self.partial: Dict[int, bytes] = {}

    def write(self, fd: int, data: bytes, stamp: bytes) -> None:
        lines = (self.partial.pop(fd, b"") + data).split(b"\n")
        rest = lines.pop()
        if rest:
            self.partial[fd] = rest
        head = stamp + _STREAMS.get(fd, b"?") + b": "
        for line in lines:
            if b"\r" in line:  # a progress bar: its last state
                line = next((part for part in reversed(line.split(b"\r")) if part), b"")
            self.file.write(head + line + b"\n")

    def close(self, stamp: bytes) -> None:
        for fd in list(self.partial):
            self.write(fd, b"\n", stamp)
        self.file.close()


class Output:
    """See the module docstring. ``local``: how many ranks this launcher starts; ``fold``:
    fold their lines (else pass them through as they come); ``log_dir``: where each rank's
    whole output goes (None: nowhere)."""

    def __init__(self, local: int, fold: bool, log_dir: Optional[str]) -> None:
        self.address, bind = _address()
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(bind)  # type: ignore[arg-type]
        self.server.listen(max(16, 2 * local))
        self.server.setblocking(False)
        self.log_dir = log_dir
        if log_dir is not None:
            os.makedirs(log_dir, exist_ok=True)
        screens = _screens()
        self.folder = Folder(local, {fd: _isatty(fd) for fd in (1, 2)}, fold=fold,
                             screens=screens)
        self.logs: Dict[int, _Log] = {}
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.server, selectors.EVENT_READ, None)
        self.stopping = threading.Event()
        self.broken = False  # the folder failed: copy bytes as they come
        self._second = -1
        self._stamp = b""
        self.thread = threading.Thread(target=self._run, name="axolotl-dist-output", daemon=True)
        self.thread.start()

    # --- the thread ----------------------------------------------------------------------

    def _run(self) -> None:
        drain_until = None
        last_data = time.monotonic()
        while True:
            now = time.monotonic()
            if self.stopping.is_set():
                if drain_until is None:
                    drain_until = now + _DRAIN
                conns = len(self.selector.get_map()) - 1
                if conns <= 0 or now >= drain_until or now - last_data >= _QUIET:
                    break
            due = None if self.broken else self.folder.due()
            timeout = 0.5 if due is None else max(0.0, min(0.5, due - now))
            if self.stopping.is_set():
                timeout = min(timeout, 0.05)
            read = False
            for key, _ in self.selector.select(timeout):
                if key.data is None:
                    self._accept()
                elif self._read(key.data, time.time()):
                    read = True
            now = time.monotonic()
            self._step(now)
            if read:
                last_data = now
                # many small writes: let them gather, read them in one pass (a line waits
                # at most this much longer)
                time.sleep(_GATHER)
        self._finish()

    def _accept(self) -> None:
        try:
            while True:
                sock, _ = self.server.accept()
                sock.setblocking(False)
                self.selector.register(sock, selectors.EVENT_READ, _Conn(sock))
        except (BlockingIOError, InterruptedError):
            return

    def _read(self, conn: _Conn, wall: float) -> bool:
        try:
            data = conn.sock.recv(_READ)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            data = b""
        if not data:
            self.selector.unregister(conn.sock)
            conn.sock.close()
            if conn.rank >= 0:
                self._guarded(lambda: self.folder.end(conn.rank, conn.fd, time.monotonic()))
            return False
        if conn.rank < 0:
            conn.head += data
            if b"\n" not in conn.head:
                if len(conn.head) > _HEADER_MAX:  # not one of our ranks
                    self.selector.unregister(conn.sock)
                    conn.sock.close()
                return False
            head, data = conn.head.split(b"\n", 1)
            try:
                rank, fd = (int(x) for x in head.split())
            except ValueError:
                self.selector.unregister(conn.sock)
                conn.sock.close()
                return False
            conn.rank, conn.fd = rank, fd if fd in (1, 2) else 2
            if not data:
                return True
        if self.log_dir is not None:
            self._log(conn.rank, conn.fd, data, wall)
        if self.broken:
            self.folder.out.append((conn.fd, data))
        else:
            self._guarded(lambda: self.folder.feed(conn.rank, conn.fd, data, time.monotonic()),
                          conn.fd, data)
        return True

    def _guarded(self, step, fd: int = 0, data: bytes = b"") -> None:  # type: ignore[no-untyped-def]
        """Run a step of the folder; should it fail, everything after goes out unfolded."""
        try:
            step()
        except Exception:  # noqa: BLE001 - a bug must not stop the ranks' output
            self.broken = True
            if data:
                self.folder.out.append((fd, data))

    def _step(self, now: float) -> None:
        if not self.broken:
            self._guarded(lambda: self.folder.tick(now))
        self._write(self.folder.take())
        for log in self.logs.values():
            log.file.flush()

    def _finish(self) -> None:
        if not self.broken:
            self._guarded(self.folder.flush)
        self._write(self.folder.take())
        stamp = self._stamp_of(time.time())
        for log in self.logs.values():
            log.close(stamp)
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self.selector.close()

    # --- writing -------------------------------------------------------------------------

    def _write(self, chunks: List[Tuple[int, bytes]]) -> None:
        for fd, data in chunks:
            view = memoryview(data)
            while view:
                try:
                    view = view[os.write(fd, view):]
                except InterruptedError:
                    continue
                except OSError:  # the launcher's output is gone (a closed pipe): drop it
                    break

    def _stamp_of(self, wall: float) -> bytes:
        second = int(wall)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(second)).encode()
        return self._stamp + b".%03d " % int((wall - second) * 1000)

    def _log(self, rank: int, fd: int, data: bytes, wall: float) -> None:
        log = self.logs.get(rank)
        if log is None:
            path = os.path.join(self.log_dir or ".", log_name(rank))
            try:
                log = self.logs[rank] = _Log(path)
            except OSError as exc:  # said once; the launcher's report then names no file
                self.log_dir = None
                self.folder.out.append((2, f"axolotl-dist: cannot write {path} "
                                           f"({exc.strerror or exc}); --log-dir is off for "
                                           "the rest of the run\n".encode()))
                return
        log.write(fd, data, self._stamp_of(wall) + b"[rank %d] " % rank)

    # --- the launcher's side -------------------------------------------------------------

    def close(self) -> None:
        """Read what the ranks' processes left (they have ended), write everything held, close."""
        flush_standard_streams()
        self.stopping.set()
        self.thread.join(timeout=_DRAIN + 2.0)
        try:
            self.server.close()
        except OSError:
            pass
        if isinstance(self.address, str) and not self.address.startswith("@"):
            try:
                os.unlink(self.address)
            except OSError:
                pass


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _screens() -> Dict[int, int]:
    """fd -> the screen it shows on: stdout and stderr on one terminal share one."""
    try:
        out, err = os.fstat(1), os.fstat(2)
    except OSError:
        return {1: 1, 2: 2}
    same = (out.st_dev, out.st_ino, out.st_rdev) == (err.st_dev, err.st_ino, err.st_rdev)
    return {1: 1, 2: 1 if same else 2}
