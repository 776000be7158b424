"""Every record the kit keeps in the c10d store is data, never code, and a bad one never
hangs a run (docs/design/store.md, "Trust model"; issue #47).

Ranks run against :class:`hostile_store.HostileStore`: a proxy that replaces the value of
each write to the attacked keys with an attacker's bytes, so that the reader finds them where
it expected the kit's record. A first run of each phase (recording only) lists the key
families the kit writes in it; then each family is attacked on its own, in two runs: one
with a pickle that would create a file if it were ever unpickled, one with the other payloads
in turn (empty, random, oversized, not UTF-8, another version's record, JSON of another
shape, a truncated record). The phases: a ``zero_first`` block, the value helpers, a failure
relayed out of a block, a failure relayed by an exit record, debug mode's checks, and
``axolotl-dist where`` reading every rank's answer. The records of the attempt handshake
(``axolotl_dist/attempt/...``) are written and read in ``init_distributed()``, before any
phase's body, the same way in every phase: the first phase attacks them, the others leave them
be (each of those runs waits out the ranks' timeout).

Each rank must end within the run's bound either as without the attacker ("ignored": the
bytes were overwritten, or never read, or read and set aside) or with one of the kit's errors
("clear error"); any other exception (a ``JSONDecodeError``, a ``KeyError``...) or a rank
still running at the bound fails the test, and so does the canary file. The figures (keys,
bytes, outcomes) are printed for the closing note (``pytest -s``).
"""

import json
import pickle
import random
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

import axolotl_dist as ad
from axolotl_dist.testing import run_distributed_outcomes
from fixtures import ROOT, subprocess_env
from hostile_store import CodeRunningPickle, HostileStore, family

#: The kit's own errors: what a rank may raise on a bad record.
KIT_ERRORS = ("DistributedEnvError", "RankFailedError", "CollectiveMismatchError",
              "RankTimeoutError")
WORLD = 2
#: An attacker can stall a run until its timeouts (docs/design/store.md, "Trust model"): the ranks'
#: init and collectives get STALL seconds; a run may take BOUND.
STALL, BOUND = 8.0, 25.0


def _payloads(seed):
    rng = random.Random(seed)
    return [b"", bytes(rng.randrange(256) for _ in range(200)), b"{" + b" " * (2 << 20) + b"}",
            b"\xff\xfe" * 10, json.dumps({"v": 99, "k": "failure", "b": []}).encode(),
            json.dumps([1, 2, 3]).encode(), b'{"v": 1, "k": "exit", "b": [0, "Val',
            json.dumps({"v": 1, "k": "where", "b": {"rank": "0"}}).encode()]


# --- the phases: one body per rank each (the harness forks WORLD ranks) ------------------------

def _zero_first():
    with ad.zero_first():
        if ad.get_rank() == 0:
            time.sleep(0.3)
    ad.barrier()
    return "ok"


def _helpers():
    got = ad.gather_from_all_ranks(lambda: ad.get_rank() + 2 ** 70)
    obj = ad.compute_and_broadcast(lambda: {"a": 1})
    total = ad.reduce_and_broadcast(lambda: 0.1, sum)
    return "ok" if obj == {"a": 1} and total == 0.2 and (got is None) == (ad.get_rank() != 0) \
        else f"wrong: {got} {obj} {total}"


def _relay_block():
    with ad.zero_first():
        if ad.get_rank() == 0:
            raise ValueError("injected")
    return "not raised"


def _relay_exit():
    if ad.get_rank() == 1:
        raise ValueError("injected")
    ad.barrier()
    return "not raised"


def _debug():
    ad.gather_from_all_ranks(lambda: 1)
    with ad.zero_first():
        pass
    ad.barrier()
    return "ok"


PHASES = {
    "zero_first": (_zero_first, {}),
    "helpers": (_helpers, {}),
    "relayed failure (block)": (_relay_block, {}),
    "relayed failure (exit record)": (_relay_exit, {}),
    "debug mode": (_debug, {"AXOLOTL_DIST_DEBUG": "1"}),
}
#: What a rank does in each phase without an attacker: "ok", or the start of its error.
EXPECTED = {
    "zero_first": ("ok", "ok"), "helpers": ("ok", "ok"), "debug mode": ("ok", "ok"),
    "relayed failure (block)": ("ValueError: injected", "RankFailedError"),
    "relayed failure (exit record)": ("RankFailedError", "ValueError: injected"),
}
#: Families every phase must write (so that the test cannot quietly fuzz nothing).
MUST = {"zero_first": {"axd/zf/#/site", "axd/exit/#", "axolotl_dist/*/who/#",
                       "axolotl_dist/attempt/join/#", "axolotl_dist/attempt/answer/#/*"},
        "helpers": {"axd/run", "axd/exit/#"},
        "relayed failure (block)": {"axd/zf/#/*/error"},
        "relayed failure (exit record)": {"axd/exit/#"},
        "debug mode": {"axd/dbg/#/c/#"}}
#: The attempt handshake's families: init's, the same in every phase (attacked in the first).
INIT_FAMILIES = ("axolotl_dist/attempt/",)


def _run(phase, target=None, payloads=(b"",)):
    fn, env = PHASES[phase]
    hostile = HostileStore(WORLD, target, payloads)
    try:
        start = time.monotonic()
        outcomes = run_distributed_outcomes(fn, WORLD, env={"MASTER_PORT": str(hostile.port),
                                                            **env}, timeout=BOUND,
                                            pg_timeout=STALL)
        return outcomes, hostile, time.monotonic() - start
    finally:
        hostile.close()


def _classify(phase, outcome):
    """"ignored", "clear error", or what is wrong with this rank's end."""
    expected = EXPECTED[phase][outcome.rank]
    if outcome.timed_out:
        return f"HANG (rank {outcome.rank} still running after {BOUND:.0f} s)"
    if outcome.ok:
        return "ignored" if outcome.value == expected == "ok" else f"WRONG value {outcome.value!r}"
    error = outcome.error or f"exit code {outcome.exitcode}"
    if error.startswith(expected):
        return "ignored"
    if error.split(":")[0] in KIT_ERRORS:
        return "clear error"
    return f"UNCLEAR: {outcome.describe()[:1500]}"


def _names_a_key(outcomes):
    """Whether some rank's error names a kit key: the rank that read the bad record does; the
    others may only time out waiting for it (bounded, and said as such)."""
    return any(o.error and ("axd/" in o.error or "axolotl_dist/" in o.error) for o in outcomes)


@pytest.mark.parametrize("phase", list(PHASES))
def test_no_record_an_attacker_writes_runs_or_hangs(phase, tmp_path):
    outcomes, recorder, _ = _run(phase)
    assert [_classify(phase, o) for o in outcomes] == ["ignored"] * WORLD, \
        [o.describe() for o in outcomes]
    families = sorted({family(k) for k in recorder.written})
    assert MUST[phase] <= set(families), families
    if phase != next(iter(PHASES)):
        families = [f for f in families if not f.startswith(INIT_FAMILIES)]
    canary = tmp_path / "ran"
    bomb = [pickle.dumps(CodeRunningPickle(str(canary)))]
    tally, problems, keys, sent, slowest = Counter(), [], set(), 0, 0.0
    for n, fam in enumerate(families):
        for payloads in (bomb, _payloads(n)[n % 8:] + _payloads(n)[:n % 8]):
            outcomes, hostile, took = _run(phase, lambda key, f=fam: family(key) == f, payloads)
            slowest = max(slowest, took)
            keys |= {k for k, _ in hostile.attacked}
            sent += hostile.bytes_sent
            stall_report = [_classify(phase, outcome) for outcome in outcomes]
            if "clear error" in stall_report and not _names_a_key(outcomes):
                stall_report = [f"NO KEY NAMED: {o.describe()[:400]}" for o in outcomes]
            for verdict in stall_report:
                tally[verdict if verdict in ("ignored", "clear error") else "wrong"] += 1
                if verdict not in ("ignored", "clear error"):
                    problems.append(f"{fam} <- {payloads[0][:40]!r}... ({took:.1f} s): "
                                    f"{verdict}")
    print(f"\n{phase}: {len(families)} families, {len(keys)} keys attacked, {sent} bytes, "
          f"rank outcomes {dict(tally)}, slowest run {slowest:.1f} s")
    assert not canary.exists(), "an attacker's pickle ran"
    assert problems == [], "\n\n".join(problems)


# --- axolotl-dist where ------------------------------------------------------------------------

def _stall_until(answered):
    """Rank 0 holds both ranks in a block until ``answered`` exists (``where`` is done), 18 s
    at most."""
    def body():
        with ad.zero_first():
            if ad.get_rank() == 0:
                deadline = time.monotonic() + 18
                while not answered.exists() and time.monotonic() < deadline:
                    time.sleep(0.1)
        return "ok"
    return body


def _root(note):
    """The root keys where reads (not an attempt's): with or without the run's note."""
    def target(key):
        name = family(key)
        return name.startswith("axolotl_dist/") and not name.startswith("axolotl_dist/attempt/") \
            and (note or name != "axolotl_dist/run")
    return target


@pytest.mark.parametrize("attack,note", [("pickle", True), ("pickle", False),
                                         ("payloads", False)])
def test_where_reads_every_rank_answer_as_data(attack, note, tmp_path):
    canary = tmp_path / "ran"
    payloads = [pickle.dumps(CodeRunningPickle(str(canary)))] if attack == "pickle" else _payloads(7)
    hostile = HostileStore(WORLD, _root(note), payloads)
    answer, answered = {}, tmp_path / "answered"

    def where():
        time.sleep(2.0)
        try:
            answer["done"] = subprocess.run(
                [sys.executable, "-m", "axolotl_dist.launch", "where", "--master-addr",
                 "127.0.0.1", "--master-port", str(hostile.store_port), "--timeout", "12"],
                env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=60,
                cwd=str(ROOT))
        finally:
            answered.touch()

    asker = threading.Thread(target=where)
    asker.start()
    try:
        outcomes = run_distributed_outcomes(_stall_until(answered), WORLD,
                                            env={"MASTER_PORT": str(hostile.port)},
                                            timeout=BOUND, pg_timeout=STALL)
    finally:
        asker.join(70)
        hostile.close()
    done = answer["done"]
    print(f"\nwhere ({attack}, note {note}): {len(hostile.attacked)} writes attacked, "
          f"{len({k for k, _ in hostile.attacked})} keys, {hostile.bytes_sent} bytes; "
          f"exit {done.returncode}\n{done.stdout}{done.stderr}")
    assert not canary.exists(), "an attacker's pickle ran"
    assert hostile.attacked
    for outcome in outcomes:  # the ranks: as without the attacker, or a kit error
        assert _classify("zero_first", outcome) in ("ignored", "clear error"), outcome.describe()
    assert "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    assert done.returncode in (0, 1), done.stdout + done.stderr
    assert "store key 'axolotl_dist/" in done.stdout, done.stdout  # the answer, named unreadable
