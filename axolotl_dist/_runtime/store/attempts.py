"""Each attempt of a restarted run in its own namespace of a store that outlives attempts.

``torchrun --max-restarts N`` (and ``axolotl-dist``, ``accelerate launch``) stop every rank on a
failure and start them again; the ranks of every attempt connect to the same c10d store, the
launcher's agent's (``TORCHELASTIC_USE_AGENT_STORE=True``), which keeps what the previous
attempt wrote: torch's own bootstrap of the process group (the dead attempt's gloo addresses)
and the kit's records (its failures, blocks, heartbeats). An attempt that read them would fail
with the last attempt's error, or connect to a dead rank.

Where the agent hosts the store (:func:`.access.agent_hosts_store`; a store hosted by rank 0,
under bare env vars, ``srun`` or ``mpirun``, dies with the attempt), the ranks of an attempt
agree on its number first, and keep everything else under :func:`~.keys.attempt_prefix` of it. No environment variable names an attempt on every node
alike (``TORCHELASTIC_RESTART_COUNT`` counts one node's restarts; a membership change restarts
with the same count), so the number comes from the store, and a rank must tell a fresh answer
from a stale one. The handshake (:func:`agree`):

* rank 0 takes the next number, ``E = add(ATTEMPTS, 1)``: only the one live rank 0 counts, so
  ``E`` is new;
* every other rank draws a random token, writes it to :func:`~.keys.attempt_join` and waits
  for :func:`~.keys.attempt_answer` of that token in one blocking ``get``: a key nobody wrote
  before, so whatever it holds is rank 0's answer for this attempt. It then marks itself in
  :func:`~.keys.attempt_joined` of ``E``;
* rank 0 reads the tokens and answers each one it has not answered yet, until every rank
  marked itself under ``E``. A token it reads may be a dead attempt's: its answer is then
  never read, and the rank's fresh token is answered at the next look.

No blocking call times out (one that does makes torch print C++ warnings): a rank above 0
blocks in its ``get`` with a timer that, at its deadline, writes the answer key itself from a
fresh connection (:data:`_GAVE_UP`, a value rank 0 never writes), so the ``get`` returns and
the rank raises its own error. Rank 0 polls: ``check`` at 1 ms growing by half to 50 ms, and
names the ranks it still waits for after ``late_after`` seconds (doubling): ``rank 5
has not reached the store for 30 s; the other 63 wait``. Cost: a rank above 0 makes three
calls (``set``, ``get``, ``set``); rank 0 one ``add``, then one ``check`` of the ``W - 1``
tokens per look until all exist, one ``multi_get`` of them, a ``multi_set`` of the answers
and one ``check`` of the ``W - 1`` marks per look until every rank joined (a look or two: a
rank's mark follows its answer at once). Per rank: 3 + (a dozen looks) / W. The keys are tiny
and stay (a few per rank per attempt).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from datetime import timedelta
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional

from ...errors import DistributedEnvError
from ..base.kitlog import kit as log
from ..base.text import ranks_text
from . import keys, records, seals
from .access import checked_or_ignored, put
from .store_state import STORE

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import Store

__all__ = ["agree", "agreed_attempt", "attempt_store", "connect", "forget"]

#: Seconds between rank 0's looks at the tokens: the first, then growing by half to the last.
_FIRST_LOOK, _LAST_LOOK = 0.001, 0.05


def agree(store: "Store", rank: int, world_size: int, timeout: timedelta,
          late_after: float = 30.0, late_level: int = logging.WARNING) -> int:
    """The number of the attempt this rank belongs to, the same on its ``world_size`` ranks
    (see the module docstring); :class:`DistributedEnvError` if they do not all come within
    ``timeout``. Rank 0 names the ranks it still waits for after ``late_after`` seconds, then
    at doubling intervals, at log level ``late_level``."""
    deadline = time.monotonic() + timeout.total_seconds()
    if rank == 0:
        return _lead(store, world_size, deadline, _Late(world_size, late_after, late_level))
    return _join(store, rank, timeout, deadline)


_TOKEN_LEN = 32  # uuid4().hex

#: What a rank's own timer writes to its answer key at its deadline: no attempt's number.
_GAVE_UP = b"\x00gave up"
#: Seconds before its deadline the timer writes it: the ``get`` itself times out at the deadline.
_MARGIN = 0.5


def _pauses() -> Iterator[float]:
    """The pauses between looks: :data:`_FIRST_LOOK`, growing by half, then :data:`_LAST_LOOK`."""
    pause = _FIRST_LOOK
    while True:
        yield pause
        pause = min(_LAST_LOOK, pause * 1.5)


class _Late:
    """Rank 0's account of the ranks it waits for in the handshake: logged after ``after``
    seconds, then at doubling intervals."""

    def __init__(self, world_size: int, after: float, level: int) -> None:
        self.world_size, self.start, self.every = world_size, time.monotonic(), after
        self.level = level
        self.next_at = self.start + after

    def look(self, store: "Store", wanted: List[str], what: str) -> None:
        """Name the ranks whose key of ``wanted`` (one per rank 1..W-1) is missing, if due."""
        now = time.monotonic()
        if now < self.next_at:
            return
        self.every *= 2
        self.next_at = now + self.every
        missing = [r for r, key in enumerate(wanted, 1) if not store.check([key])]
        if missing:
            log.emit(self.level, "%s %s for %.0f s; the other %d wait", _ranks(missing), what,
                     now - self.start, self.world_size - len(missing))


def _ranks(ranks: List[int]) -> str:
    """``rank 5 has`` / ``ranks 1-8, 11 and 3 more have``: the subject of :class:`_Late`'s
    line, at most :data:`_NAMED` ranks named (:func:`~..base.text.ranks_text`)."""
    more = f" and {len(ranks) - _NAMED} more" if len(ranks) > _NAMED else ""
    return f"{ranks_text(ranks[:_NAMED])}{more} {'has' if len(ranks) == 1 else 'have'}"


#: The most ranks :class:`_Late` names in a line.
_NAMED = 8


def _until(store: "Store", wanted: List[str], deadline: float,
           late: Optional[_Late] = None, what: str = "") -> bool:
    """Poll until every key of ``wanted`` exists (True) or ``deadline`` passes (False), naming
    the missing ones through ``late``. Not ``store.wait``: one that times out makes torch print
    C++ warnings."""
    pauses = _pauses()
    while not store.check(wanted):
        if time.monotonic() > deadline:
            return False
        if late is not None:
            late.look(store, wanted, what)
        time.sleep(next(pauses))
    return True


def _lead(store: "Store", world_size: int, deadline: float, late: _Late) -> int:
    attempt = int(store.add(keys.ATTEMPTS, 1))
    tokens = [keys.attempt_join(r) for r in range(1, world_size)]
    joined = [keys.attempt_joined(attempt, r) for r in range(1, world_size)]
    # a rank's first token ever (the run's first attempt)
    if not _until(store, tokens, deadline, late, "not reached the store"):
        raise DistributedEnvError(_late(store, attempt, world_size))
    answered: Dict[int, bytes] = {}
    pauses = _pauses()
    while True:
        fresh = [(r, t) for r, t in enumerate(store.multi_get(tokens), 1) if answered.get(r) != t]
        drawn = [(r, _token(t, r)) for r, t in fresh]  # None: not this run's, not answered
        names = [keys.attempt_answer(r, token) for r, token in drawn if token is not None]
        if names:
            store.multi_set(names, [seals.seal(k, str(attempt)) for k in names])
        answered.update(fresh)
        if store.check(joined):
            return attempt
        if time.monotonic() > deadline:
            raise DistributedEnvError(_late(store, attempt, world_size))
        late.look(store, joined, f"not joined attempt {attempt}")
        time.sleep(next(pauses))


def _late(store: "Store", attempt: int, world_size: int) -> str:
    """Rank 0's message when ranks did not take this attempt's number in time."""
    missing = ", ".join(str(r) for r in range(1, world_size)
                        if not store.check([keys.attempt_joined(attempt, r)]))
    return (f"rank 0 began attempt {attempt} of this run in init_distributed, but rank(s) "
            f"{missing or 'above 0'} did not join it in time: are they started, with the same "
            "MASTER_ADDR, MASTER_PORT and WORLD_SIZE? (raise init_distributed(timeout=...) if "
            "they start late)")


def _join(store: "Store", rank: int, timeout: timedelta, deadline: float) -> int:
    token = uuid.uuid4().hex
    put(store, keys.attempt_join(rank), token)
    answer = keys.attempt_answer(rank, token)
    # before the get's own timeout (which makes torch print C++ warnings) runs out
    timer = threading.Timer(max(0.0, deadline - time.monotonic() - _MARGIN), _give_up, (store, answer))
    timer.daemon = True
    timer.start()
    try:
        data = store.get(answer)  # returns with rank 0's answer, or the timer's
    finally:
        timer.cancel()
    attempt = None
    while attempt is None:  # an answer not sealed by this run is none: the genuine one follows
        if data == _GAVE_UP:
            raise DistributedEnvError(
                f"rank {rank} waited {timeout.total_seconds():.0f} s in init_distributed for "
                "rank 0 to begin this attempt of the run: is rank 0 started, under the same "
                "launcher? (raise init_distributed(timeout=...) if it starts late)")
        attempt = checked_or_ignored(lambda data: records.read_number(data, "an attempt's number"),
                                     data, answer, 0)
        if attempt is None:
            time.sleep(_LAST_LOOK)
            data = store.get(answer) if time.monotonic() < deadline else _GAVE_UP
    store.set(keys.attempt_joined(attempt, rank), "")
    return attempt


def _give_up(store: "Store", answer: str) -> None:
    """A joiner's deadline: write :data:`_GAVE_UP` to its ``answer`` key, unless rank 0 answered
    first, from a fresh connection (the joiner's own is blocked in its ``get``)."""
    try:
        store.clone().compare_set(answer, "", _GAVE_UP)
    except Exception:  # noqa: BLE001 - the store is gone: the joiner's get fails on its own
        pass


def _token(data: bytes, rank: int) -> Optional[str]:
    """Global ``rank``'s join token as rank 0 read it; None for one not sealed by this run
    (ignored); DistributedEnvError naming the key for bytes the kit did not draw."""
    return checked_or_ignored(lambda raw: records.read_token(raw, "a join token", _TOKEN_LEN),
                              data, keys.attempt_join(rank), rank)


def forget() -> None:
    """A new group starts: no attempt is agreed on until :func:`attempt_store` runs again."""
    STORE.attempt = None


def connect(addr: str, port: int, world_size: int, timeout: timedelta) -> "Store":
    """A connection to the agent's store at ``addr:port`` (the root of every attempt's keys)."""
    import torch.distributed as dist

    return dist.TCPStore(addr, port, world_size, False, timeout)


def attempt_store(root: "Store", rank: int, world_size: int, timeout: timedelta,
                  late_after: float = 30.0, late_level: int = logging.WARNING) -> "Store":
    """This attempt's namespace of the agent's store ``root`` (:func:`connect`), once the ranks
    agreed on its number (:func:`agree`): where the kit has
    :func:`torch.distributed.init_process_group` bootstrap the group, and so where the kit's
    group keys live (under the group's own prefix). The number is kept in ``STORE.attempt``
    (:func:`agreed_attempt`)."""
    import torch.distributed as dist

    attempt = STORE.attempt = agree(root, rank, world_size, timeout, late_after, late_level)
    return dist.PrefixStore(keys.attempt_prefix(attempt), root)


def agreed_attempt() -> Optional[int]:
    """The number of this attempt the ranks agreed on through the agent's store (from 1), or
    None where no such handshake ran (:func:`axolotl_dist.get_attempt`)."""
    return STORE.attempt
