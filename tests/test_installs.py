"""What users' installs need: the kit hashes the same in every process (so ``datasets`` caches
work inside ``zero_first`` in an editable clone), no NumPy on the core path, and the backend
chosen from what this machine can run.

The other installs (the README's install line alone, a wheel, PyPI's CUDA build of torch on a
machine without a GPU, the oldest torch ``setup.cfg`` admits) need fresh venvs: they are
``scripts/compat.sh``'s, which the README's test command runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import axolotl_dist as ad
from fixtures import ROOT, run, subprocess_env, unfold

#: A map function that mentions the kit (its rank, its logger), as preprocessing code does.
MAP_SCRIPT = textwrap.dedent('''
    import os
    import sys

    import axolotl_dist as ad

    log = ad.get_logger("prep")
    CALLS = sys.argv[1]


    def tokenize(batch):
        with open(os.path.join(CALLS, f"rank{ad.get_rank()}"), "a") as fh:
            fh.write("x")  # one character per call of the map function on this rank
        log.debug("rank %d maps %d rows", ad.get_rank(), len(batch["text"]))
        return {"n": [len(t) for t in batch["text"]]}
''')

HASH_SCRIPT = MAP_SCRIPT + textwrap.dedent('''
    from datasets.fingerprint import Hasher

    print("hash", Hasher.hash(tokenize))
''')

ZERO_FIRST_SCRIPT = MAP_SCRIPT + textwrap.dedent('''
    import datasets

    ad.init_distributed()
    raw = os.path.join(CALLS, "raw")
    with ad.zero_first():  # built once, by rank 0
        if not os.path.exists(raw):
            datasets.Dataset.from_dict({"text": [f"line {i}" for i in range(64)]}).save_to_disk(raw)
    with ad.zero_first():  # rank 0 maps and writes the cache; the others load it
        out = datasets.load_from_disk(raw).map(tokenize, batched=True, batch_size=16)
    mine = os.path.join(CALLS, f"rank{ad.get_rank()}")
    calls = len(open(mine).read()) if os.path.exists(mine) else 0
    print(f"rank {ad.get_rank()} calls={calls} fingerprint={out._fingerprint} rows={len(out)}",
          flush=True)
''')

#: What ``datasets`` logs when it cannot hash a map function (its cache is then never reused).
RANDOM_HASH = "couldn't be hashed properly"


def _script(tmp_path: Path, text: str) -> str:
    path = tmp_path / "prep.py"
    path.write_text(text)
    return str(path)


def test_the_checkout_under_test_is_outside_site_packages():
    """The hash tests below cover the case that failed (dill copies such modules by value)."""
    assert "site-packages" not in ad.__file__ and Path(ad.__file__).is_relative_to(ROOT)


#: Run in a fresh interpreter: the collector's state around ``import axolotl_dist``, then
#: whether a reference cycle made after the import is still collected.
GC_SCRIPT = textwrap.dedent('''
    import gc, sys, weakref
    if sys.argv[1] == "off":
        gc.disable()
    import axolotl_dist
    print("enabled", gc.isenabled(), "frozen", gc.get_freeze_count())
    class Node:
        pass
    a, b = Node(), Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    print("cycle collected", gone() is None)
''')


@pytest.mark.parametrize("collector", ["on", "off"])
def test_the_import_leaves_the_collector_as_it_was_with_its_objects_frozen(collector):
    """``import axolotl_dist`` pauses the cyclic collector while it imports torch and the kit
    and moves what the import made to the permanent generation (``gc.freeze``): later
    collections skip torch's million objects. Enabled or not, the collector is left as the
    script had it, and what the script makes afterwards is collected as before."""
    proc = subprocess.run([sys.executable, "-c", GC_SCRIPT, collector], env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    state, collected = proc.stdout.splitlines()
    enabled, frozen = re.fullmatch(r"enabled (True|False) frozen (\d+)", state).groups()
    assert enabled == str(collector == "on"), state
    assert int(frozen) > 100_000, state  # torch's and the kit's objects
    assert collected == "cycle collected True"


def test_a_map_function_that_mentions_the_kit_hashes_the_same_in_two_processes(tmp_path):
    pytest.importorskip("datasets")
    script = _script(tmp_path, HASH_SCRIPT)
    hashes = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, script, str(tmp_path)], env=subprocess_env(tmp_path),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert RANDOM_HASH not in proc.stderr, proc.stderr[-3000:]
        hashes += re.findall(r"^hash (\w+)$", proc.stdout, re.MULTILINE)
    assert len(hashes) == 2 and hashes[0] == hashes[1], hashes


def test_the_kit_pickles_as_references_to_its_modules():
    import pickle

    import axolotl_dist.testing as kit_testing

    for module in (ad, ad.ordering, ad.parallel, kit_testing):
        data = pickle.dumps(module)
        assert len(data) < 200 and pickle.loads(data) is module


def test_zero_first_map_twice_the_second_launch_maps_nothing(tmp_path):
    """Two launches of ``zero_first`` + ``Dataset.map`` with a function that calls the kit: the
    first maps on rank 0 only (rank 1 loads rank 0's cache), the second maps nowhere."""
    pytest.importorskip("datasets")
    script = _script(tmp_path, ZERO_FIRST_SCRIPT)
    calls = tmp_path / "calls"
    calls.mkdir()
    seen = []
    for launch in range(2):
        for f in calls.glob("rank*"):
            f.unlink()
        code, out, err = run([sys.executable, "-m", "axolotl_dist.launch", "-n", "2", script,
                              str(calls)], subprocess_env(tmp_path), 150)
        assert code == 0, err[-3000:]
        assert RANDOM_HASH not in err, err[-3000:]
        rows = dict((int(r), (int(c), fp, int(n))) for r, c, fp, n in
                    re.findall(r"^rank (\d) calls=(\d+) fingerprint=(\w+) rows=(\d+)$", unfold(out),
                               re.MULTILINE))
        assert set(rows) == {0, 1}, out
        seen.append(rows)
    first, second = seen
    assert first[0][0] == 4 and first[1][0] == 0, first  # 64 rows in batches of 16, on rank 0
    assert second[0][0] == 0 and second[1][0] == 0, second  # every rank loads the cache
    fingerprints = {fp for rows in seen for _, fp, _ in rows.values()}
    assert len(fingerprints) == 1, seen
    assert {n for rows in seen for _, _, n in rows.values()} == {64}


def test_the_default_backend_is_what_this_machine_runs():
    """No usable accelerator here (CI has none): gloo, whatever torch was built for. PyPI's
    CUDA build without a GPU runs this in scripts/compat.sh."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a usable GPU")
    assert ad.default_backend() == "gloo"
    assert ad.default_backend("cpu") == "gloo"


def test_an_explicit_nccl_without_a_gpu_still_says_what_to_do():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a usable GPU")
    with pytest.raises(ad.DistributedEnvError, match=r"backend='nccl'.*no usable CUDA GPU.*"
                                                     r"pass backend='gloo'"):
        ad.init_distributed(backend="nccl")


def test_the_value_codec_needs_no_numpy(tmp_path):
    """A process where NumPy cannot be imported: values and a failure report cross ranks, and
    nobody prints torch's NumPy warning."""
    blocker = tmp_path / "no_numpy"
    blocker.mkdir()
    (blocker / "numpy.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    script = tmp_path / "values.py"
    script.write_text(textwrap.dedent('''
        import sys
        import axolotl_dist as ad

        assert "numpy" not in sys.modules or sys.modules["numpy"] is None
        ad.init_distributed()
        r = ad.get_rank()
        assert ad.compute_and_broadcast(lambda: {"a": 1, "r": r}) == {"a": 1, "r": 0}
        assert ad.reduce_and_broadcast(lambda: 2**40 + r, sum) == 2**41 + 1
        assert ad.gather_from_all_ranks(lambda: [r]) == ([[0], [1]] if r == 0 else None)
        with ad.zero_first():
            pass
        try:
            ad.compute_and_broadcast(lambda: 1 // 0)
        except ZeroDivisionError:
            assert r == 0
        except ad.RankFailedError as exc:
            assert r == 1 and "ZeroDivisionError" in str(exc)
        print(f"rank {r} ok", flush=True)
    '''))
    env = subprocess_env(tmp_path, PYTHONPATH=f"{blocker}{os.pathsep}{ROOT}")
    code, out, err = run([sys.executable, "-m", "axolotl_dist.launch", "-n", "2", str(script)],
                         env, 150)
    assert code == 0, err[-3000:]
    assert sorted(re.findall(r"^rank (\d) ok$", unfold(out), re.MULTILINE)) == ["0", "1"], out
    assert "NumPy" not in out + err, err[-3000:]


def test_the_pipeline_schedule_says_it_needs_numpy(tmp_path):
    """torch's pipelining converts objects through NumPy: without it, PipelineSchedule says so
    when it is created (the rest of the kit needs no NumPy)."""
    blocker = tmp_path / "no_numpy"
    blocker.mkdir()
    (blocker / "numpy.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    code = ("import axolotl_dist as ad\n"
            "try:\n"
            "    ad.PipelineSchedule(model_parts=[], stages=[], pp_mesh=None, schedule_name='1F1B')\n"
            "except ImportError as exc:\n"
            "    print(exc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=subprocess_env(tmp_path, PYTHONPATH=f"{blocker}{os.pathsep}{ROOT}"),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PipelineSchedule needs NumPy" in proc.stdout and "pip install numpy" in proc.stdout
