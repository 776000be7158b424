"""What many test files need, in one place: a launcher-free environment for ranks and for
subprocesses, a subprocess launcher runner that leaves nothing behind, torch's fake process
group and a free loopback port.

Variable lists come from the library (:data:`axolotl_dist.env.LAUNCHER_ENV_VARS`), so a variable
the kit learns to read is cleared here too.
"""

from __future__ import annotations

import os
import re
import socket
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple, Union

import pytest

from axolotl_dist.env import LAUNCHER_ENV_VARS
from probes import kill_tree, process_state

__all__ = ["ROOT", "NO_ENV", "LAUNCHER_PREFIXES", "subprocess_env", "start", "finish", "run",
           "launch_script", "run_bare_env", "fake_group", "free_port", "alive"]

#: The checkout under test.
ROOT = Path(__file__).resolve().parents[1]
#: For ``run_distributed(env=NO_ENV)``: ranks that see no launcher variable at all.
NO_ENV: Dict[str, Optional[str]] = {name: None for name in LAUNCHER_ENV_VARS}
#: Families of launcher variables a subprocess must not inherit from whatever started pytest.
LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PET_", "TORCHELASTIC_", "ACCELERATE_")


def subprocess_env(tmp_path: Optional[Path] = None, **extra: str) -> Dict[str, str]:
    """This process's env without launcher variables, this checkout first on the path.

    With ``tmp_path``, the Hugging Face libraries run offline with every cache under it.
    """
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_ENV_VARS and not k.startswith(LAUNCHER_PREFIXES)}
    # the checkout first; what the caller's path adds (scripts/gpu_check.sh --wheels) after it
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    if tmp_path is not None:
        home = tmp_path / "hf_home"
        env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   HF_HOME=str(home), HF_DATASETS_CACHE=str(home / "datasets"),
                   XDG_CACHE_HOME=str(tmp_path / "xdg"), TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


def _default_signals() -> None:
    """In the child before exec: SIGINT and SIGTERM at their default actions, as a program
    started from a terminal has them. An ignored signal is inherited across exec, and Python
    then never raises KeyboardInterrupt: a test runner's worker that ignores SIGINT would make
    every Ctrl-C test fail for a reason outside the program."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def start(cmd: Sequence[str], env: Dict[str, str], cwd: Union[Path, str, None] = None,
          keep_cr: bool = False) -> subprocess.Popen:
    """Start ``cmd`` (a launcher) in its own session, output captured as text (``keep_cr``:
    with its carriage returns, as a terminal gets them, instead of turned into newlines)."""
    return subprocess.Popen(list(cmd), cwd=str(cwd or ROOT), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=not keep_cr, start_new_session=True,
                            preexec_fn=_default_signals)


def finish(proc: subprocess.Popen, timeout: float) -> Tuple[int, str, str]:
    """Wait for ``proc``: ``(exit code, stdout, stderr)``. Past ``timeout`` (or interrupted) its
    whole tree is killed, and a timeout fails the test with the output so far."""
    try:
        out, err = _text(*proc.communicate(timeout=timeout))
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = _text(*proc.communicate())
        pytest.fail(f"{proc.args} did not finish in {timeout}s:\n{out}\n{err[-3000:]}")
    finally:
        if proc.poll() is None:  # interrupted (Ctrl-C, pytest-timeout): leave nothing behind
            kill_tree(proc.pid)
            proc.wait()
    return proc.returncode, out, err


def _text(*outputs: Union[str, bytes, None]) -> Tuple[str, ...]:
    """Captured output as text (bytes where :func:`start` kept carriage returns)."""
    return tuple(o.decode(errors="replace") if isinstance(o, bytes) else (o or "")
                 for o in outputs)


def run(cmd: Sequence[str], env: Dict[str, str], timeout: float,
        cwd: Union[Path, str, None] = None, keep_cr: bool = False) -> Tuple[int, str, str]:
    """:func:`start` then :func:`finish`."""
    return finish(start(cmd, env, cwd, keep_cr), timeout)


def launch_script(tmp_path: Path, name: str, script: str, ranks: int,
                  timeout: float) -> Tuple[int, str, str]:
    """Write ``script`` to ``tmp_path/name`` and run it under ``axolotl-dist -n ranks`` there:
    the launcher's ``(exit code, stdout, stderr)``."""
    (tmp_path / name).write_text(script)
    return run([sys.executable, "-m", "axolotl_dist.launch", "-n", str(ranks), name],
               subprocess_env(tmp_path), timeout, cwd=tmp_path)


def run_bare_env(tmp_path: Path, name: str, script: str, ranks: int,
                 timeout: float) -> List[Tuple[int, str, str]]:
    """Write ``script`` to ``tmp_path/name`` and start it once per rank with bare env vars
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, a free ``MASTER_PORT`` on 127.0.0.1): rank 0's
    process hosts the store, as under mpirun. Each rank's ``(exit code, stdout, stderr)``."""
    (tmp_path / name).write_text(script)
    env, port = subprocess_env(tmp_path), free_port()
    procs = [start([sys.executable, name],
                   dict(env, RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)), cwd=tmp_path)
             for r in range(ranks)]
    return [finish(p, timeout) for p in procs]


_LABEL = re.compile(r"^(\r?\x1b\[2K)?\[(ranks? [\d, -]+)\](:?) ?")


def rank_tag(rank: int, launcher: str = "axolotl-dist") -> str:
    """How a rank's traceback and error lines start: ``axolotl-dist``'s label (``[rank 1] ``,
    in place of torch's), torch's excepthook prefix under any other launcher (``[rank1]: ``)."""
    return f"[rank {rank}] " if launcher == "axolotl-dist" else f"[rank{rank}]: "


def label_ranks(label: str) -> List[int]:
    """The ranks ``axolotl-dist`` names in a label: ``rank 3``, ``ranks 0-2, 5``."""
    found: List[int] = []
    for part in label.split(" ", 1)[1].split(", "):
        a, _, b = part.partition("-")
        found.extend(range(int(a), int(b or a) + 1))
    return found


def unfold(text: str, labelled: bool = False) -> str:
    """``axolotl-dist``'s folded output as every rank printed it: a line labelled with its
    ranks (``[ranks 0-2] x``) once per rank without the label (``labelled``: with the label
    of its one rank, ``[rank 0] x``), torch's tag folded (``[ranks 1, 2]: x``) back into one
    ``[rankN]: x`` per rank; other lines as they are. For tests of other things than folding
    (tests/test_output.py checks the folding)."""
    lines: List[str] = []
    for line in text.split("\n"):
        m = _LABEL.match(line)
        if m is None or (m.group(2).startswith("rank ") and (m.group(3) or labelled)):
            lines.append(line)
            continue
        rest = line[m.end():]
        for r in label_ranks(m.group(2)):
            lines.append(f"[rank{r}]: {rest}" if m.group(3) else
                         f"[rank {r}] {rest}" if labelled else rest)
    return "\n".join(lines)


def fake_group(rank: int, world_size: int) -> None:
    """Make this process ``rank`` of a ``world_size``-rank fake process group (no data moves)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (not a zombie)."""
    return process_state(pid) != "gone"


#: A warning's line as the kit logs it: time, level, logger, the rank's tag (its rank, world).
KIT_WARNING = re.compile(r"^\d\d:\d\d:\d\d WARNING axolotl_dist: \[rank (\d+)/(\d+)\] (.*)$")


def logged_output(tmp_path: Path) -> str:
    """What a run wrote to ``tmp_path``'s ``*.out``, ``*.err`` and ``out-*.txt`` files so far,
    launcher labels unfolded."""
    files = [path for pattern in ("*.out", "*.err", "out-*.txt")
             for path in sorted(tmp_path.glob(pattern))]
    return unfold("\n".join(p.read_text(errors="replace") for p in files), labelled=True)


def await_output(tmp_path: Path, pattern: str, count: int, deadline: float) -> str:
    """The run's output (:func:`logged_output`) once ``pattern`` (a regex, per line) occurs
    ``count`` times; fails past ``deadline`` (``time.monotonic()``), showing the output's end."""
    while True:
        text = logged_output(tmp_path)
        if len(re.findall(pattern, text, re.M)) >= count:
            return text
        assert time.monotonic() < deadline, text[-4000:]
        time.sleep(0.2)


def start_logged(launcher: str, tmp_path: Path, script: List[str], ws: int, port: int,
                 env: Dict[str, str]) -> List[subprocess.Popen]:
    """``script`` (its path and arguments) on ``ws`` ranks under ``launcher`` (``axolotl-dist``,
    ``torchrun``, or ``env``: bare env vars, rank 0 hosting the store), each process's stdout and
    stderr to files of ``tmp_path`` (:func:`logged_output` reads them while it runs)."""
    runs = {"axolotl-dist": [("launch", [sys.executable, "-m", "axolotl_dist.launch", "-n",
                                         str(ws), "--master-port", str(port)], env)],
            "torchrun": [("launch", [sys.executable, "-m", "torch.distributed.run",
                                     "--nproc-per-node", str(ws), "--master-addr", "127.0.0.1",
                                     "--master-port", str(port)], env)],
            "env": [(f"rank{r}", [sys.executable],
                     dict(env, RANK=str(r), WORLD_SIZE=str(ws), LOCAL_RANK=str(r),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))) for r in range(ws)]
            }[launcher]
    procs = []
    for name, cmd, penv in runs:
        with open(tmp_path / f"{name}.out", "w") as out, open(tmp_path / f"{name}.err", "w") as err:
            procs.append(subprocess.Popen(cmd + script, cwd=tmp_path, env=penv, stdout=out,
                                          stderr=err, start_new_session=True))
    return procs
