"""zero_only: the decorator and the block really skip on other ranks, on real gloo ranks
(``@pytest.mark.distributed``: each test's body runs on every rank)."""

import pytest

import axolotl_dist as ad
from axolotl_dist.testing import run_distributed

# ---------------------------------------------------------------- zero_only


@ad.zero_only
def _record_at_import(path):
    # decorated at import time, before any process group exists
    with open(path, "a") as fh:
        fh.write(f"{ad.get_rank()}\n")
    return "wrote"


@pytest.mark.distributed(world_size=[1, 2, 3])
def test_zero_only_decorator_runs_on_rank0_only(tmp_path):
    @ad.zero_only()
    def with_parens():
        return "parens"

    @ad.zero_only(default="skipped")
    def with_default():
        return "ran"

    got = _record_at_import(str(tmp_path / "log")), with_parens(), with_default()
    assert got == (("wrote", "parens", "ran") if ad.get_rank() == 0 else (None, None, "skipped"))
    ad.barrier()
    assert (tmp_path / "log").read_text() == "0\n"  # one tmp_path, shared by the ranks


def test_zero_only_checks_rank_per_call_not_at_decoration():
    @ad.zero_only
    def f():
        return "ran"

    def body():  # decorated in the parent (rank 0 of 1), called on each rank
        return f()

    assert run_distributed(body, 2, timeout=60) == ["ran", None]


@pytest.mark.distributed(world_size=3)
def test_zero_only_with_block_is_skipped_on_other_ranks(tmp_path):
    effects = []
    with ad.zero_only():
        effects.append("body")
        (tmp_path / f"touched-{ad.get_rank()}").write_text("x")
    with ad.zero_only() as is_main:
        effects.append(("flag", is_main))
    effects.append("after")
    assert effects == (["body", ("flag", True), "after"] if ad.get_rank() == 0 else ["after"])
    ad.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["touched-0"]


@pytest.mark.distributed(world_size=2)
def test_zero_only_with_block_restores_existing_tracer():
    import sys

    calls = []

    def tracer(frame, event, arg):
        calls.append(event)
        return None

    sys.settrace(tracer)
    try:
        with ad.zero_only():
            calls.append("body")
        active = sys.gettrace() is tracer
    finally:
        sys.settrace(None)
    assert active
    assert ("body" in calls) == (ad.get_rank() == 0)


@pytest.mark.distributed(world_size=2)
def test_zero_only_exception_in_body_on_rank0_propagates():
    raised = []
    try:
        with ad.zero_only():
            raise RuntimeError("real error")
    except RuntimeError as exc:
        raised.append(str(exc))
    assert raised == (["real error"] if ad.get_rank() == 0 else [])


def test_zero_only_rejects_non_callable():
    with pytest.raises(TypeError, match="zero_only\\(\\) takes a function or keyword arguments"):
        ad.zero_only(42)




@pytest.mark.distributed(world_size=2)
def test_zero_only_block_whose_body_starts_with_try_is_skipped():
    # a skip raised on a `try:` line used to escape the `with` statement (CPython 3.11)
    ran = []
    with ad.zero_only():
        try:
            ran.append("body")
        except ValueError:
            pass
    assert ran == (["body"] if ad.get_rank() == 0 else [])
