"""Unit tests of the warnings fold's counter bits (``_runtime/lifecycle/warnfold.py``) on
``keys.WAITERS``, the counter it shares with the kit's long waits: the low 32 bits count the
waits that run long (``keys.LONG_WAITS``, read by rank 0's heartbeat), bits 32-61 the
warnings ranks published (:data:`WARNED` each), bit 62 says rank 0 reads no more of them
(:data:`UNREAD`). A rank packs with ``_publish`` (one ``add``), rank 0 unpacks with ``read``
(the heartbeat's value) and sets the flag with ``close``. An in-memory stand-in for the c10d
store's ``add`` / ``append`` / ``get``; no store, no process, no thread."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Dict, List

import pytest

from axolotl_dist._runtime.base import hooks
from axolotl_dist._runtime.lifecycle import warnfold
from axolotl_dist._runtime.lifecycle.warnfold import FOLD, FoldedWarnings
from axolotl_dist._runtime.liveness import heartbeat
from axolotl_dist._runtime.store import keys
from axolotl_dist._runtime.store.keys import LONG_WAITS, UNREAD, WARNED

#: The most warnings bits 32-61 hold.
MOST = (1 << 30) - 1
#: The bits of each field of the counter.
WAITS_BITS, COUNT_BITS, FLAG_BITS = LONG_WAITS, UNREAD - WARNED, UNREAD


class Store:
    """The store calls the fold makes: ``add`` on the counter, ``append`` / ``get`` on the log
    (Python ints: the c10d store's counters are int64, which no test here leaves)."""

    def __init__(self, counter: int = 0) -> None:
        self.values: Dict[str, object] = {keys.WAITERS: counter, keys.WARN_LOG: b""}
        self.gets: List[str] = []

    def add(self, key: str, amount: int) -> int:
        self.values[key] += amount  # type: ignore[operator]
        return self.values[key]  # type: ignore[return-value]

    def append(self, key: str, value: str) -> None:
        self.values[key] += value.encode()  # type: ignore[operator]

    def get(self, key: str) -> bytes:
        self.gets.append(key)
        return self.values[key]  # type: ignore[return-value]


class Beat:
    """What the fold uses of a rank's heartbeat."""

    def __init__(self, rank: int, store: Store) -> None:
        self.rank, self.store, self.base = rank, store, store
        self.world_size = 3
        self.when = SimpleNamespace(stall_rounds=None)

    def store_usable(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def fold(monkeypatch):
    """A pending table of this test's own; no secret unless a test sets one."""
    monkeypatch.delenv("AXOLOTL_DIST_SECRET", raising=False)
    monkeypatch.delenv("AXOLOTL_DIST_SECRET_FILE", raising=False)
    folding = FoldedWarnings()
    monkeypatch.setattr(FOLD, "folding", folding)
    return folding


def _pending(folding: FoldedWarnings) -> Dict[str, set]:
    return {text: ranks for text, (ranks, _) in folding.pending.items()}


def test_the_three_fields_share_no_bit_and_fill_a_positive_int64():
    assert WARNED == 1 << 32 == LONG_WAITS + 1  # the count starts right above the waits
    assert UNREAD == 1 << 62
    fields = (WAITS_BITS, COUNT_BITS, FLAG_BITS)
    for a, b in itertools.combinations(fields, 2):
        assert a & b == 0, (hex(a), hex(b))
    assert WAITS_BITS | COUNT_BITS | FLAG_BITS == (1 << 63) - 1  # the sign bit stays clear
    assert COUNT_BITS == MOST * WARNED  # 30 bits of count
    assert (UNREAD | COUNT_BITS | LONG_WAITS) < 1 << 63  # every packed value is a valid int64


@pytest.mark.parametrize("count, waits, unread", itertools.product(
    (1, 2, 1000, 1 << 29, MOST), (0, 1, LONG_WAITS), (False, True)))
def test_rank_0_reads_the_count_whatever_the_other_fields_hold(fold, count, waits, unread):
    store = Store()
    beat = Beat(0, store)
    warnfold.read(beat, count * WARNED + waits + (UNREAD if unread else 0))
    assert fold.counted == count
    assert store.gets == [keys.WARN_LOG]  # the count rose: one read of the log


@pytest.mark.parametrize("value", [
    5 * WARNED,                           # the same count
    5 * WARNED + LONG_WAITS,              # long waits do not make up a warning
    5 * WARNED + UNREAD,                  # nor does the flag
    4 * WARNED + LONG_WAITS + UNREAD,     # a lower count: already read
    0,
])
def test_rank_0_reads_the_log_only_when_the_count_rose(fold, value):
    store = Store()
    beat = Beat(0, store)
    fold.counted = 5
    warnfold.read(beat, value)
    assert store.gets == [] and fold.counted == 5
    warnfold.read(beat, value % WARNED + 6 * WARNED)  # one more, whatever the waits
    assert store.gets == [keys.WARN_LOG] and fold.counted == 6


@pytest.mark.parametrize("secret", [None, "0123456789abcdef0123456789abcdef"])
def test_what_ranks_publish_rank_0_reads_back_once_with_their_ranks(fold, monkeypatch, secret):
    if secret:
        monkeypatch.setenv("AXOLOTL_DIST_SECRET", secret)
    store = Store()
    one, two, zero = Beat(1, store), Beat(2, store), Beat(0, store)
    assert warnfold._publish(one, ["a.py:1: UserWarning: a\n", "b.py:2: UserWarning: b\n"])
    assert store.values[keys.WAITERS] == 2 * WARNED  # one add of both: 2 in bits 32-61
    store.add(keys.WAITERS, 1)  # a long wait starts meanwhile: the low bits only
    assert warnfold._publish(two, ["a.py:1: UserWarning: a\n"])
    assert store.values[keys.WAITERS] == 3 * WARNED + 1
    warnfold.read(zero, store.add(keys.WAITERS, 0))  # the heartbeat's read of the counter
    assert fold.counted == 3 and fold.log_read == len(store.values[keys.WARN_LOG])
    assert _pending(fold) == {"a.py:1: UserWarning: a\n": {1, 2}, "b.py:2: UserWarning: b\n": {1}}

    fold.pending.clear()
    store.add(keys.WAITERS, -1)  # the long wait ended: no warning counted away
    warnfold.read(zero, store.add(keys.WAITERS, 0))
    assert len(store.gets) == 1 and fold.pending == {}
    assert warnfold._publish(two, ["c.py:3: UserWarning: c\n"])
    warnfold.read(zero, store.add(keys.WAITERS, 0))
    assert fold.counted == 4
    assert _pending(fold) == {"c.py:3: UserWarning: c\n": {2}}  # only the log's new part


def test_once_rank_0_closed_a_publisher_is_told_to_print_its_warning_itself(fold, monkeypatch):
    printed: list = []
    monkeypatch.setattr(FOLD, "warn_hook", lambda *shown: None)  # installed()
    monkeypatch.setattr(warnfold, "bounded", lambda fn, seconds: fn())  # no store worker
    monkeypatch.setattr(warnfold, "_print", printed.extend)
    store = Store(counter=LONG_WAITS)  # every wait bit set: none of them reads as the flag
    one, zero = Beat(1, store), Beat(0, store)
    assert warnfold._publish(one, ["a.py:1: UserWarning: a\n"])  # rank 0 still reads
    warnfold.close(zero)
    assert store.values[keys.WAITERS] == LONG_WAITS + WARNED + UNREAD
    assert fold.counted == 1  # close read what was published before the flag, from its answer
    assert printed == [("a.py:1: UserWarning: a\n", {1})]
    assert not warnfold._publish(one, ["b.py:2: UserWarning: b\n"])  # the flag: print it here
    assert store.values[keys.WAITERS] == LONG_WAITS + 2 * WARNED + UNREAD  # still counted
    warnfold.close(Beat(1, store))  # a rank above 0 sets no flag
    assert store.values[keys.WAITERS] == LONG_WAITS + 2 * WARNED + UNREAD


def test_a_full_count_is_read_and_one_more_is_printed_by_its_rank_not_read_twice(fold):
    # the count does not saturate: the warning past MOST carries into the flag's bit, so its
    # rank prints it itself (as after rank 0's exit), and rank 0's read sees no new count
    store = Store(counter=(MOST - 1) * WARNED + LONG_WAITS)
    one, zero = Beat(1, store), Beat(0, store)
    fold.counted = MOST - 1
    assert warnfold._publish(one, ["a.py:1: UserWarning: a\n"])
    warnfold.read(zero, store.add(keys.WAITERS, 0))
    assert fold.counted == MOST and len(store.gets) == 1
    assert not warnfold._publish(one, ["b.py:2: UserWarning: b\n"])
    assert store.values[keys.WAITERS] == UNREAD + LONG_WAITS  # the long waits untouched
    warnfold.read(zero, store.add(keys.WAITERS, 0))
    assert fold.counted == MOST and len(store.gets) == 1


@pytest.mark.parametrize("value, stalls, warned", [
    (0, False, 0),
    (1, True, 0),
    (LONG_WAITS, True, 0),                       # every wait bit: no warning
    (WARNED, False, 1),                          # one warning: no long wait
    (MOST * WARNED + UNREAD, False, MOST),       # every bit above the waits: no long wait
    (MOST * WARNED + UNREAD + LONG_WAITS, True, MOST),
    (7 * WARNED + 2, True, 7),
])
def test_rank_0s_heartbeat_reads_long_waits_and_warnings_apart(fold, value, stalls, warned):
    # the counter's other reader: heartbeat._waiters turns the stall detector on from the low
    # bits and hands the value to the fold (its task on rank 0's heartbeat)
    assert [type(task) for task in hooks.heartbeat_tasks()] == [warnfold._OnHeartbeat]
    beat = Beat(0, Store(counter=value))
    heartbeat.Heartbeat._waiters(beat)  # type: ignore[arg-type]
    assert beat.when.stall_rounds is stalls
    assert fold.counted == warned
