"""A file written by appending, through a shared memory map (the timeline's event files:
:mod:`..protocols.timeline`): no system call per write, and what was copied survives the
process (the kernel's page cache holds it). The file grows in :data:`CHUNK` steps allocated
before use: a full disk stops the map, never the writer, which goes on with ``os.pwrite``."""

from __future__ import annotations

import mmap
import os
import threading
from typing import Optional

__all__ = ["CHUNK", "MappedFile"]


#: Bytes a file grows by at a time (for the timeline, one allocation per ~5000 spans).
CHUNK = 1 << 20


class MappedFile:
    """Append-only writes into a memory map of a file (see the module docstring); falls back
    to ``os.write`` where the file cannot be mapped or grown."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.lock = threading.Lock()
        self.pos = 0
        self.memory: Optional[mmap.mmap] = None
        try:
            os.posix_fallocate(self.fd, 0, CHUNK)
            self.memory = mmap.mmap(self.fd, CHUNK)
        except (OSError, ValueError, AttributeError):  # no space, or no mmap here
            self.memory = None

    def write(self, data: bytes) -> None:
        with self.lock:
            mapped = self.memory
            end = self.pos + len(data)
            if mapped is not None and end > len(mapped):
                mapped = self._grow(end)
            if mapped is None:
                os.pwrite(self.fd, data, self.pos)
            else:
                mapped[self.pos:end] = data
            self.pos = end

    def _grow(self, end: int) -> Optional[mmap.mmap]:
        assert self.memory is not None
        size = (end // CHUNK + 1) * CHUNK
        try:
            os.posix_fallocate(self.fd, 0, size)  # real blocks: a full disk raises here
            self.memory.resize(size)
        except (OSError, ValueError, SystemError):  # keep writing without the map
            self.memory.close()
            self.memory = None
        return self.memory

    def close(self) -> None:
        with self.lock:
            if self.memory is not None:
                self.memory.close()
                self.memory = None
            os.ftruncate(self.fd, self.pos)
            os.close(self.fd)
