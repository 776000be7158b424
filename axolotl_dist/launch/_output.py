"""The ranks' output through the launcher: folded on screen, kept whole in ``--log-dir``.

The launcher listens on a Unix socket, mode 0600 in its own 0700 directory, whose path it
gives its ranks in ``AXOLOTL_DIST_LAUNCHER_FOLDS``; a connection of another user (Linux's
``SO_PEERCRED``) is closed unread (docs/design/launching.md, "Local channels"). Each rank, first
thing in its bootstrap (:func:`connect`), opens two connections, says which rank and stream
each is, and puts them in place of its stdout and stderr (file descriptors 1 and 2, so C
code, subprocesses and data loader workers write there too). One thread of the launcher
(:class:`Output`) reads every connection, hands the bytes to :class:`._fold.Folder` and writes
what it returns to the launcher's own stdout and stderr (stderr stays stderr), and, with a log
directory, each rank's every line, unfolded, to ``<dir>/rank<r>.log`` with its time and stream.

Where the launcher's stdout or stderr is a terminal (``AXOLOTL_DIST_LAUNCHER_TTY`` says which,
and its size), the rank makes that stream a pseudo-terminal instead (:func:`_pseudo_terminal`):
the slave, in raw mode (no ``\n`` to ``\r\n``) and of the launcher's size, becomes the rank's
fd, and the master goes to the launcher with the connection's header (``SCM_RIGHTS``); the
launcher reads the master from then on. So a rank sees ``isatty()`` True and sizes its progress
bars as under torchrun on a terminal, one pseudo-terminal per stream (stdout and stderr stay
apart). ``--local-ranks-filter``: the lines of the other local ranks are kept in
``--log-dir`` but not shown.

Nothing waits on the launcher's screen: a rank blocks only while the launcher has not read
what it wrote (the socket's buffer is full), and the thread reads at once. Should the thread
fail, it goes on copying bytes unfolded: a rank must never block on a dead reader.
"""

from __future__ import annotations

import errno
import fcntl
import os
import selectors
import shutil
import socket
import struct
import tempfile
import termios
import threading
import time
import tty
from typing import Dict, List, Optional, Set, Tuple, Union

from ..env.variables import LAUNCHER_FOLDS_ENV_VAR, LAUNCHER_TTY_ENV_VAR
from .._runtime.base.private import FILE_MODE, my_uid, peer_uid, private_dir
from .._runtime.base.procs import flush_standard_streams
from ._fold import Folder
from ._report import RESTART_COUNT_ENV_VAR
from ._rank_logs import RankLog, log_name

__all__ = ["Output", "connect"]

_HEADER_MAX = 64
_READ = 1 << 16
#: How long :meth:`Output.close` reads what the ranks' processes left, at most (seconds);
#: it stops sooner once every connection ended, or nothing came for :data:`_QUIET`.
_DRAIN, _QUIET = 3.0, 0.2
#: Seconds the thread lets the ranks' writes gather after a read (fewer, larger reads).
_GATHER = 0.002
_SOCKET_NAME = "out.sock"
#: The longest path a Unix socket takes everywhere, in bytes (macOS: 104 with its NUL).
_PATH_MAX = 103


def _socket_place(directory: Optional[str]) -> Tuple[str, Optional[str]]:
    """``(path, made)``: where the socket goes, in ``directory`` (this user's alone) where its
    path is short enough for a socket's, else in a fresh directory of mode 0700 (``made``,
    removed at :meth:`Output.close`) under the temporary one, or ``/tmp`` where that is long
    too."""
    if directory is not None:
        path = os.path.join(private_dir(directory), _SOCKET_NAME)
        if len(os.fsencode(path)) <= _PATH_MAX:
            return path, None
    for parent in (None, "/tmp"):
        made = tempfile.mkdtemp(prefix="axolotl_dist_out_", dir=parent)  # 0700, a fresh name
        path = os.path.join(made, _SOCKET_NAME)
        if len(os.fsencode(path)) <= _PATH_MAX:
            return path, made
        os.rmdir(made)
    raise OSError(errno.ENAMETOOLONG, "no directory with a path short enough for a socket")


def tty_note() -> str:
    """For ``AXOLOTL_DIST_LAUNCHER_TTY``: which of this process's stdout and stderr are
    terminals and the size of the first (``"1,2:24x80"``); ``""`` where neither is."""
    fds = [fd for fd in (1, 2) if _isatty(fd)]
    if not fds:
        return ""
    rows, cols = 24, 80
    try:
        rows, cols = struct.unpack("HHHH", fcntl.ioctl(fds[0], termios.TIOCGWINSZ, bytes(8)))[:2]
    except OSError:
        pass
    return f"{','.join(map(str, fds))}:{rows}x{cols}"


def _tty_wanted() -> Tuple[Set[int], Tuple[int, int]]:
    """The fds that get a pseudo-terminal and its ``(rows, cols)``, from the launcher's note."""
    text = os.environ.get(LAUNCHER_TTY_ENV_VAR, "")
    fds_text, _, size = text.partition(":")
    try:
        fds = {int(fd) for fd in fds_text.split(",") if fd.strip()}
        rows, _, cols = size.partition("x")
        return fds & {1, 2}, (int(rows or 24), int(cols or 80))
    except ValueError:
        return set(), (24, 80)


def _pseudo_terminal(size: Tuple[int, int]) -> Tuple[int, int]:
    """``(master, slave)``: a pseudo-terminal in raw mode (bytes pass as written: no
    ``\n`` to ``\r\n``) of ``size`` rows and columns."""
    master, slave = os.openpty()
    tty.setraw(slave)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", size[0], size[1], 0, 0))
    return master, slave


def connect() -> bool:
    """In a rank started by ``axolotl-dist``: send this process's stdout and stderr to the
    launcher (see the module docstring). False where there is no launcher to send them to."""
    where = os.environ.get(LAUNCHER_FOLDS_ENV_VAR, "")
    if not where:
        return False
    rank = os.environ.get("RANK", "0").strip() or "0"
    local = os.environ.get("LOCAL_RANK", "-1").strip() or "-1"
    restart = os.environ.get(RESTART_COUNT_ENV_VAR, "0").strip() or "0"
    ttys, size = _tty_wanted()
    socks: List[socket.socket] = []
    fds: Dict[int, int] = {}  # the rank's fd -> what goes in its place
    try:
        for fd in (1, 2):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            socks.append(sock)
            sock.connect(where)
            head = f"{int(rank)} {fd} {int(local)} {int(restart)}\n".encode()
            if fd in ttys:
                master, slave = _pseudo_terminal(size)
                try:
                    socket.send_fds(sock, [head], [master])
                finally:
                    os.close(master)
                fds[fd] = slave
            else:
                sock.sendall(head)
                fds[fd] = sock.fileno()
    except (OSError, ValueError):  # no launcher listening: keep the inherited streams
        for sock in socks:
            sock.close()
        for fd in ttys:
            if fd in fds:
                os.close(fds[fd])
        return False
    flush_standard_streams()
    for fd in (1, 2):
        os.dup2(fds[fd], fd)
        if fd in ttys:
            os.close(fds[fd])
    for sock in socks:
        sock.close()
    return True


class _Conn:
    """One stream of one rank: its connection, then (a pseudo-terminal) its master."""

    __slots__ = ("sock", "head", "rank", "fd", "local", "attempt", "master")

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.head, self.rank, self.fd, self.local = sock, b"", -1, 0, -1
        self.attempt = 0  # torch's restart count of the rank's process
        self.master = -1

    def fileobj(self) -> Union[int, socket.socket]:
        """What the selector watches: the master once there is one, else the connection."""
        return self.master if self.master >= 0 else self.sock

    def recv(self) -> Tuple[bytes, List[int]]:
        """What came, and the fds passed with it (only with the header). Raises
        BlockingIOError where nothing did; b"" at the end (a master's EIO: the rank is gone)."""
        if self.master >= 0:
            try:
                return os.read(self.master, _READ), []
            except OSError as exc:
                if exc.errno == errno.EIO:
                    return b"", []
                raise
        if self.rank < 0:
            data, fds, _, _ = socket.recv_fds(self.sock, _READ, 2)
            return data, list(fds)
        return self.sock.recv(_READ), []

    def close(self) -> None:
        self.sock.close()
        if self.master >= 0:
            os.close(self.master)
            self.master = -1


class Output:
    """See the module docstring. ``local``: how many ranks this launcher starts; ``fold``:
    fold their lines (else pass them through as they come); ``log_dir``: where each rank's
    whole output goes (None: nowhere); ``directory``: the launcher's own directory (mode
    0700), where the socket goes (None: a directory made for it); ``fold_cpp``: torch's blocks
    of C++ frames shown as one line each (not under ``--no-fold``)."""

    def __init__(self, local: int, fold: bool, log_dir: Optional[str],
                 shown: Optional[Set[int]] = None, directory: Optional[str] = None,
                 fold_cpp: bool = True) -> None:
        #: The socket's path (``AXOLOTL_DIST_LAUNCHER_FOLDS``); the directory made for it.
        self.address, self._made = _socket_place(directory)
        #: The uids whose connections were refused (said once each: :meth:`_accept`).
        self.refused: Set[int] = set()
        #: ``--local-ranks-filter``: the local ranks whose lines are shown (None: all).
        self.shown = shown
        #: For the ranks (``AXOLOTL_DIST_LAUNCHER_TTY``): which streams are terminals.
        self.ttys = tty_note()
        self._notes: List[bytes] = []
        self._notes_lock = threading.Lock()
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.address)
        os.chmod(self.address, FILE_MODE)  # in a 0700 directory already: no one else comes in
        self.server.listen(max(16, 2 * local))
        self.server.setblocking(False)
        self.log_dir = log_dir
        if log_dir is not None:
            os.makedirs(log_dir, exist_ok=True)
        screens = _screens()
        shown_count = local if shown is None else len(shown & set(range(local))) or 1
        self.folder = Folder(shown_count, {fd: _isatty(fd) for fd in (1, 2)}, fold=fold,
                             screens=screens, fold_cpp=fold_cpp, log_dir=log_dir)
        self.logs: Dict[int, RankLog] = {}
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
            self._say_notes()
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
                uid = peer_uid(sock)
                if uid is not None and uid != my_uid():  # not one of this run's ranks
                    sock.close()  # nothing read: nothing it sent is shown
                    self._refuse(uid)
                    continue
                sock.setblocking(False)
                self.selector.register(sock, selectors.EVENT_READ, _Conn(sock))
        except (BlockingIOError, InterruptedError):
            return

    def _refuse(self, uid: int) -> None:
        """Say once per user that a connection of ``uid`` was closed unread."""
        if uid in self.refused or len(self.refused) > 16:
            return
        self.refused.add(uid)
        self.announce(f"axolotl-dist: closed a connection to the ranks' output socket from uid "
                      f"{uid}, not this run's user (uid {my_uid()}); nothing it sent is shown")

    def _drop(self, conn: _Conn) -> None:
        self.selector.unregister(conn.fileobj())
        conn.close()

    def _header(self, conn: _Conn, data: bytes, fds: List[int]) -> Optional[bytes]:
        """Take the connection's header (``rank fd [local_rank [restart]]``, with a
        pseudo-terminal's master where the rank made one); what came after it, None while it
        is incomplete."""
        conn.head += data
        if b"\n" not in conn.head:
            for extra in fds:
                os.close(extra)
            if len(conn.head) > _HEADER_MAX:  # not one of our ranks
                self._drop(conn)
            return None
        head, data = conn.head.split(b"\n", 1)
        try:
            numbers = [int(x) for x in head.split()]
            rank, fd = numbers[:2]
        except ValueError:
            numbers, rank, fd = [], -1, 0
        if len(numbers) not in (2, 3, 4) or len(fds) > 1:
            for extra in fds:
                os.close(extra)
            self._drop(conn)
            return None
        conn.rank, conn.fd = rank, fd if fd in (1, 2) else 2
        conn.local = numbers[2] if len(numbers) >= 3 else -1
        conn.attempt = numbers[3] if len(numbers) == 4 else 0
        if fds:  # from now on the rank writes to the pseudo-terminal, not the connection
            self.selector.unregister(conn.sock)
            conn.master = fds[0]
            os.set_blocking(conn.master, False)
            self.selector.register(conn.master, selectors.EVENT_READ, conn)
        return data

    def _read(self, conn: _Conn, wall: float) -> bool:
        fds: List[int] = []
        try:
            data, fds = conn.recv()
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            if conn.rank >= 0 and self._shows(conn):
                self._guarded(lambda: self.folder.end(conn.rank, conn.fd, time.monotonic()))
            return False
        if conn.rank < 0:
            rest = self._header(conn, data, fds)
            if not rest:
                return rest is not None
            data = rest
        if self.log_dir is not None:
            self._log(conn, data, wall)
        if not self._shows(conn):
            return True
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

    def _shows(self, conn: _Conn) -> bool:
        """Whether this stream's lines go to the screen (``--local-ranks-filter``)."""
        return self.shown is None or conn.local in self.shown

    def _say_notes(self) -> None:
        """The launcher's own lines (:meth:`announce`): after everything the ranks printed."""
        with self._notes_lock:
            notes, self._notes = self._notes, []
        if notes:
            if not self.broken:
                self._guarded(self.folder.flush)
            self._write(self.folder.take() + [(2, note) for note in notes])

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
        self._say_notes()
        for key in list(self.selector.get_map().values()):
            if isinstance(key.data, _Conn):
                key.data.close()
            else:
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

    def _log(self, conn: _Conn, data: bytes, wall: float) -> None:
        rank = conn.rank
        log = self.logs.get(rank)
        if log is None:
            path = os.path.join(self.log_dir or ".", log_name(rank))
            try:
                log = self.logs[rank] = RankLog(path)
            except OSError as exc:  # said once; the launcher's report then names no file
                self.log_dir = None
                self.folder.out.append((2, f"axolotl-dist: cannot write {path} "
                                           f"({exc.strerror or exc}); --log-dir is off for "
                                           "the rest of the run\n".encode()))
                return
        stamp = self._stamp_of(wall) + b"[rank %d] " % rank
        log.begin(conn.attempt, stamp)
        log.write(conn.fd, data, stamp)

    # --- the launcher's side -------------------------------------------------------------

    def announce(self, text: str) -> None:
        """Print the launcher's line ``text`` on its stderr after what the ranks printed so
        far (their held lines first)."""
        with self._notes_lock:
            self._notes.append(text.rstrip("\n").encode() + b"\n")

    def close(self) -> None:
        """Read what the ranks' processes left (they have ended), write everything held, close."""
        flush_standard_streams()
        self.stopping.set()
        self.thread.join(timeout=_DRAIN + 2.0)
        try:
            self.server.close()
        except OSError:
            pass
        try:
            os.unlink(self.address)
        except OSError:
            pass
        if self._made is not None:
            shutil.rmtree(self._made, ignore_errors=True)


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
