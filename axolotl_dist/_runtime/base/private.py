"""The kit's own files and sockets on this host: this user's alone (docs/design/launching.md, "Local
channels").

* :func:`private_dir`: a directory only this user may enter (mode 0700), made without a race
  (``mkdir`` with the mode, then checked through an ``O_NOFOLLOW`` descriptor); one that was
  there already is refused (:class:`NotPrivateError`, naming the path and the fix) where it is
  a link, not a directory, another user's, or writable by anyone else; one that is only
  readable by others is narrowed to 0700.
* :func:`user_dir`: ``<tempfile.gettempdir()>/axolotl_dist-<uid>``, this user's private
  directory under the shared temporary one.
* :func:`write_private`: a whole file of mode 0600 (a fresh ``O_EXCL`` file, then renamed).
* :func:`peer_uid`: whose process is at the other end of a Unix socket (``SO_PEERCRED``).
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import tempfile
from typing import Optional

__all__ = ["NotPrivateError", "private_dir", "user_dir", "write_private", "create_private",
           "peer_uid", "my_uid", "DIR_MODE", "FILE_MODE"]

DIR_MODE, FILE_MODE = 0o700, 0o600
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)


class NotPrivateError(OSError):
    """A directory the kit would keep a run's files in that others could read or change."""


def my_uid() -> int:
    """The uid this process creates files as (-1 where the platform has none)."""
    return os.geteuid() if hasattr(os, "geteuid") else -1


def private_dir(path: str, fix: str = "") -> str:
    """Make ``path`` (its parent must exist) a directory of mode 0700, or check the one that
    is there; return ``path``. Raises :class:`NotPrivateError` (``fix``: what the user can do,
    after the kit's own advice) where it is a link, not a directory, another user's, or
    writable by others."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:  # a link (ELOOP), a file (ENOTDIR)
        if os.path.islink(path) or (os.path.exists(path) and not os.path.isdir(path)):
            raise _refused(path, "is a link or not a directory", "remove it", fix) from None
        raise exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISDIR(info.st_mode):
            raise _refused(path, "is not a directory", "remove it", fix)
        uid = my_uid()
        if uid >= 0 and info.st_uid != uid:
            raise _refused(path, f"belongs to uid {info.st_uid}, not to this user (uid {uid})",
                           "its owner (or root) can remove it", fix)
        if info.st_mode & 0o022:
            raise _refused(path, f"is writable by other users (mode "
                           f"{stat.S_IMODE(info.st_mode):o})", "check what is in it, then "
                           f"chmod 700 {path} (or remove it)", fix)
        if stat.S_IMODE(info.st_mode) != DIR_MODE:  # readable by others, or a tight umask
            os.fchmod(fd, DIR_MODE)
    finally:
        os.close(fd)
    return path


def _refused(path: str, why: str, advice: str, fix: str) -> NotPrivateError:
    return NotPrivateError(
        f"{path} {why}: the kit keeps a run's files only in a directory that is this user's "
        f"alone; {advice}{'; ' + fix if fix else ''}")


def user_dir(fix: str = "") -> str:
    """This user's private directory under the system's temporary one (made if missing):
    ``<tempfile.gettempdir()>/axolotl_dist-<uid>``. Raises :class:`NotPrivateError`."""
    uid = my_uid()
    return private_dir(os.path.join(tempfile.gettempdir(), f"axolotl_dist-{max(uid, 0)}"), fix)


def create_private(path: str) -> int:
    """A new file at ``path`` (none may be there: ``O_EXCL``, no link followed), mode 0600; its
    descriptor, open for writing."""
    fd = os.open(path, _NEW_FILE, FILE_MODE)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != FILE_MODE:  # a umask wider than 0o077's
            os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_private(path: str, data: bytes) -> None:
    """``path`` holds ``data``, whole (a reader sees the old file or the new one), mode 0600.
    Raises OSError."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.unlink(tmp)  # left by a writer of the same pid that died
    except FileNotFoundError:
        pass
    fd = create_private(tmp)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def peer_uid(sock: socket.socket) -> Optional[int]:
    """The uid of the process that connected ``sock`` (a Unix socket), as it was when it
    connected; None where the platform cannot say (``SO_PEERCRED`` is Linux's)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i"))
    except OSError:
        return None
    return int(struct.unpack("3i", creds)[1])
