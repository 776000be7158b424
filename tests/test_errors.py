"""Bad input gets a clear error that names the variable or argument and the fix; nothing hangs.

Every case runs in real forked ranks under a wall-clock timeout; a hang would surface as a
timed-out rank, which the harness turns into a failure.
"""

import re

import pytest
import torch
import torch.distributed as dist

import axolotl_dist as ad
from axolotl_dist.testing import run_distributed, run_distributed_outcomes
from fixtures import NO_ENV



# (env overrides for every rank of a 2-rank torchrun-style env, regex of the message)
ENV_CASES = {
    "RANK not an int": ({"RANK": "one"}, r"RANK='one' is not an integer; set it to this process's global rank"),
    "RANK negative": ({"RANK": "-1"}, r"RANK=-1 must be >= 0; set it to this process's global rank"),
    "RANK out of range": ({"RANK": "2"}, r"RANK=2 is out of range for WORLD_SIZE=2: set it to this process's global rank in \[0, WORLD_SIZE\)"),
    "WORLD_SIZE not an int": ({"WORLD_SIZE": "2.0"}, r"WORLD_SIZE='2.0' is not an integer; set it to the total number of processes"),
    "WORLD_SIZE zero": ({"WORLD_SIZE": "0"}, r"WORLD_SIZE=0 must be >= 1; set it to the total number of processes"),
    "LOCAL_RANK not an int": ({"LOCAL_RANK": "x"}, r"LOCAL_RANK='x' is not an integer; set it to this process's rank on its node"),
    "LOCAL_RANK out of range": ({"LOCAL_RANK": "2"}, r"LOCAL_RANK=2 is out of range for LOCAL_WORLD_SIZE=2: set it to this process's rank on its node, in \[0, LOCAL_WORLD_SIZE\)"),
    "LOCAL_WORLD_SIZE not an int": ({"LOCAL_WORLD_SIZE": ""}, r"LOCAL_WORLD_SIZE='' is not an integer; set it to the number of processes on this node"),
    "LOCAL_WORLD_SIZE zero": ({"LOCAL_WORLD_SIZE": "0"}, r"LOCAL_WORLD_SIZE=0 must be >= 1; set it to the number of processes on this node"),
    "LOCAL_WORLD_SIZE > WORLD_SIZE": ({"LOCAL_WORLD_SIZE": "3"}, r"LOCAL_WORLD_SIZE=3 is larger than the world size 2: set it to the number of processes on this node"),
    "NODE_RANK not an int": ({"NODE_RANK": "node0"}, r"NODE_RANK='node0' is not an integer; set it to this node's index in \[0, NUM_NODES\)"),
    "NODE_RANK negative": ({"NODE_RANK": "-1"}, r"NODE_RANK=-1 must be >= 0; set it to this node's index"),
    "NODE_RANK out of range": ({"NODE_RANK": "1"}, r"NODE_RANK=1 is out of range for 1 node\(s\): set it to this node's index in \[0, NUM_NODES\)"),
    "MASTER_PORT out of range": ({"MASTER_PORT": "70000"}, r"MASTER_PORT=70000 is not a TCP port: set it to a free port in \[1, 65535\]"),
    "WORLD_SIZE beyond the store": ({"WORLD_SIZE": "2147483648"}, r"WORLD_SIZE=2147483648 is larger than the 2147483647 ranks torch's c10d store takes; set it to the total number of processes"),
    "RANK beyond the store": ({"RANK": "2147483648"}, r"RANK=2147483648 is larger than the 2147483647 ranks torch's c10d store takes; set it to this process's global rank"),
    "MASTER_ADDR with a stray space": ({"MASTER_ADDR": "127.0.0.1 "}, r"MASTER_ADDR='127.0.0.1 ' has spaces around the address \(torch would wait its whole timeout for a host of that name\): set MASTER_ADDR=127.0.0.1$"),
    "MASTER_ADDR empty": ({"MASTER_ADDR": ""}, r"MASTER_ADDR='' is empty: set it to the host name or IP address of rank 0's node"),
}

#: which query reports each variable (validate_env_vars and init_distributed report all of them)
QUERY_FOR = {"RANK": "get_rank", "WORLD_SIZE": "get_world_size", "LOCAL_RANK": "get_local_rank",
             "LOCAL_WORLD_SIZE": "get_local_world_size", "NODE_RANK": "get_node_rank",
             "MASTER_PORT": "validate_env_vars", "MASTER_ADDR": "validate_env_vars"}


@pytest.mark.parametrize("case", list(ENV_CASES))
def test_bad_launcher_env_is_named_with_the_fix(case):
    env, pattern = ENV_CASES[case]
    query = QUERY_FOR[case.split()[0]]

    def body():
        import re

        msgs = []
        for call in (getattr(ad, query), ad.validate_env_vars, ad.init_distributed):
            with pytest.raises(ad.DistributedEnvError) as info:
                call()
            assert re.search(pattern, str(info.value)), (call.__name__, str(info.value))
            msgs.append(str(info.value))
        return msgs, dist.is_initialized()

    for msgs, initialized in run_distributed(body, 2, init=False, env=env, timeout=60):
        assert not initialized  # failed before creating anything
        assert len(msgs) == 3


def test_rank_without_world_size():
    def body():
        rank = int(__import__("os").environ["RANK"])
        if rank == 0:  # RANK=0 alone is a single process (OLMo's bootstrap rule)
            return ad.get_world_size()
        with pytest.raises(ad.DistributedEnvError) as info:
            ad.get_rank()
        with pytest.raises(ad.DistributedEnvError):
            ad.init_distributed()
        return str(info.value)

    one, msg = run_distributed(body, 2, init=False, env={"WORLD_SIZE": None, "LOCAL_WORLD_SIZE": None})
    assert one == 1
    assert "RANK=1 is set but WORLD_SIZE is not: set WORLD_SIZE to the total number of processes" in msg


def test_world_size_without_rank():
    def body():
        with pytest.raises(ad.DistributedEnvError, match=r"WORLD_SIZE=2 is set but RANK is not: set RANK"):
            ad.get_rank()
        return True

    assert run_distributed(body, 2, init=False, env={"RANK": None}) == [True, True]


def test_master_addr_missing_for_a_multi_rank_init():
    def body():
        with pytest.raises(ad.DistributedEnvError) as info:
            ad.init_distributed()
        return str(info.value), dist.is_initialized()

    for rank, (msg, initialized) in enumerate(
            run_distributed(body, 2, init=False, env={"MASTER_ADDR": None}, timeout=60)):
        assert f"MASTER_ADDR not set for a 2-rank init (rank {rank})" in msg
        assert "set MASTER_ADDR to the host of rank 0" in msg and "torchrun" in msg
        assert not initialized


def test_unresolvable_master_addr_fails_init_at_once():
    # torch would retry the rendezvous host until its timeout (here 300 s)
    def body():
        import time

        start = time.monotonic()
        with pytest.raises(ad.DistributedEnvError) as info:
            ad.init_distributed()
        return str(info.value), time.monotonic() - start

    for msg, elapsed in run_distributed(body, 2, init=False, timeout=60,
                                        env={"MASTER_ADDR": "no-such-host.invalid"}):
        assert msg.startswith("MASTER_ADDR='no-such-host.invalid' does not resolve to an address"), msg
        assert msg.endswith("set it to the host name or IP address of rank 0's node"), msg
        assert elapsed < 10


def test_slurm_task_without_its_task_count_names_the_slurm_variable():
    def body():
        with pytest.raises(ad.DistributedEnvError) as info:
            ad.get_world_size()
        return str(info.value)

    env = {"RANK": None, "WORLD_SIZE": None, "LOCAL_RANK": None, "LOCAL_WORLD_SIZE": None,
           "SLURM_PROCID": "1", "SLURM_STEP_ID": "0"}
    msgs = run_distributed(body, 2, init=False, env=env, rank_env=lambda r: {"SLURM_PROCID": str(r + 1)})
    for msg in msgs:
        assert "is set but SLURM_NTASKS (or SLURM_STEP_NUM_TASKS) is not: set SLURM_NTASKS to the " \
               "total number of processes (srun sets both)" in msg, msg


def test_env_that_disagrees_with_the_initialized_group():
    def body():
        import os

        rank = dist.get_rank()
        seen = []
        os.environ["RANK"] = str(1 - rank)
        for call in (ad.get_rank, ad.is_main_process, ad.get_global_rank, ad.init_distributed,
                     lambda: ad.all_reduce_value(1)):
            with pytest.raises(ad.DistributedEnvError) as info:
                call()
            seen.append(str(info.value))
        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = "3"
        with pytest.raises(ad.DistributedEnvError) as info:
            ad.get_world_size()
        seen.append(str(info.value))
        os.environ["WORLD_SIZE"] = "2"
        return seen, ad.get_rank(), ad.all_reduce_value(1)

    for rank, (seen, rank_again, total) in enumerate(run_distributed(body, 2)):
        for msg in seen[:-1]:
            assert (f"RANK={1 - rank} in the environment disagrees with the initialized process "
                    f"group (which says {rank}): unset RANK or launch every process") in msg
        assert "WORLD_SIZE=3 in the environment disagrees with the initialized process group (which says 2)" in seen[-1]
        assert (rank_again, total) == (rank, 2)  # fixing the env fixes the queries


COLLECTIVES = {
    "barrier": lambda: ad.barrier(),
    "broadcast": lambda: ad.broadcast(torch.zeros(1)),
    "all_reduce": lambda: ad.all_reduce(torch.zeros(1)),
    "all_gather": lambda: ad.all_gather(torch.zeros(1)),
    "all_gather_object": lambda: ad.all_gather_object(1),
    "broadcast_object": lambda: ad.broadcast_object(1),
    "broadcast_object_list": lambda: ad.broadcast_object_list([1]),
    "synchronize_value": lambda: ad.synchronize_value(1),
    "synchronize_flag": lambda: ad.synchronize_flag(True),
    "all_reduce_value": lambda: ad.all_reduce_value(1),
    "all_reduce_value(tensor)": lambda: ad.all_reduce_value(torch.ones(1)),
    "compute_and_broadcast": lambda: ad.compute_and_broadcast(lambda: 1),
    "gather_from_all_ranks": lambda: ad.gather_from_all_ranks(lambda: 1),
    "gather_scalar_from_all_ranks": lambda: ad.gather_scalar_from_all_ranks(lambda: 1),
    "reduce_and_broadcast": lambda: ad.reduce_and_broadcast(lambda: 1, sum),
}


def test_collective_with_world_size_above_1_but_no_group():
    def body():
        msgs = {}
        for name, call in COLLECTIVES.items():
            with pytest.raises(ad.DistributedEnvError) as info:
                call()
            msgs[name] = str(info.value)
        return msgs, dist.is_initialized()

    for msgs, initialized in run_distributed(body, 3, init=False, timeout=60):
        assert not initialized
        for name, msg in msgs.items():
            helper = name.split("(")[0]
            assert msg == (f"{helper}() needs a process group: the environment says WORLD_SIZE=3 but "
                           "torch.distributed is not initialized; call axolotl_dist.init_distributed() first")


WS_CALLS = {
    "gather_from_all_ranks": lambda ws: ad.gather_from_all_ranks(lambda: 1, world_size=ws),
    "gather_scalar_from_all_ranks": lambda ws: ad.gather_scalar_from_all_ranks(lambda: 1, ws),
    "reduce_and_broadcast": lambda ws: ad.reduce_and_broadcast(lambda: 1, sum, world_size=ws),
}


@pytest.mark.parametrize("init", [False, True], ids=["no-group", "group"])
def test_world_size_argument_that_disagrees_raises(init):
    """axolotl's world_size=1 default silently mis-sized the list; here it is checked."""
    ws = 2 if init else 1

    def body():
        msgs = []
        for name, call in WS_CALLS.items():
            wrong = ws + 1 if init else 2
            with pytest.raises(ValueError) as info:
                call(wrong)
            msgs.append(str(info.value))
            if init:  # axolotl's default of 1 on a 2-rank run
                with pytest.raises(ValueError, match=rf"{name}\(world_size=1\) disagrees"):
                    call(1)
            call(ws)  # the right size is fine
        return msgs

    env = NO_ENV if not init else None
    for msgs in run_distributed(body, ws, init=init, env=env, timeout=60):
        for name, msg in zip(WS_CALLS, msgs):
            wrong = ws + 1 if init else 2
            assert msg == (f"{name}(world_size={wrong}) disagrees with the actual world size {ws}: "
                           "drop the world_size argument (it is inferred) or pass the real size")


SRC_CALLS = {
    "broadcast": ("src", lambda r: ad.broadcast(torch.zeros(1), src=r)),
    "synchronize_value": ("src", lambda r: ad.synchronize_value(1, src=r)),
    "compute_and_broadcast": ("src", lambda r: ad.compute_and_broadcast(lambda: 1, src=r)),
    "compute_and_broadcast(rank=)": ("src", lambda r: ad.compute_and_broadcast(lambda: 1, rank=r)),
    "broadcast_object": ("src", lambda r: ad.broadcast_object(1, src=r)),
    "broadcast_object_list": ("src", lambda r: ad.broadcast_object_list([1], src=r)),
    "gather_from_all_ranks": ("dst", lambda r: ad.gather_from_all_ranks(lambda: 1, dst=r)),
    "gather_scalar_from_all_ranks": ("dst", lambda r: ad.gather_scalar_from_all_ranks(lambda: 1, dst=r)),
    "gather_from_all_ranks(rank=)": ("dst", lambda r: ad.gather_from_all_ranks(lambda: 1, rank=r)),
}


@pytest.mark.parametrize("ws, init", [(1, False), (2, True), (3, True)], ids=["no-group", "ws2", "ws3"])
def test_src_or_dst_outside_the_group(ws, init):
    def body():
        msgs = {}
        for name, (arg, call) in SRC_CALLS.items():
            for bad in (ws, -1):
                with pytest.raises(ValueError) as info:
                    call(bad)
                msgs[(name, bad)] = (arg, str(info.value))
            with pytest.raises(TypeError, match=rf"{arg}='0' must be an int rank"):
                call("0")
        return msgs, ad.all_reduce_value(1)  # every rank raised the same, so still in step

    env = NO_ENV if not init else None
    for msgs, total in run_distributed(body, ws, init=init, env=env, timeout=60):
        assert total == ws
        assert len(msgs) == 2 * len(SRC_CALLS)
        for (name, bad), (arg, msg) in msgs.items():
            assert msg == f"{arg}={bad} is outside the group of {ws} rank(s): pass a rank in [0, {ws})", name


def test_bad_reduce_op_names():
    def body():
        msgs = []
        for call in (lambda: ad.all_reduce(torch.ones(1), "mean"),
                     lambda: ad.all_reduce_value(1, op="median"),
                     lambda: ad.all_reduce_value(torch.ones(1), op="average"),
                     lambda: ad.all_reduce(torch.ones(1), reduce_operation=dist.ReduceOp.PREMUL_SUM)):
            with pytest.raises(ValueError) as info:
                call()
            msgs.append(str(info.value))
        with pytest.raises(ValueError, match=r"reduce_operation='AVG'\) needs a floating tensor.*cast first or use 'SUM'"):
            ad.all_reduce(torch.ones(1, dtype=torch.int64), "avg")
        return msgs, ad.all_reduce_value(1, op="SUM")

    for init, env in ((True, None), (False, NO_ENV)):
        ws = 2 if init else 1
        for msgs, total in run_distributed(body, ws, init=init, env=env, timeout=60):
            assert total == ws
            for msg, name in zip(msgs, ("'mean'", "'median'", "'average'", "PREMUL_SUM")):
                assert msg.startswith("unknown reduction ") and name in msg
                assert msg.endswith("use one of SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR, AVG")


def test_get_global_rank_argument_errors():
    def body():
        sub = dist.new_group([0, 1])
        with pytest.raises(ValueError, match=r"get_global_rank\(group=...\) needs group_rank=: pass the rank"):
            ad.get_global_rank(group=sub)
        with pytest.raises(ValueError, match=r"group_rank=2 is out of range for a group of 2 rank\(s\): pass a rank in \[0, 2\)"):
            ad.get_global_rank(2, sub)
        with pytest.raises(TypeError, match=r"group_rank='0' must be an int"):
            ad.get_global_rank("0")
        return True

    assert run_distributed(body, 2) == [True, True]


def test_group_argument_without_a_process_group():
    def body():
        with pytest.raises(ad.DistributedEnvError, match=r"group= but torch.distributed is not initialized: call axolotl_dist.init_distributed\(\) first"):
            ad.get_rank(dist.group.WORLD or object())
        return True

    assert run_distributed(body, 1, init=False, env=NO_ENV) == [True]


def test_nothing_hangs_when_only_one_rank_raises_before_a_collective():
    """A rank whose fn raises inside a helper does not leave the others blocked (all ranks join
    the same collectives and everyone raises), within seconds, not the collective timeout."""

    def body():
        def fn():
            if ad.get_rank() == 1:
                raise KeyError("tokenizer missing")
            return 1

        ad.compute_and_broadcast(lambda: 1)
        ad.gather_from_all_ranks(fn)

    outcomes = run_distributed_outcomes(body, 3, timeout=60, pg_timeout=300)
    assert not any(o.timed_out for o in outcomes)
    assert max(o.elapsed for o in outcomes) < 30
    assert isinstance(outcomes[1].exception, KeyError)
    for o in (outcomes[0], outcomes[2]):
        assert isinstance(o.exception, ad.RankFailedError) and o.exception.rank == 1
        assert "KeyError" in o.error and "tokenizer missing" in o.error


def test_default_logging_switch_that_is_not_a_switch_names_the_variable(monkeypatch):
    monkeypatch.setenv("AXOLOTL_DIST_DEFAULT_LOGGING", "maybe")
    log = ad.get_logger("axolotl_dist.test_switch")
    with pytest.raises(ad.DistributedEnvError,
                       match=r"AXOLOTL_DIST_DEFAULT_LOGGING='maybe' is not a switch: set "
                             r"AXOLOTL_DIST_DEFAULT_LOGGING=0 to turn the stderr fallback off"):
        log.info("hello")
    monkeypatch.setenv("AXOLOTL_DIST_DEFAULT_LOGGING", " off ")  # the kit's switch words
    log.info("hello")


@pytest.mark.parametrize("name", ["AXOLOTL_DIST_STORE_LINGER", "AXOLOTL_DIST_HEARTBEAT_TIMEOUT",
                                  "AXOLOTL_DIST_WAIT_LOG_INTERVAL", "AXOLOTL_DIST_DEBUG_TIMEOUT"])
@pytest.mark.parametrize("value", ["inf", "nan", "-1", "0", "1e9999", "soon"])
def test_seconds_that_are_not_positive_and_finite_are_rejected_naming_the_variable(
        monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ad.DistributedEnvError,
                       match=rf"^{name}='{re.escape(value)}' must be a positive number of "
                             rf"seconds: set e\.g\. {name}=\d+$"):
        ad.validate_env_vars()
    monkeypatch.setenv(name, " 2.5 ")
    ad.validate_env_vars()
