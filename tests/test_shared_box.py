"""On a shared box the run is its user's (issue #60; docs/design/store.md, "Trust model"): with a
run secret, a record someone outside the job writes at a kit key before the genuine one is
ignored and the run ends as it would without it.

The stranger is :class:`hostile_store.HostileStore` in its ``forge_first`` mode: at the first
write of each attacked key it puts a record there itself (the genuine content with every digit
changed, without a seal or with a seal that is not the run's, or bytes that are no record) and
holds the genuine write back (:data:`HOLDS`), so that readers look at the forged record first. Each key family the kit
writes in a phase of ``tests/test_store_fuzz.py`` is attacked on its own, in the first phase
that writes it; every rank must end as without the stranger.
"""

import os
import re
import sys
import time

import pytest

from axolotl_dist.testing import run_distributed_outcomes
from fixtures import finish, start, subprocess_env, unfold
from strangers import STORE_CLIENT, as_nobody, intruder_python
from hostile_store import HostileStore, family
from test_store_fuzz import BOUND, EXPECTED, PHASES, STALL, WORLD, _classify

pytestmark = pytest.mark.timeout(600)

#: Seconds the genuine write waits behind the stranger's: none (a compare_set finds the
#: stranger's record), and long enough for a reader polling the key to find it.
HOLDS = (0.0, 0.3)
#: The run's secret (what axolotl-dist makes for a one-node run).
SECRET = {"AXOLOTL_DIST_SECRET": "0123456789abcdef0123456789abcdef"}


def _run(phase, target=None, hold=0.0):
    fn, env = PHASES[phase]
    hostile = HostileStore(WORLD, target, (b"",), forge_first=hold)
    try:
        start = time.monotonic()
        outcomes = run_distributed_outcomes(
            fn, WORLD, env={"MASTER_PORT": str(hostile.port), **SECRET, **env},
            timeout=BOUND, pg_timeout=STALL)
        return outcomes, hostile, time.monotonic() - start
    finally:
        hostile.close()


def _families():
    """(phase, family) for every family the kit writes, in the first phase that writes it."""
    seen, todo = set(), []
    for phase in PHASES:
        outcomes, recorder, _ = _run(phase)
        assert [_classify(phase, o) for o in outcomes] == ["ignored"] * WORLD, \
            [o.describe() for o in outcomes]
        for fam in sorted({family(k) for k in recorder.written} - seen):
            seen.add(fam)
            todo.append((phase, fam))
    return todo


def test_a_record_forged_before_the_genuine_one_is_ignored():
    todo = _families()
    assert len(todo) >= 15, todo
    problems, forged, slowest = [], 0, 0.0
    for phase, fam in todo:
        for hold in HOLDS:
            outcomes, hostile, took = _run(phase, lambda key, f=fam: family(key) == f, hold)
            forged += len(hostile.forged)
            slowest = max(slowest, took)
            for outcome in outcomes:
                verdict = _classify(phase, outcome)
                if verdict != "ignored":
                    problems.append(f"{phase}: {fam}, held {hold} s ({took:.1f} s): {verdict}: "
                                    f"{outcome.describe()[:600]}")
    print(f"\n{len(todo)} families, {forged} keys forged, slowest run {slowest:.1f} s")
    assert problems == [], "\n\n".join(problems)


# --- every kit key overwritten while ranks wait in zero_first --------------------------------

def _held_in_zero_first(marks):
    """Rank 0 runs the block's body until ``marks/go`` exists (20 s at most), leaving
    ``marks/port`` (the store's) and ``marks/inside`` on entry and ``marks/done`` at its end; a
    waiting rank that leaves the block before ``done`` exists returns "EARLY"."""
    def body():
        import os

        import axolotl_dist as ad

        rank = ad.get_rank()
        with ad.zero_first():
            if rank == 0:
                with open(os.path.join(marks, "port"), "w") as fh:
                    fh.write(os.environ["MASTER_PORT"])
                open(os.path.join(marks, "inside"), "w").close()
                end = time.monotonic() + 20
                while not os.path.exists(os.path.join(marks, "go")) and time.monotonic() < end:
                    time.sleep(0.05)
                open(os.path.join(marks, "done"), "w").close()
        if rank != 0 and not os.path.exists(os.path.join(marks, "done")):
            return "EARLY"
        ad.barrier()
        return "ok"
    return body


#: What the stranger writes over every kit key: bytes no record or counter holds; a number
#: with every rank's bit set (a block's word says every rank is done); each record's content
#: with its digits changed and no seal.
OVERWRITES = {"none": lambda old: old,
              "garbage": lambda old: b"\x00garbage\xff",
              "all bits": lambda old: b"2147483647",
              "changed record": lambda old: _unsealed_copy(old)}


def _unsealed_copy(old):
    import re
    body = re.sub(rb"^\x1fs1:[A-Za-z0-9_-]{22}:", b"", old)
    return body.translate(bytes.maketrans(b"0123456789", b"1234567890")) or b"1"


def _overwrite_kit_keys(port, how, only=None):
    """Overwrite every kit key of the store at ``port`` (as a client of it), or those of family
    ``only``: the keys done. ``how`` "counted": a counter (a number) gets "all bits", a
    record a changed copy."""
    from datetime import timedelta

    import torch.distributed as dist
    from hostile_store import KIT_KEY

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10),
                          wait_for_workers=False)
    done = []
    for key in store.list_keys():
        if KIT_KEY.search(key) and (only is None or family(key) == only):
            name = key[1:] if key.startswith("/") else key  # torch's client adds the "/"
            old = store.get(name)
            way = how if how != "counted" else "all bits" if old.strip().isdigit() \
                else "changed record"  # a counter holds a number, a record does not
            store.set(name, OVERWRITES[way](old))
            done.append(key)
    return done


def _overwritten_while_waiting(marks, how, store="parent", only=None):
    """Every rank's outcome of :func:`_held_in_zero_first` where the stranger overwrote the kit
    keys (of family ``only``) while ranks 1 and 2 waited; and the keys it overwrote."""
    import pathlib
    import threading

    box = {}
    runner = threading.Thread(target=lambda: box.update(outcomes=run_distributed_outcomes(
        _held_in_zero_first(marks), 3, env=SECRET, timeout=60, pg_timeout=20, store=store)))
    runner.start()
    end, marks = time.monotonic() + 30, pathlib.Path(marks)
    while not (marks / "inside").exists() and time.monotonic() < end:
        time.sleep(0.05)
    time.sleep(1.0)  # the others are waiting in the block
    overwritten = _overwrite_kit_keys(int((marks / "port").read_text()), how, only)
    time.sleep(1.0)  # a rank that would leave early does so now
    (marks / "go").write_text("")
    runner.join(90)
    return box["outcomes"], overwritten


def _problems(outcomes):
    """What is wrong with the ranks' ends: a rank that left the block before rank 0's body
    ended, or one that ended neither as without the stranger nor on an error naming it."""
    texts = [o.describe() for o in outcomes]
    if any(o.ok and o.value == "EARLY" for o in outcomes):
        return texts
    if not all(o.ok and o.value == "ok" or o.error and "outside the job" in o.error
               for o in outcomes):
        return texts
    return []


@pytest.mark.parametrize("store", ["parent", "rank0"])
@pytest.mark.parametrize("how", [h for h in OVERWRITES if h != "none"])
def test_overwriting_every_kit_key_never_lets_a_rank_leave_zero_first_early(tmp_path, how,
                                                                            store):
    outcomes, overwritten = _overwritten_while_waiting(str(tmp_path), how, store)
    assert len(overwritten) >= 10, overwritten
    assert _problems(outcomes) == []


def test_overwriting_each_kit_key_family_alone_never_lets_a_rank_leave_early(tmp_path):
    """Each family the stranger finds while the ranks wait, overwritten on its own (a counter
    with every bit, a record with a changed copy): no rank leaves early, and every rank ends
    as without the stranger or on an error naming it."""
    first = tmp_path / "first"
    first.mkdir()
    _, overwritten = _overwritten_while_waiting(str(first), "none")
    families = sorted({family(k) for k in overwritten})
    assert len(families) >= 10, families
    problems = {}
    for n, fam in enumerate(families):
        marks = tmp_path / str(n)
        marks.mkdir()
        outcomes, _ = _overwritten_while_waiting(str(marks), "counted", only=fam)
        if _problems(outcomes):
            problems[fam] = _problems(outcomes)
    print(f"\n{len(families)} families overwritten one at a time")
    assert problems == {}


# --- another real user overwrites every kit key of an axolotl-dist run (issue #77) ----------

#: Rank 0 runs a 15 s ``zero_first`` body (it writes the store's port first); a waiting rank
#: that leaves the block before the body's end prints EARLY.
FIFTEEN_SECONDS = """
import os, sys, time
import axolotl_dist as ad
ad.init_distributed()
rank = ad.get_rank()
with ad.zero_first():
    if rank == 0:
        with open("port.tmp", "w") as fh:
            fh.write(os.environ["MASTER_PORT"])
        os.rename("port.tmp", "port")
        time.sleep(15)
        open("done", "w").close()
if rank != 0 and not os.path.exists("done"):
    print(f"EARLY {rank}", flush=True)
ad.barrier()
"""
#: What a rank's last line says where the tampering ended it: its own error naming the
#: stranger, or the launcher's line for a rank it stopped after another rank's.
TOLD = re.compile(r"outside the job|stopped by axolotl-dist while still running, because rank "
                  r"\d+ failed first")


@pytest.mark.skipif(os.geteuid() != 0, reason="playing another user needs root")
@pytest.mark.parametrize("ranks, how", [(3, "garbage"), (2, "counted")])
def test_a_stranger_overwriting_every_kit_key_is_told_once_per_rank(tmp_path, ranks, how):
    os.chmod(tmp_path, 0o755)  # the other user's client needs nothing here: the port is given
    (tmp_path / "fifteen.py").write_text(FIFTEEN_SECONDS)
    proc = start([sys.executable, "-m", "axolotl_dist.launch", "-n", str(ranks), "fifteen.py"],
                 subprocess_env(tmp_path), cwd=tmp_path)
    try:
        end = time.monotonic() + 60
        while not (tmp_path / "port").exists() and time.monotonic() < end and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(1.5)  # the others wait in the block
        port = (tmp_path / "port").read_text()
        done = as_nobody(intruder_python(), "-c", STORE_CLIENT, port, how)
    finally:
        code, out, err = finish(proc, 90)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) >= 10, done.stdout  # the keys it overwrote
    text = unfold(out + err, labelled=True)
    assert "EARLY" not in text, text
    assert "frame #" not in text and "(most recent call first)" not in text, text  # no C++ trace
    if code == 0:
        return
    for rank in range(ranks):
        lines = [line for line in text.splitlines() if line.startswith(f"[rank {rank}] ")]
        told = [line for line in lines if TOLD.search(line) and "WARNING" not in line]
        assert told, (rank, text)
        assert len([line for line in lines if "Error:" in line or "stopped by" in line]) == 1, \
            (rank, text)
