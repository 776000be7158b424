"""``zero_first``'s side of the block protocol (:mod:`.blocks`): a block on the rank that runs
first and on the ranks that wait, the stack of blocks a thread runs first, and the arrivals a
sole first rank confirms later (docs/design/blocks.md, "zero_first blocks").
"""

from __future__ import annotations

import sys
from typing import List, Sequence

from ..base.groups import failure_record, restore_failure_record
from .blocks import BLOCKS
from ..liveness.peers import store_errors
from ..liveness import scopes
from . import map_cache
from .blocks import FAILED_MASK, RELEASED, Block
from ..store import records, seals
from ..store.access import put
from ...errors import CollectiveMismatchError, DistributedEnvError, RankFailedError

__all__ = ["ZeroFirstBlock", "first_run_begin", "first_run_end", "confirm_all", "confirm_at_exit", "AHEAD"]


#: What :meth:`ZeroFirstBlock._confirmed`'s read gives for a key that is not there (no record
#: the kit writes starts with a NUL).
_ABSENT = "\x00absent"


class ZeroFirstBlock(Block):
    """One ``zero_first`` block on this rank (see the module docstring)."""

    kind, family, noun = "zf", "zero_first", "zero_first block"
    __slots__ = ()

    def _released(self) -> bool:
        return self.full() if self.explicit else bool(self.words[0] & 1)  # has(0), inline

    @property
    def releases(self) -> bool:  # type: ignore[override]
        return not self.explicit

    def done(self) -> None:
        """This rank ran the body first and it ended: in a run with a secret, group rank 0 of a
        default block writes its sealed record first (a waiter leaves on rank 0's bit only with
        it: a counter carries no seal), then its bit."""
        if not self.explicit and self.rank == 0 and seals.SEALS.groups[self.group]:
            put(self.store, self.done_key, str(self.seq))
        self.set_bit()

    @property
    def done_key(self) -> str:
        """Where group rank 0 of a default block records that its body ended (runs with a
        secret)."""
        return f"{self.keys[0]}/done"

    def extra_keys(self) -> List[str]:  # deleted with the words
        return [self.done_key] if not self.explicit and seals.SEALS.groups[self.group] else []

    def _confirmed(self) -> None:
        """In a run with a secret, a default block's waiter released by rank 0's bit reads rank
        0's sealed record of its end; a bit without it (a counter moved or a key deleted by a
        process outside the job) is an error naming both keys, never an early exit."""
        if self.explicit or not seals.SEALS.groups[self.group]:
            return
        key = self.done_key
        with store_errors(self.what):  # one round trip, no write: absent gives the sentinel
            data = self.store.compare_set(key, _ABSENT, _ABSENT)
        data = None if data == _ABSENT.encode() else data
        try:
            ours = data is not None and seals.opened(key, data) == str(self.seq).encode()
        except records.BadRecord:
            ours = False
        if not ours:
            raise DistributedEnvError(
                f"the counter at store key {self.keys[0]!r} says group rank 0 finished "
                f"{self.what}, but its sealed record {key!r} is "
                f"{'not there' if data is None else 'not this run' + chr(39) + 's'}: a process "
                "outside the job changed the store (only the job's own ranks hold the run's "
                'secret; docs/design/store.md, "Trust model"). This rank does not go on as if the '
                "block were done")

    def await_firsts(self) -> None:
        """A waiting rank: arrive, wait until the first rank(s) are done; raise their failure."""
        self.set_bit()
        if not self.explicit:
            # the default, released by group rank 0's bit (word 0, with the flags): the fast
            # path, the arrival's answer (word 0 is still unread, 0, on a rank past 30) or one
            # read more, then nothing to clean up (this rank wrote no pairing record and
            # deletes no words)
            if self.words[0] & RELEASED == 1:
                return self._confirmed()
            self.read((0,))  # names a lost store itself
            if self.words[0] & RELEASED == 1:
                return self._confirmed()
        if self.explicit:
            which: Sequence[int] = ()  # every word: the firsts still running, the ranks not here

            def watch() -> List[int]:
                return self.missing()
        else:
            which = (0,)

            def watch() -> List[int]:
                return self.missing((0,))

        self.wait(self._released, which, watch, self.timeout, sleep=not self.explicit)
        self._confirmed()
        self.finish(complete=self.explicit)

    def confirm_later(self) -> None:
        """See :func:`first_run_end`: the sole first rank's arrival check, deferred when it
        would wait."""
        pending = BLOCKS.unconfirmed
        words = self.words
        if (words[0] & (1 << self.ws) - 1 == (1 << self.ws) - 1 if len(words) == 1  # full()
                else self.full()):  # every rank is here, so past every earlier block: all confirmed
            if pending:
                for block in [b for b in pending if b.seq < self.seq and b.group is self.group]:
                    pending.remove(block)
                    block.finish(complete=True)
            self.finish(complete=True)
            return
        pending.append(self)
        while len(pending) > AHEAD:
            pending.pop(0).await_arrivals()  # see confirm_all

    def await_arrivals(self) -> None:
        """A first rank: wait until every rank has reached this block (with this block's own
        ``timeout``). Another first rank's failure ends the wait: the waiting ranks raise it,
        this rank's body succeeded. Ranks that finished their script without reaching it make
        it a block the ranks did not all enter: :func:`_never_entered`."""
        known = failure_record()
        try:
            self.wait(self.full, (), self.missing, self.timeout,
                      " (waiting for every rank to reach it)", failed_ok=True)
        except RankFailedError as exc:
            if exc.exc_type != "exited":
                raise
            restore_failure_record(known)  # not another rank's failure: this rank's extra block
            raise _never_entered(self, exc) from None
        if self.words[0] & FAILED_MASK:  # read it all the same: its publisher waits for every reader
            with store_errors(self.what):
                self._stored("error")
        else:
            self.finish(complete=True)


def _never_entered(block: ZeroFirstBlock, lost: RankFailedError) -> CollectiveMismatchError:
    """The error for a block this rank ran first that ranks ``lost.ranks`` finished their
    script without entering: the block is this rank's extra one (or theirs is missing), not a
    failure of theirs."""
    ranks = sorted(lost.ranks or (lost.rank,))
    me = block.group.rank
    named = f"desc={block.desc!r} " if block.desc is not None else ""
    return CollectiveMismatchError(
        f"{block.what} on rank {me} was never reached by rank(s) {ranks}: they finished their "
        f"script and exited without entering it. Every rank must enter the same "
        f"{block.noun}s in the same order: one inside a @zero_only function, or under an "
        "`if` on the rank, runs on some ranks only. If two blocks on different lines are "
        "meant to be one (the branches of an `if`), give both the same label: desc=\"...\".",
        calls={me: f"{block.noun} {named}at {block.site}"}, missing=ranks)


# --- the first-run stack ---------------------------------------------------------------------

def first_run_begin(block: ZeroFirstBlock) -> None:
    """This thread starts the body of a block it runs first (as its group's rank 0, a
    ``datasets`` map in the body that the others cannot reuse is said: :mod:`.map_cache`)."""
    runs = BLOCKS.first_runs
    runs.depth += 1
    if block.rank == 0:
        runs.main += 1
        if "datasets" in sys.modules:  # what map_cache.watch looks at first, without its frame
            map_cache.watch()
    block.scope = scopes.enter("shared_first_run" if block.explicit else "first_run",
                               block.group, lambda: block.what, block.seq)


def first_run_end(block: ZeroFirstBlock, ok: bool) -> None:
    """The body of ``block``, which this thread ran first, ended (``ok``: without raising).
    Once the outermost first-run block ends, settle every block finished inside it: with
    several first ranks (explicit ``is_main``), wait for every rank's arrival now; as the sole
    first rank, confirm it now if every rank is already there, else later
    (:func:`confirm_all`, before this rank's next collective, or when it gets :data:`AHEAD`
    blocks ahead). A body that raised has published its failure: nothing is awaited."""
    # Why wait only at the outermost end: an inner block's waiting ranks are still blocked in
    # the *outer* block (they enter the inner one only after the outer body ran here), so
    # waiting for their arrival inside the outer body would deadlock. Finished inner blocks
    # are kept, in order, and all awaited once nothing encloses them any more.
    runs = BLOCKS.first_runs
    runs.depth -= 1
    if block.rank == 0:
        runs.main -= 1
    if block.scope is not None:
        scopes.leave(block.scope)
        block.scope = None
    if ok:
        runs.pending.append(block)
    if runs.depth > 0:
        return
    finished, runs.pending = runs.pending, []
    if ok:
        for done in finished:
            if done.explicit:
                done.await_arrivals()
            else:
                done.confirm_later()


#: How many of its blocks a sole first rank (default ``is_main``) may leave unconfirmed: it
#: does not wait at a block's end for the other ranks' arrival; a later block that finds them
#: all there confirms it (they reach blocks in order), and past this many it waits.
AHEAD = 1


def confirm_all() -> None:
    """Wait for the arrivals of every block this process left unconfirmed: before a collective
    the other ranks must join (they may still be waiting in a block that does not pair).
    Each block leaves the list before its wait: a wait that raises (a mismatch, a lost peer,
    Ctrl-C) has given its account, and the exit must not check the block again and log the
    same failure a second time."""
    pending = BLOCKS.unconfirmed
    while pending:
        pending.pop(0).await_arrivals()


def confirm_at_exit(bound: float) -> None:
    """:func:`confirm_all` at the exit: each block waits at most ``bound`` seconds more, and
    none is left unconfirmed afterwards, whatever the wait raised."""
    for block in BLOCKS.unconfirmed:
        block.timeout = bound if block.timeout is None else min(block.timeout, bound)
    try:
        confirm_all()
    finally:
        BLOCKS.unconfirmed.clear()
