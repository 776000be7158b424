"""A ``datasets`` map inside ``zero_first`` that leaves the other ranks no cache file to load is
said once, on rank 0, with the fix (docs/preprocessing.md, "A map that writes no cache").

Real gloo ranks forked by the harness; each rank's stderr is read with logging unconfigured
(the harness's ranks inherit pytest's logging handlers: a rank drops them, so the kit prints
through its own stderr fallback, as in a user's script). Every dataset lives under ``tmp_path``.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable, List

import pytest

datasets = pytest.importorskip("datasets")

import axolotl_dist as ad  # noqa: E402
from axolotl_dist.testing import run_distributed  # noqa: E402
from fixtures import ROOT, subprocess_env  # noqa: E402

TIMEOUT = 90  # the harness kills ranks still alive then, and says which
ROWS = 20
#: The start of the note on rank 0 of 2, as the kit prints it (time, level, logger, rank).
NOTE = re.compile(r"^\d\d:\d\d:\d\d WARNING axolotl_dist: \[rank 0/2\] zero_first: the datasets "
                  r"map of (\S+) at (\S+) wrote no cache file the other ranks can load: ")
FIXES = ("save_to_disk the dataset, then load_from_disk it before the map",
         "pass cache_file_name= (a path every rank can read)",
         "or in place of the block, call ad.shared_map(dataset, fn, ...): it splits the map "
         "across every rank",
         'docs/preprocessing.md, "A map that writes no cache"', "Said once per process.")


def tokenize(example):
    """Module-level and stateless: ``datasets`` hashes it the same in every process."""
    return {"n": len(example["text"])}


def _source():
    return datasets.Dataset.from_dict({"text": [f"row {i}" + "x" * i for i in range(ROWS)]})


def _on_disk(tmp_path: Path) -> str:
    path = str(tmp_path / "raw")
    _source().save_to_disk(path)
    return path


def _kit_lines(body: Callable[[], object]) -> List[str]:
    """Run ``body`` in a rank with logging unconfigured; the kit's lines it printed."""
    datasets.disable_progress_bars()
    root = logging.getLogger()
    handlers, root.handlers = root.handlers, []
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            body()
    finally:
        root.handlers = handlers
    return [line for line in err.getvalue().splitlines() if " axolotl_dist: " in line]


def _at(site: str, marker: str) -> bool:
    """Whether ``site`` (``path:N``, the path as the kit shortens it) is the line of this file
    that ends with ``marker``."""
    path, line = site.rsplit(":", 1)
    lines = Path(__file__).read_text().splitlines()
    (n,) = [i for i, text in enumerate(lines, 1) if text.endswith(marker)]
    return Path(path).resolve() == Path(__file__).resolve() and int(line) == n


BLOCKS = {"zero_first": lambda: ad.zero_first(),
          "main_process_first": lambda: ad.main_process_first(),
          "local_main_process_first": lambda: ad.local_main_process_first()}


@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_in_memory_map_in_the_block_is_noted_once_on_rank_0_with_the_fix(block):
    def body():
        out = []

        def maps():
            for _ in range(2):  # two blocks, several maps each: one note per process
                with BLOCKS[block]():
                    ds = _source().map(tokenize)  # the noted map
                    ds = ds.map(tokenize)
                    splits = datasets.DatasetDict({"train": _source()}).map(tokenize)
                    out.append((ds["n"], splits["train"]["n"]))

        return _kit_lines(maps), out

    results = run_distributed(body, 2, timeout=TIMEOUT)
    expected = [len(f"row {i}" + "x" * i) for i in range(ROWS)]
    assert [out for _, out in results] == [[(expected, expected)] * 2] * 2
    (note,), others = results[0][0], results[1][0]
    assert others == []  # a waiting rank says nothing
    m = NOTE.match(note)
    assert m, note
    assert m.group(1) == "tokenize" and _at(m.group(2), "# the noted map"), note
    assert ("the dataset is held in memory (Dataset.from_dict, from_list, from_pandas, or an "
            "in-memory map's result), so datasets has no cache directory to write to. Every "
            "other rank will run the whole map again after this block. To map once: ") in note
    for fix in FIXES:
        assert fix in note, fix


def test_keep_in_memory_on_a_dataset_on_disk_is_noted(tmp_path):
    raw = _on_disk(tmp_path)

    def body():
        def maps():
            with ad.zero_first():
                datasets.load_from_disk(raw).map(tokenize, keep_in_memory=True)  # kept
        return _kit_lines(maps)

    (note,), others = run_distributed(body, 2, timeout=TIMEOUT)
    assert others == []
    m = NOTE.match(note)
    assert m and m.group(1) == "tokenize" and _at(m.group(2), "# kept"), note
    assert ("can load: keep_in_memory=True kept the result in memory. Every other rank will run "
            "the whole map again after this block. To map once: drop keep_in_memory=True, or "
            "pass cache_file_name= (a path every rank can read) in its place; or in place of "
            "the block, call ad.shared_map(dataset, fn, ...)") in note


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("not picklable")


def test_a_function_datasets_cannot_hash_is_noted(tmp_path):
    raw = _on_disk(tmp_path)

    def body():
        guard = _Unpicklable()

        def unhashable(example):
            return {"n": len(example["text"]) + (guard is None)}

        def maps():
            with ad.zero_first():
                datasets.load_from_disk(raw).map(unhashable)  # random fingerprint
        return _kit_lines(maps)

    (note,), others = run_distributed(body, 2, timeout=TIMEOUT)
    assert others == []
    m = NOTE.match(note)
    assert m, note
    assert m.group(1) == ("test_a_function_datasets_cannot_hash_is_noted.<locals>.body.<locals>"
                          ".unhashable") and _at(m.group(2), "# random fingerprint"), note
    assert ("datasets could not hash the function or its arguments (its warning \"couldn't be "
            "hashed properly\") and used a random fingerprint, so the cache file it wrote has a "
            "name no other rank looks for") in note
    assert "make the function and fn_kwargs picklable by dill" in note
    assert "pass cache_file_name= (a path every rank can read)" in note


def test_the_cached_path_says_nothing_and_rank_1_loads_rank_0s_file(tmp_path):
    raw = _on_disk(tmp_path)

    def body():
        files = []

        def maps():
            with ad.zero_first():
                ds = datasets.load_from_disk(raw).map(tokenize)
                files.append([f["filename"] for f in ds.cache_files])
                named = _source().map(tokenize, cache_file_name=str(tmp_path / "named.arrow"))
                files.append([f["filename"] for f in named.cache_files])
        return _kit_lines(maps), files

    results = run_distributed(body, 2, timeout=TIMEOUT)
    assert [lines for lines, _ in results] == [[], []]
    assert results[0][1] == results[1][1]  # one fingerprint, one file name on both ranks
    assert results[0][1][1] == [str(tmp_path / "named.arrow")]


def test_a_map_outside_any_block_says_nothing(tmp_path):
    raw = _on_disk(tmp_path)

    def body():
        def maps():
            _source().map(tokenize)  # before any block
            with ad.zero_first():
                datasets.load_from_disk(raw).map(tokenize)  # the cached path: nothing to say
            _source().map(tokenize)  # after one: datasets' map is watched now
            _source().map(tokenize, keep_in_memory=True)
        return _kit_lines(maps)

    assert run_distributed(body, 2, timeout=TIMEOUT) == [[], []]


def test_one_process_says_nothing():
    def body():
        def maps():
            with ad.zero_first():
                _source().map(tokenize)
        return _kit_lines(maps)

    assert run_distributed(body, 1, timeout=TIMEOUT) == [[]]


def test_a_block_never_imports_datasets(tmp_path):
    # a fresh interpreter: importing the kit and running blocks on 2 ranks leaves datasets out
    code = ("import sys\n"
            "import axolotl_dist as ad\n"
            "from axolotl_dist.testing import run_distributed\n"
            "def body():\n"
            "    with ad.zero_first():\n"
            "        pass\n"
            "    with ad.main_process_first():\n"
            "        pass\n"
            "    return 'datasets' in sys.modules\n"
            "print(run_distributed(body, 2, timeout=60), 'datasets' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=subprocess_env(tmp_path),
                          capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["[False,", "False]", "False"]


def test_caching_turned_off_is_noted(tmp_path):
    raw = _on_disk(tmp_path)

    def body():
        def maps():
            datasets.disable_caching()  # in this rank's process only
            with ad.zero_first():
                datasets.load_from_disk(raw).map(tokenize)  # to a temporary file
        return _kit_lines(maps)

    (note,), others = run_distributed(body, 2, timeout=TIMEOUT)
    assert others == []
    m = NOTE.match(note)
    assert m and m.group(1) == "tokenize" and _at(m.group(2), "# to a temporary file"), note
    assert ("can load: datasets' caching is off (datasets.disable_caching()): the result went to "
            "a temporary file the other ranks do not read. Every other rank will run the whole "
            "map again after this block. To map once: call datasets.enable_caching(), or pass "
            "cache_file_name= (a path every rank can read) with load_from_cache_file=True; or in "
            "place of the block, call ad.shared_map(dataset, fn, ...)") in note
