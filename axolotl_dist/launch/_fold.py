"""Folding what several ranks print alike into one line that names them (``axolotl-dist``).

:class:`Folder` takes each local rank's output as it arrives (bytes, per rank and stream) and
gives back what the launcher writes, in order:

* a complete line (with the indented lines that came with it in one write: a log record's or
  a warning's continuation) that other ranks print alike within :data:`WINDOW` seconds is
  written once, with the set of ranks: ``[ranks 0-3] UserWarning: ...``. "Alike" ignores a
  leading time of day (``12:00:01``, ``2026-01-01 12:00:01,123``), the rank's own tag (the
  kit's ``[rank 1/4]``, torch's ``[rank1]:``), which becomes the set (``[ranks 0-3/4]``), and
  the date, time and pid or thread id in torch's C++ log prefix (c10's ``[W1126
  21:40:08.123456789 reducer.cpp:1529]``, glog's ``W1126 21:40:08.123456 12345 file.cpp:12]``:
  its severity, file and line still count); the line written is the first rank's;
* a line no other rank printed alike is written after the window with its rank (``[rank 2]``,
  or as it is where it carries the kit's tag); one every local rank printed, as soon as the
  last did; torch's tag is shown as the launcher's label (``[rank1]: x`` as ``[rank 1] x``);
* no line waits longer than :data:`WINDOW`, and one rank's lines are never reordered: a group
  is written only after every earlier group holding one of its ranks;
* a traceback (``Traceback (most recent call last):`` and what follows within
  :data:`BLOCK_QUIET` of each line) is written whole, in one piece, each line with its rank,
  never folded with another rank's;
* a block of C++ frames torch prints (``Exception raised from X at file.cpp:12 (most recent
  call first):``, then ``frame #0: ...`` lines, ``<omitting python frames>``, a blank line)
  is written as one line: its first, with a note (where the frames are kept: the rank's log
  file) in place of the frames;
* progress bars (output with ``\\r`` and no newline yet) and a partial line left waiting pass
  through at once; a line written while a bar is open goes above it (on a terminal the bar is
  cleared and redrawn, elsewhere the bar's line is ended first).

It keeps no file or socket: :mod:`._output` feeds it and writes what it returns.
"""

from __future__ import annotations

import os
import re
from collections import deque
from typing import Deque, Dict, List, Optional, Sequence, Set, Tuple

from .._runtime.base.text import RankTag, find_rank_tag, ranks_text
from ._rank_logs import log_name

__all__ = ["WINDOW", "BLOCK_QUIET", "Folder", "label", "CPP_NOTE"]

#: Seconds a line waits for other ranks' alike lines (the longest any line is held).
WINDOW = 0.25
#: A traceback ends after this many seconds without a new line from its rank.
BLOCK_QUIET = 0.1
#: A traceback is written once it is this old (seconds) or this long (lines), even mid-flow.
_BLOCK_MAX_AGE, _BLOCK_MAX_LINES = 1.0, 2000
_TB_HEAD = b"Traceback (most recent call last):"
#: The first line of a block of C++ frames torch prints (c10's ``Error::what()`` of an error
#: it logs as a warning), the lines that continue it, and the end of its first line.
_CPP_HEAD = b"Exception raised from "
_CPP_FRAME = re.compile(rb"frame #\d+: |<omitting python frames>$|$")
_CPP_TAIL = b" (most recent call first):"
#: What :class:`Folder` writes after a C++ block's first line by default.
CPP_NOTE = b"(its C++ frames are not shown: --log-dir keeps them)"
#: A leading time of day: ``12:00:01``, ``12:00:01.123``, ``2026-01-01 12:00:01,123``.
_TIME = re.compile(rb"(?:\d{4}-\d\d-\d\d[ T])?\d\d:\d\d:\d\d(?:[.,]\d+)? ")
#: How far into a line a rank's own tag (the kit's ``[rank 1/4]``, torch's ``[rank1]:``: read
#: by :func:`~.._runtime.base.text.find_rank_tag`, beside the kit's writer) may start and end: a
#: tag further in is part of the message.
_TAG_WITHIN = 160
#: torch's C++ log prefix at the start (after the rank's tag): its severity, then the date and
#: time (c10: ``[W1126 21:40:08.123456789 ``; glog: ``W1126 21:40:08.123456 ``, or with the
#: year, ``W20261126``), then a pid or thread id where it has one, before ``file.cpp:123] ``.
_CPP = re.compile(rb"(\[?[FEWIV])\d{3,8} \d\d:\d\d:\d\d\.\d+(?: +\d+)?(?= [^ \]]+:\d+\] )")
_CPP_FIRST = frozenset(b"[FEWIV")
#: A C++ log line as :func:`_parse` leaves it: its severity, then ``file.cpp:123] ``.
_CPP_LOGGED = re.compile(rb"\[?[FEWIV] [^ \]]+:\d+\] ")
_INDENT = (b" ", b"\t")


_LABELS: Dict[Tuple[int, ...], bytes] = {}


def label(ranks: Sequence[int]) -> bytes:
    """``[rank 2]`` / ``[ranks 0-3]``."""
    key = tuple(ranks)
    text = _LABELS.get(key)
    if text is None:
        if len(_LABELS) > 4096:
            _LABELS.clear()
        text = _LABELS[key] = b"[" + ranks_text(key).encode() + b"]"
    return text


def _labelled(line: bytes, tag: Optional[RankTag], ranks: List[int],
              owner: int) -> bytes:
    """``line`` as shown, printed alike by ``ranks`` (``owner`` first): its own tag where it
    has the kit's (``[rank 1/4]``, ``[ranks 0-3/4]`` once folded), the launcher's label in
    place of torch's (``[rank1]:``, its excepthook's and C++ logs' prefix: ``[rank 1]``, so one
    run's lines carry one form), else the label before it."""
    if tag is None:
        return label(ranks) + b" " + line
    if tag.torch:
        return line[:tag.start] + label(ranks) + b" " + line[tag.end:]  # the tag took its ": "
    if ranks == [owner]:
        return line
    return line[:tag.start] + label(ranks)[:-1] + tag.rest + line[tag.end:]


class _Group:
    """One line, and the ranks that printed it alike so far."""

    __slots__ = ("key", "fd", "line", "tag", "owner", "ranks", "deadline", "done", "busy")

    def __init__(self, key: bytes, fd: int, line: bytes, tag: Optional[RankTag],
                 owner: int, deadline: float) -> None:
        self.key, self.fd, self.line, self.tag = key, fd, line, tag
        self.owner = owner  # whose line ``line`` is
        self.ranks: Dict[int, int] = {}  # rank -> the group's place among that rank's lines
        self.deadline = deadline
        self.done = self.busy = False


class _Block:
    """A rank's traceback (or, ``cpp``, a block of torch's C++ frames), collected until it is
    whole."""

    __slots__ = ("fd", "lines", "start", "last", "cpp")

    def __init__(self, fd: int, now: float, cpp: bool = False) -> None:
        self.fd, self.lines, self.start, self.last = fd, [], now, now
        self.cpp = cpp


def _cpp_log(line: bytes) -> bool:
    """Whether ``line`` is one of torch's C++ log lines (``[W1129 05:50:11.798 file.cpp:126]
    ...``): it ends a Python traceback it follows (it comes from another thread or C++)."""
    return _CPP_LOGGED.match(_parse(line)[0]) is not None


def _continues_cpp(line: bytes) -> bool:
    """Whether ``line`` (a rank's, its tag and time stripped) continues a C++ block: a frame,
    torch's ``<omitting python frames>``, or the blank line that ends it."""
    return _CPP_FRAME.match(_parse(line)[0].strip()) is not None


def _parse(line: bytes) -> Tuple[bytes, Optional[RankTag]]:
    """``(key, tag)``: the line as compared across ranks (no leading time, no rank tag, a C++
    log prefix as its severity, file and line only: ``b"[W reducer.cpp:1529] ..."``), and
    its rank tag, if it has one."""
    key, tag = line, None
    if line[:1].isdigit():
        m = _TIME.match(line)
        if m is not None:
            key = line[m.end():]
    first = line.find(b"\n")
    within = _TAG_WITHIN if first < 0 else min(first, _TAG_WITHIN)
    if b"[rank" in line[:within]:
        tag = find_rank_tag(line, within)
        if tag is not None:
            start = tag.start - (len(line) - len(key))
            if start >= 0:
                key = key[:start] + key[start + (tag.end - tag.start):]
    if key[:1] and key[0] in _CPP_FIRST:
        m = _CPP.match(key)
        if m is not None:
            key = m.group(1) + key[m.end():]
    return key, tag


class Folder:
    """See the module docstring. ``local``: how many ranks this launcher runs (a line every
    one of them printed is written at once); ``tty``: per output fd, whether it is a
    terminal (bars are then redrawn under a line, not ended by it); ``screens``: fd -> the
    screen it shows on (stdout and stderr on one terminal share one); ``fold=False``: every
    line passes through as it comes, unlabelled (``--no-fold``); ``fold_cpp``: a block of C++
    frames becomes one line (else it passes through, as ``--no-fold`` has it), which names the
    rank's file in ``log_dir`` (``--log-dir``) as where its frames are."""

    def __init__(self, local: int, tty: Dict[int, bool], fold: bool = True,
                 window: float = WINDOW, screens: Optional[Dict[int, int]] = None,
                 fold_cpp: bool = True, log_dir: Optional[str] = None) -> None:
        self.all = local
        self.tty, self.fold, self.window = tty, fold, window
        self.fold_cpp, self.log_dir = fold_cpp, log_dir
        self.open: Dict[Tuple[int, bytes], _Group] = {}  # (fd, key) -> the group still joinable
        self.order: Deque[_Group] = deque()  # groups not yet written, oldest first
        self.queues: Dict[int, Deque[_Group]] = {}  # rank -> its groups not yet written
        self.count: Dict[int, int] = {}  # rank -> how many groups it joined
        #: rank r -> rank m -> m's place of the last group r holds with m in it (a join that
        #: would put r's lines in another order than m's is refused: see :meth:`_join`)
        self.latest: Dict[int, Dict[int, int]] = {}
        self.partial: Dict[Tuple[int, int], bytes] = {}  # (rank, fd) -> bytes after the last \n
        self.partial_at: Dict[Tuple[int, int], float] = {}
        self.blocks: Dict[int, _Block] = {}  # rank -> its traceback being collected
        self.midline: Set[Tuple[int, int]] = set()  # (rank, fd) shown without its newline
        #: per screen (an output fd, or the one both go to), the rank whose unfinished line
        #: (a progress bar) is on it, and the text that redraws it
        self.bar: Dict[int, Tuple[int, bytes]] = {}
        self.screens = screens or {}
        self.out: List[Tuple[int, bytes]] = []

    # --- input ---------------------------------------------------------------------------

    def feed(self, rank: int, fd: int, data: bytes, now: float) -> None:
        """``data`` arrived from ``rank`` on stream ``fd`` (1 stdout, 2 stderr)."""
        key = (rank, fd)
        buf = self.partial.pop(key, b"") + data
        self.partial_at.pop(key, None)
        lines = buf.split(b"\n")
        rest = lines.pop()
        unit: List[bytes] = []  # a line and the indented lines after it in one read: one record
        for line in lines:
            if unit and line[:1] in _INDENT:
                unit.append(line)
                continue
            if unit:
                self._line(rank, fd, b"\n".join(unit), now)
            unit = [line]
        if unit:
            self._line(rank, fd, b"\n".join(unit), now)
        if rest:
            if b"\r" in rest:  # a progress bar's update: at once
                self._raw(rank, fd, rest)
            else:
                self.partial[key] = rest
                self.partial_at[key] = now

    def end(self, rank: int, fd: int, now: float) -> None:
        """``rank``'s stream ``fd`` ended: what it left without a newline is a line."""
        rest = self.partial.pop((rank, fd), b"")
        self.partial_at.pop((rank, fd), None)
        if rest:
            self._line(rank, fd, rest, now)
        block = self.blocks.get(rank)
        if block is not None and block.fd == fd:
            self._write_block(rank)

    def _line(self, rank: int, fd: int, line: bytes, now: float) -> None:
        if (rank, fd) in self.midline:  # the end of a bar or of a partial line shown already
            self._raw(rank, fd, line + b"\n")
            return
        block = self.blocks.get(rank)
        if block is not None:
            if block.fd == fd and (_continues_cpp(line) if block.cpp else not _cpp_log(line)):
                block.lines.extend(line.split(b"\n"))
                block.last = now
                if len(block.lines) >= _BLOCK_MAX_LINES:
                    self._write_block(rank)
                return
            self._write_block(rank)
        if self.fold_cpp and _parse(line)[0].startswith(_CPP_HEAD):
            self._release(rank)
            self.blocks[rank] = _Block(fd, now, cpp=True)
            self.blocks[rank].lines.append(line)
            return
        if not self.fold:
            self._raw(rank, fd, line + b"\n")
            return
        if b"\r" in line:  # the end of a progress bar, or a line written over one
            self._raw(rank, fd, line + b"\n")
            return
        key, tag = _parse(line)
        if key.startswith(_TB_HEAD):
            self._release(rank)
            self.blocks[rank] = blk = _Block(fd, now)
            blk.lines.extend(line.split(b"\n"))
            return
        self._group(rank, fd, line, now, key, tag)

    def _group(self, rank: int, fd: int, line: bytes, now: float,
               key: Optional[bytes] = None,
               tag: Optional[RankTag] = None) -> None:
        """Hold ``line`` in the group of lines alike to it (a new one where none is open)."""
        if key is None:
            key, tag = _parse(line)
        group = self.open.get((fd, key))
        if group is None or rank in group.ranks or not self._may_join(rank, group):
            group = _Group(key, fd, line, tag, rank, now + self.window)
            self.open[(fd, key)] = group
            self.order.append(group)
        self._join(rank, group)
        if len(group.ranks) >= self.all:
            self._write(group)

    def _may_join(self, rank: int, group: _Group) -> bool:
        """Whether ``rank`` may add its line to ``group``: its lines held now (written before
        this one) come before the group in every other member's lines too, so no rank's
        lines would be reordered to fold them."""
        latest = self.latest.get(rank)
        return latest is None or all(latest.get(m, -1) < place for m, place in group.ranks.items())

    def _join(self, rank: int, group: _Group) -> None:
        place = self.count[rank] = self.count.get(rank, 0) + 1
        group.ranks[rank] = place
        queue = self.queues.get(rank)
        if queue is None:
            queue = self.queues[rank] = deque()
        queue.append(group)
        mine = self.latest.get(rank)
        if mine is None:
            mine = self.latest[rank] = {}
        for m, at in group.ranks.items():
            mine[m] = at
            if m != rank:
                self.latest[m][rank] = place

    def _release(self, rank: int) -> None:
        """Write every held line of ``rank`` (it is about to write something at once)."""
        queue = self.queues.get(rank)
        while queue:
            self._write(queue[0])

    # --- time ----------------------------------------------------------------------------

    def due(self) -> Optional[float]:
        """When :meth:`tick` next has something to write (None: nothing waits)."""
        while self.order and self.order[0].done:
            self.order.popleft()
        times = [self.order[0].deadline] if self.order else []
        times += [b.last + BLOCK_QUIET for b in self.blocks.values()]
        times += [b.start + _BLOCK_MAX_AGE for b in self.blocks.values()]
        times += [t + self.window for t in self.partial_at.values()]
        return min(times) if times else None

    def tick(self, now: float) -> None:
        """Write what is due at ``now``: expired groups, whole tracebacks, stale partial lines."""
        for rank, block in list(self.blocks.items()):  # first: a C++ block's line may fold
            if now - block.last >= BLOCK_QUIET or now - block.start >= _BLOCK_MAX_AGE:
                self._write_block(rank)
        while self.order and (self.order[0].done or self.order[0].deadline <= now):
            self._write(self.order.popleft())
        for key, since in list(self.partial_at.items()):
            if now - since >= self.window:  # a prompt, or print(end=""): shown as it is
                del self.partial_at[key]
                self._raw(key[0], key[1], self.partial.pop(key))

    def flush(self) -> None:
        """Write everything held (the run ended)."""
        for rank, fd in list(self.partial):
            self.end(rank, fd, float("inf"))
        for rank in list(self.blocks):
            self._write_block(rank)
        while self.order:
            self._write(self.order.popleft())
        for rank, fd in list(self.midline):  # a bar left open: its line ends here
            self._raw(rank, fd, b"\n")

    def take(self) -> List[Tuple[int, bytes]]:
        """What to write since the last call: ``(fd, bytes)`` in order, runs on one fd merged."""
        out, self.out = self.out, []
        merged: List[Tuple[int, List[bytes]]] = []
        for fd, data in out:
            if merged and merged[-1][0] == fd:
                merged[-1][1].append(data)
            else:
                merged.append((fd, [data]))
        return [(fd, b"".join(parts)) for fd, parts in merged]

    # --- output --------------------------------------------------------------------------

    def _write(self, group: _Group) -> None:
        """Write ``group``, after every line its ranks held before it."""
        if group.done:
            return
        group.busy = True
        for m in list(group.ranks):
            queue = self.queues[m]
            while queue[0] is not group:
                if queue[0].busy:  # lines in crossed orders: m's line leaves the group
                    self._split(group, m)
                    break
                self._write(queue[0])
        group.busy, group.done = False, True
        if self.open.get((group.fd, group.key)) is group:
            del self.open[(group.fd, group.key)]
        for m in group.ranks:
            self.queues[m].popleft()
        if not group.ranks:
            return
        line = group.line
        text = line if not line.strip() else _labelled(line, group.tag, list(group.ranks),
                                                       group.owner)  # an empty line: no rank
        self._emit(group.fd, text + b"\n")

    def _split(self, group: _Group, rank: int) -> None:
        """Take ``rank`` out of ``group``: its line becomes a group of its own, in its place."""
        queue = self.queues[rank]
        alone = _Group(group.key, group.fd, group.line, group.tag, group.owner, group.deadline)
        alone.ranks[rank] = group.ranks.pop(rank)
        queue[queue.index(group)] = alone
        self.order.append(alone)

    def _write_block(self, rank: int) -> None:
        block = self.blocks.pop(rank)
        if block.cpp:  # one line: its first, the note in place of the frames
            head = block.lines[0]
            if head.endswith(_CPP_TAIL):
                head = head[:-len(_CPP_TAIL)]
            line = head + b" " + self._cpp_note(rank)
            if self.fold:
                self._group(rank, block.fd, line, block.last)
            else:
                self._raw(rank, block.fd, line + b"\n")
            return
        lines = [_labelled(line, _parse(line)[1], [rank], rank) for line in block.lines]
        self._emit(block.fd, b"\n".join(lines) + b"\n")

    def _cpp_note(self, rank: int) -> bytes:
        """What stands for the frames of ``rank``'s C++ block on screen."""
        if self.log_dir is None:
            return CPP_NOTE
        path = os.path.join(self.log_dir, log_name(rank))
        return b"(its C++ frames are in " + os.fsencode(path) + b")"

    def _raw(self, rank: int, fd: int, data: bytes) -> None:
        """``rank``'s output as it is, now (after its own held lines)."""
        if rank in self.blocks:  # a C++ block's line is held with the rest: written first
            self._write_block(rank)
        self._release(rank)
        if data.endswith(b"\n"):
            self.midline.discard((rank, fd))
        else:
            self.midline.add((rank, fd))
        self._emit(fd, data, rank)

    def _emit(self, fd: int, data: bytes, rank: int = -1) -> None:
        """Queue ``data`` for ``fd``: a rank's own unfinished line (``rank``) goes on, anything
        else goes above an open bar on that screen (cleared and redrawn on a terminal, its
        line ended elsewhere)."""
        screen = self.screens.get(fd, fd)
        bar = self.bar.get(screen)
        if bar is not None and bar[0] != rank:
            if self.tty.get(fd, False):
                data = b"\r\x1b[2K" + data + bar[1]
            else:
                del self.bar[screen]
                data = b"\n" + data
        self.out.append((fd, data))
        if rank >= 0:
            if data.endswith(b"\n"):
                self.bar.pop(screen, None)
            else:
                cut = data.rfind(b"\r")
                self.bar[screen] = (rank, data[cut:] if cut >= 0 else data)
