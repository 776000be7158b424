"""One account of a failure (issue #34), with real processes: a rank that raises prints its
traceback once; every other rank prints one line naming it, where it failed and its message
(the traceback is the failing rank's to print: they share a machine); the launcher's summary
is one line per failed rank that points to the traceback above instead of copying it. Under
``axolotl-dist``, torchrun and bare env vars (rank 0 hosts the store). And the test harness
with rank 0 hosting the store prints nothing of torch's C++ (no store call after its host
ended). The cross-machine case (the traceback shown beside the account) is in
tests/test_hosts.py."""

import re
import sys

import pytest

from axolotl_dist.testing import run_distributed_outcomes
from fixtures import launch_script, rank_tag, run, run_bare_env, subprocess_env

MESSAGE = "bad row 17 in data.jsonl"
SCRIPT = """
import axolotl_dist as ad
ad.init_distributed()
with ad.zero_first():
    if ad.get_rank() == 0:
        raise ValueError("bad row 17 in data.jsonl")
ad.barrier()
"""
#: rank 1's account (after its tag): its own line, then rank 0, where it failed, its
#: exception, and where the traceback is
ACCOUNT = (r"axolotl_dist\.errors\.RankFailedError at (\S*/)?e\.py:4 in <module>: "
           r"rank 0 failed in zero_first block #1 at (\S*/)?e\.py:4 in <module>: ValueError: "
           + re.escape(MESSAGE) + r" \(its traceback is in rank 0's output\)$")
TIMEOUT = 90


def _check_accounts(output: str, launcher: str) -> None:
    """What every launcher's whole output holds: the message three times (rank 0's raise line
    and last line, rank 1's account), rank 0's traceback once, rank 1's account one line."""
    assert output.count(MESSAGE) == 3, output
    assert output.count(rank_tag(0, launcher) + "Traceback (most recent call last)") == 1, output
    one = "^" + re.escape(rank_tag(1, launcher))
    assert len(re.findall(one + ACCOUNT, output, re.M)) == 1, output
    assert len(re.findall(one, output, re.M)) == 1, output  # nothing else from rank 1
    assert "--- traceback" not in output and "Exception raised from" not in output, output


def test_one_account_under_axolotl_dist(tmp_path):
    code, out, err = launch_script(tmp_path, "e.py", SCRIPT, 2, TIMEOUT)
    assert code == 1, err
    _check_accounts(out + err, "axolotl-dist")
    assert err.count("Traceback (most recent call last)") == 1, err
    # the launcher: one line for rank 0, pointing above
    assert re.search(r"^axolotl-dist: rank 0 \(local rank 0, pid \d+\) failed first: it raised "
                     r"ValueError (and exited with code 1|\(and was stopped by the launcher while "
                     r"exiting\)); its traceback is above( \(marked rank \d+\))?$", err, re.M), err
    assert err.rstrip().endswith("axolotl-dist: exit code 1"), err


def test_one_account_with_bare_env_vars(tmp_path):
    results = run_bare_env(tmp_path, "e.py", SCRIPT, 2, TIMEOUT)
    assert [code for code, _, _ in results] == [1, 1], results
    output = "".join(out + err for _, out, err in results)
    _check_accounts(output, "env")
    assert output.count("Traceback (most recent call last)") == 1, output


def test_one_account_under_torchrun(tmp_path):
    (tmp_path / "e.py").write_text(SCRIPT)
    code, out, err = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", "e.py"], subprocess_env(tmp_path), TIMEOUT,
                         cwd=tmp_path)
    assert code == 1, err
    _check_accounts(out + err, "torchrun")  # its own summary names exit codes only
    assert "ChildFailedError" in err, err


COLLECTIVE_IN_BLOCK = """
import axolotl_dist as ad
ad.init_distributed()
with ad.zero_first():
    ad.barrier()
ad.barrier()
"""


def test_a_collective_in_a_first_run_block_is_told_twice_with_no_warning(tmp_path):
    # rank 0 raises CollectiveMismatchError; rank 1 names it once; nothing is logged
    code, out, err = launch_script(tmp_path, "c.py", COLLECTIVE_IN_BLOCK, 2, TIMEOUT)
    assert code == 1, err
    assert err.count("can never complete") == 1, err  # rank 0's error; rank 1 names it:
    assert re.search(r"^\[rank 1\] axolotl_dist\.errors\.RankFailedError at c\.py:4 in <module>: "
                     r"rank 0 failed in zero_first block #1 at c\.py:4 in <module>: "
                     r"CollectiveMismatchError: barrier\(\) at c\.py:5 in… \(its traceback is "
                     r"in rank 0's output\)$", err, re.M), err
    assert err.count("Traceback (most recent call last)") == 1, err
    assert "WARNING" not in err and "--- traceback" not in err, err
    assert re.search(r"^axolotl-dist: rank 0 .* failed first: it raised CollectiveMismatchError"
                     r".*; its traceback is above( \(marked rank \d+\))?$", err, re.M), err


ELSEWHERE = """
import sys
import axolotl_dist as ad
ad.init_distributed()
if ad.get_rank() == 0:
    sys.stderr = open("rank0.log", "w", buffering=1)  # its output goes elsewhere
with ad.zero_first():
    if ad.get_rank() == 0:
        raise ValueError("bad row 17 in data.jsonl")
ad.barrier()
"""


def test_a_traceback_that_went_elsewhere_is_in_the_launchers_summary(tmp_path):
    code, out, err = launch_script(tmp_path, "e.py", ELSEWHERE, 2, TIMEOUT)
    assert code == 1, err
    assert MESSAGE in (tmp_path / "rank0.log").read_text()
    summary = err.split("--- traceback of rank 0 ---\n", 1)
    assert len(summary) == 2, err
    assert summary[1].startswith("Traceback (most recent call last)"), err
    assert f"ValueError: {MESSAGE}" in summary[1], err
    assert "its traceback is above" not in err, err
    assert len(re.findall(r"^\[rank 1\] axolotl_dist\.errors\.RankFailedError at ", err, re.M)) == 1


FORGED = """
import os, re, threading, time
from datetime import timedelta
import torch.distributed as dist
import axolotl_dist as ad

ad.init_distributed()

def forge():  # what any process that reaches the store can do: a text where the kit counts
    s = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                      is_master=False, timeout=timedelta(seconds=10))
    for _ in range(200):
        words = [k for k in s.list_keys() if re.search(r"/axd/zf/1/[0-9a-f]{10}$", k)]
        if words:
            s.set(words[0], "garbage")
            return
        time.sleep(0.02)

if ad.get_rank() == 1:
    threading.Thread(target=forge, daemon=True).start()
with ad.zero_first():
    if ad.get_rank() == 0:
        time.sleep(3)  # rank 1 waits; the word is forged before rank 0 sets its bit
"""


def test_a_forged_record_that_ends_the_run_is_named_not_the_rank_stopped_after_it(tmp_path):
    # the DistributedEnvError quotes torch's DistNetworkError; the launcher stops the other rank
    # in the same second: the summary named that rank "killed by signal 15" in 1 run of 3
    code, out, err = launch_script(tmp_path, "f.py", FORGED, 2, TIMEOUT)
    assert code == 1, err
    # whichever rank met the forged word first (rank 0 setting its bit, rank 1 polling it)
    assert re.search(r"^axolotl-dist: rank (\d) \(local rank \1, pid \d+\) failed first: it raised "
                     r"DistributedEnvError and exited with code 1;", err, re.M), err
    assert "killed by signal" not in err, err
    # the key and the trust model, read by the store's refusal of an add or by the kit itself
    assert "store key 'axd/zf/1/" in err, err
    assert "only the job's own processes may write to its" in err.lower(), err


def _forge_the_word(change: int) -> None:
    """From a thread of rank 1: once the word of zero_first block #1 is there, add ``change``
    to it, as any process that reaches the store can."""
    import os
    import re
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    def forge():
        s = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=10))
        for _ in range(250):
            words = [k for k in s.list_keys() if re.search(r"/axd/zf/1/[0-9a-f]{10}$", k)]
            if words:
                s.add(words[0], change)
                return
            time.sleep(0.02)

    threading.Thread(target=forge, daemon=True).start()


@pytest.mark.parametrize("change, why", [
    (1 << 20, "with bits of ranks the group of 2 does not have"),  # a rank it does not have
    (-(1 << 63), "with bits of ranks the group of 2 does not have"),  # negative: no add does that
    (-1, "without this rank's bit, which it had set"),  # rank 1's bit taken, rank 0's put
])
def test_a_forged_word_of_a_block_is_named_on_the_rank_that_reads_it(change, why):
    # the ranks' adds are checked inline (a frame less per block); a word no add of the kit
    # could leave is an error naming the key on each rank that meets it, never a wait
    def body():
        import time

        import axolotl_dist as ad
        if ad.get_rank() == 1:
            _forge_the_word(change)
        with ad.zero_first():
            if ad.get_rank() == 0:
                time.sleep(2)  # rank 1 has arrived and polls: the forged word is read
    outcomes = run_distributed_outcomes(body, 2, timeout=60)
    met = [o for o in outcomes if o.error and o.error.startswith("DistributedEnvError: ")]
    assert met, outcomes  # a rank that read the word names it
    for o in met:
        assert "store key 'axd/zf/1/" in o.error and why in o.error, o.error
        assert "a process outside the job changed it" in o.error, o.error
    for o in outcomes:  # a rank the other's error reached first (a loaded machine) has its
        if o not in met:  # account: the forgery, never a wait or a timeout
            assert o.error and o.error.startswith(f"RankFailedError: rank {1 - o.rank} failed "
                                                  "in zero_first block #1"), o
            assert "DistributedEnvError: " in o.error and why in o.error, o.error


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


def _catch_rank_0s_failure():
    import axolotl_dist as ad

    def tokenize():
        if ad.get_rank() == 0:
            raise ValueError(MESSAGE)
        return 0

    try:
        ad.compute_and_broadcast(tokenize)
    except ad.RankFailedError as exc:
        return str(exc), exc.remote_traceback, exc.machine is not None, exc
    except ValueError:
        return None


def test_str_leaves_the_traceback_to_a_rank_on_this_machine_and_keeps_it_in_the_attribute():
    from axolotl_dist import RankFailedError
    from axolotl_dist.testing import run_distributed
    from probes import failure_report, read_failure_report

    _, (text, remote, named, exc) = run_distributed(_catch_rank_0s_failure, 2, timeout=60)
    assert text == f"rank 0 failed in compute_and_broadcast: ValueError: {MESSAGE}", text
    assert named and "Traceback (most recent call last)" in remote and "in tokenize" in remote
    assert str(exc) == text  # rebuilt here (pickled back from the rank): the same machine
    # a failing rank on another machine, or on one not known: the traceback follows the line
    for machine in ("another-boot:4026531836", None):
        there = RankFailedError(0, "ValueError", MESSAGE, remote, where="compute_and_broadcast",
                                machine=machine)
        assert str(there) == f"{text}\n--- traceback from rank 0 ---\n{remote.rstrip()}"
        back = read_failure_report(failure_report(there))
        assert back.machine == machine and str(back) == str(there)


RAW = """
import torch, torch.distributed as dist
import axolotl_dist as ad
ad.init_distributed()
rank, last = ad.get_rank(), ad.get_world_size() - 1
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
for step in range(2 if rank == last else 3):
    model(torch.randn(2, 8)).sum().backward()
if rank == last:
    raise ValueError("bad row 17 in data.jsonl")
t = torch.ones(4)
dist.all_reduce(t)
"""
#: a rank in DDP's all-reduce (inside gloo) when the last rank raised: gloo's "Connection
#: closed by peer" becomes the last rank's account, at the rank's own line
RAW_ACCOUNT = (r"axolotl_dist\.errors\.RankFailedError at (\S*/)?e\.py:8 in <module>: "
               r"rank {last} failed at (\S*/)?e\.py:\d+: ValueError: " + re.escape(MESSAGE)
               + r"…? \(its traceback is in rank {last}'s output\)$")


def test_a_torch_collective_failed_by_a_peer_gives_that_peers_account(tmp_path):
    # the store in the launcher (2 ranks) and in rank 0 (3 ranks): torchrun's agent hosts it
    # as the kit's launcher does, and the account is the ranks' own, whoever started them
    for ws, launcher in ((2, "axolotl-dist"), (3, "env")):
        if launcher == "axolotl-dist":
            code, out, err = launch_script(tmp_path, "e.py", RAW, ws, TIMEOUT)
            output = out + err
        else:
            results = run_bare_env(tmp_path, "e.py", RAW, ws, TIMEOUT)
            output = "".join(o + e for _, o, e in results)
        last = ws - 1
        assert "Connection closed by peer" not in output and "GLHF" not in output, output
        assert output.count(rank_tag(last, launcher) + "Traceback (most recent call last)") == 1
        for r in range(last):
            one = "^" + re.escape(rank_tag(r, launcher))
            assert re.search(one + RAW_ACCOUNT.format(last=last), output, re.M), (launcher, output)
