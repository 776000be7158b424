"""A chain of failures where the store lives in rank 0 (bare env vars, ``srun``, ``mpirun``):
rank 1 fails, rank 0 (the store's host) catches the failure its barrier raises and ends at
once with ``os._exit`` (the store goes with it), rank 2 waits in the same barrier. Every rank
must name rank 1, the failure that came first, not the store's host (docs/faults.md, "Where
the store lives")."""

from __future__ import annotations

import pytest

from fixtures import run_bare_env

pytestmark = pytest.mark.timeout(120)

CHAIN = """\
import os, signal, sys
import axolotl_dist as ad

ad.init_distributed()
rank = ad.get_rank()
ad.barrier()
try:
    if rank == 1:
        FAIL
    ad.barrier()
except ad.RankFailedError as exc:
    if rank == 0:
        print(f"rank 0 caught: rank {exc.rank} failed", flush=True)
        os._exit(1)
    raise
"""

FAILURES = {
    "raise": ("raise ValueError('boom on rank 1')",
              "rank 1 failed at chain.py:9: ValueError: boom on rank 1"),
    "os._exit": ("os._exit(3)", "rank 1 failed in barrier: died"),
    "SIGKILL": ("os.kill(os.getpid(), signal.SIGKILL)", "rank 1 failed in barrier: died"),
}


@pytest.mark.parametrize("kind", list(FAILURES))
def test_every_rank_names_the_first_failure_when_the_store_host_leaves_at_once(tmp_path, kind):
    statement, named = FAILURES[kind]
    (code0, out0, err0), (code1, _, err1), (code2, out2, err2) = run_bare_env(
        tmp_path, "chain.py", CHAIN.replace("FAIL", statement), 3, timeout=90)
    assert code0 == 1 and "rank 0 caught: rank 1 failed" in out0, (out0, err0)
    assert code1 != 0
    assert code2 == 1, err2
    assert named in err2, err2
    assert "store host" not in err2 and "rank 0 failed" not in err2, err2
    assert err2.count("RankFailedError") == 1, err2  # one account
    for err in (err0, err1, err2):  # no store call after the store's host ended
        assert "frame #" not in err and "TCPStore.cpp" not in err, err
