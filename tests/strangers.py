"""Another user on the same machine, played by a real process running as ``nobody`` (no
supplementary groups, started by root): what the tests of a shared box use to be the stranger
who reaches the run's socket, files or store. Skipped where there is no such user or no Python
it may run. ``STORE_CLIENT`` is a c10d store client in the standard library alone (the other
user's Python has no torch): it speaks TCPStore's wire protocol as ``benchmarks/store_traffic.py``
documents it."""

from __future__ import annotations

import functools
import pwd
import subprocess
import sys

import pytest

__all__ = ["other_user", "as_nobody", "intruder_python", "STORE_CLIENT"]


def other_user() -> pwd.struct_passwd:
    """The user that plays the stranger (the test is skipped without one)."""
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' to play another user")


def as_nobody(python: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run ``python args...`` as the other user, from ``/``, with a bare environment."""
    who = other_user()
    return subprocess.run([python, *args], user=who.pw_uid, group=who.pw_gid, extra_groups=[],
                          cwd="/", capture_output=True, text=True, timeout=timeout,
                          env={"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"})


@functools.lru_cache(maxsize=None)
def intruder_python() -> str:
    """A Python the other user may run (this one may live under root's home)."""
    for python in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            if as_nobody(python, "-c", "pass").returncode == 0:
                return python
        except OSError:  # not there, or not for this user
            continue
    pytest.skip("no Python that user 'nobody' may run")


#: ``python -c STORE_CLIENT PORT HOW``: overwrite every kit key of the c10d store on
#: 127.0.0.1:PORT (``HOW``: ``garbage`` bytes no record or counter holds; ``counted``: a
#: number with every rank's bit set in a counter, a record's copy with its digits changed and
#: no seal); prints how many keys it overwrote.
STORE_CLIENT = r'''
import re, socket, struct, sys
VALIDATE, SET, GET, LIST_KEYS, MAGIC = 0, 1, 3, 17, 0x3C85F7CE
KIT_KEY = re.compile(r"(^|/)axd/|^/?axolotl_dist/(?!attempt/\d+/)")
sock = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
def blob(data): return struct.pack("<Q", len(data)) + data
def recv(n):
    got = b""
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        if not chunk: raise EOFError("the store closed the connection")
        got += chunk
    return got
def number(): return struct.unpack("<Q", recv(8))[0]
def value(): return recv(number())
sock.sendall(bytes([VALIDATE]) + struct.pack("<I", MAGIC))
sock.sendall(bytes([LIST_KEYS]))
keys = [value().decode() for _ in range(number())]
done = 0
for key in keys:
    if not KIT_KEY.search(key):
        continue
    sock.sendall(bytes([GET]) + blob(key.encode()))
    old = value()
    if sys.argv[2] == "garbage":
        new = b"\x00garbage\xff"
    elif old.strip().isdigit():
        new = b"2147483647"
    else:
        body = re.sub(rb"^\x1fs1:[A-Za-z0-9_-]{22}:", b"", old)
        new = body.translate(bytes.maketrans(b"0123456789", b"1234567890")) or b"1"
    sock.sendall(bytes([SET]) + blob(key.encode()) + blob(new))
    done += 1
sock.sendall(bytes([GET]) + blob(b"/axolotl_dist/run"))  # a reply: every SET before it is done
value()
print(done)
'''
