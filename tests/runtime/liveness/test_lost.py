"""Unit tests of a lost peer's account (``_runtime/liveness/lost.py``): a peer that failed on the
deadlock this rank's wait is part of gives this rank its own ``CollectiveMismatchError``
(``deadlock_from_lost``, from the parties in the peer's record, never from its message's wording);
several lost ranks make one ``RankFailedError`` naming the root cause first (``lost_error``: a
rank's own exception, then a death, then the earliest normal exit, a rank that only relayed
another's failure last), the others after it in the same order. No store, no process."""

from __future__ import annotations

import itertools
import math


from axolotl_dist._runtime.liveness.lost import Lost, deadlock_from_report, lost_error, deadlock_from_lost
from axolotl_dist._runtime.store import records
from axolotl_dist.errors import CollectiveMismatchError, RankFailedError

FINDING = ("ranks 0-2 wait for each other in kit calls that can never meet:\n"
           "  ranks 0, 1: reduce_and_broadcast at prog.py:11 in <module> (its 2nd collective on "
           "the default group), waiting for rank 2\n"
           "  rank 2: zero_first block #1 at prog.py:9 in <module> (on the default group), "
           "waiting for rank 0 to finish it\n"
           "Move it out of the `if`.")
#: The finding's parties, as the stall detector publishes them with it.
PARTIES = [([0, 1], "reduce_and_broadcast at prog.py:11 in <module>"),
           ([2], "zero_first block #1 at prog.py:9 in <module>")]


def _failed(rank: int, exc_type: str, message: str, deadlock=None) -> Lost:
    return Lost(rank, "failed", message,
                RankFailedError(rank, exc_type, message, "", where="x", deadlock=deadlock))


def test_a_peer_that_failed_on_this_waits_deadlock_gives_this_ranks_own_finding():
    peer = _failed(0, "CollectiveMismatchError",
                   "rank 0's reduce_and_broadcast at prog.py:11 in <module> can never complete: "
                   + FINDING, (FINDING, PARTIES))
    error = deadlock_from_lost([peer], 2, "zero_first block #1 at prog.py:9 in <module>")
    assert isinstance(error, CollectiveMismatchError)
    assert str(error).startswith("rank 2's zero_first block #1 at prog.py:9 in <module> can "
                                 "never complete: ranks 0-2 wait for each other"), error
    assert "prog.py:11" in str(error) and "`if`" in str(error)


def test_any_other_failure_stays_the_peers_failure():
    other = _failed(0, "CollectiveMismatchError",
                    "rank 0's barrier at a.py:3 in <module> can never complete: " + FINDING,
                    (FINDING, PARTIES))
    assert deadlock_from_lost([other], 3, "zero_first block #1 at prog.py:9 in <module>") is None
    assert deadlock_from_lost([other], 2, "barrier at b.py:5 in <module>") is None  # another call
    assert deadlock_from_lost([_failed(1, "ValueError", "boom")], 2, "barrier at b.py:5") is None


def test_a_collective_failed_by_the_peers_exit_takes_the_same_finding():
    # the peer read the finding first and its exit closed the collective's connections: the
    # backend's error, diagnosed as the peer's RankFailedError, is checked alike (deadlock_from_report)
    peer = RankFailedError(0, "CollectiveMismatchError",
                           "rank 0's reduce_and_broadcast at prog.py:11 in <module> can never "
                           "complete: " + FINDING, "", where="zero_first block #1",
                           deadlock=(FINDING, PARTIES))
    error = deadlock_from_report(peer, 2, "zero_first block #1 at prog.py:9 in <module>")
    assert isinstance(error, CollectiveMismatchError) and str(error).startswith("rank 2's ")
    assert deadlock_from_report(peer, 3, "zero_first block #1 at prog.py:9 in <module>") is None
    assert deadlock_from_report(None, 2, "zero_first block #1 at prog.py:9 in <module>") is None


def test_the_finding_comes_from_the_report_not_from_its_wording():
    # a message that reads like a finding decides nothing: the parties travel in the record
    worded = _failed(0, "CollectiveMismatchError", "rank 0's reduce_and_broadcast at prog.py:11 "
                     "in <module> can never complete: " + FINDING)
    assert deadlock_from_lost([worded], 2, "zero_first block #1 at prog.py:9 in <module>") is None
    reworded = _failed(0, "CollectiveMismatchError", "a message in other words", (FINDING, PARTIES))
    error = deadlock_from_lost([reworded], 2, "zero_first block #1 at prog.py:9 in <module>")
    assert error is not None and error.deadlock == (FINDING, PARTIES)


def test_a_finding_survives_the_failure_record_and_a_relay():
    report = records.read_failure(records.failure(RankFailedError(
        0, "CollectiveMismatchError", "m", where="x", deadlock=(FINDING, PARTIES))))
    assert report.deadlock == (FINDING, PARTIES)
    relayed = lost_error([Lost(0, "exited", "d", report, 1.0)], "barrier")
    assert relayed.deadlock == (FINDING, PARTIES)
    assert deadlock_from_report(relayed, 1, "reduce_and_broadcast at prog.py:11") is not None


# --------------------------------------------------------------------------- lost_error's order
DIED = "pid 4242 on node-a, exited without reporting an error"
SILENT = "no heartbeat from pid 77 on node-b for 31 s"
DONE = "its process finished its script and exited (no uncaught exception)"


def _own(rank: int, exc_type: str, message: str, when: float = math.inf) -> Lost:
    """A rank that exited on its own uncaught exception."""
    report = RankFailedError(rank, exc_type, message, f"Traceback ...\n{exc_type}: {message}\n",
                             where="train_step", machine="m-1", site="train.py:88")
    return Lost(rank, "exited", f"its process exited after an uncaught {exc_type}: {message}",
                report, when)


def _relayed(rank: int, source: int, when: float = math.inf) -> Lost:
    """A rank that exited after hearing that ``source`` failed (on ``ValueError: boom``)."""
    report = RankFailedError(source, "ValueError", "boom", "Traceback ...\nValueError: boom\n",
                             where="barrier", machine="m-0", site="prep.py:5")
    return Lost(rank, "exited", f"its process exited after learning that rank {source} failed",
                report, when)


def _died(rank: int, when: float = math.inf) -> Lost:
    return Lost(rank, "died", DIED, None, when)


def _unresponsive(rank: int) -> Lost:
    return Lost(rank, "unresponsive", SILENT, None)


def _exited(rank: int, when: float) -> Lost:
    return Lost(rank, "exited", DONE, None, when)


def test_a_ranks_own_exception_is_the_root_cause_whatever_the_others_and_times():
    lost = [_exited(3, when=1.0), _died(2, when=0.5), _relayed(4, source=1, when=0.1),
            _own(1, "ValueError", "bad shard 17", when=9.0)]
    for order in itertools.permutations(lost):
        error = lost_error(order, "barrier")
        assert error.args[0] == (
            "rank 1 failed in barrier: ValueError: bad shard 17"
            f"; also rank 2 died: {DIED}"
            f"; also rank 3 exited: {DONE}"
            "; also rank 4 exited: its process exited after learning that rank 1 failed")
        assert error.ranks == (1, 2, 3, 4)


def test_the_root_causes_report_is_kept_and_the_wait_named():
    error = lost_error([_died(0), _own(2, "KeyError", "'labels'")], "gather_object")
    assert isinstance(error, RankFailedError)
    assert (error.rank, error.exc_type, error.where) == (2, "KeyError", "gather_object")
    assert error.exc_message == f"'labels'; also rank 0 died: {DIED}"
    assert error.remote_traceback == "Traceback ...\nKeyError: 'labels'\n"
    assert (error.machine, error.site) == ("m-1", "train.py:88")


def test_of_two_own_exceptions_the_earlier_one_is_the_root_cause():
    error = lost_error([_own(0, "OSError", "disk full", when=7.0),
                        _own(2, "ValueError", "nan loss", when=5.0)], "all_reduce")
    assert error.args[0] == ("rank 2 failed in all_reduce: ValueError: nan loss; also rank 0 "
                             "exited: its process exited after an uncaught OSError: disk full")
    assert error.ranks == (2, 0)


def test_an_exception_of_unknown_time_comes_after_one_of_known_time():
    error = lost_error([_own(0, "OSError", "a"), _own(3, "OSError", "b", when=100.0)], "x")
    assert (error.rank, error.ranks) == (3, (3, 0))


def test_at_the_same_time_the_lower_rank_comes_first():
    error = lost_error([_own(5, "OSError", "a", when=2.0), _own(4, "OSError", "b", when=2.0)],
                       "x")
    assert (error.rank, error.ranks) == (4, (4, 5))
    silent = lost_error([_died(3), _unresponsive(1)], "x")  # one category, no time: by rank
    assert silent.args[0] == f"rank 1 failed in x: unresponsive: {SILENT}; also rank 3 died: {DIED}"


def test_a_death_comes_before_a_normal_exit_even_a_later_one():
    error = lost_error([_exited(0, when=1.0), _died(6, when=30.0)], "barrier")
    assert error.args[0] == f"rank 6 failed in barrier: died: {DIED}; also rank 0 exited: {DONE}"
    assert (error.rank, error.exc_type, error.ranks) == (6, "died", (6, 0))
    assert error.remote_traceback is None and error.machine is None and error.site is None


def test_of_normal_exits_the_earliest_is_the_root_cause():
    error = lost_error([_exited(1, when=20.0), _exited(2, when=10.0)], "zero_first block #1")
    assert error.args[0] == (f"rank 2 failed in zero_first block #1: exited: {DONE}; also "
                             f"rank 1 exited: {DONE}")
    assert error.ranks == (2, 1)


def test_a_normal_exit_comes_before_a_rank_that_only_relayed_a_failure():
    error = lost_error([_relayed(1, source=0, when=1.0), _exited(2, when=50.0)], "barrier")
    assert error.args[0] == (f"rank 2 failed in barrier: exited: {DONE}; also rank 1 exited: "
                             "its process exited after learning that rank 0 failed")
    assert error.ranks == (2, 1)


def test_ranks_that_only_relayed_a_failure_name_the_rank_that_failed():
    error = lost_error([_relayed(1, source=0, when=4.0), _relayed(3, source=0, when=2.0)],
                       "barrier")
    assert error.args[0] == (
        "rank 0 failed in barrier: ValueError: boom (rank 3 exited on this failure); also "
        "rank 1 exited: its process exited after learning that rank 0 failed")
    assert (error.rank, error.exc_type, error.ranks) == (0, "ValueError", (0, 3, 1))
    assert (error.machine, error.site) == ("m-0", "prep.py:5")
    assert error.where == "barrier"  # this rank's wait, not the failed rank's


def test_an_empty_message_takes_no_separator_before_the_others():
    interrupted = Lost(0, "exited", "its process exited after an uncaught KeyboardInterrupt: ",
                       RankFailedError(0, "KeyboardInterrupt", ""))
    error = lost_error([_died(1), interrupted], "barrier")
    assert error.args[0] == f"rank 0 failed in barrier: KeyboardInterrupt; also rank 1 died: {DIED}"
    assert lost_error([interrupted], "barrier").args[0] == \
        "rank 0 failed in barrier: KeyboardInterrupt"


def test_a_single_lost_rank_is_named_alone():
    error = lost_error([_unresponsive(7)], "broadcast")
    assert error.args[0] == f"rank 7 failed in broadcast: unresponsive: {SILENT}"
    assert error.ranks == (7,)
