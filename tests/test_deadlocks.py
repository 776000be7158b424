"""Kit waits that can never end raise on every rank involved, naming each rank's call.

Each script diverges right after a barrier: some ranks call what the others do not (a
``zero_first`` block under an ``if`` on the rank, a collective under ``if
ad.is_main_process():``). Every rank must raise ``CollectiveMismatchError`` naming both lines,
within 15 s of the divergence, under ``axolotl-dist`` and under bare env vars (rank 0's process
hosts the store). Then runs that only look alike (long bodies, slow ranks, first ranks meeting
in a subgroup inside their body) must end normally: the judge waits for a wait that can never
end, not a slow one.
"""

from __future__ import annotations

import re
import textwrap

import pytest

from fixtures import launch_script, run_bare_env

pytestmark = pytest.mark.timeout(120)

HEAD = """\
import sys, time
import axolotl_dist as ad
ad.init_distributed()
rank = ad.get_rank()
ad.barrier()  # every rank is here: the divergence starts below
t0 = time.time()
try:
{body}
except ad.CollectiveMismatchError:
    print(f"MISMATCH rank {{rank}} after {{time.time() - t0:.1f}} s", flush=True)
    raise
print(f"DONE rank {{rank}}", flush=True)
"""

#: name -> (ranks, body); the lines marked ``# A`` and ``# B`` are the two sides.
CASES = {
    "extra_block_on_rank_1": (2, """\
if rank == 1:
    with ad.zero_first():  # A
        pass
ad.reduce_and_broadcast(lambda: rank, sum)  # B
"""),
    "barrier_under_is_main": (2, """\
if ad.is_main_process():
    ad.barrier()  # A
ad.compute_and_broadcast(lambda: 42)  # B
"""),
    "gather_under_is_main": (2, """\
if ad.is_main_process():
    ad.gather_from_all_ranks(lambda: rank)  # A
ad.barrier()  # B
"""),
    "extra_block_on_rank_2_of_3": (3, """\
if rank == 2:
    with ad.zero_first():  # A
        pass
ad.reduce_and_broadcast(lambda: rank, sum)  # B
"""),
}


def _script(body: str) -> str:
    return HEAD.format(body=textwrap.indent(body, "    "))


def _line_of(script: str, mark: str) -> int:
    return next(n for n, line in enumerate(script.splitlines(), 1) if line.endswith(f"# {mark}"))


def _launch(tmp_path, script: str, ws: int, how: str):
    """Run ``script`` on ``ws`` ranks: ``[(exit code, output)]`` per process (one for the
    launcher, one per rank under bare env vars)."""
    if how == "axolotl-dist":
        code, out, err = launch_script(tmp_path, "prog.py", script, ws, 90)
        return [(code, out + err)]
    return [(code, out + err) for code, out, err in run_bare_env(tmp_path, "prog.py", script,
                                                                  ws, 90)]


@pytest.mark.parametrize("how", ["axolotl-dist", "env"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_wait_that_can_never_end_raises_on_every_rank_naming_both_lines(tmp_path, case, how):
    ws, body = CASES[case]
    script = _script(body)
    line_a, line_b = _line_of(script, "A"), _line_of(script, "B")
    results = _launch(tmp_path, script, ws, how)
    output = "".join(text for _, text in results)
    assert all(code != 0 for code, _ in results), output
    seconds = {int(r): float(s) for r, s in re.findall(r"MISMATCH rank (\d) after ([\d.]+) s",
                                                         output)}
    assert sorted(seconds) == list(range(ws)), output  # every rank raised the mismatch
    assert max(seconds.values()) <= 15.0, seconds
    # each rank's own error names both sides: every rank's call, by file and line
    errors = re.findall(r"CollectiveMismatchError: (rank \d's .*?)(?=\n\S*Traceback|\Z)",
                        re.sub(r"^\[rank ?\d\]:? ", "", output, flags=re.M), re.S)
    assert len(errors) >= ws, output
    for error in errors[:ws]:
        assert f"prog.py:{line_a}" in error and f"prog.py:{line_b}" in error, error
        assert "wait for each other in kit calls that can never meet" in error, error
        assert "`if`" in error, error  # what to change
    assert "DONE" not in output, output


#: Runs that only look like a deadlock for a while.
SLOW = {
    # the first rank's body runs long while the other waits in the block
    "long_first_run": (2, """\
with ad.zero_first():
    if rank == 0:
        time.sleep(4)
ad.barrier()
"""),
    # ranks arrive late, in turn, at a mix of helpers and blocks
    "late_ranks_mixed_calls": (3, """\
for step in range(6):
    if step % 3 == rank:
        time.sleep(1.2)
    if step % 2:
        with ad.zero_first():
            if rank == 0:
                time.sleep(0.8)
    else:
        ad.compute_and_broadcast(lambda: step)
    ad.gather_from_all_ranks(lambda: [rank] * 1000)
"""),
    # two first ranks meet in a group of their own inside the block; rank 2 waits for both
    "first_ranks_meet_inside_the_block": (3, """\
import torch.distributed as dist
pair = dist.new_group([0, 1])
with ad.zero_first(is_main=rank < 2):
    if rank < 2:
        time.sleep(0.5 * rank)
        ad.barrier(group=pair)
        time.sleep(2)
ad.barrier()
"""),
    # four ranks, one of them late at each step, through every kind of kit wait (a
    # broadcast's root moves on while the others still receive)
    "mixed_steps_of_four_ranks": (4, """\
import random, torch
for step in range(24):
    rng = random.Random(step)
    slow, pause = rng.randrange(4), rng.choice([0.0, 0.3, 0.7, 1.3])
    if rank == slow:
        time.sleep(pause)
    kind = rng.randrange(7)
    if kind == 0:
        ad.barrier()
    elif kind == 1:
        ad.compute_and_broadcast(lambda: list(range(50000)) if rank == 0 else None)
    elif kind == 2:
        ad.gather_from_all_ranks(lambda: rank)
    elif kind == 3:
        with ad.zero_first():
            if rank == 0:
                time.sleep(pause)
    elif kind == 4:
        with ad.zero_first(is_main=rank < 2):
            if rank < 2:
                time.sleep(pause / 2)
    elif kind == 5:
        ad.do_n_at_a_time(lambda: time.sleep(0.2), n=2)
    else:
        ad.broadcast(torch.ones(4_000_000) * rank, src=step % 4)
"""),
}


@pytest.mark.parametrize("case", sorted(SLOW))
def test_slow_waits_that_end_are_not_deadlocks(tmp_path, case):
    ws, body = SLOW[case]
    results = _launch(tmp_path, _script(body), ws, "env")
    output = "".join(text for _, text in results)
    assert [code for code, _ in results] == [0] * ws, output
    assert "MISMATCH" not in output and output.count("DONE rank") == ws, output
