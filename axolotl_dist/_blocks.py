"""The store protocols behind :func:`~axolotl_dist.zero_first` and
:func:`~axolotl_dist.do_n_at_a_time` (their behaviour is documented in :mod:`axolotl_dist.ordering`).

``zero_first`` block number ``seq`` on a group keeps, under ``axd/zf/<seq>/``:

* ``site``: ``rank|file.py:line|where`` of the first rank to arrive. Every rank compares its
  own call site with it (one ``compare_set``), so blocks that do not pair (a block only some
  ranks enter shifts the numbering) raise :class:`~axolotl_dist.errors.CollectiveMismatchError`
  on every rank, naming both sites, instead of releasing a rank early;
* ``arrived``: +1 per rank that reached the block, and ``mask/<i>`` a bit per rank (read only
  to name the ranks a wait still depends on); ``state``: +1 per first rank that finished its
  body, +:data:`FAILED` when one raised; both get +:data:`MISMATCH` on a mismatch;
* ``nfirst`` and ``first/<k>`` (explicit ``is_main``): each first rank's global rank, with
  ``|done`` appended once its body finished;
* ``error`` / ``mismatch``: the failure for the other ranks, acknowledged by each reader
  (``<key>/ack/<rank>``) so a store host lingers until they have read it;
* ``fin``: +1 per rank done with the block's keys; the rank that makes it the world size
  deletes them all, so a loop of blocks does not grow the store.

A first rank waits for nobody before its body; when its outermost first-run block ends it waits
until every rank has reached each block it ran first (so nested blocks cannot deadlock), like
the barrier that ends axolotl's and accelerate's versions. ``do_n_at_a_time`` call ``seq``
keeps ``done/<round>`` counters, ``failed``, ``error`` and ``fin`` under ``axd/dn/<seq>/``.
"""

from __future__ import annotations

import pickle
import threading
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence, TypeVar

from ._callsite import CallSite
from ._signals import (
    await_readers,
    global_ranks,
    group_store,
    poll_until,
    publish_error,
    read_error,
    store_errors,
)
from .errors import CollectiveMismatchError

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = ["MISMATCH", "FAILED", "ZeroFirstBlock", "first_run_begin", "first_run_end", "run_in_rounds"]

#: Added to a block's counters when two ranks reached it from different call sites.
MISMATCH = 1 << 40
#: Added to a block's state when a first rank raised.
FAILED = 1 << 20
#: Ranks per arrival mask key (bits of a signed 64-bit store counter).
_MASK_BITS = 62

T = TypeVar("T")


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
            if self.explicit and self.first:
                self.k = self.store.add(f"{self.p}/nfirst", 1)
                self.store.set(f"{self.p}/first/{self.k}", str(self.globals[self.rank]))
            word, bit = divmod(self.rank, _MASK_BITS)
            self.store.add(f"{self.p}/mask/{word}", 1 << bit)
            if self.store.add(f"{self.p}/arrived", 1) >= MISMATCH:
                raise self._stored("mismatch")

    def _publish_mismatch(self, other: int, other_site: str) -> None:
        error = CollectiveMismatchError(
            f"zero_first blocks do not pair: block #{self.seq} on the "
            f"{'default group' if self.group is None else 'group'} is at {other_site} on rank "
            f"{other} but at {self.site} on rank {self.rank}. Every rank must enter the same "
            "zero_first blocks in the same order: a zero_first inside a @zero_only function, "
            "or under an `if` on the rank, runs on some ranks only.",
            calls={other: f"zero_first at {other_site}", self.rank: f"zero_first at {self.site}"})
        self.store.set(f"{self.p}/mismatch", pickle.dumps((self.rank, error)))
        self.store.add(f"{self.p}/state", MISMATCH)
        self.store.add(f"{self.p}/arrived", MISMATCH)
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

    def _firsts(self) -> Dict[int, bool]:
        """Global rank -> done, of every first rank registered so far (explicit ``is_main``)."""
        n = self.store.add(f"{self.p}/nfirst", 0)
        if not n:
            return {}
        values = self.store.multi_get([f"{self.p}/first/{i}" for i in range(1, n + 1)])
        return {int(v.split(b"|")[0]): v.endswith(b"|done") for v in values}

    def _readers(self) -> List[int]:
        """The group ranks that read this block's failure: the ranks that wait for it."""
        if not self.explicit:
            return list(range(1, self.ws))
        firsts = self._firsts()
        return [r for r in range(self.ws) if self.globals[r] not in firsts]

    def _not_arrived(self) -> List[int]:
        """Global ranks that have not reached this block yet."""
        words = -(-self.ws // _MASK_BITS)
        masks = [self.store.add(f"{self.p}/mask/{w}", 0) for w in range(words)]
        return [g for r, g in enumerate(self.globals)
                if not masks[r // _MASK_BITS] >> (r % _MASK_BITS) & 1]

    # -- a first rank ---------------------------------------------------------------------

    def done(self) -> None:
        """This first rank's body finished."""
        with store_errors(self.what):
            if self.explicit:
                self.store.set(f"{self.p}/first/{self.k}", f"{self.globals[self.rank]}|done")
            self.store.add(f"{self.p}/state", 1)

    def fail(self, exc: BaseException) -> None:
        """This first rank's body raised ``exc``: tell the waiting ranks (never raises)."""
        publish_error(self.store, f"{self.p}/error", self.rank, exc, self.what)
        try:
            self.store.add(f"{self.p}/state", FAILED)
            readers = self._readers()
        except Exception:  # noqa: BLE001 - the store is gone: nobody can be told
            return
        await_readers(self.store, f"{self.p}/error", readers, self.group)

    def await_arrivals(self, timeout: Optional[float]) -> None:
        """Wait until every rank has reached this block (and raise if they do not pair)."""
        poll_until(lambda: self.store.add(f"{self.p}/arrived", 0) >= self.ws,
                   watch=self._not_arrived, timeout=timeout, me=self.rank,
                   what=f"{self.what} (waiting for every rank to reach it)")
        with store_errors(self.what):
            if self.store.add(f"{self.p}/arrived", 0) >= MISMATCH:
                raise self._stored("mismatch")
            self.finish()

    # -- a waiting rank -------------------------------------------------------------------

    def await_firsts(self, timeout: Optional[float]) -> None:
        """Wait until the first rank(s) are done; raise their failure or a mismatch."""
        store, p = self.store, self.p
        if not self.explicit:
            def ready() -> bool:
                return store.add(f"{p}/state", 0) != 0

            def watch() -> Sequence[int]:
                return [self.globals[0]]
        else:
            def ready() -> bool:
                state = store.add(f"{p}/state", 0)
                if state >= FAILED:
                    return True
                arrived = store.add(f"{p}/arrived", 0)
                return arrived >= MISMATCH or (
                    arrived == self.ws and state == store.add(f"{p}/nfirst", 0))

            def watch() -> Sequence[int]:  # the firsts still running and the ranks not here
                running = [g for g, done in self._firsts().items() if not done]
                return sorted(set(running) | set(self._not_arrived()))

        poll_until(ready, watch=watch, timeout=timeout, what=self.what, me=self.rank)
        with store_errors(self.what):
            state = store.add(f"{p}/state", 0)
            if state >= MISMATCH or store.add(f"{p}/arrived", 0) >= MISMATCH:
                raise self._stored("mismatch")
            if state >= FAILED:
                raise self._stored("error")
            self.finish()

    # -- cleaning up ----------------------------------------------------------------------

    def finish(self) -> None:
        """This rank reads none of the block's keys again; the last one deletes them."""
        store, p = self.store, self.p
        if store.add(f"{p}/fin", 1) != self.ws:
            return
        n = store.add(f"{p}/nfirst", 0)
        for name in ["site", "arrived", "state", "error", "mismatch", "nfirst", "fin",
                     *(f"first/{i}" for i in range(1, n + 1)),
                     *(f"mask/{w}" for w in range(-(-self.ws // _MASK_BITS)))]:
            store.delete_key(f"{p}/{name}")


class _FirstRuns(threading.local):
    """The zero_first blocks this thread is running first, nested, and those finished inside."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending: List[ZeroFirstBlock] = []


_FIRST_RUNS = _FirstRuns()


def first_run_begin() -> None:
    """This thread starts the body of a block it runs first."""
    _FIRST_RUNS.depth += 1


def first_run_end(block: ZeroFirstBlock, ok: bool) -> List[ZeroFirstBlock]:
    """The body of ``block`` ended (``ok``: without raising). Returns the blocks whose
    arrivals to await now: all finished ones once the outermost first-run block ends."""
    runs = _FIRST_RUNS
    runs.depth -= 1
    if ok:
        runs.pending.append(block)
    if runs.depth > 0:
        return []
    pending, runs.pending = runs.pending, []
    return pending if ok else []


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
