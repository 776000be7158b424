"""Unit tests of a waiter's check (``_runtime/liveness/stalls.py``): a lost rank's exit record
read into the account ``lost_error`` orders, and the stall detector's report refused where it
is not what the detector writes. No store, no process."""

from __future__ import annotations


import pytest

from axolotl_dist._runtime.liveness import stalls
from axolotl_dist._runtime.liveness.lost import Lost, lost_error
from axolotl_dist._runtime.liveness.stalls import PeerChecker
from axolotl_dist._runtime.store import records
from axolotl_dist.errors import RankFailedError

DONE = "its process finished its script and exited (no uncaught exception)"


def _exited(rank: int, when: float) -> Lost:
    return Lost(rank, "exited", DONE, None, when)


@pytest.mark.parametrize("report_of, detail", [
    (None, DONE),
    (3, "its process exited after an uncaught ValueError: bad shard 17"),
    (0, "its process exited after learning that rank 0 failed"),
])
def test_an_exit_record_makes_the_lost_rank_lost_error_orders(report_of, detail):
    report = None if report_of is None else records.failure(RankFailedError(
        report_of, "ValueError", "bad shard 17", where="barrier"))
    lost = PeerChecker._from_record(3, report, 12.5)
    assert (lost.rank, lost.how, lost.detail, lost.when) == (3, "exited", detail, 12.5)
    assert (lost.report is None) == (report_of is None)
    root = lost_error([_exited(1, when=99.0), lost], "barrier").rank
    assert root == {None: 3, 3: 3, 0: 1}[report_of]  # a relay comes after a normal exit


@pytest.mark.parametrize("rank", ["\u00b2", "-1", "1 "])
def test_a_stall_report_whose_silent_rank_int_cannot_read_is_refused(rank):
    data = records.document({"silent": {rank: 12.5}, "deadlocks": []}).encode()
    with pytest.raises(records.BadRecord, match="silent ranks are not rank -> seconds"):
        stalls._stall_report(data)
