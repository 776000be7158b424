"""Unit tests of a wait's failure (``_runtime/liveness/waits.py``): a peer that failed on the
deadlock this wait is part of gives this rank its own ``CollectiveMismatchError``. No store, no
process: the wait is built without its store."""

from __future__ import annotations

from axolotl_dist._runtime.base.text import ranks_in_text, ranks_text
from axolotl_dist._runtime.liveness.stalls import Lost
from axolotl_dist._runtime.liveness.waits import Waiting
from axolotl_dist.errors import CollectiveMismatchError, RankFailedError

FINDING = ("ranks 0-2 wait for each other in kit calls that can never meet:\n"
           "  ranks 0, 1: reduce_and_broadcast at prog.py:11 in <module> (its 2nd collective on "
           "the default group), waiting for rank 2\n"
           "  rank 2: zero_first block #1 at prog.py:9 in <module> (on the default group), "
           "waiting for rank 0 to finish it\n"
           "Move it out of the `if`.")


def _wait(me: int, shown: str) -> Waiting:
    wait = Waiting.__new__(Waiting)
    wait.me, wait.shown, wait.what = me, shown, shown
    return wait


def _failed(rank: int, exc_type: str, message: str) -> Lost:
    return Lost(rank, "failed", message, RankFailedError(rank, exc_type, message, "", where="x"))


def test_a_peer_that_failed_on_this_waits_deadlock_gives_this_ranks_own_finding():
    peer = _failed(0, "CollectiveMismatchError",
                   "rank 0's reduce_and_broadcast at prog.py:11 in <module> can never complete: "
                   + FINDING)
    error = _wait(2, "zero_first block #1 at prog.py:9 in <module>").failure([peer])
    assert isinstance(error, CollectiveMismatchError)
    assert str(error).startswith("rank 2's zero_first block #1 at prog.py:9 in <module> can "
                                 "never complete: ranks 0-2 wait for each other"), error
    assert "prog.py:11" in str(error) and "`if`" in str(error)


def test_any_other_failure_is_the_peers_failure():
    other = _failed(0, "CollectiveMismatchError",
                    "rank 0's barrier at a.py:3 in <module> can never complete: " + FINDING)
    assert isinstance(_wait(3, "zero_first block #1 at prog.py:9 in <module>").failure([other]),
                      RankFailedError)  # rank 3 is no party
    assert isinstance(_wait(2, "barrier at b.py:5 in <module>").failure([other]),
                      RankFailedError)  # rank 2 is, in another call
    plain = _failed(1, "ValueError", "boom")
    assert isinstance(_wait(2, "barrier at b.py:5 in <module>").failure([plain]), RankFailedError)


def test_a_ranks_label_reads_back():
    for ranks in ([2], [0, 1], [0, 1, 2], [0, 1, 2, 5, 7, 8, 9]):
        assert ranks_in_text(ranks_text(ranks).split(" ", 1)[1]) == ranks
