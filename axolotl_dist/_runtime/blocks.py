"""The store protocols behind :func:`~axolotl_dist.zero_first` and
:func:`~axolotl_dist.do_n_at_a_time` (their behaviour is documented in :mod:`axolotl_dist.ordering`).

``zero_first`` block number ``seq`` on a group keeps, under ``axd/zf/<seq>/``:

* ``site``: ``rank|file.py:line|where`` of the first rank to arrive. Every rank compares its
  own call site with it (one ``compare_set``), so blocks that do not pair (a block only some
  ranks enter shifts the numbering) raise :class:`~axolotl_dist.errors.CollectiveMismatchError`
  on every rank, naming both sites, instead of releasing a rank early;
* ``state``: the block's counters packed in one store integer, so that one ``add`` both
  updates and reads them (:class:`_Tally`): which ranks arrived, how many first ranks
  registered and finished, how many ranks are done with the block's keys, and the
  failed / mismatch flags. Beyond 31 ranks the arrival bits move to ``mask/<i>`` and the
  done / finished counts to ``tally``;
* ``firsts/<i>`` (explicit ``is_main``): for 31 ranks each, a bit per first rank and one per
  first rank done;
* ``error`` / ``mismatch``: the failure for the other ranks (the first published wins, by
  ``compare_set``), acknowledged by each reader (``<key>/ack/<rank>``) so a store host
  lingers until they have read it.

A block costs each rank three or four store round trips when nobody has to wait, and the rank
that finishes last deletes its two or three keys, so a loop of blocks does not grow the store.
A first rank waits for nobody before its body; when its outermost first-run block ends it
waits until every rank has reached each block it ran first (so nested blocks cannot
deadlock): the same guarantee as a barrier at the end of the block.
``do_n_at_a_time`` call ``seq`` keeps ``done/<round>`` counters, ``failed``, ``error`` and
``fin`` under ``axd/dn/<seq>/``. Sequence diagrams: docs/design.md, "zero_first blocks" and
docs/design.md, "do_n_at_a_time rounds".
"""

from __future__ import annotations

import pickle
from typing import TYPE_CHECKING, Callable, List, NamedTuple, Optional, Sequence, Tuple, TypeVar

from .callsite import CallSite
from .groups import global_ranks
from .records import await_readers, publish_error, read_error
from .peers import store_errors
from .state import STATE
from .store import group_store
from .wait import poll_until
from ..errors import CollectiveMismatchError, failure_report

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = ["ZeroFirstBlock", "first_run_begin", "first_run_end", "run_in_rounds"]

T = TypeVar("T")

#: Up to this many ranks a block's counters and arrival bits share one store integer.
_PACKED = 31
_FAILED = 1 << 56
_MISMATCH = 1 << 57
_MASK_BITS = 62  # arrival bits per ``mask/<i>`` key beyond _PACKED ranks
_WIDE = (1 << 28) - 1


class _Counts(NamedTuple):
    arrived: int
    firsts: int
    done: int
    fin: int
    failed: bool
    mismatch: bool


class _Tally:
    """How a block's counters sit in store integers (see the module docstring)."""

    def __init__(self, ws: int) -> None:
        self.packed = ws <= _PACKED
        if self.packed:  # state: arrival bits 0-30, firsts 32-39, done 40-47, fin 48-55
            self.first, self.done, self.fin = 1 << 32, 1 << 40, 1 << 48
        else:  # state: arrived 0-27, firsts 28-55; tally: done 0-27, fin 28-55
            self.first, self.done, self.fin = 1 << 28, 1, 1 << 28

    def arrival(self, rank: int) -> int:
        """What rank ``rank`` adds to ``state`` when it arrives: its own bit (packed, so the
        mask says *which* ranks are here), else 1 (a count; the bits go to ``mask/<i>``)."""
        return 1 << rank if self.packed else 1

    def counts(self, state: int, tally: int = 0) -> _Counts:
        failed, mismatch = bool(state & _FAILED), bool(state & _MISMATCH)
        if self.packed:
            return _Counts(bin(state & 0x7FFFFFFF).count("1"), (state >> 32) & 0xFF,
                           (state >> 40) & 0xFF, (state >> 48) & 0xFF, failed, mismatch)
        return _Counts(state & _WIDE, (state >> 28) & _WIDE, tally & _WIDE, (tally >> 28) & _WIDE,
                       failed, mismatch)


class ZeroFirstBlock:
    """One ``zero_first`` block on this rank (see the module docstring)."""

    def __init__(self, group: Optional["ProcessGroup"], seq: int, rank: int, ws: int,
                 site: CallSite, explicit: bool, first: bool) -> None:
        self.group, self.rank, self.ws, self.site = group, rank, ws, site
        self.explicit, self.first = explicit, first
        self.store = group_store(group)
        self.globals = global_ranks(group)
        self.p = f"axd/zf/{seq}"
        self.seq = seq
        self.what = f"zero_first block #{seq} at {site}"
        self.tally = _Tally(ws)
        self.now = _Counts(0, 0, 0, 0, False, False)  # the counts last read

    # -- the counters ---------------------------------------------------------------------

    def _add(self, state: int = 0, tally: int = 0) -> _Counts:
        """Add to the counters (0: just read them); remember and return what they say now."""
        s = self.store.add(f"{self.p}/state", state)
        t = 0 if self.tally.packed else self.store.add(f"{self.p}/tally", tally)
        self.now = self.tally.counts(s, t)
        return self.now

    def _flag(self, key: str, payload: bytes, flag: int) -> bool:
        """Publish ``payload`` under ``key`` unless another rank's came first; True if ours."""
        if self.store.compare_set(key, "", payload) != payload:
            return False
        self.store.add(f"{self.p}/state", flag)
        return True

    # -- arriving -------------------------------------------------------------------------

    def enter(self) -> None:
        """Pair this block with the other ranks' (by call site), register, arrive."""
        with store_errors(self.what):
            mine = f"{self.rank}|{self.site.key}|{self.site}"
            have = self.store.compare_set(f"{self.p}/site", "", mine).decode(errors="replace")
            if have != mine:
                other, key, where = have.split("|", 2)
                if key != self.site.key:
                    self._publish_mismatch(int(other), where)
            registers = self.explicit and self.first
            if registers:
                key, bit = self._first_bit()
                self.store.add(key, 1 << bit)
            if not self.tally.packed:
                word, bit = divmod(self.rank, _MASK_BITS)
                self.store.add(f"{self.p}/mask/{word}", 1 << bit)
            arrival = self.tally.arrival(self.rank) + (self.tally.first if registers else 0)
            if self._add(arrival).mismatch:
                raise self._stored("mismatch")

    def _publish_mismatch(self, other: int, other_site: str) -> None:
        error = CollectiveMismatchError(
            f"zero_first blocks do not pair: block #{self.seq} on the "
            f"{'default group' if self.group is None else 'group'} is at {other_site} on rank "
            f"{other} but at {self.site} on rank {self.rank}. Every rank must enter the same "
            "zero_first blocks in the same order: a zero_first inside a @zero_only function, "
            "or under an `if` on the rank, runs on some ranks only.",
            calls={other: f"zero_first at {other_site}", self.rank: f"zero_first at {self.site}"})
        if not self._flag(f"{self.p}/mismatch", pickle.dumps((self.rank, error)), _MISMATCH):
            raise self._stored("mismatch")  # another pair of ranks found it first
        await_readers(self.store, f"{self.p}/mismatch",
                      [r for r in range(self.ws) if r != self.rank], self.group)
        raise error

    def _stored(self, name: str) -> Exception:
        """The failure another rank published as ``name``: read, acknowledged, and kept
        readable for the remaining readers if this process hosts the store."""
        key = f"{self.p}/{name}"
        if name == "mismatch":
            publisher, error = pickle.loads(self.store.get(key))
            self.store.set(f"{key}/ack/{self.rank}", b"")
        else:
            error = read_error(self.store, key, self.rank)
            publisher = error.rank
        readers = [r for r in self._readers() if r not in (publisher, self.rank)]
        await_readers(self.store, key, readers, self.group)
        return error

    def _first_bit(self) -> Tuple[str, int]:
        """This rank's ``firsts/<i>`` key and bit (its done bit is 31 higher)."""
        word, bit = divmod(self.rank, 31)
        return f"{self.p}/firsts/{word}", bit

    def _first_words(self) -> List[int]:
        return [self.store.add(f"{self.p}/firsts/{w}", 0) for w in range(-(-self.ws // 31))]

    def _firsts(self) -> List[int]:
        """Group ranks that go first: rank 0, or those that registered (explicit ``is_main``)."""
        if not self.explicit:
            return [0]
        words = self._first_words()
        return [r for r in range(self.ws) if words[r // 31] >> (r % 31) & 1]

    def _running_firsts(self) -> List[int]:
        """Global ranks of the first ranks whose body has not finished."""
        words = self._first_words()
        return [self.globals[r] for r in range(self.ws)
                if words[r // 31] >> (r % 31) & 1 and not words[r // 31] >> (r % 31 + 31) & 1]

    def _readers(self) -> List[int]:
        """The group ranks that read this block's failure: the ranks that wait for it."""
        firsts = set(self._firsts())
        return [r for r in range(self.ws) if r not in firsts]

    def _not_arrived(self) -> List[int]:
        """Global ranks that have not reached this block yet."""
        if self.tally.packed:
            bits = self.store.add(f"{self.p}/state", 0) & 0x7FFFFFFF
            return [g for r, g in enumerate(self.globals) if not bits >> r & 1]
        words = -(-self.ws // _MASK_BITS)
        masks = [self.store.add(f"{self.p}/mask/{w}", 0) for w in range(words)]
        return [g for r, g in enumerate(self.globals)
                if not masks[r // _MASK_BITS] >> (r % _MASK_BITS) & 1]

    # -- a first rank ---------------------------------------------------------------------

    def done(self) -> None:
        """This first rank's body finished."""
        with store_errors(self.what):
            if self.explicit:
                key, bit = self._first_bit()
                self.store.add(key, 1 << (bit + 31))
            if self.tally.packed:
                self._add(self.tally.done)
            else:
                self._add(0, self.tally.done)

    def fail(self, exc: BaseException) -> None:
        """This first rank's body raised ``exc``: tell the waiting ranks (never raises)."""
        try:
            ours = self._flag(f"{self.p}/error", failure_report(self.rank, exc, self.what), _FAILED)
            readers = self._readers()
        except Exception:  # noqa: BLE001 - the store is gone: nobody can be told
            publish_error(self.store, f"{self.p}/error", self.rank, exc, self.what)
            return
        if ours:
            await_readers(self.store, f"{self.p}/error", readers, self.group)

    def await_arrivals(self, timeout: Optional[float]) -> None:
        """Wait until every rank has reached this block (and raise if they do not pair)."""
        if not (self.now.arrived >= self.ws or self.now.mismatch):  # not known yet: poll
            poll_until(lambda: self._add().arrived >= self.ws or self.now.mismatch,
                       watch=self._not_arrived, timeout=timeout, me=self.rank,
                       what=f"{self.what} (waiting for every rank to reach it)")
        with store_errors(self.what):
            if self.now.mismatch:
                raise self._stored("mismatch")
            self.finish()

    # -- a waiting rank -------------------------------------------------------------------

    def _released(self) -> bool:
        now = self.now
        if now.failed or now.mismatch:
            return True
        if not self.explicit:
            return now.done >= 1
        return now.arrived == self.ws and now.done == now.firsts

    def await_firsts(self, timeout: Optional[float]) -> None:
        """Wait until the first rank(s) are done; raise their failure or a mismatch."""
        if self.explicit:
            def watch() -> Sequence[int]:  # the firsts still running and the ranks not here
                return sorted(set(self._running_firsts()) | set(self._not_arrived()))
        else:
            def watch() -> Sequence[int]:
                return [self.globals[0]]

        def released() -> bool:
            self._add()
            return self._released()

        if not self._released():  # the arrival's own read did not release us: poll
            poll_until(released, watch=watch, timeout=timeout, what=self.what, me=self.rank)
        with store_errors(self.what):
            if self.now.mismatch:
                raise self._stored("mismatch")
            if self.now.failed:
                raise self._stored("error")
            self.finish()

    # -- cleaning up ----------------------------------------------------------------------

    def finish(self) -> None:
        """This rank reads none of the block's keys again; the last one deletes them (every
        rank got here, so nothing failed: no ``error`` or ``mismatch`` key exists)."""
        fin = self._add(self.tally.fin) if self.tally.packed else self._add(0, self.tally.fin)
        if fin.fin != self.ws:
            return
        names = ["site", "state"]
        if self.explicit:
            names += [f"firsts/{w}" for w in range(-(-self.ws // 31))]
        if not self.tally.packed:
            names += ["tally", *(f"mask/{w}" for w in range(-(-self.ws // _MASK_BITS)))]
        for name in names:
            self.store.delete_key(f"{self.p}/{name}")


def first_run_begin() -> None:
    """This thread starts the body of a block it runs first."""
    STATE.first_runs.depth += 1


def first_run_end(block: ZeroFirstBlock, ok: bool) -> List[ZeroFirstBlock]:
    """The body of ``block`` ended (``ok``: without raising). Returns the blocks whose
    arrivals to await now: all finished ones once the outermost first-run block ends."""
    # Why wait only at the outermost end: an inner block's waiting ranks are still blocked in
    # the *outer* block (they enter the inner one only after the outer body ran here), so
    # waiting for their arrival inside the outer body would deadlock. Finished inner blocks
    # are kept, in order, and all awaited once nothing encloses them any more.
    runs = STATE.first_runs
    runs.depth -= 1
    if ok:
        runs.pending.append(block)
    if runs.depth > 0:
        return []
    pending, runs.pending = runs.pending, []
    return pending if ok else []  # a body that raised: its failure is published, not awaited


def run_in_rounds(f: Callable[[], T], group: Optional["ProcessGroup"], seq: int, rank: int,
                  ws: int, rounds: int, timeout: Optional[float]) -> T:
    """``do_n_at_a_time``'s protocol: round ``k`` holds the group ranks with
    ``rank % rounds == k``; every rank waits for the rounds before its own, runs ``f``, then
    waits for the rest."""
    store = group_store(group)
    globals_ = global_ranks(group)
    p = f"axd/dn/{seq}"
    what = f"do_n_at_a_time call #{seq}"

    def members(k: int) -> List[int]:
        return [globals_[r] for r in range(k, ws, rounds)]

    def wait_round(k: int) -> None:
        size = len(range(k, ws, rounds))
        poll_until(lambda: store.add(f"{p}/done/{k}", 0) >= size or store.add(f"{p}/failed", 0) > 0,
                   watch=lambda: members(k), timeout=timeout, what=what, me=rank)
        with store_errors(what):
            if store.add(f"{p}/failed", 0):
                error = read_error(store, f"{p}/error", rank)
                others = [r for r in range(ws) if r not in (rank, error.rank)]
                await_readers(store, f"{p}/error", others, group)
                raise error

    my_round = rank % rounds
    for k in range(my_round):
        wait_round(k)
    try:
        result = f()
    except BaseException as exc:
        publish_error(store, f"{p}/error", rank, exc, what)
        try:
            store.add(f"{p}/failed", 1)
        except Exception:  # noqa: BLE001 - the store is gone: nobody can be told
            pass
        else:
            await_readers(store, f"{p}/error", [r for r in range(ws) if r != rank], group)
        raise
    with store_errors(what):
        store.add(f"{p}/done/{my_round}", 1)
    for k in range(my_round, rounds):
        wait_round(k)
    with store_errors(what):
        if store.add(f"{p}/fin", 1) == ws:
            for name in ["failed", "error", "fin", *(f"done/{k}" for k in range(rounds))]:
                store.delete_key(f"{p}/{name}")
    return result
