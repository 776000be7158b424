"""The typed user snippet that `mypy` checks (README test command) is real code: it runs."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_typed_snippet_runs_as_one_process():
    pytest.importorskip("tqdm", reason="the snippet uses ad.tqdm: the hf extra (or tqdm)")
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "typing", "snippet_typed.py")],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("done 3 3 0.5 rank0-choice [0] [1.5] 0 {'steps': 10}"), proc.stdout
