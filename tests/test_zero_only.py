"""zero_only: the decorator and the block really skip on other ranks, on real gloo ranks."""

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


@pytest.mark.parametrize("ws", [1, 2, 3])
def test_zero_only_decorator_runs_on_rank0_only(tmp_path, ws):
    path = str(tmp_path / "log")

    @ad.zero_only()
    def with_parens():
        return "parens"

    @ad.zero_only(default="skipped")
    def with_default():
        return "ran"

    def body():
        return _record_at_import(path), with_parens(), with_default()

    out = run_distributed(body, ws, timeout=60)
    assert out[0] == ("wrote", "parens", "ran")
    for r in range(1, ws):
        assert out[r] == (None, None, "skipped")
    assert open(path).read() == "0\n"


def test_zero_only_checks_rank_per_call_not_at_decoration():
    @ad.zero_only
    def f():
        return "ran"

    def body():  # decorated in the parent (rank 0 of 1), called on each rank
        return f()

    assert run_distributed(body, 2, timeout=60) == ["ran", None]


def test_zero_only_with_block_is_skipped_on_other_ranks(tmp_path):
    def body():
        effects = []
        with ad.zero_only():
            effects.append("body")
            (tmp_path / f"touched-{ad.get_rank()}").write_text("x")
        with ad.zero_only() as is_main:
            effects.append(("flag", is_main))
        effects.append("after")
        return effects

    out = run_distributed(body, 3, timeout=60)
    assert out[0] == ["body", ("flag", True), "after"]
    assert out[1] == out[2] == ["after"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["touched-0"]


def test_zero_only_with_block_restores_existing_tracer():
    import sys

    def body():
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
        return active, "body" in calls

    out = run_distributed(body, 2, timeout=60)
    assert out[0] == (True, True)
    assert out[1] == (True, False)


def test_zero_only_exception_in_body_on_rank0_propagates():
    def body():
        try:
            with ad.zero_only():
                raise RuntimeError("real error")
        except RuntimeError as exc:
            return str(exc)
        return "no error"

    assert run_distributed(body, 2, timeout=60) == ["real error", "no error"]


def test_zero_only_rejects_non_callable():
    with pytest.raises(TypeError, match="zero_only\\(\\) takes a function or keyword arguments"):
        ad.zero_only(42)




def test_zero_only_block_whose_body_starts_with_try_is_skipped():
    # a skip raised on a `try:` line used to escape the `with` statement (CPython 3.11)
    def body():
        ran = []
        with ad.zero_only():
            try:
                ran.append("body")
            except ValueError:
                pass
        return ran

    assert run_distributed(body, 2, timeout=60) == [["body"], []]
