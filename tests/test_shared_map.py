"""shared_map on real gloo ranks: one-process results, split work, caching, failures, nodes."""

import contextlib
import glob
import io
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time

import pytest

datasets = pytest.importorskip("datasets")

import axolotl_dist as ad  # noqa: E402
from axolotl_dist.data import shard_bounds  # noqa: E402
from axolotl_dist.testing import run_distributed, run_distributed_outcomes  # noqa: E402

PG_TIMEOUT = 300.0  # the group's collective timeout: failures must surface long before it
ROWS = 30
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Where a dataset held in memory is mapped through temporary parts: this user's own directory.
_TEMP_PARTS = os.path.join(tempfile.gettempdir(), f"axolotl_dist-{os.geteuid()}", "shared_map")


# ------------------------------------------------------------------ functions the ranks map
# Module-level and free of mutable state, so datasets hashes them the same on every call.
# Each counts the rows it is given in <SM_CALLS>/rows-<RANK> (a no-op outside the ranks).


def _count(rows):
    where = os.environ.get("SM_CALLS")
    if where:
        with open(os.path.join(where, f"rows-{os.environ['RANK']}"), "a") as fh:
            fh.write("." * rows)


def double(ex):
    _count(1)
    return {"b": ex["a"] * 2}


def triple(ex):
    _count(1)
    return {"b": ex["a"] * 3}


def with_index(ex, idx):
    _count(1)
    return {"b": ex["a"] * 2, "idx": idx}


def pack(batch):
    """One output row per batch: the result depends on where the batches start."""
    _count(len(batch["a"]))
    return {"total": [sum(batch["a"])], "first": [batch["a"][0]], "n": [len(batch["a"])]}


def batched_index(batch, idx):
    _count(len(idx))
    return {"i2": [i * 2 for i in idx], "width": [len(t) for t in batch["t"]]}


def index_and_rank(ex, idx, rank):
    _count(1)
    return {"idx": idx, "rank": -1 if rank is None else rank}


async def async_double(ex):
    _count(1)
    return {"b": ex["a"] * 2}


def scale(a, k=1):
    _count(1)
    return {"scaled": a * k}


def fail_on_row_15(ex, idx):
    """Row 15 raises (rank 1's part on 2 or 3 ranks); the other rows are slow."""
    if idx == 15:
        raise ValueError("bad row 15")
    time.sleep(0.2)
    return {"b": ex["a"]}


def killed_once(ex, idx):
    """Kills its own process at row 20 while <SM_CALLS>/kill exists (removed first)."""
    _count(1)
    flag = os.path.join(os.environ.get("SM_CALLS", "/nonexistent"), "kill")
    if idx == 20 and os.path.exists(flag):
        os.remove(flag)
        os.kill(os.getpid(), signal.SIGKILL)
    return {"b": ex["a"] * 2}


def side_effect_only(ex):
    _count(1)


CASES = {
    "unbatched": (double, {}),
    "unbatched-with-indices-remove": (with_index, {"with_indices": True, "remove_columns": ["t"]}),
    "batched-pack-remove": (pack, {"batched": True, "batch_size": 4, "remove_columns": ["a", "t"]}),
    "batched-with-indices": (batched_index, {"batched": True, "batch_size": 7, "with_indices": True}),
    "batched-drop-last": (pack, {"batched": True, "batch_size": 4, "drop_last_batch": True,
                                 "remove_columns": ["a", "t"]}),
    "input-columns-fn-kwargs": (scale, {"input_columns": "a", "fn_kwargs": {"k": 3}}),
    "with-rank-is-none-as-in-one-process": (index_and_rank, {"with_indices": True, "with_rank": True}),
    "features": (double, {"features": datasets.Features(
        {"a": datasets.Value("int64"), "t": datasets.Value("string"), "b": datasets.Value("int32")})}),
    "async": (async_double, {}),
}


# ------------------------------------------------------------------ helpers


def _source():
    return datasets.Dataset.from_dict({"a": list(range(ROWS)), "t": [f"row {i}" * (i % 4) for i in range(ROWS)]})


def _on_disk(tmp_path, name="src"):
    """The source dataset saved under ``tmp_path/name`` (loaded back: it has cache files)."""
    path = str(tmp_path / name)
    if not os.path.exists(path):
        _source().save_to_disk(path)
    return path


def _expected(tmp_path, fn, kwargs):
    """A one-process map of a separate copy (same fingerprint), after the ranks ran."""
    ds = datasets.load_from_disk(_on_disk(tmp_path, "reference"))
    return ds.map(fn, **kwargs)


def _rows_mapped(tmp_path, ws):
    counts = []
    for rank in range(ws):
        path = tmp_path / f"rows-{rank}"
        counts.append(len(path.read_text()) if path.exists() else 0)
        if path.exists():
            path.unlink()
    return counts


def _summary(ds):
    return ds.to_dict(), ds.features, ds._fingerprint, ds.format, ds.split


def _env(tmp_path):
    return {"SM_CALLS": str(tmp_path), "HF_DATASETS_OFFLINE": "1"}


# ------------------------------------------------------------------ equality and split


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("case", sorted(CASES))
def test_same_result_as_one_process_and_each_rank_maps_its_part(tmp_path, ws, case):
    fn, kwargs = CASES[case]
    src = _on_disk(tmp_path)

    def body():
        out = ad.shared_map(datasets.load_from_disk(src), fn, **kwargs)
        return _summary(out), sorted(os.path.basename(f["filename"]) for f in out.cache_files)

    results = run_distributed(body, ws, env=_env(tmp_path), timeout=90, pg_timeout=PG_TIMEOUT)
    rows = _rows_mapped(tmp_path, ws)
    expected = _expected(tmp_path, fn, kwargs)
    for summary, files in results:
        assert summary == _summary(expected)
        assert files == [f"cache-{expected._fingerprint}-part{i:05d}of{ws:05d}.arrow" for i in range(ws)]
    batch = kwargs.get("batch_size", 1) if kwargs.get("batched") else 1
    batches = -(-ROWS // batch)
    last = ROWS // batch * batch if kwargs.get("drop_last_batch") else ROWS  # rows map calls fn on
    parts = [shard_bounds(batches, ws, r) for r in range(ws)]
    assert rows == [max(0, min(e * batch, last) - s * batch) for s, e in parts]


def test_formatted_dataset_keeps_its_format_and_in_memory_dataset_works(tmp_path):
    def body():
        ds = _source().with_format("numpy", columns=["a"], output_all_columns=True)
        out = ad.shared_map(ds, double)
        return _summary(out), out.cache_files, os.listdir(_TEMP_PARTS)

    results = run_distributed(body, 2, env=_env(tmp_path), timeout=90)
    expected = _source().with_format("numpy", columns=["a"], output_all_columns=True).map(double)
    for (data, features, fingerprint, fmt, split), cache_files, _ in results:
        assert (features, fingerprint, fmt, split) == _summary(expected)[1:]
        assert {k: list(v) for k, v in data.items()} == {k: list(v) for k, v in expected.to_dict().items()}
        assert cache_files == []  # held in memory, like datasets' own in-memory map
    assert _rows_mapped(tmp_path, 2) == [15, 15]
    leftovers = glob.glob(os.path.join(_TEMP_PARTS, f"{expected._fingerprint}-*"))
    assert leftovers == []  # the temporary parts are removed once every rank has read them
    for path in (_TEMP_PARTS, os.path.dirname(_TEMP_PARTS)):  # this user's alone
        info = os.lstat(path)
        assert (info.st_uid, stat.S_IMODE(info.st_mode)) == (os.geteuid(), 0o700), path


# ------------------------------------------------------------------ caching


def test_second_call_maps_nothing_and_a_change_recomputes(tmp_path):
    src = _on_disk(tmp_path)
    calls = str(tmp_path)

    def counted():
        path = os.path.join(calls, f"rows-{os.environ['RANK']}")
        n = len(open(path).read()) if os.path.exists(path) else 0
        if os.path.exists(path):
            os.remove(path)
        return n

    def body():
        ds = datasets.load_from_disk(src)
        seen = []
        for fn, kwargs in [(double, {}), (double, {}), (triple, {}), (scale, {"input_columns": "a"}),
                           (scale, {"input_columns": "a", "fn_kwargs": {"k": 5}}),
                           (scale, {"input_columns": "a", "fn_kwargs": {"k": 5}})]:
            out = ad.shared_map(ds, fn, **kwargs)
            ad.barrier()  # every rank counted before anyone removes its count
            seen.append((counted(), out._fingerprint, out.to_dict()))
            ad.barrier()
        again = ad.shared_map(ds, double, load_from_cache_file=False)
        seen.append((counted(), again._fingerprint, again.to_dict()))
        return seen

    results = run_distributed(body, 2, env=_env(tmp_path), timeout=120)
    runs = [(double, {}), (double, {}), (triple, {}), (scale, {"input_columns": "a"}),
            (scale, {"input_columns": "a", "fn_kwargs": {"k": 5}}),
            (scale, {"input_columns": "a", "fn_kwargs": {"k": 5}}), (double, {})]
    expected = [_expected(tmp_path, fn, kw) for fn, kw in runs]
    for rank_seen in results:
        counts = [c for c, _, _ in rank_seen]
        assert counts == [15, 0, 15, 15, 15, 0, 15]
        for (_, fingerprint, data), exp in zip(rank_seen, expected):
            assert (fingerprint, data) == (exp._fingerprint, exp.to_dict())


def test_a_part_without_a_valid_marker_is_recomputed(tmp_path):
    src = _on_disk(tmp_path)

    def body():
        return _summary(ad.shared_map(datasets.load_from_disk(src), double))

    run_distributed(body, 2, env=_env(tmp_path), timeout=90)
    assert _rows_mapped(tmp_path, 2) == [15, 15]
    fingerprint = _expected(tmp_path, double, {})._fingerprint
    part1 = os.path.join(src, f"cache-{fingerprint}-part00001of00002")
    # a writer killed between rename and marker: half a file, no marker
    with open(part1 + ".arrow", "r+b") as fh:
        fh.truncate(os.path.getsize(part1 + ".arrow") // 2)
    os.remove(part1 + ".done")
    results = run_distributed(body, 2, env=_env(tmp_path), timeout=90)
    assert _rows_mapped(tmp_path, 2) == [0, 15]
    assert results == [_summary(_expected(tmp_path, double, {}))] * 2
    # a marker whose file was cut short afterwards is not trusted either
    with open(part1 + ".arrow", "r+b") as fh:
        fh.truncate(100)
    results = run_distributed(body, 2, env=_env(tmp_path), timeout=90)
    assert _rows_mapped(tmp_path, 2) == [0, 15]
    assert results == [_summary(_expected(tmp_path, double, {}))] * 2
    assert glob.glob(os.path.join(src, "*incomplete*")) == []


# ------------------------------------------------------------------ failures


def test_a_raising_row_fails_every_rank_fast_naming_rank_and_rows(tmp_path):
    src = _on_disk(tmp_path)

    def body():
        ad.shared_map(datasets.load_from_disk(src), fail_on_row_15, with_indices=True)

    outcomes = run_distributed_outcomes(body, 3, env=_env(tmp_path), timeout=60,
                                        pg_timeout=PG_TIMEOUT)
    assert isinstance(outcomes[1].exception, ValueError), outcomes[1].describe()
    for o in (outcomes[0], outcomes[2]):
        assert isinstance(o.exception, ad.RankFailedError), o.describe()
        assert o.exception.rank == 1 and o.exception.exc_type == "ValueError"
        assert "bad row 15" in str(o.exception)
        assert "rows [10, 20)" in str(o.exception)
        # their own parts take 10 x 0.2 s; they stop mapping as soon as rank 1 fails
        assert o.elapsed < 10.0
    assert outcomes[0].elapsed < outcomes[1].elapsed + 2.0
    leftovers = [os.path.basename(p) for p in glob.glob(os.path.join(src, "cache-*"))]
    assert leftovers == []  # nothing marked complete, no half-written parts


def test_a_killed_rank_is_noticed_and_its_part_recomputed_next_time(tmp_path):
    src = _on_disk(tmp_path)
    (tmp_path / "kill").write_text("")

    def body():
        return _summary(ad.shared_map(datasets.load_from_disk(src), killed_once, with_indices=True))

    outcomes = run_distributed_outcomes(body, 2, env=_env(tmp_path), timeout=60,
                                        pg_timeout=PG_TIMEOUT)
    assert outcomes[1].exitcode == -signal.SIGKILL
    assert isinstance(outcomes[0].exception, ad.RankFailedError), outcomes[0].describe()
    assert outcomes[0].exception.rank == 1 and outcomes[0].exception.exc_type == "died"
    assert outcomes[0].elapsed < 15.0
    assert _rows_mapped(tmp_path, 2) == [15, 6]
    results = run_distributed(body, 2, env=_env(tmp_path), timeout=90)
    assert _rows_mapped(tmp_path, 2) == [0, 15]  # rank 0's finished part is reused
    assert results == [_summary(_expected(tmp_path, killed_once, {"with_indices": True}))] * 2


def test_ranks_with_different_datasets_all_raise(tmp_path):
    def body():
        ds = _source()
        if ad.get_rank() == 1:
            ds = ds.select(range(10))
        ad.shared_map(ds, double)

    outcomes = run_distributed_outcomes(body, 2, env=_env(tmp_path), timeout=60)
    for o in outcomes:
        assert isinstance(o.exception, ad.DistributedConfigError), o.describe()
        assert "every rank must pass the same dataset" in str(o.exception)
        assert "rank 1: 10 rows" in str(o.exception)


# ------------------------------------------------------------------ nodes, keys, progress


def test_two_nodes_without_a_shared_filesystem_each_get_everything(tmp_path):
    src = _on_disk(tmp_path)

    def node_env(rank):
        node = rank // 2
        return {"NODE_RANK": str(node), "LOCAL_RANK": str(rank % 2), "LOCAL_WORLD_SIZE": "2",
                "NUM_NODES": "2", "AXOLOTL_DIST_SHARED_FS": "0",
                "SM_NODE_DIR": str(tmp_path / f"node{node}")}

    def body():
        out = ad.shared_map(datasets.load_from_disk(src), double,
                            cache_dir=os.environ["SM_NODE_DIR"])
        return _summary(out), sorted(f["filename"] for f in out.cache_files)

    results = run_distributed(body, 4, env=_env(tmp_path), rank_env=node_env, timeout=120)
    assert _rows_mapped(tmp_path, 4) == [15, 15, 15, 15]  # each node's two ranks split it
    expected = _expected(tmp_path, double, {})
    for rank, (summary, files) in enumerate(results):
        assert summary == _summary(expected)
        node_dir = str(tmp_path / f"node{rank // 2}")
        assert files == [os.path.join(node_dir, f"cache-{expected._fingerprint}-part{i:05d}of00002.arrow")
                         for i in range(2)]


def test_store_keys_are_deleted_after_each_call(tmp_path):
    src = _on_disk(tmp_path)

    def body():
        from probes import store_of

        ds = datasets.load_from_disk(src)
        for fn in (double, triple, double):
            ad.shared_map(ds, fn)
        with contextlib.suppress(ad.RankFailedError, ValueError):
            ad.shared_map(ds, fail_on_row_15, with_indices=True)
        ad.barrier()
        time.sleep(0.2)  # the last rank out deletes the keys after it returned
        store = store_of()
        names = ["arrived", "done", "failed", "progress", "left", "who/0", "who/1", "error/1"]
        return [k for s in range(1, 5) for k in (f"axd/sm/{s}/{n}" for n in names) if store.check([k])]

    assert run_distributed(body, 2, env=_env(tmp_path), timeout=90) == [[], []]


def test_one_progress_bar_on_the_main_rank_counting_every_rank(tmp_path):
    src = _on_disk(tmp_path)

    def body():
        datasets.enable_progress_bars()
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            ad.shared_map(datasets.load_from_disk(src), double, desc="Tokenizing")
        return err.getvalue(), datasets.are_progress_bars_disabled()

    results = run_distributed(body, 2, env=_env(tmp_path), timeout=90)
    main, other = results[0][0], results[1][0]
    assert "Tokenizing (shared_map over 2 ranks)" in main and f"{ROWS}/{ROWS}" in main
    assert main.count("Tokenizing") == main.count("Tokenizing (shared_map")
    assert other == ""  # no bar at all on the other rank
    assert [disabled for _, disabled in results] == [False, False]  # datasets' bars restored


def test_side_effect_only_function_returns_the_dataset(tmp_path):
    src = _on_disk(tmp_path)

    def body():
        ds = datasets.load_from_disk(src)
        out = ad.shared_map(ds, side_effect_only)
        return out._fingerprint == ds._fingerprint, out.to_dict() == ds.to_dict()

    assert run_distributed(body, 2, env=_env(tmp_path), timeout=90) == [(True, True)] * 2
    assert _rows_mapped(tmp_path, 2) == [15, 15]


def test_debug_mode_names_a_rank_calling_something_else(tmp_path):
    def body():
        if ad.get_rank() == 0:
            ad.shared_map(_source(), double)
        else:
            ad.barrier()

    outcomes = run_distributed_outcomes(body, 2, env={**_env(tmp_path), "AXOLOTL_DIST_DEBUG": "1"},
                                        timeout=60)
    for o in outcomes:
        assert isinstance(o.exception, ad.CollectiveMismatchError), o.describe()
        assert "shared_map" in str(o.exception) and "barrier" in str(o.exception)


# ------------------------------------------------------------------ one process, bad input


def test_one_process_is_exactly_dataset_map(tmp_path):
    src = _on_disk(tmp_path)
    kwargs = {"batched": True, "batch_size": 4, "remove_columns": ["a", "t"]}
    out = ad.shared_map(datasets.load_from_disk(src), pack, **kwargs)
    expected = _expected(tmp_path, pack, kwargs)
    assert _summary(out) == _summary(expected)
    assert [os.path.basename(f["filename"]) for f in out.cache_files] == [
        f"cache-{expected._fingerprint}.arrow"]
    assert os.path.dirname(out.cache_files[0]["filename"]) == src
    elsewhere = ad.shared_map(datasets.load_from_disk(src), double, cache_dir=tmp_path / "elsewhere")
    assert [f["filename"] for f in elsewhere.cache_files] == [
        str(tmp_path / "elsewhere" / f"cache-{_expected(tmp_path, double, {})._fingerprint}.arrow")]
    assert not ad.is_initialized()


def test_one_rank_group_is_dataset_map(tmp_path):
    src = _on_disk(tmp_path)

    def body():
        out = ad.shared_map(datasets.load_from_disk(src), double)
        return _summary(out), [os.path.basename(f["filename"]) for f in out.cache_files]

    [(summary, files)] = run_distributed(body, 1, timeout=60)
    expected = _expected(tmp_path, double, {})
    assert summary == _summary(expected) and files == [f"cache-{expected._fingerprint}.arrow"]


@pytest.mark.parametrize("kwargs, error, message", [
    ({"num_proc": 2}, ValueError, r"num_proc=2\) is not supported: shared_map already splits"),
    ({"cache_file_name": "x.arrow"}, ValueError, r"cache_file_name=\.\.\.\) is not supported.*cache_dir="),
    ({"batch_sise": 2}, TypeError, r"unknown Dataset.map argument\(s\) \['batch_sise'\]"),
    ({"timeout": 0}, ValueError, r"timeout=0\) must be a positive number"),
    ({"remove_columns": "nope"}, ValueError, r"remove_columns=\['nope'\]\): column\(s\) \['nope'\]"),
    ({"cache_dir": 3}, TypeError, r"cache_dir=\.\.\.\) must be a directory path"),
])
def test_bad_arguments_say_what_to_fix(kwargs, error, message):
    with pytest.raises(error, match=message):
        ad.shared_map(_source(), double, **kwargs)


@pytest.mark.parametrize("dataset, message", [
    ([{"a": 1}], r"takes a datasets.Dataset, got list"),
    (datasets.DatasetDict(), r"got DatasetDict \(map each split"),
])
def test_non_dataset_input_is_rejected(dataset, message):
    with pytest.raises(TypeError, match=message):
        ad.shared_map(dataset, double)


def test_missing_datasets_names_the_extra_and_the_package_imports_without_it():
    code = ("import sys, axolotl_dist as ad\n"
            "assert 'datasets' not in sys.modules, 'importing axolotl_dist imported datasets'\n"
            "assert 'shared_map' in ad.__all__\n"
            "sys.modules['datasets'] = None  # what a machine without datasets sees\n"
            "try:\n"
            "    ad.shared_map([], None)\n"
            "except ImportError as exc:\n"
            "    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert 'pip install datasets (or, in a clone of axolotl_dist, pip install -e ".[datasets]")' \
        in done.stdout
    assert "the 'datasets' extra" in done.stdout


def test_empty_dataset_and_more_ranks_than_batches(tmp_path):
    def body():
        empty = ad.shared_map(_source().select([]), double, remove_columns=["t"])
        one_batch = ad.shared_map(_source(), pack, batched=True, batch_size=None,
                                  remove_columns=["a", "t"])
        return _summary(empty), _summary(one_batch)

    results = run_distributed(body, 3, env=_env(tmp_path), timeout=90)
    expected = (_summary(_source().select([]).map(double, remove_columns=["t"])),
                _summary(_source().map(pack, batched=True, batch_size=None, remove_columns=["a", "t"])))
    assert results == [expected] * 3
    assert _rows_mapped(tmp_path, 3) == [ROWS, 0, 0]  # one batch of everything: rank 0's
