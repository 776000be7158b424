"""Exits that leave no store call behind: with rank 0 hosting the store, a rank ending on
another rank's failure makes its last store call before rank 0 ends, so the test harness
prints nothing of torch's C++ (``sendBytes failed ... Broken pipe``)."""

import sys

from fixtures import run, subprocess_env

TIMEOUT = 90


HARNESS = """
from axolotl_dist.testing import run_distributed, run_distributed_outcomes

def body():
    import axolotl_dist as ad
    return ad.reduce_and_broadcast(lambda: ad.get_rank() + 1, sum)

def failing():
    import axolotl_dist as ad
    return ad.compute_and_broadcast(lambda: 1 // 0)

assert run_distributed(body, world_size=2, store="rank0") == [3, 3]
outcomes = run_distributed_outcomes(failing, 2, store="rank0", timeout=60)
assert "ZeroDivisionError" in outcomes[0].error
assert "rank 0 failed in compute_and_broadcast" in outcomes[1].error
print("done")
"""


def test_the_harness_with_rank_0_hosting_the_store_prints_nothing_from_torch(tmp_path):
    # docs/testing.md's snippet with the store in rank 0: rank 1's last store calls at exit
    # came after rank 0, the store's host, had ended (torch printed "sendBytes failed ...
    # Broken pipe" and a C++ stack, twice)
    (tmp_path / "h.py").write_text(HARNESS)
    code, out, err = run([sys.executable, "h.py"], subprocess_env(tmp_path), TIMEOUT,
                         cwd=tmp_path)
    assert code == 0 and out.strip() == "done", (out, err)
    for text in ("Exception raised from", "frame #", "sendBytes", "Broken pipe"):
        assert text not in err, err
