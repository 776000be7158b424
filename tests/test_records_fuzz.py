"""A failure report read off the store is data, never code (docs/design/decisions.md, decision 19):
random, truncated, oversized, foreign and hostile bytes given to
the kit's failure-report reader (what every rank runs on a relayed failure and an exit record)
are refused with a ``ValueError`` saying why, quickly, and a pickle that would run code runs
nothing."""

import json
import pickle
import random
import time

import axolotl_dist as ad
from hostile_store import CodeRunningPickle
from probes import failure_report, read_failure_report


def _cases(tmp_path):
    good = failure_report(ad.RankFailedError(1, "ValueError", "boom", "Traceback ...\n",
                                             where="barrier", ranks=(1,)))
    rng = random.Random(47)
    cases = {"pickle that runs code": pickle.dumps(CodeRunningPickle(str(tmp_path / "ran"))),
             "pickle of a tuple": pickle.dumps((1, "ValueError", "boom", None, "", (), None)),
             "empty": b"", "oversized": b"{" + b" " * (2 << 20) + b"}",
             "not utf-8": b"\xff\xfe" * 10}
    for n in range(len(good)):
        cases[f"truncated at {n}"] = good[:n]
    doc = json.loads(good)
    for name, change in {
            "version 2": lambda d: d.update(v=2), "no version": lambda d: d.pop("v"),
            "kind exit": lambda d: d.update(k="exit"), "body a dict": lambda d: d.update(b={}),
            "rank a string": lambda d: d["b"].__setitem__(0, "1"),
            "rank a bool": lambda d: d["b"].__setitem__(0, True),
            "ranks of strings": lambda d: d["b"].__setitem__(5, ["1"]),
            "a field short": lambda d: d["b"].pop(),
            "a field more": lambda d: d["b"].append(1),
            "message a list": lambda d: d["b"].__setitem__(2, ["boom"])}.items():
        bad = json.loads(good)
        change(bad)
        cases[name] = json.dumps(bad).encode()
    for i in range(300):
        cases[f"random {i}"] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400)))
    for i in range(100):  # valid JSON of random shapes
        cases[f"json {i}"] = json.dumps(rng.choice([
            [rng.random()], {"v": 1, "k": "failure", "b": rng.random()}, "text", None,
            {"v": 1, "k": "failure", "b": [rng.randrange(9)] * 7}])).encode()
    return good, cases


def test_failure_reports_refuse_what_the_kit_did_not_write(tmp_path):
    good, cases = _cases(tmp_path)
    assert read_failure_report(good).exc_message == "boom"
    outcomes = {}
    start = time.monotonic()
    for name, data in cases.items():
        try:
            read_failure_report(data)
            outcomes[name] = "accepted"
        except ValueError as exc:
            assert str(exc), name  # says why
            outcomes[name] = "refused"
    assert time.monotonic() - start < 10
    assert not (tmp_path / "ran").exists()  # the hostile pickle ran nothing
    assert [n for n, o in outcomes.items() if o != "refused"] == []
    assert len(outcomes) >= 500
