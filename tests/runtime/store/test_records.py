"""Unit tests of the store records' codec (``_runtime/store/records.py``): what a writer makes,
its reader gives back; anything else is a ``BadRecord`` saying why. No store, no process."""

from __future__ import annotations

import json

import pytest

from axolotl_dist._runtime.store import records
from axolotl_dist._runtime.store.records import BadRecord
from axolotl_dist.errors import CollectiveMismatchError, RankFailedError

DEADLOCK = ("ranks 0-2 wait for each other", [([0, 2], "barrier at a.py:3"), ([1], "zf at a.py:5")])
FIELDS = (1, "ValueError", "boom", "Traceback ...\n", "barrier", (1, 2), None, "train.py:88",
          DEADLOCK)
FAILURE = RankFailedError(*FIELDS[:4], where=FIELDS[4], ranks=FIELDS[5], machine=FIELDS[6],
                          site=FIELDS[7], deadlock=FIELDS[8])


def test_a_failure_report_reads_back_field_for_field():
    back = records.read_failure(records.failure(FAILURE))
    assert type(back) is RankFailedError and back.__reduce__()[1] == FIELDS


def test_an_exit_record_carries_its_failure_and_time():
    report = records.failure(FAILURE)
    assert records.read_exit(records.exit_record(report, 12.5)) == (report, 12.5)
    assert records.read_exit(records.exit_record(None, 3)) == (None, 3.0)


@pytest.mark.parametrize("data, why", [
    (b"", "not a record of the kit"),
    (b"\xff\xfe", "not a record of the kit"),
    (b"[1, 2]", "JSON without its fields"),
    (json.dumps({"v": 999, "k": "failure", "b": []}).encode(), "version 999"),
    (records.exit_record(None, 1.0), "'exit' record where a failure record belongs"),
    (b"{" + b" " * records.MAX_RECORD + b"}", "over the"),
    ("text", "is bytes, got str"),
])
def test_what_the_kit_did_not_write_is_refused_with_the_reason(data, why):
    with pytest.raises(BadRecord, match=why):
        records.read_failure(data)


@pytest.mark.parametrize("field, value", [(0, "1"), (0, True), (5, ["1"]), (6, 7), (7, 88),
                                          (8, "deadlock"), (8, ["a", [[[0], 3]]]),
                                          (8, ["a", [[["0"], "call"]]]), (8, [1, []])])
def test_a_field_of_the_wrong_type_is_refused(field, value):
    body = list(FIELDS)
    body[5], body[8] = list(body[5]), [DEADLOCK[0], [list(p) for p in DEADLOCK[1]]]
    body[field] = value
    data = json.dumps({"v": records.VERSION, "k": "failure", "b": body}).encode()
    with pytest.raises(BadRecord, match="failure record"):
        records.read_failure(data)


def test_an_exit_record_with_a_bad_failure_inside_is_refused():
    data = json.dumps({"v": records.VERSION, "k": "exit", "b": ["not a report", 1.0]}).encode()
    with pytest.raises(BadRecord):
        records.read_exit(data)


@pytest.mark.parametrize("value", [0, -1, 2 ** 200, -(3 ** 90),
                                   pytest.param(10 ** 6000, id="6001-digits")])
def test_big_ints_go_as_hexadecimal_text(value):
    assert records.read_bigint(records.bigint(value)) == value
    assert records.bigint(-255) == b"-ff"


@pytest.mark.parametrize("raw", [b"", b"-", b"12g", b"--1", b"0x1f", b"1F", b" 1",
                                 "\u00b2".encode()])
def test_a_big_int_that_is_not_hexadecimal_text_is_refused(raw):
    with pytest.raises(BadRecord):
        records.read_bigint(raw)


def test_a_peer_record_reads_back_and_a_foreign_one_reads_as_unknown():
    made = records.peer("node-1", 4242, "boot:123", True, "torchrun|x")
    assert records.read_peer(made.encode()) == ("node-1", 4242, "boot:123", True, "torchrun|x")
    assert records.read_peer(b"node-1|pid|m|1|l") is None
    assert records.read_peer(b"just text") is None


def test_a_blocks_pairing_record_reads_back():
    made = records.site(3, "a4789bd445", None, "prep.py:12 in <module>")
    assert records.read_site(made) == (3, "a4789bd445", None, "prep.py:12 in <module>")
    assert records.read_site(records.site(0, "t1", "tok", "x|y")) == (0, "t1", "tok", "x|y")
    for bad in ("3|a-b|d|s", "x|t|d|s", "1|t|d", "1234567890|t|d|s"):
        with pytest.raises(BadRecord, match="rank\\|tag\\|label\\|site"):
            records.read_site(bad)


def test_a_stuck_mark_is_two_numbers_or_none():
    assert records.read_stuck_mark(records.stuck_mark(7, 2).encode()) == ("7", "2")
    assert records.read_stuck_mark(b"") == ("", "")
    for bad in (b"7|x", b"7", b"1|" + b"1" * 70):
        with pytest.raises(BadRecord, match="two numbers"):
            records.read_stuck_mark(bad)


def test_an_object_must_have_exactly_its_fields_of_their_types():
    fields = {"a": int, "b": (str, type(None))}
    assert records.read_object(b'{"a": 1, "b": null}', fields, "x") == {"a": 1, "b": None}
    for bad, why in ((b'{"a": 1}', "fields"), (b'{"a": true, "b": "s"}', "'a' is bool"),
                     (b'{"a": 1, "b": 2}', "'b' is int"), (b"nope", "not a JSON document")):
        with pytest.raises(BadRecord, match=why):
            records.read_object(bad, fields, "x")


def test_a_number_int_cannot_read_makes_a_record_unreadable_not_an_error():
    # '²' passes str.isdigit(), and int() refuses it: a forged record holding it is one this
    # version cannot read (None, skipped, BadRecord), as any other, never a ValueError
    assert records.read_peer("node-1|\u00b2|m|1|l".encode()) is None
    entries = f"\u00b2\ta warning{records.WARNING_END}1\tanother{records.WARNING_END}".encode()
    assert records.read_warning_entries(entries) == [(1, "another")]
    with pytest.raises(BadRecord, match="a block's pairing record is not rank"):
        records.read_site("\u00b2|t1|x|y")


@pytest.mark.parametrize("rank", ["\u00b2", "--1", "-\u00b2"])
def test_a_mismatch_record_whose_ranks_int_cannot_read_is_refused(rank):
    data = records.mismatch(CollectiveMismatchError("m", calls={0: "a"}, missing=()))
    doc = json.loads(data)
    doc["b"][2] = {rank: "x"}
    with pytest.raises(BadRecord, match="a mismatch record's calls are not rank -> text"):
        records.read_mismatch(json.dumps(doc).encode())
