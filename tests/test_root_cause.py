"""The rank that died first is named first, past a store host that exits after it.

Three ranks under bare env vars (rank 0's process hosts the store): rank 1 is SIGKILLed, then
ranks 0 and 2 call ``compute_and_broadcast``. Rank 0 names rank 1 and ends; rank 2 must name
rank 1 too (its process was gone first, on this host), not "rank 0 (the store host) died",
and no torch C++ frames may show.
"""

from __future__ import annotations

import re

import pytest

from fixtures import run_bare_env

pytestmark = pytest.mark.timeout(120)

SCRIPT = """\
import os, signal, time
import axolotl_dist as ad
ad.init_distributed()
ad.barrier()
if ad.get_rank() == 1:
    os.kill(os.getpid(), signal.SIGKILL)
time.sleep(1)
ad.compute_and_broadcast(lambda: 1)
"""


def test_a_dead_rank_is_named_first_past_the_store_host_that_exits_after_it(tmp_path):
    (code0, _, err0), (code1, _, _), (code2, _, err2) = run_bare_env(tmp_path, "chain.py", SCRIPT,
                                                                     3, 90)
    assert code1 == -9 and code0 == 1 and code2 == 1, (err0, err2)
    for err in (err0, err2):
        assert re.search(r"RankFailedError( at chain\.py:8 in <module>)?: rank 1 failed in "
                         r"compute_and_broadcast: died", err), err
        assert "the store host" not in err, err
        assert "frame #" not in err and "Exception raised from" not in err, err
