"""Unit tests of the error for lost peers (``_runtime/liveness/stalls.py``): a peer that failed
on the deadlock this rank's wait is part of gives this rank its own ``CollectiveMismatchError``
(``party_error``). No store, no process."""

from __future__ import annotations

from axolotl_dist._runtime.liveness.stalls import Lost, deadlock_part, party_error
from axolotl_dist.errors import CollectiveMismatchError, RankFailedError

FINDING = ("ranks 0-2 wait for each other in kit calls that can never meet:\n"
           "  ranks 0, 1: reduce_and_broadcast at prog.py:11 in <module> (its 2nd collective on "
           "the default group), waiting for rank 2\n"
           "  rank 2: zero_first block #1 at prog.py:9 in <module> (on the default group), "
           "waiting for rank 0 to finish it\n"
           "Move it out of the `if`.")


def _failed(rank: int, exc_type: str, message: str) -> Lost:
    return Lost(rank, "failed", message, RankFailedError(rank, exc_type, message, "", where="x"))


def test_a_peer_that_failed_on_this_waits_deadlock_gives_this_ranks_own_finding():
    peer = _failed(0, "CollectiveMismatchError",
                   "rank 0's reduce_and_broadcast at prog.py:11 in <module> can never complete: "
                   + FINDING)
    error = party_error([peer], 2, "zero_first block #1 at prog.py:9 in <module>")
    assert isinstance(error, CollectiveMismatchError)
    assert str(error).startswith("rank 2's zero_first block #1 at prog.py:9 in <module> can "
                                 "never complete: ranks 0-2 wait for each other"), error
    assert "prog.py:11" in str(error) and "`if`" in str(error)


def test_any_other_failure_stays_the_peers_failure():
    other = _failed(0, "CollectiveMismatchError",
                    "rank 0's barrier at a.py:3 in <module> can never complete: " + FINDING)
    assert party_error([other], 3, "zero_first block #1 at prog.py:9 in <module>") is None
    assert party_error([other], 2, "barrier at b.py:5 in <module>") is None  # another call
    assert party_error([_failed(1, "ValueError", "boom")], 2, "barrier at b.py:5") is None


def test_a_collective_failed_by_the_peers_exit_takes_the_same_finding():
    # the peer read the finding first and its exit closed the collective's connections: the
    # backend's error, diagnosed as the peer's RankFailedError, is checked alike (deadlock_part)
    peer = RankFailedError(0, "CollectiveMismatchError",
                           "rank 0's reduce_and_broadcast at prog.py:11 in <module> can never "
                           "complete: " + FINDING, "", where="zero_first block #1")
    error = deadlock_part(peer, 2, "zero_first block #1 at prog.py:9 in <module>")
    assert isinstance(error, CollectiveMismatchError) and str(error).startswith("rank 2's ")
    assert deadlock_part(peer, 3, "zero_first block #1 at prog.py:9 in <module>") is None
    assert deadlock_part(None, 2, "zero_first block #1 at prog.py:9 in <module>") is None
