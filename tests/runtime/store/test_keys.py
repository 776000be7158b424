"""Unit tests of the store keys' spelling (``_runtime/store/keys.py``): the strings the builders
return (docs/design/store.md, "Store keys"), which keys the kit counts in (``is_counter``), a listed
key as the kit names it (``as_named``), and the heartbeat counter's bit fields. No store."""

from __future__ import annotations

import pytest

from axolotl_dist._runtime.store import keys

TAG = "0123456789"  # a block's pairing tag: 10 hex digits


@pytest.mark.parametrize("built, spelled", [
    (keys.waiting(3), "axd/waiting/3"),
    (keys.exit_record(5), "axd/exit/5"),
    (keys.exit_pending(5), "axd/exit/5/pending"),
    (keys.ack(keys.exit_record(5), 2), "axd/exit/5/ack/2"),
    (keys.gone(0), "axd/gone/0"),
    (keys.deadlock("beef"), "axd/deadlock/beef"),
    (keys.block("zf", 7), "axd/zf/7"),
    (keys.block("ck", 0), "axd/ck/0"),
    (keys.debug_check(4), "axd/dbg/4"),
    (keys.shared_fs("ab12"), "axd/fs/ab12"),
    (keys.shared_map(9), "axd/sm/9"),
    (keys.clock(2, 1, "ping"), "axd/clk/2/1/ping"),
    (keys.who("r1", 3), "axolotl_dist/r1/who/3"),
    (keys.heartbeat("r1", 3), "axolotl_dist/r1/hb/3"),
    (keys.dead("r1"), "axolotl_dist/r1/dead"),
    (keys.where_answer("r1", 0), "axolotl_dist/r1/where/0"),
    (keys.where_question("r1"), "axolotl_dist/r1/ask"),
    (keys.long_wait("r1", 1), "axolotl_dist/r1/wait/1"),
    (keys.stuck("r1", 1), "axolotl_dist/r1/stuck/1"),
    (keys.attempt_join(2), "axolotl_dist/attempt/join/2"),
    (keys.attempt_answer(2, "cafe"), "axolotl_dist/attempt/answer/2/cafe"),
    (keys.attempt_joined(3, 2), "axolotl_dist/attempt/3/joined/2"),
    (keys.attempt_prefix(4), "axolotl_dist/attempt/4"),
])
def test_each_builder_spells_the_documented_key(built, spelled):
    assert built == spelled


def test_the_fixed_keys_are_spelled_as_documented():
    assert (keys.RUN, keys.EXITS, keys.EXIT_LOG, keys.STALL_REPORT, keys.WAITERS,
            keys.WARN_LOG) == ("axd/run", "axd/exits", "axd/exit_log", "axd/stalls",
                               "axd/waiters", "axd/warn_log")
    assert (keys.RUN_NOTE, keys.ATTEMPTS) == ("axolotl_dist/run", "axolotl_dist/attempt")


def test_a_rendezvous_rounds_keys_and_their_round_back():
    prefix = keys.rendezvous_prefix("job7", 2)
    assert prefix == "torch.rendezvous.job7.2"
    assert keys.rendezvous_port(prefix) == "torch.rendezvous.job7.2/MASTER_PORT"
    assert keys.rendezvous_addr(prefix) == "torch.rendezvous.job7.2/MASTER_ADDR"
    assert keys.rendezvous_round("torch.rendezvous.job7.2/MASTER_PORT") == "torch.rendezvous.job7.2"


@pytest.mark.parametrize("key, is_port", [
    ("torch.rendezvous.job7.2/MASTER_PORT", True),
    ("torch.rendezvous.x.y.0/MASTER_PORT", True),
    ("torch.rendezvous.job7.2/MASTER_ADDR", False),
    ("torch.rendezvous.job7.2", False),
    ("other.job7.2/MASTER_PORT", False),
    ("MASTER_PORT", False),
])
def test_only_a_rendezvous_rounds_port_key_is_one(key, is_port):
    assert keys.is_rendezvous_port(key) is is_port


@pytest.mark.parametrize("key", [
    "axd/exits",
    "axd/waiters",
    "axd/waiting/3",
    f"axd/zf/4/{TAG}",
    f"axd/zf/4/{TAG}/2",
    "axd/dn/0/abcdef0123",
    f"axd/ck/12/{TAG}",
    "axd/fs/9f3a/seen",
    "axd/dbg/7/n",
    "axd/dbg/7/d/digest",
    "axd/sm/2/arrived",
    "axd/sm/2/progress",
    "axd/sm/2/done",
    "axd/sm/2/failed",
    "axd/sm/2/left",
    "axd/sm/2/left/host/a",
    "axolotl_dist/r1/hb/0",
    "axolotl_dist/attempt",
    "axolotl_dist/attempt/3/axd/exits",  # under an attempt's prefix
    "default_pg/1/axd/waiting/0",  # under a group's prefix
    "outer/axolotl_dist/r1/hb/12",
])
def test_the_kits_counters_are_counters_under_any_prefix(key):
    assert keys.is_counter(key)


@pytest.mark.parametrize("key", [
    "axd/run",
    "axd/exit_log",
    "axd/stalls",
    "axd/warn_log",
    "axd/exit/3",
    "axd/waiting/x",
    "axd/waiting/3/x",
    f"axd/zf/4/{TAG}/site",
    "axd/zf/4/site",
    "axd/zf/4/012345678",  # 9 hex digits: not a tag
    "axd/zf/4/0123456789a",  # 11
    "axd/zf/4/ABCDEF0123",  # upper case
    f"axd/xx/4/{TAG}",
    "axd/fs/9f3a",
    "axd/dbg/7/abort",
    "axd/dbg/7/c/0",
    "axd/sm/2/who/0",
    "axd/sm/2/error/0",
    "axolotl_dist/run",
    "axolotl_dist/r1/who/0",
    "axolotl_dist/r1/hb/0/x",
    "axolotl_dist/attempt/3",
    "axolotl_dist/attempt/join/0",
    "xaxd/exits",  # a counter's tail only after a '/'
    "myaxolotl_dist/attempt",
    "axd/exits/more",
    "",
])
def test_other_keys_are_not_counters(key):
    assert not keys.is_counter(key)


@pytest.mark.parametrize("listed, named", [
    ("axd/exits", "axd/exits"),
    ("default_pg/1/axd/run", "axd/run"),
    ("axolotl_dist/attempt/3/axd/exits", "axd/exits"),  # a group key under an attempt
    ("axolotl_dist/attempt/3/joined/0", "axolotl_dist/attempt/3/joined/0"),
    ("axolotl_dist/r1/hb/2", "axolotl_dist/r1/hb/2"),
    ("outer/axolotl_dist/run", "axolotl_dist/run"),
    ("torch.rendezvous.job7.2/MASTER_PORT", "torch.rendezvous.job7.2/MASTER_PORT"),
    ("", ""),
])
def test_a_listed_key_is_named_from_axd_else_from_axolotl_dist(listed, named):
    assert keys.as_named(listed) == named


def test_the_heartbeat_counters_fields_sit_where_documented():
    # beats: bits 0-31; where's requests: bits 32-47; deaths announced: bits 48 and above
    assert keys.REQUEST == 0x1_0000_0000
    assert keys.NOTICE == 0x1_0000_0000_0000
    assert keys.BEATS == 0xFFFF_FFFF


def test_a_heartbeat_count_built_from_its_fields_reads_back_field_for_field():
    count = 7 + 3 * keys.REQUEST + 2 * keys.NOTICE
    assert count == 0x0002_0003_0000_0007
    assert count & keys.BEATS == 7
    assert keys.requests_of(count) == 3
    assert keys.notices_of(count) == 2


@pytest.mark.parametrize("count, requests, notices", [
    (0, 0, 0),
    (0xFFFF_FFFF, 0, 0),  # a full beats field spills into neither
    (0x0000_0001_0000_0000, 1, 0),
    (0x0000_FFFF_FFFF_FFFF, 0xFFFF, 0),  # a full requests field is not a notice
    (0x0001_0000_0000_0000, 0, 1),
    (0x0001_0000_0000_0005, 0, 1),
    (0x0005_0002_0000_0009, 2, 5),
    (0x1_0000_0000_0000_0000, 0, 0x1_0000),  # notices are unbounded above bit 48
])
def test_requests_and_notices_read_their_own_bits_only(count, requests, notices):
    assert keys.requests_of(count) == requests
    assert keys.notices_of(count) == notices


def test_the_documented_table_lists_each_key_once_with_placeholders():
    assert len(keys.DOCUMENTED) == len(set(keys.DOCUMENTED))
    assert "axolotl_dist/<run>/hb/<rank>" in keys.DOCUMENTED
    assert "axd/exit/<rank>/ack/<reader>" in keys.DOCUMENTED
    assert "axolotl_dist/attempt/<a>" in keys.DOCUMENTED
