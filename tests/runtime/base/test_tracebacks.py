"""Unit tests of the one-line account of another rank's failure
(``_runtime/base/tracebacks.py``): the failing rank's own line and its message's first words
where its traceback is printed on this machine, the whole account where it is not. No process
group, no store."""

from __future__ import annotations

import pytest

from axolotl_dist._runtime.base import tracebacks
from axolotl_dist._runtime.base.procs import MACHINE
from axolotl_dist._runtime.store import records
from axolotl_dist.errors import RankFailedError

LONG = ("debug mode: torch's collective #10 on the default group differs across ranks: ranks "
        "0, 1 are in torch's all_reduce #10\n  rank 2: barrier()\n      at ddp.py:13")


@pytest.mark.parametrize("message, quoted", [
    ("bad row 17 in data.jsonl", "bad row 17 in data.jsonl"),
    ("", ""),
    (LONG, "debug mode: torch's…"),
    ("short first line\nand a second", "short first line…"),
    ("x" * 100, "x" * tracebacks.EXCERPT + "…"),  # no space to cut at
])
def test_an_excerpt_is_the_first_words_of_the_first_line(message, quoted):
    assert tracebacks.excerpt(message) == quoted


def _failure(message: str, machine, where: str = "torch's collective") -> RankFailedError:
    return RankFailedError(2, "CollectiveMismatchError", message, "Traceback ...\n",
                           where=where, machine=machine, site="ddp.py:13")


def test_a_peer_on_this_machine_is_named_with_its_line_and_first_words():
    line = tracebacks.format_failure(_failure(LONG, MACHINE), None)
    assert line == ("axolotl_dist.errors.RankFailedError: rank 2 failed at ddp.py:13: "
                    "CollectiveMismatchError: debug mode: torch's… (its traceback is in rank "
                    "2's output)\n")


def test_a_place_with_its_own_line_is_kept():
    where = "zero_first block #1 at e.py:4 in <module>"
    line = tracebacks.format_failure(_failure("bad row", MACHINE, where), None)
    assert f"rank 2 failed in {where}: CollectiveMismatchError: bad row (its" in line


def test_a_peer_elsewhere_gets_its_whole_account_and_traceback():
    line = tracebacks.format_failure(_failure(LONG, "another-machine"), None)
    assert LONG in line and "--- traceback from rank 2 ---" in line


def test_the_site_survives_a_report():
    error = _failure(LONG, MACHINE)
    back = records.read_failure(records.failure(error))
    assert back.site == "ddp.py:13" and str(back) == str(error)
