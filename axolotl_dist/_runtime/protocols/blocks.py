"""The store protocols behind :func:`~axolotl_dist.zero_first` and
:func:`~axolotl_dist.do_n_at_a_time` (their behaviour is documented in
:mod:`axolotl_dist.ordering`; sequence diagrams in docs/design/blocks.md, "zero_first blocks" and
docs/design/blocks.md, "do_n_at_a_time rounds").

A block (``zero_first`` block or ``do_n_at_a_time`` call number ``seq`` on a group, counted
per rank) lives in **bit words**: store integers that hold one bit per group rank, 31 ranks a
word. Word 0 is ``axd/<kind>/<seq>/<tag>``, word ``w`` ``.../<tag>/<w>``. ``tag`` hashes what
pairs blocks across ranks: the call site (``file.py:41``), or the ``desc=`` label when given.
So ranks that agree meet on the same keys without a store call to compare, and ranks that do
not agree wait on different keys, where the check below finds them.

What a rank's bit means: a waiting rank sets it when it arrives; a rank that runs first sets
it when its body is done (its arrival is folded into its done). Hence one ``add`` per rank on
the fast path, and it also reads the word back:

* a ``zero_first`` waiter is released when group rank 0's bit is set (default: rank 0 goes
  first), or when every bit is set (explicit ``is_main``: only then is it known that every
  first rank is done);
* a first rank confirms that every bit is set (every rank reached the block: what a barrier
  at the block's end would), never before its outermost first-run block ends (so nested blocks
  cannot deadlock): with several first ranks then; as the sole first rank (default ``is_main``)
  then if its own ``add`` already saw every bit, else at its next collective or block, once it
  would be more than ``AHEAD`` block ahead (:mod:`.zero_first`);
* ``do_n_at_a_time``: a rank of round ``k`` (``rank % rounds``) waits for every bit of the
  rounds before it, runs ``f``, sets its bit and waits for every bit.

A default block's waiter that has polled a while blocks on the block's wake key (bit 31 of word
0: :mod:`..store.wakeup`); an ``add`` that can release it (group rank 0's done, a flag) and finds
the bit set wakes it. Without key waiters, the fast path sends nothing more.

Word 0 also carries two flags, counted in bits 32-46 and 47-62 (an ``add`` cannot set a bit
twice safely, and two ranks may flag at once): ``FAILED`` (a rank's body raised; its report is
under ``.../error``) and ``MISMATCH`` (blocks do not pair; the report under
``axd/<kind>/<seq>/mismatch``).

Keys are deleted one block late, by group rank 0, from a background thread on its own store
connection (off the caller's path): when rank 0 sees every bit of block ``t`` set, every rank
has reached ``t`` and is past the blocks rank 0 saw complete before, whose words it deletes. A
rank that still reads one (a first rank at the end of an enclosing block) reads 0 and takes the
block as complete. So a loop of blocks keeps the store's key count flat, at no store call on
the fast path.

Pairing is checked only when a wait outlasts its first polls (:func:`~..liveness.polls.poll_until`'s
``slow``): the rank writes ``rank|tag|desc|site`` to ``axd/<kind>/<seq>/site`` by
``compare_set``; if another rank's record with another tag is there, the blocks do not pair,
and it publishes a :class:`~axolotl_dist.errors.CollectiveMismatchError` naming both sites and
labels, flagging both tags' words. Two ranks at different sites both end up waiting (neither
releases the other), so both reach this check.
"""

from __future__ import annotations

import hashlib
import threading
from functools import lru_cache
from typing import Any, Callable, Dict, List, Optional, Sequence, TypeVar

from ..base.callsite import CallSite
from ..base.groups import Group
from ..store import sweep, wakeup
from ..store import keys, records
from ..store.access import checked, is_store_error, kit_store, parsed, set_if_absent
from ..store.store_state import STORE
from ..liveness.progress import Point
from ..liveness.failures import await_readers, failure_report, publish_error, read_error
from ..liveness.peers import store_errors, store_lost_error
from ..liveness.polls import poll_until
from . import timeline
from .timeline import TIMELINE
from ..liveness import scopes
from ...errors import CollectiveMismatchError, DistributedEnvError
from ..base.state import PerGroup, RoomState, register

__all__ = ["Block", "RELEASED", "FAILED_MASK", "pairing_tag", "together", "arrive",
           "spy_on_stores", "BLOCKS", "BlocksState", "FirstRuns"]


class FirstRuns(threading.local):
    """The ``zero_first`` blocks this thread runs first: how deeply nested, the blocks that
    finished inside the outermost one (their arrivals are awaited when it ends), and how many
    of them it runs as its group's rank 0 (a ``datasets`` map there is looked at)."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending: List["Block"] = []
        self.main = 0  # of the ``depth`` blocks, those run as the group's rank 0


class BlocksState(RoomState):
    """``first_runs`` (per thread: the ``zero_first`` blocks it runs first, nested, those
    finished inside them, how many as its group's rank 0); ``unconfirmed`` (blocks this rank
    ran first as the sole first rank whose other ranks' arrival it has not confirmed yet);
    ``store_spy`` (a test's wrapper around the store a block uses, see
    :func:`axolotl_dist.testing._probes.count_store_calls`); ``finished`` (group -> block
    kind -> the finished blocks' keys group rank 0 deletes later)"""

    def __init__(self) -> None:
        self.first_runs = FirstRuns()
        self.unconfirmed: List["Block"] = []
        self.store_spy: Optional[Callable[[Any], Any]] = None
        #: group -> block kind -> the finished blocks' keys group rank 0 deletes later
        self.finished: PerGroup[Dict[str, List[Any]]] = PerGroup(lambda g: {})


BLOCKS = register("blocks", BlocksState())

T = TypeVar("T")

#: Group ranks per bit word (bits 0-30).
WORD_BITS = 31
_WORD_MASK = (1 << WORD_BITS) - 1
#: Word 0, bits 32-46: how many ranks flagged a failed body (a count, not a bit: two ranks may
#: flag at once, and an add cannot set a bit idempotently); bits 47-62: likewise, a mismatch.
FAILED = 1 << 32
MISMATCH = 1 << 47
FAILED_MASK = ((1 << 15) - 1) << 32
_MISMATCH_MASK = ((1 << 16) - 1) << 47
#: Word 0 & this == 1: group rank 0's bit set and no flag (a default block's waiter may go).
RELEASED = 1 | FAILED_MASK | _MISMATCH_MASK


@lru_cache(maxsize=256)
def _suspect_bits(ws: int, w: int) -> int:
    """The bits of word ``w`` that no add of the kit sets in a group of ``ws``: those of ranks
    it does not have, and the sign (a negative int has bit 63 set). Cached: no frame."""
    ranks = min(WORD_BITS, ws - w * WORD_BITS)
    return _WORD_MASK >> ranks << ranks | 1 << 63


@lru_cache(maxsize=4096)
def pairing_tag(site: CallSite, desc: Optional[str]) -> str:
    """The key part that pairs blocks across ranks: a short hash of the label if there is one,
    else of the call site's ``file.py:line`` (directories may differ across nodes)."""
    pairs_by = f"desc:{desc}" if desc is not None else f"site:{site.key}"
    return hashlib.blake2b(pairs_by.encode(), digest_size=5).hexdigest()


class Block:
    """The bit words, flags, failure and pairing records of one block on this rank."""

    kind = ""  # "zf" or "dn": the key family
    family = ""  # its call counter (``Group.seq``): "zero_first" or "do_n_at_a_time"
    noun = ""  # how messages name a block of this kind
    __slots__ = ("group", "seq", "rank", "ws", "site", "desc", "tag", "store", "base", "keys",
                 "words", "_globals", "wrote_site", "explicit", "first", "timeout", "scope")
    # a block per call, built on the hot path: one __init__ for both kinds (``explicit``,
    # ``first``, ``timeout`` and ``scope`` serve zero_first blocks)

    def __init__(self, g: Group, seq: int, site: CallSite, desc: Optional[str],
                 explicit: bool = False, first: bool = False,
                 timeout: Optional[float] = None) -> None:
        self.group, self.seq, self.rank, self.ws = g, seq, g.rank, g.size
        self.explicit, self.first, self.timeout = explicit, first, timeout
        self.scope: Optional[scopes.ExclusiveScope] = None
        self.site, self.desc = site, desc
        self.tag = pairing_tag(site, desc)
        self.store = STORE.groups[g].store or kit_store(g)  # kit_store's answer once made
        if BLOCKS.store_spy is not None:  # a test counting store calls
            self.store = BLOCKS.store_spy(self.store)
        self.base = keys.block(self.kind, seq)
        word0 = f"{self.base}/{self.tag}"
        self.keys = [word0] if self.ws <= WORD_BITS else [word0] + [
            f"{word0}/{w}" for w in range(1, -(-self.ws // WORD_BITS))]
        self.words = [0] * len(self.keys)  # their values, as last read
        self._globals: Optional[List[int]] = None
        self.wrote_site = False

    @property
    def what(self) -> str:
        """How messages name this block (built only when one is needed)."""
        label = f" {self.desc!r}" if self.desc is not None else ""
        return f"{self.noun} #{self.seq}{label}" + (f" at {self.site}" if self.sited else "")

    sited = True  # whether messages name the call site

    # -- bits -----------------------------------------------------------------------------

    def set_bit(self) -> None:
        """Set this rank's bit (arrived, or done for a first rank); remember its word."""
        word, bit = divmod(self.rank, WORD_BITS)
        try:
            value = self.words[word] = self.store.add(self.keys[word], 1 << bit)
            if value & _suspect_bits(self.ws, word) or not value >> bit & 1:
                self._checked(word, value, mine=True)  # :meth:`_checked`'s look, inline
            if value & wakeup.WAKE_BIT and (self.rank == 0 and self.releases or
                                            self.wakes_when_full and self.full()):
                wakeup.wake(self.store, self.keys[0])
        except Exception as exc:  # noqa: BLE001
            if is_store_error(exc):
                raise store_lost_error(exc, self.what, self.keys[word]) from None  # it quotes exc
            raise

    releases = False  # group rank 0's bit releases the waiters (a default zero_first block)
    #: the last rank to set its bit wakes the waiters (every rank waits for every bit; one
    #: word, up to 31 ranks: a rank sees only its own word's bits)
    wakes_when_full = False

    def read(self, which: Sequence[int] = ()) -> None:
        """Read the words ``which`` again (default: all).

        A word that reads 0 after this rank set its bit in it was deleted: group rank 0
        deletes a block's words only once every bit was set (see :meth:`finish`), so the block
        is complete. The read re-created the key; it is deleted again in the background."""
        for w in which or range(len(self.keys)):
            shift = self.rank - w * WORD_BITS
            mine = self.words[w] >> shift & 1 if self.rank // WORD_BITS == w else 0
            try:
                value = self.words[w] = self.store.add(self.keys[w], 0)
            except Exception as exc:  # noqa: BLE001
                if is_store_error(exc):
                    raise store_lost_error(exc, self.what, self.keys[w]) from None  # it quotes exc
                raise
            if value & _suspect_bits(self.ws, w) or mine and value and not value >> shift & 1:
                self._checked(w, value, mine=bool(mine))  # :meth:`_checked`'s look, inline
            if value == 0 and mine:
                self.words = [_WORD_MASK] * len(self.keys)
                sweep.delete(self.group, self.store, [self.keys[w]])
                return

    def _checked(self, w: int, value: int, mine: bool) -> int:
        """Word ``w`` as read (``mine``: this rank's bit is set in it, a word deleted once the
        block completed aside). One with the bit of a rank the group does not have, or without
        this rank's (an ``add`` of the kit sets each rank's bit once, so no sum carries), was
        changed by a process outside the job: an error naming the key, not a wait that can
        never end. The hot path looks first inline (:meth:`set_bit`, :meth:`read`: a frame
        less on every block) and calls this when the word may be wrong."""
        lost = mine and value != 0 and not value >> (self.rank - w * WORD_BITS) & 1
        if value & _suspect_bits(self.ws, w) or lost:
            why = ("without this rank's bit, which it had set" if lost else
                   f"with bits of ranks the group of {self.ws} does not have")
            raise DistributedEnvError(
                f"the word of {self.what} at store key {self.keys[w]!r} reads {value}, {why}: a "
                "process outside the job changed it (only the kit's adds write there; "
                'docs/design/store.md, "Trust model")')
        return value

    def has(self, rank: int) -> bool:
        word, bit = divmod(rank, WORD_BITS)
        return bool(self.words[word] >> bit & 1)

    def full(self, ranks: Optional[Sequence[int]] = None) -> bool:
        """Whether the bit of every rank in ``ranks`` (default: all) is set."""
        if ranks is None:
            if len(self.words) == 1:  # up to 31 ranks: one test, no generator
                mask = (1 << self.ws) - 1
                return self.words[0] & mask == mask
            last = len(self.words) - 1
            tail = self.ws - last * WORD_BITS
            return all(w & _WORD_MASK == _WORD_MASK for w in self.words[:last]) and \
                self.words[last] & ((1 << tail) - 1) == (1 << tail) - 1
        return all(self.has(r) for r in ranks)

    def flagged(self) -> bool:
        return bool(self.words[0] & (FAILED_MASK | _MISMATCH_MASK))

    def missing(self, ranks: Optional[Sequence[int]] = None) -> List[int]:
        """Global ranks among ``ranks`` (default: all) whose bit is not set."""
        if self._globals is None:
            self._globals = self.group.ranks
        return [self._globals[r] for r in (ranks if ranks is not None else range(self.ws))
                if not self.has(r)]

    # -- waiting ----------------------------------------------------------------------------

    def wait(self, done: Callable[[], bool], which: Sequence[int], watch: Callable[[], List[int]],
             timeout: Optional[float], doing: str = "", failed_ok: bool = False,
             sleep: bool = False) -> None:
        """Poll the words ``which`` until ``done()`` or a flag; then raise a flagged failure
        (``failed_ok``: another rank's failed body is not this rank's error, a mismatch is).
        ``doing`` is added to :attr:`what` in the wait's messages. ``sleep``: once polls have
        not been enough, block on the block's wake key (only where one ``add`` releases the wait:
        see the module docstring)."""
        if not (done() or self.flagged()):
            self.read(which)  # once more before setting up a wait: usually enough
        if not (done() or self.flagged()):
            def ready() -> bool:
                self.read(which)
                return done() or self.flagged()

            point = Point(self.group, self.family, self.seq, self.tag,
                          finish=self.kind == "zf" and not self.first)
            poll_until(ready, watch=watch, timeout=timeout, what=self.what + doing,
                       me=self.rank, slow=self.check_pairing,
                       sleep=self._sleep if sleep else None, point=point,
                       fresh=True)  # the words as the read above found them
        mismatch, failed = self.words[0] & _MISMATCH_MASK, self.words[0] & FAILED_MASK
        if mismatch or (failed and not failed_ok):
            with store_errors(self.what):
                raise self._stored("mismatch" if mismatch else "error")

    def _sleep(self) -> Optional[wakeup.KeyWaiter]:
        waiter, self.words[0] = wakeup.request_wake(self.group, self.store, self.keys[0], self.words[0])
        return waiter

    # -- pairing ----------------------------------------------------------------------------

    def check_pairing(self) -> None:
        """Compare this block's pairing with the first rank that checked (see the module
        docstring); raise :class:`CollectiveMismatchError` if they differ."""
        mine = records.site(self.rank, self.tag, self.desc, str(self.site))
        have = set_if_absent(self.store, f"{self.base}/site", mine).decode(errors="replace")
        if have == mine:
            self.wrote_site = True  # deleted when this rank is done with the block
            return
        other, tag, desc, site = parsed(records.read_site, have, f"{self.base}/site")
        if tag != self.tag:
            self._publish_mismatch(other, tag, desc, site)

    def _publish_mismatch(self, other: int, other_tag: str, other_desc: Optional[str],
                          other_site: str) -> None:
        def label(desc: Optional[str], site: str, rank: int) -> str:
            named = f" (desc={desc!r})" if desc is not None else ""
            return f"at {site}{named} on rank {rank}"

        group = "default group" if self.group.default else "group"
        error = CollectiveMismatchError(
            f"{self.noun}s do not pair: block #{self.seq} on the {group} is "
            f"{label(other_desc, other_site, other)} but {label(self.desc, str(self.site), self.rank)}. "
            f"Every rank must enter the same {self.noun}s in the same order: one inside a "
            "@zero_only function, or under an `if` on the rank, runs on some ranks only. If "
            "two blocks on different lines are meant to be one (the branches of an `if`, a "
            f"helper reached from two places), give both the same label: desc=\"...\".",
            calls={other: f"{self.noun} {label(other_desc, other_site, other)}",
                   self.rank: f"{self.noun} {label(self.desc, str(self.site), self.rank)}"})
        key = f"{self.base}/mismatch"
        payload = records.mismatch(error, self.rank)
        ours = set_if_absent(self.store, key, payload) == payload  # the first report wins
        for word0 in {self.keys[0], f"{self.base}/{other_tag}"}:
            if self.store.add(word0, MISMATCH) & wakeup.WAKE_BIT:
                wakeup.wake(self.store, word0)
        if not ours:
            raise self._stored("mismatch")
        self.words[0] += MISMATCH
        await_readers(self.store, key, self._readers(exclude=()), self.group)
        raise error

    # -- failures -----------------------------------------------------------------------------

    def fail(self, exc: BaseException) -> None:
        """This rank's body raised ``exc``: tell the others (never raises)."""
        key = f"{self.keys[0]}/error"
        try:
            report = failure_report(self.rank, exc, self.what)
            ours = set_if_absent(self.store, key, report) == report
            if self.store.add(self.keys[0], FAILED) & wakeup.WAKE_BIT:
                wakeup.wake(self.store, self.keys[0])
            readers = self._readers(exclude=(self.rank,))
        except Exception:  # noqa: BLE001 - the store is gone: nobody can be told
            publish_error(self.store, key, self.rank, exc, self.what)
            return
        if ours:
            await_readers(self.store, key, readers, self.group)

    def _readers(self, exclude: Sequence[int]) -> List[int]:
        """Group ranks that will read a failure of this block: every other rank still in it."""
        return [r for r in range(self.ws) if r != self.rank and r not in exclude]

    def _stored(self, name: str) -> Exception:
        """The failure another rank published (``"error"`` or ``"mismatch"``): read,
        acknowledged, and kept readable for the remaining readers if this process hosts the
        store."""
        if name == "mismatch":
            key = f"{self.base}/mismatch"
            publisher, message, calls, missing = checked(records.read_mismatch,
                                                         self.store.get(key), key)
            error = CollectiveMismatchError(message, calls, missing)
            self.store.set(keys.ack(key, self.rank), b"")
        else:
            key = f"{self.keys[0]}/error"
            error = read_error(self.store, key, self.rank)
            publisher = error.rank
        await_readers(self.store, key, self._readers(exclude=(publisher,)), self.group)
        return error

    # -- cleaning up ----------------------------------------------------------------------------

    def finish(self, complete: bool) -> None:
        """This rank is done with the block, without a failure (``complete``: it saw every
        bit set). Deleted in the background: the pairing record this rank wrote (a rank that
        checks later writes its own), and, on group rank 0 when ``complete``, the words of the
        blocks of this kind it saw complete earlier. Every rank has set its bit here, so every
        rank is past them: a waiter reads a block's words only until it is released, before
        it reaches a later block; a first rank that still reads one, at the end of an
        enclosing block, finds it deleted (see :meth:`read`)."""
        if self.wrote_site:
            sweep.delete(self.group, self.store, [f"{self.base}/site"])
        if self.rank != 0 or not complete:
            return
        done = BLOCKS.finished[self.group].setdefault(self.kind, [])
        old: List[str] = []
        keep = []
        for entry in done:  # loops, not comprehensions: each of those is a frame per block
            if entry[0] < self.seq:
                old.extend(entry[1])
            else:
                keep.append(entry)
        if old:
            done[:] = keep
            sweep.delete(self.group, self.store, old)
        keys = self.keys + self.extra_keys()
        done.append((self.seq, keys + [wakeup.wake_key(self.keys[0])]  # someone slept
                     if self.words[0] & wakeup.WAKE_BIT else keys))

    def extra_keys(self) -> List[str]:
        """Keys of this block beside its words, deleted with them (a kind's own)."""
        return []


def together(f: Callable[[], T], block: Block, timeout: Optional[float],
             waited: Callable[[], List[int]]) -> T:
    """Run ``f`` on this rank, then :func:`arrive`. If ``f`` raises, the other ranks hear of it
    (their wait raises :class:`~axolotl_dist.errors.RankFailedError` naming this rank and the
    line) and this rank re-raises."""
    try:
        result = f()
    except BaseException as exc:
        block.fail(exc)
        raise
    arrive(block, timeout, waited)
    return result


def arrive(block: Block, timeout: Optional[float], waited: Callable[[], List[int]]) -> None:
    """This rank's part of ``block`` is done: set its bit and wait until every rank's is (or
    raise the failure of a rank that raised or died; a ``RankTimeoutError`` after ``timeout``
    seconds); while tracing, the wait is recorded as waiting for the global ranks ``waited()``.
    A block that :attr:`Block.wakes_when_full` sleeps on its wake key once polls are not
    enough."""
    block.set_bit()
    t0 = timeline.now()
    block.wait(block.full, (), block.missing, timeout, sleep=block.wakes_when_full)
    if TIMELINE.recorder is not None:
        timeline.wait_span(block.family, t0, waited(), block.site, block.group, block.seq)
    block.finish(complete=True)


def spy_on_stores(spy: Optional[Callable[[Any], Any]]) -> Optional[Callable[[Any], Any]]:
    """Wrap the store of every block entered from now on in ``spy(store)`` (None: stop);
    returns the spy it replaces (:func:`axolotl_dist.testing._probes.count_store_calls`)."""
    previous, BLOCKS.store_spy = BLOCKS.store_spy, spy
    return previous
