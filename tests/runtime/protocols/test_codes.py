"""Unit tests of the helpers' header codes (``_runtime/protocols/codes.py``): what
``register_helper`` gives, what ``helper_code`` puts in slot 3 of a header (the helper in the
low 8 bits, a root rank above), what ``describe_code`` reads back, and ``mismatch_error``'s
message. The registry is filled at import and survives ``state.reset()``: each test here runs
on an empty one and puts the kit's back as it was, in place (other modules hold its objects)."""

from __future__ import annotations

import re

import pytest

from axolotl_dist._runtime.protocols import codes
from axolotl_dist.errors import CollectiveMismatchError


@pytest.fixture(autouse=True)
def empty_registry():
    saved = (list(codes.HELPERS), dict(codes.CODES), dict(codes.ROOTED))
    objects = (codes.HELPERS, codes.CODES, codes.ROOTED)
    codes.HELPERS.clear()
    codes.CODES.clear()
    codes.ROOTED.clear()
    try:
        yield
    finally:
        codes.HELPERS[:] = saved[0]
        codes.CODES.clear()
        codes.CODES.update(saved[1])
        codes.ROOTED.clear()
        codes.ROOTED.update(saved[2])
        assert (codes.HELPERS, codes.CODES, codes.ROOTED) == saved
        assert all(a is b for a, b in zip((codes.HELPERS, codes.CODES, codes.ROOTED), objects))


def test_helpers_get_codes_from_1_in_the_order_they_register():
    assert codes.register_helper("alpha") == 1
    assert codes.register_helper("beta", root="src") == 2
    assert codes.register_helper("gamma") == 3
    assert codes.HELPERS == ["alpha", "beta", "gamma"]
    assert codes.CODES == {"alpha": 1, "beta": 2, "gamma": 3}
    assert codes.ROOTED == {"beta": "src"}


def test_the_same_name_keeps_its_code():
    assert codes.register_helper("alpha") == 1
    assert codes.register_helper("beta") == 2
    assert codes.register_helper("alpha") == 1
    assert codes.register_helper("alpha", root="dst") == 1  # a root given later is kept
    assert codes.HELPERS == ["alpha", "beta"]
    assert codes.ROOTED == {"alpha": "dst"}


def test_a_helper_without_a_root_has_the_same_code_whatever_root_is_passed():
    codes.register_helper("filler")
    codes.register_helper("barrier_like")
    assert codes.helper_code("barrier_like") == 2
    assert codes.helper_code("barrier_like", 5) == 2


def test_a_rooted_helpers_code_carries_its_root_above_the_low_8_bits():
    codes.register_helper("filler")
    codes.register_helper("gather_from_all_ranks", root="dst")
    assert codes.helper_code("gather_from_all_ranks") == 2
    assert codes.helper_code("gather_from_all_ranks", 1) == 0x102
    assert codes.helper_code("gather_from_all_ranks", 3) == 770
    assert codes.helper_code("gather_from_all_ranks", 1000) == 0x3E802


def test_a_code_describes_the_helper_and_root_it_was_made_from():
    codes.register_helper("all_reduce")
    codes.register_helper("broadcast", root="src")
    codes.register_helper("gather_from_all_ranks", root="dst")
    assert codes.describe_code(codes.helper_code("all_reduce", 4)) == "all_reduce"
    assert codes.describe_code(codes.helper_code("broadcast")) == "broadcast(src=0)"
    assert codes.describe_code(codes.helper_code("broadcast", 7)) == "broadcast(src=7)"
    assert codes.describe_code(codes.helper_code("gather_from_all_ranks", 1)) == \
        "gather_from_all_ranks(dst=1)"
    assert codes.describe_code(0x303) == "gather_from_all_ranks(dst=3)"
    assert codes.describe_code(0x2) == "broadcast(src=0)"


def test_distinct_helpers_get_distinct_codes_and_descriptions():
    names = [f"helper_{i}" for i in range(20)]
    made = [codes.register_helper(name) for name in names]
    assert made == list(range(1, 21))
    assert [codes.describe_code(codes.helper_code(name)) for name in names] == names


def test_two_roots_of_one_helper_are_different_codes():
    codes.register_helper("broadcast", root="src")
    assert codes.helper_code("broadcast", 0) != codes.helper_code("broadcast", 1)
    assert codes.helper_code("broadcast", 0) & 0xFF == codes.helper_code("broadcast", 1) & 0xFF


@pytest.mark.parametrize("code", [0, 3, 0xFF, 0x100, 0x1FF])
def test_a_code_no_helper_has_is_described_as_unknown(code):
    codes.register_helper("alpha")
    codes.register_helper("beta")
    assert codes.describe_code(code) == f"an unknown helper (code {code})"


def test_an_unknown_code_names_its_number():
    assert codes.describe_code(1) == "an unknown helper (code 1)"
    assert codes.describe_code(0x305) == "an unknown helper (code 773)"


def test_an_unregistered_name_has_no_code():
    with pytest.raises(KeyError):
        codes.helper_code("never_registered")


def test_the_255_codes_run_out_with_a_value_error():
    for i in range(255):
        codes.register_helper(f"h{i}")
    assert codes.CODES["h254"] == 255
    assert codes.register_helper("h0") == 1  # a known name still has its code
    with pytest.raises(ValueError, match=re.escape(
            "register_helper('one_too_many'): no header code left (255 in use)")):
        codes.register_helper("one_too_many")
    assert len(codes.HELPERS) == 255 and "one_too_many" not in codes.CODES


def test_mismatch_error_lists_every_ranks_helper_and_this_ranks_call_site():
    codes.register_helper("all_reduce")
    codes.register_helper("broadcast", root="src")
    error = codes.mismatch_error({2: 0x102, 0: 1, 1: 9}, 0, lambda: "train.py:12")
    assert isinstance(error, CollectiveMismatchError)
    assert error.calls == {0: "all_reduce", 1: "an unknown helper (code 9)",
                           2: "broadcast(src=1)"}
    assert error.missing == ()
    assert str(error) == (
        "the ranks called different helpers that met in one collective (rank 0: all_reduce, "
        "rank 1: an unknown helper (code 9), rank 2: broadcast(src=1)): every rank must call "
        "the same helpers in the same order. This rank (rank 0) called all_reduce at "
        "train.py:12; run with AXOLOTL_DIST_DEBUG=1 to see every rank's file and line.")


def test_mismatch_error_names_the_calling_ranks_own_helper():
    codes.register_helper("all_reduce")
    codes.register_helper("broadcast", root="src")
    error = codes.mismatch_error({0: 1, 1: 0x302}, 1, lambda: "eval.py:3")
    assert "This rank (rank 1) called broadcast(src=3) at eval.py:3;" in str(error)
    assert error.calls == {0: "all_reduce", 1: "broadcast(src=3)"}
