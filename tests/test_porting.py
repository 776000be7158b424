"""accelerate's distributed names in the kit (docs/porting.md): the same results as accelerate's
own for the same inputs, run side by side on real gloo ranks (1, 2 and 3), the duplicates a
sampler pads in dropped by ``gather_for_metrics``, and clear errors for bad input. The failure
paths of every helper (a rank raising, killed or gone, both store placements) are in
``tests/test_faults.py`` through ``tests/fault_matrix.py``."""

import collections
import random

import pytest
import torch

import axolotl_dist as ad
from axolotl_dist.testing import run_distributed, run_distributed_outcomes

Pair = collections.namedtuple("Pair", "logits labels")


def _same(a, b):
    """Equal structure, types, dtypes, shapes and bits."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a, b))
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (type(a) is type(b) and len(a) == len(b)
                and all(_same(x, y) for x, y in zip(a, b)))
    return a == b


def _inputs(rank):
    """Rank ``rank``'s random inputs of :func:`_side_by_side`: its floats and float64 extras."""
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(4, 3, generator=gen), torch.randn(2, generator=gen, dtype=torch.float64)


def _in_rank_order(ws, reduction, pick):
    """``pick`` of every rank's inputs summed in rank order (a mean: then divided by ``ws``):
    what the kit's sum of small tensors gives (they come with the shape check's headers and
    are added up on each rank; gloo's ring adds 3 or more ranks' floats in another order)."""
    parts = [pick(*_inputs(r)) for r in range(ws)]
    total = parts[0].clone()
    for part in parts[1:]:
        total += part
    return total / ws if reduction == "mean" else total


def _side_by_side():
    """Every rank: the kit's helpers and accelerate's on the same rank-dependent inputs;
    returns {case: (same?, kit's result as a list)}. A float sum at 3 ranks or more is
    compared with the sum in rank order (:func:`_in_rank_order`), not with gloo's."""
    from accelerate import PartialState
    from accelerate.utils import gather as a_gather
    from accelerate.utils import gather_object as a_gather_object
    from accelerate.utils import pad_across_processes as a_pad
    from accelerate.utils import reduce as a_reduce
    from accelerate.utils import set_seed as a_set_seed

    from accelerate import Accelerator

    Accelerator(cpu=True)  # accelerate's state over the kit's group (set_seed needs it)
    rank, ws = ad.get_rank(), ad.get_world_size()
    floats, extra = _inputs(rank)  # arbitrary bits: a sum's rounding shows
    nested = {"pair": Pair(floats, torch.arange(4) + 10 * rank),
              "extra": [extra, torch.tensor(rank)]}
    ragged = torch.full((rank + 1, 2 + rank), float(rank))
    out = {}

    def case(name, kit, acc):
        out[name] = (_same(kit, acc), kit)

    case("gather tensor", ad.gather(floats), a_gather(floats))
    case("gather nested", ad.gather(nested), a_gather(nested))
    case("gather bf16", ad.gather(floats.bfloat16()), a_gather(floats.bfloat16()))
    case("gather_object", ad.gather_object([{"r": rank}, f"s{rank}"]),
         a_gather_object([{"r": rank}, f"s{rank}"]))
    for reduction in ("sum", "mean", "max"):
        pair = Pair(floats, nested["extra"][0])
        expected = a_reduce(pair, reduction) if ws < 3 or reduction == "max" else Pair(
            _in_rank_order(ws, reduction, lambda f, e: f),
            _in_rank_order(ws, reduction, lambda f, e: e))
        case(f"reduce {reduction}", ad.reduce(pair, reduction), expected)
    case("reduce default", ad.reduce(floats), a_reduce(floats) if ws < 3 else
         _in_rank_order(ws, "mean", lambda f, e: f))
    for kw in ({}, {"dim": 1}, {"dim": -1, "pad_index": -7, "pad_first": True},
               {"dim": 1, "pad_first": True}):
        case(f"pad {kw}", ad.pad_across_processes({"x": ragged, "l": torch.arange(rank + 1)}, **kw),
             a_pad({"x": ragged, "l": torch.arange(rank + 1)}, **kw))
    for kw in ({}, {"device_specific": True}):
        ad.set_seed(1234, **kw)
        kit = (random.random(), torch.rand(3), torch.get_rng_state())
        a_set_seed(1234, **kw)
        acc = (random.random(), torch.rand(3), torch.get_rng_state())
        case(f"set_seed {kw}", kit, acc)
    state, theirs = ad.PartialState(cpu=True), PartialState()
    names = ("process_index", "local_process_index", "num_processes", "is_main_process",
             "is_local_main_process", "is_last_process", "use_distributed")
    case("PartialState", [getattr(state, n) for n in names] + [state.device.type],
         [getattr(theirs, n) for n in names] + [theirs.device.type])  # theirs: cpu:0, ours: cpu
    return {k: (same, repr(v)) for k, (same, v) in out.items()}


@pytest.mark.parametrize("ws", [2, 3])
def test_every_helper_gives_what_accelerates_gives(ws):
    for rank, cases in enumerate(run_distributed(_side_by_side, ws, timeout=90)):
        differ = {k: v for k, (same, v) in cases.items() if not same}
        assert not differ, (rank, differ)
        assert len(cases) == 15


def _kit_results():
    rank = ad.get_rank()
    x = torch.arange(2.0) + 10 * rank
    return {
        "gather": ad.gather({"x": x, "s": torch.tensor(rank)}),
        "gather uneven": ad.gather(torch.arange(rank + 1)),
        "gather_object": ad.gather_object([rank, {"k": rank}]) + ad.gather_object("whole"),
        "reduce": ad.reduce(x, "sum"), "mean": ad.reduce(x), "min": ad.reduce(x, "min"),
        "pad": ad.pad_across_processes(torch.ones(rank + 1, 2), pad_index=5),
        "pad first dim 1": ad.pad_across_processes(torch.ones(2, rank + 1), 1, 0, True),
        "last": (ad.is_last_process(), ad.PartialState().is_last_process),
        "wait": ad.wait_for_everyone(),
    }


@pytest.mark.parametrize("init", [True, False], ids=["group", "no-group"])
def test_one_process_gives_the_multi_rank_shape(init):
    got = run_distributed(_kit_results, 1, init=init)[0]
    assert _same(got["gather"], {"x": torch.tensor([0.0, 1.0]), "s": torch.tensor([0])})
    assert _same(got["gather_object"], [0, {"k": 0}, "whole"])
    assert _same(got["mean"], torch.tensor([0.0, 1.0]))
    assert _same(got["pad"], torch.ones(1, 2))
    assert got["last"] == (True, True) and got["wait"] is None


@pytest.mark.parametrize("ws", [2, 3])
def test_uneven_rows_objects_and_reductions_on_several_ranks(ws):
    for rank, got in enumerate(run_distributed(_kit_results, ws)):
        rows = [torch.arange(2.0) + 10 * r for r in range(ws)]
        assert _same(got["gather"], {"x": torch.cat(rows), "s": torch.arange(ws)})
        assert _same(got["gather uneven"], torch.cat([torch.arange(r + 1) for r in range(ws)]))
        assert got["gather_object"] == [v for r in range(ws) for v in (r, {"k": r})] + ["whole"] * ws
        assert _same(got["reduce"], sum(rows))
        assert _same(got["mean"], sum(rows) / ws)
        assert _same(got["min"], rows[0])
        assert got["pad"].shape == (ws, 2) and got["pad"][rank + 1:].eq(5).all()
        assert got["pad first dim 1"].shape == (2, ws)
        assert got["pad first dim 1"][:, ws - rank - 1:].eq(1).all()
        assert got["last"] == (rank == ws - 1,) * 2


# ---- gather_for_metrics -------------------------------------------------------------------

def _eval_pass(n, source, batch, objects=False, split=False, drop_last=False):
    """One evaluation pass over ``n`` rows: each rank predicts its rows (the prediction of row
    i is i), gathered per batch; returns the gathered predictions."""
    from torch.utils.data import DataLoader

    rows = list(range(n))
    if split:
        with ad.split_between_processes(rows, apply_padding=True) as mine:
            batches = [mine[i:i + batch] for i in range(0, len(mine), batch)]
    else:
        sampler = ad.get_sampler(rows, drop_last=drop_last)
        loader = DataLoader(rows, batch_size=batch, sampler=sampler)
        batches = [b.tolist() for b in loader]
    src = {"loader": loader if not split else None, "sampler": None if split else sampler,
           "dataset": rows, "length": n}[source]
    got = []
    for b in batches:
        preds = [f"row{i}" for i in b] if objects else torch.tensor(b) * 1.0
        part = ad.gather_for_metrics(preds, src)
        got += part if objects else part.long().tolist()
    return got


def _metrics_cases():
    out = {}
    for n in (9, 1, 12):
        for source in ("loader", "sampler", "dataset", "length"):
            out[(n, source)] = _eval_pass(n, source, batch=2)
        out[(n, "objects")] = _eval_pass(n, "loader", batch=2, objects=True)
        out[(n, "split")] = _eval_pass(n, "length", batch=3, split=True)
        out[(n, "one call")] = _eval_pass(n, "length", batch=100)
        out[(n, "drop_last")] = _eval_pass(n, "sampler", batch=2, drop_last=True)
        out[(n, "twice")] = _eval_pass(n, "length", batch=1) + ["|"] + _eval_pass(n, "length", 1)
    return out


@pytest.mark.parametrize("ws", [1, 2, 3])
def test_gather_for_metrics_counts_every_row_once(ws):
    for got in run_distributed(_metrics_cases, ws, timeout=90):
        for n in (9, 1, 12):
            for source in ("loader", "sampler", "dataset", "length", "split", "one call"):
                assert sorted(got[(n, source)]) == list(range(n)), (n, source, got[(n, source)])
            assert sorted(got[(n, "objects")]) == sorted(f"row{i}" for i in range(n))
            kept = n - n % ws
            assert sorted(got[(n, "drop_last")]) == list(range(kept)), got[(n, "drop_last")]
            twice = got[(n, "twice")]
            assert sorted(twice[:n]) == sorted(twice[n + 1:]) == list(range(n))


def test_nine_rows_on_two_ranks_exactly_nine_predictions_where_all_gather_counts_ten():
    """The issue's case: get_sampler over 9 rows on 2 ranks; all_gather per batch counts the
    padding row again, gather_for_metrics does not, and the metric comes out exact."""
    def body():
        from torch.utils.data import DataLoader

        labels = torch.tensor([i % 3 for i in range(9)])
        loader = DataLoader(list(range(9)), batch_size=4, sampler=ad.get_sampler(range(9)))
        naive, kept, right = [], [], 0
        for idx in loader:
            preds = labels[idx]  # a perfect model
            naive += torch.cat(ad.all_gather(idx)).tolist()
            gathered = ad.gather_for_metrics((preds, labels[idx]), loader)
            kept += gathered[0].tolist()
            right += int((gathered[0] == gathered[1]).sum())
        return naive, len(kept), right

    for naive, count, right in run_distributed(body, 2):
        assert sorted(naive) == [0, 0, 1, 2, 3, 4, 5, 6, 7, 8]
        assert (count, right) == (9, 9)


def test_accelerates_gather_for_metrics_and_the_kits_keep_the_same_rows():
    """accelerate's, with its prepared loader, next to the kit's, with get_sampler: the same
    multiset of predictions (accelerate orders by its own sharding, the kit by rank)."""
    def body():
        from accelerate import Accelerator
        from torch.utils.data import DataLoader

        acc = Accelerator(cpu=True)
        theirs = []
        for batch in acc.prepare(DataLoader(list(range(9)), batch_size=2)):
            theirs += acc.gather_for_metrics(batch).tolist()
        loader = DataLoader(list(range(9)), batch_size=2, sampler=ad.get_sampler(range(9)))
        ours = [x for b in loader for x in ad.gather_for_metrics(b, loader).tolist()]
        return sorted(theirs), sorted(ours)

    for ws in (2, 3):
        for theirs, ours in run_distributed(body, ws, timeout=90):
            assert theirs == ours == list(range(9))


# ---- errors that say what to fix ----------------------------------------------------------

def _errors():
    rank = ad.get_rank()
    cases = {
        "trailing dims": lambda: ad.gather({"logits": torch.zeros(2, 3 + rank)}),
        "dtypes": lambda: ad.gather(torch.zeros(2, dtype=torch.float32 if rank else torch.int64)),
        "structure": lambda: ad.gather([torch.zeros(1)] * (rank + 1)),
        "not a tensor": lambda: ad.gather({"a": [torch.zeros(1), "text"]}),
        "mean of ints": lambda: ad.reduce(torch.arange(3)),
        "reduction": lambda: ad.reduce(torch.ones(1), "none"),
        "scale": lambda: ad.reduce(torch.ones(1), "sum", 2.0),
        "pad structure": lambda: ad.pad_across_processes(torch.zeros([2] * (rank + 1)), dim=1),
        "unsharded": lambda: ad.gather_for_metrics(torch.arange(9), 9),
        "source": lambda: ad.gather_for_metrics(torch.arange(2), "nine"),
        "no source": lambda: ad.gather_for_metrics(torch.arange(2)),
        "rows differ": lambda: ad.gather_for_metrics((torch.arange(2), torch.arange(3)), 8),
        "objects": lambda: ad.gather_for_metrics({"a": "b"}, 4),
        "replicas": lambda: ad.gather_for_metrics(torch.arange(1), ad.get_sampler(
            range(4), num_replicas=4, rank=0)),
        "seed": lambda: ad.set_seed(-1),
        "seed type": lambda: ad.set_seed("1"),
        "state kwargs": lambda: ad.PartialState(mixed_precision="fp16"),
    }
    out = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = "returned"
        except (ValueError, TypeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    out["after"] = ad.gather(torch.tensor([rank])).tolist()  # still in step
    return out


EXPECTED = {
    "trailing dims": "TensorMismatchError: gather: data['logits'] differs across ranks: "
                     "float32[2, 3] on rank 0; float32[2, 4] on rank 1: tensors are joined on "
                     "dim 0, so every other dim must agree: pad_across_processes(data, dim=...) "
                     "first",
    "dtypes": "gather: data differs across ranks: int64[2] on rank 0; float32[2] on rank 1",
    "structure": "gather: the ranks passed different numbers of tensors: 1 tensor(s) on rank 0; "
                 "2 tensor(s) on rank 1",
    "not a tensor": "TypeError: gather: data['a'][1] is a str, not a tensor",
    "mean of ints": "reduce(reduction='mean'): data is torch.int64, and a mean of integers is "
                    "not one: cast it to a float dtype first, or pass reduction='sum'",
    "reduction": "reduce(reduction='none'): pass one of ['max', 'mean', 'min', 'sum']",
    "scale": "only accelerate's XLA path applies scale",
    "pad structure": "pad_across_processes: data differs across ranks: float32[2] on rank 0; "
                     "float32[2, 2] on rank 1: every rank must pass the same structure, with the "
                     "same number of dims in each tensor (padded on dim 1)",
    "unsharded": "gather_for_metrics: rank 0 has sent 9 rows in this pass, but 9 samples over "
                 "2 ranks give each rank at most 5: shard the evaluation data with "
                 "get_sampler(dataset)",
    "no source": "TypeError: gather_for_metrics(input_data) needs data_source=: accelerate's "
                 "reads the loader Accelerator.prepare wrapped; pass the evaluation DataLoader",
    "source": "TypeError: gather_for_metrics(data_source='nine'): pass the evaluation "
              "DataLoader, its DistributedSampler, the dataset, or its number of samples",
    "rows differ": "rank 0's tensors have different numbers of rows (data[0]: 2, data[1]: 3)",
    "objects": "TypeError: gather_for_metrics: objects go as a list",
    "replicas": "the sampler splits over num_replicas=4 ranks but this group has 2",
    "seed": "set_seed: seed -1 is outside [0, 2**32)",
    "seed type": "TypeError: set_seed(seed='1') needs an int",
    "state kwargs": "TypeError: PartialState() got ['mixed_precision']",
}


@pytest.mark.parametrize("store", ["parent", "rank0"])
def test_bad_input_says_what_to_fix_on_every_rank(store):
    outcomes = run_distributed_outcomes(_errors, 2, store=store, timeout=60)
    for o in outcomes:
        assert o.ok, o.describe()
        got = o.value
        assert got["after"] == [0, 1]
        for name, text in EXPECTED.items():
            assert text in got[name], (o.rank, name, got[name])  # the same account on each


def _big_gathers():
    """Structures of more than a MiB a rank (the kit then moves each rank's rows straight
    into the result, issue #74): uneven first dims, a rank with no rows, two dtypes, twice (the
    second call after the helper's slot was learnt), and gather_for_metrics dropping the rows
    the sampler repeated."""
    rank, ws = ad.get_rank(), ad.get_world_size()
    rows = {0: 3000, 1: 0, 2: 4100}[rank]
    data = {"x": torch.arange(rows * 128, dtype=torch.float32).reshape(rows, 128) + rank,
            "ids": torch.full((rows, 2), rank, dtype=torch.int64)}
    first, second = ad.gather(data), ad.gather(data)
    n = 2 * 2500 - 1  # 2 ranks: 2500 rows each, the sampler repeats one
    mine = torch.arange(2500 * 128, dtype=torch.float64).reshape(2500, 128) + 1e6 * rank
    metrics = ad.gather_for_metrics(mine, n) if ws == 2 else None
    return ([{k: v.tolist() for k, v in first.items()}, {k: v.tolist() for k, v in
                                                          second.items()}],
            None if metrics is None else (list(metrics.shape), metrics[:, 0].tolist()))


@pytest.mark.parametrize("ws", [2, 3])
def test_a_big_gather_gives_every_rank_the_rows_in_rank_order(ws):
    results = run_distributed(_big_gathers, ws, timeout=120)
    # the expected rows in plain Python: a big torch op here would start torch's thread pool
    # in this process, and a rank forked after that hangs in its first parallel op
    rows = [3000, 0, 4100][:ws]
    x = [[float(i * 128 + j + r) for j in range(128)] for r, n in enumerate(rows)
         for i in range(n)]
    ids = [[r, r] for r, n in enumerate(rows) for _ in range(n)]
    for gathered, metrics in results:
        for one in gathered:
            assert one["x"] == x and one["ids"] == ids
        if ws == 2:
            shape, firsts = metrics
            assert shape == [4999, 128], shape  # 5000 rows sent, the repeated one dropped
            assert firsts[:2500] == [128.0 * i for i in range(2500)]
            assert firsts[2500:] == [1e6 + 128.0 * i for i in range(2499)]
