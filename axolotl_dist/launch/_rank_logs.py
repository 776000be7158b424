"""``--log-dir DIR``: each rank's whole output in ``DIR/rank<r>.log``, line by line, with the
time, the rank and the stream (``2026-11-27 17:33:51.825 [rank 1] stdout: ...``); a restarted
rank's lines (``--max-restarts``) follow a line that says where its attempt begins.
:class:`._output.Output` feeds it."""

from __future__ import annotations

from typing import Dict

__all__ = ["RankLog", "log_name"]

_STREAMS = {1: b"stdout", 2: b"stderr"}


def log_name(rank: int) -> str:
    """The file of rank ``rank``'s output in a log directory."""
    return f"rank{rank}.log"


class RankLog:
    """One rank's whole output, line by line, with the time and the stream."""

    def __init__(self, path: str) -> None:
        self.file = open(path, "wb")
        self.partial: Dict[int, bytes] = {}
        self.attempt = 0  # the restart count of the process whose lines come now

    def begin(self, attempt: int, stamp: bytes) -> None:
        """Lines of a restarted rank (``--max-restarts``) follow one that says so: the
        attempts of one rank share its file."""
        if attempt > self.attempt:
            self._end_partial_lines(stamp)  # the last attempt's unfinished lines end here
            self.attempt = attempt
            self.file.write(stamp + b"axolotl-dist: attempt %d (restart %d) starts here\n"
                            % (attempt + 1, attempt))

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
        self._end_partial_lines(stamp)
        self.file.close()

    def _end_partial_lines(self, stamp: bytes) -> None:
        for fd in list(self.partial):
            self.write(fd, b"\n", stamp)
