"""Any exception can be reported: one whose ``__str__`` or ``__repr__`` raises, one that cannot
be pickled, a ``BaseException`` that is not an ``Exception``. The failing rank prints its
traceback once, every other rank names it in one line (the traceback is the failing rank's to
print: they run on one machine), and the launcher's summary points to it; under
``axolotl-dist`` (store in the launcher) and a bare env launch (store in rank 0)."""

import re
import sys

import pytest

from fixtures import finish, free_port, rank_tag, start, subprocess_env

SCRIPT = """
import sys, threading
import axolotl_dist as ad

class BadStr(Exception):
    def __str__(self):
        raise RuntimeError("str failed")

class BadRepr(BadStr):
    def __repr__(self):
        raise RuntimeError("repr failed")

class Unpicklable(Exception):
    def __init__(self, message):
        super().__init__(message)
        self.lock = threading.Lock()

class Stop(BaseException):
    pass

KINDS = {"badstr": lambda: BadStr("x"), "badrepr": lambda: BadRepr("x"),
         "unpicklable": lambda: Unpicklable("holds a lock"), "base": lambda: Stop("stop now")}

def tokenize(kind):
    raise KINDS[kind]()

ad.init_distributed()
kind, where = sys.argv[1], sys.argv[2]
if where == "zero_first":
    with ad.zero_first():
        if ad.get_rank() == 0:
            tokenize(kind)
elif where == "value":
    ad.compute_and_broadcast(lambda: tokenize(kind))
else:
    if ad.get_rank() == 0:
        tokenize(kind)
    ad.barrier()
"""

#: What each kind's last traceback line says.
LINE = {"badstr": "BadStr: <exception str() failed>", "badrepr": "BadRepr: <exception str() failed>",
        "unpicklable": "Unpicklable: holds a lock", "base": "Stop: stop now"}
#: Where each rank 0 failed, as the others' one-line account says: the block's line, else its
#: own line (the raise in tokenize).
HELPER = {"zero_first": "in zero_first block #1 at boom.py:", "value": "at boom.py:",
          "plain": "at boom.py:"}


def _check_rank_accounts(err, kind, where, ws, launcher):
    # rank 0's traceback: in its own output only; each other rank's account of it is one line
    assert err.count("raise KINDS[kind]()") == 1, err
    assert err.count("Traceback (most recent call last)") == 1, err
    assert "Logging error" not in err and "Error in sys.excepthook" not in err, err
    assert "During handling of the above exception" not in err, err  # no second traceback
    for rank in range(1, ws):
        tag = "^" + re.escape(rank_tag(rank, launcher))
        accounts = re.findall(rf"{tag}axolotl_dist\.errors\.RankFailedError at "
                              rf"boom\.py:\d+ in <module>: rank 0 failed "
                              rf"{re.escape(HELPER[where])}.*{re.escape(LINE[kind])} \(its "
                              r"traceback is in rank 0's output\)$", err, re.M)
        assert len(accounts) == 1, err
        assert len(re.findall(tag, err, re.M)) == 1, err  # nothing else
    assert err.count(rank_tag(0, launcher) + LINE[kind]) == 1, err


@pytest.mark.parametrize("kind", sorted(LINE))
def test_any_exception_is_reported_under_the_launcher(tmp_path, kind):
    (tmp_path / "boom.py").write_text(SCRIPT)
    code, _, err = finish(start([sys.executable, "-m", "axolotl_dist.launch", "-n", "2",
                                 "boom.py", kind, "zero_first"], subprocess_env(tmp_path),
                                cwd=tmp_path), 90)
    assert code == 1, err
    _check_rank_accounts(err, kind, "zero_first", 2, "axolotl-dist")
    # the launcher's summary names the exception and points to the traceback above
    name = LINE[kind].split(":")[0]
    assert re.search(rf"^axolotl-dist: rank 0 \(local rank 0, pid \d+\) failed first: it raised "
                     rf"{name} .*; its traceback is above( \(marked rank \d+\))?$", err, re.M), err
    assert "--- traceback of rank" not in err, err


#: Each kind once, each place twice: in a value helper (the exception travels to the other
#: ranks: the unpicklable one must still) and raised out of the script while they wait.
IN_RANK_0 = [("unpicklable", "value"), ("badstr", "value"), ("badrepr", "plain"),
             ("base", "plain")]


@pytest.mark.parametrize("kind,where", IN_RANK_0)
def test_any_exception_is_reported_when_rank_0_hosts_the_store(tmp_path, kind, where):
    (tmp_path / "boom.py").write_text(SCRIPT)
    port, ws = free_port(), 3
    env = subprocess_env(tmp_path)
    procs = [start([sys.executable, "boom.py", kind, where],
                   dict(env, RANK=str(r), WORLD_SIZE=str(ws), LOCAL_RANK=str(r),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)), cwd=tmp_path)
             for r in range(ws)]
    results = [finish(p, 60) for p in procs]
    assert [code for code, _, _ in results] == [1] * ws, results
    _check_rank_accounts("".join(err for _, _, err in results), kind, where, ws, "env")
