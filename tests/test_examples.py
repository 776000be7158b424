"""The examples run as one process and on 2 ranks, and the ranks agree."""

import os
import re
import subprocess
import sys

import pytest

from fixtures import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "preprocess_dataset.py")


#: Every example runs without a warning: ``python -W error`` for every process of the run.
NO_WARNINGS = {"PYTHONWARNINGS": "error"}


def _run(cmd, tmp_path):
    env = subprocess_env(**NO_WARNINGS)
    proc = subprocess.run(cmd + [SCRIPT, "--cache-dir", str(tmp_path)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_preprocess_example_single_process(tmp_path):
    out = _run([sys.executable], tmp_path)
    totals = re.findall(r"rank 0 local_tokens=(\d+) total_tokens=(\d+)", out)
    assert totals and totals[0][0] == totals[0][1]
    assert "rank 0 tokenized 200 samples" in out


def test_preprocess_example_two_ranks_through_launcher(tmp_path):
    out = _run([sys.executable, "-m", "axolotl_dist.launch", "-n", "2"], tmp_path)
    rows = dict((int(r), (int(l), int(t))) for r, l, t in
                re.findall(r"rank (\d) local_tokens=(\d+) total_tokens=(\d+)", out))
    assert set(rows) == {0, 1}
    assert rows[0][1] == rows[1][1] == rows[0][0] + rows[1][0]  # agreed, exact total
    assert out.count("tokenized 200 samples") == 1  # only rank 0 tokenized and logged


DEBUG_SCRIPT = os.path.join(ROOT, "examples", "debug_mismatch.py")


def test_debug_example_names_both_calls_through_the_launcher():
    env = subprocess_env(AXOLOTL_DIST_DEBUG="1", **NO_WARNINGS)
    launch = [sys.executable, "-m", "axolotl_dist.launch", "-n", "2", DEBUG_SCRIPT]
    proc = subprocess.run(launch, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "CollectiveMismatchError: debug mode: mismatched call #1" in proc.stderr
    assert "rank 0: compute_and_broadcast(src=0)" in proc.stderr
    assert "rank 1: gather_from_all_ranks(dst=0)" in proc.stderr
    assert re.search(r"debug_mismatch\.py:\d+ in evaluate: best = ad\.compute_and_broadcast", proc.stderr)
    fixed = subprocess.run(launch + ["--fixed"], env=env, cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert fixed.returncode == 0, fixed.stderr[-3000:]
    assert "best=0.5 losses=[1.0, 0.5]" in fixed.stdout


SHARED_MAP_SCRIPT = os.path.join(ROOT, "examples", "shared_map.py")


def test_shared_map_example_on_two_ranks_matches_one_process(tmp_path):
    pytest.importorskip("datasets", reason="needs the datasets extra")
    env = subprocess_env(HF_DATASETS_OFFLINE="1", **NO_WARNINGS)
    found = {}
    for name, launch in [("one", [sys.executable]),
                         ("two", [sys.executable, "-m", "axolotl_dist.launch", "-n", "2"])]:
        proc = subprocess.run(launch + [SHARED_MAP_SCRIPT, "--cache-dir", str(tmp_path / name),
                                        "--samples", "300"],
                              env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        found[name] = re.findall(r"rank (\d): rows=(\d+) tokens=(\d+) fingerprint=(\w+)", proc.stdout)
    [(_, rows, tokens, fingerprint)] = found["one"]
    assert rows == "300"
    assert sorted(found["two"]) == [("0", rows, tokens, fingerprint), ("1", rows, tokens, fingerprint)]
    parts = sorted(p.name for p in (tmp_path / "two" / "raw_300").glob("cache-*"))
    assert parts == [f"cache-{fingerprint}-part0000{i}of00002.{ext}" for i in (0, 1)
                     for ext in ("arrow", "done")]


#: A progress bar's text (``desc: 40%|####  | 4/10 [00:01<00:02, ...]``).
_BAR = re.compile(r"\|[^|\n]*\| *\d+/\d+ \[[^\]\n]*\]")


def glued_to_a_bar(output: str) -> list:
    """Lines of a terminal's worth of output (stdout and stderr in one stream) where text was
    written onto a progress bar instead of on a line of its own."""
    glued = []
    for line in output.split("\n"):
        for segment in line.split("\r"):
            for match in _BAR.finditer(segment):
                if segment[match.end():].strip():
                    glued.append(segment)
    return glued


def test_the_bar_check_sees_a_line_glued_onto_a_bar():
    assert glued_to_a_bar("train:  25%|##  | 10/40 [00:00<00:00, 47.27it/s, loss=3.9]step 10 x\n")
    assert not glued_to_a_bar("train:  25%|##  | 10/40 [00:00<00:00, 47.27it/s]\r    \rstep 10\n")


@pytest.mark.parametrize("example", ["quickstart.py", "hf_finetune.py"])
def test_examples_run_under_the_launcher_without_warnings_or_lines_glued_to_bars(tmp_path, example):
    """The examples no other test launches through ``axolotl-dist -n 2`` (those tests set
    ``PYTHONWARNINGS=error`` too), with stdout and stderr in one stream as a terminal shows
    them."""
    if example == "hf_finetune.py":
        for module in ("datasets", "tokenizers", "transformers"):
            pytest.importorskip(module, reason="needs the hf extra")
    env = subprocess_env(tmp_path, **NO_WARNINGS)
    proc = subprocess.run([sys.executable, "-m", "axolotl_dist.launch", "-n", "2",
                           os.path.join(ROOT, "examples", example), "--output-dir",
                           str(tmp_path / "out")] if example == "hf_finetune.py" else
                          [sys.executable, "-m", "axolotl_dist.launch", "-n", "2",
                           os.path.join(ROOT, "examples", example)],
                          env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "Warning" not in proc.stdout, proc.stdout[-3000:]
    assert glued_to_a_bar(proc.stdout) == [], proc.stdout[-3000:]
    if example == "hf_finetune.py":
        assert "step 40 loss=" in proc.stdout and "train: 100%" in proc.stdout


EVALUATE_SCRIPT = os.path.join(ROOT, "examples", "evaluate.py")


def test_evaluation_example_on_2_and_3_ranks_reports_what_one_process_does(tmp_path):
    """10 uneven evaluation rows: gather_for_metrics counts each once, so the metric (and a
    loss sum independent of row order) is the same on 1, 2 and 3 ranks."""
    env = subprocess_env(tmp_path, **NO_WARNINGS)
    seen = {}
    for ranks in (1, 2, 3):
        launch = [sys.executable] if ranks == 1 else [
            sys.executable, "-m", "axolotl_dist.launch", "-n", str(ranks)]
        proc = subprocess.run(launch + [EVALUATE_SCRIPT], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        [(shown, metrics)] = re.findall(r"ranks=(\d) (rows=.*)", proc.stdout)
        assert shown == str(ranks)
        seen[ranks] = metrics
    assert seen[1].startswith("rows=10 correct=")
    assert seen[1] == seen[2] == seen[3], seen
