"""The start-up report (``AXOLOTL_DIST_STARTUP=1``), 4 real ranks: rank 0 logs one table after
init, every phase with its median and slowest rank; a rank that starts late is named by rank 0
while the others wait, and shows as the slowest in ``imports``; under bare env vars (rank 0
hosts the store) the phases the kit cannot see apart are dashes; off, nothing is said."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from fixtures import free_port, run, start, finish, subprocess_env

SCRIPT = """
import os, time
import axolotl_dist as ad
if ad.get_rank() == int(os.environ.get("LATE_RANK", "-1")):
    time.sleep(float(os.environ["LATE_S"]))
ad.init_distributed()
ad.barrier()
"""

PHASES = ("launch", "imports", "store connect", "kit handshake", "group bootstrap",
          "kit services", "first collective", "in all")


def _launch(tmp_path: Path, **extra: str):
    (tmp_path / "s.py").write_text(SCRIPT)
    return run([sys.executable, "-m", "axolotl_dist.launch", "-n", "4", "s.py"],
               subprocess_env(tmp_path, **extra), 120, cwd=tmp_path)


def _rows(text: str):
    """The report's rows: phase -> (median, slowest, rank) (None for dashes)."""
    assert text.count("start-up of 4 ranks (AXOLOTL_DIST_STARTUP=1), seconds:") == 1, text
    assert re.search(r"\d\d:\d\d:\d\d INFO axolotl_dist: \[rank 0/4\] start-up of 4 ranks", text)
    rows = {}
    for phase in PHASES:
        m = re.search(rf"^  {phase} +(?:(\d+\.\d\d) +(\d+\.\d\d) +rank (\d) \((.+)\)|- +-)$",
                      text, re.M)
        assert m, (phase, text)
        rows[phase] = (float(m[1]), float(m[2]), int(m[3])) if m[1] else None
    return rows


def test_the_report_on_four_ranks_and_nothing_without_it(tmp_path):
    code, out, err = _launch(tmp_path, AXOLOTL_DIST_STARTUP="1")
    assert code == 0, err
    rows = _rows(err)
    assert all(rows[p] is not None for p in PHASES), rows  # axolotl-dist: every phase seen
    median, slowest, _ = rows["in all"]
    assert 0 < median <= slowest < 60, rows
    code, out, err = _launch(tmp_path)
    assert code == 0 and "start-up of" not in err, err


def test_a_rank_seven_seconds_late_is_named_while_the_others_wait(tmp_path):
    code, out, err = _launch(tmp_path, AXOLOTL_DIST_STARTUP="1", LATE_RANK="2", LATE_S="7")
    assert code == 0, err
    named = re.findall(r"\[rank 0/4\] rank 2 has not reached the store for 5 s; the other 3 wait",
                       err)
    assert len(named) == 1, err
    rows = _rows(err)
    assert rows["imports"][2] == 2 and rows["imports"][1] >= 7, rows  # the late one, slowest
    assert rows["kit handshake"][1] >= 5, rows  # the others waited for it there


def test_under_bare_env_vars_the_store_and_handshake_are_part_of_the_bootstrap(tmp_path):
    (tmp_path / "s.py").write_text(SCRIPT)
    env, port = subprocess_env(tmp_path, AXOLOTL_DIST_STARTUP="1"), free_port()
    procs = [start([sys.executable, "s.py"],
                   dict(env, RANK=str(r), WORLD_SIZE="4", LOCAL_RANK=str(r),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)), cwd=tmp_path)
             for r in range(4)]
    ends = [finish(p, 120) for p in procs]
    assert [e[0] for e in ends] == [0] * 4, [e[2][-2000:] for e in ends]
    rows = _rows(ends[0][2])
    for phase in ("launch", "store connect", "kit handshake"):
        assert rows[phase] is None, (phase, rows)
    assert rows["group bootstrap"] is not None and rows["first collective"] is not None, rows
    assert all("start-up of" not in e[2] for e in ends[1:])  # rank 0 alone says it
