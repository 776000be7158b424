"""The examples on the real stack and through the launchers users run, with 2 real processes.

``examples/hf_finetune.py`` (Hugging Face datasets, tokenizers, transformers) through
``accelerate launch`` with two CPU processes: the loss goes down, and rank 1 loads rank 0's
``datasets`` cache file instead of calling the map function; ``examples/finetune.py`` through
it too. (``tests/test_launch.py`` runs ``examples/finetune.py`` through ``axolotl-dist -n 2``;
one launch per example and launcher keeps the suite short: each costs seconds of imports.)
Needs the ``hf`` extra; each launch is bounded by a timeout, every cache lives under the
test's ``tmp_path``, and nothing touches the network.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import List, Tuple

import pytest

from fixtures import free_port, run, subprocess_env

for _module in ("datasets", "tokenizers", "transformers", "accelerate"):
    pytest.importorskip(_module, reason="needs the hf extra: pip install -e '.[hf]'")

LAUNCH_TIMEOUT = 150  # below pytest-timeout's 180 s, so a stuck launch is reported with its output


def _run(cmd: List[str], tmp_path: Path) -> Tuple[int, str, str]:
    return run(cmd, subprocess_env(tmp_path), LAUNCH_TIMEOUT)


def _losses(out: str) -> List[float]:
    return [float(m) for m in re.findall(r"^step \d+ loss=([0-9.]+)$", out, re.MULTILINE)]


def _accelerate_launch(script: str, *args: str) -> List[str]:
    """``accelerate launch`` with no config file: the flags that start 2 CPU processes.

    ``--multi_gpu`` makes it start ``--num_processes`` processes through torchrun even without
    a GPU (``--cpu`` would silently start one); the other flags are the values it would
    otherwise read from a config file (and warn about).
    """
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), script, *args]


def test_hf_example_through_accelerate_launch_rank1_loads_rank0s_datasets_cache(
        tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    code, out, err = _run(_accelerate_launch("examples/hf_finetune.py", "--output-dir",
                                             str(out_dir)), tmp_path)
    assert code == 0, err[-3000:]

    maps = dict((int(r), (int(n), f)) for r, n, f in
                re.findall(r"^rank (\d) map calls=(\d+) cache=(\S+)$", out, re.MULTILINE))
    assert set(maps) == {0, 1}, out  # two processes, each reporting its map calls
    assert maps[0][0] >= 1, "rank 0 must run the tokenize function"
    assert maps[1][0] == 0, "rank 1 must load rank 0's cache file instead of calling the map function"
    assert maps[0][1] == maps[1][1] and maps[0][1].startswith("cache-")
    (cache_file,) = list(out_dir.glob(f"data_*/raw/{maps[0][1]}"))  # datasets' file, on disk
    assert cache_file.stat().st_size > 0

    losses = _losses(out)
    assert len(losses) == 5 and out.count("step 1 loss=") == 1, out  # main process only
    assert losses[-1] < losses[0] * 0.6, losses
    assert "done: ranks=2 steps=40 tokens=20480 " in out  # 2 ranks x 40 steps x 8 x 32, agreed
    assert err.count("INFO hf_finetune: [rank 0/2] wrote 1200 lines") == 1, err[-3000:]
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (out_dir / "checkpoints" / "step-40" / name).is_file(), name
    assert not (tmp_path / "hf_home" / "hub").exists()  # nothing fetched from the hub


def test_finetune_example_through_accelerate_launch_on_two_cpu_processes(tmp_path: Path) -> None:
    code, out, err = _run(_accelerate_launch("examples/finetune.py", "--output-dir",
                                             str(tmp_path / "out")), tmp_path)
    assert code == 0, err[-3000:]
    assert re.search(r"^done: ranks=2 steps=\d+ tokens=\d+ ", out, re.MULTILINE), out  # 2 processes
    losses = _losses(out)
    assert len(losses) >= 4 and losses[-1] < losses[0], losses
