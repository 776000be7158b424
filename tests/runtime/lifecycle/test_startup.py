"""Unit tests of the start-up report's arithmetic (``_runtime/lifecycle/startup.py``): phases
as differences of one process's stamps, a phase a rank did not go through left out, and the
table's median and slowest rank with its host. No process group."""

from __future__ import annotations

import math

from axolotl_dist._runtime.lifecycle import startup
from axolotl_dist._runtime.lifecycle.lifecycle_state import LIFECYCLE


def test_phases_are_differences_of_the_stamps_and_a_skipped_one_is_nan(monkeypatch):
    monkeypatch.setattr(LIFECYCLE, "startup", {"launcher": 100.0, "process": 101.5, "init": 104.0,
                                               "bootstrap": 104.5, "services": 104.6,
                                               "collective": 104.65})
    got = startup.durations()
    names = [name for _, name in startup.PHASES]
    by_name = dict(zip(names, got))
    assert by_name["launch"] == 1.5 and by_name["imports"] == 2.5
    assert math.isnan(by_name["store connect"]) and math.isnan(by_name["kit handshake"])
    assert math.isclose(by_name["group bootstrap"], 0.5)  # from init: no store phase between
    assert math.isclose(by_name["first collective"], 0.05)


def test_the_table_names_the_median_and_the_slowest_rank_with_its_host():
    nan = float("nan")
    ranks = [("node-a", [1.0, 3.0, 0.1, 0.2, 0.5, 0.0, 0.01]),
             ("node-a", [1.0, 3.2, 0.1, 0.2, 0.5, 0.0, 0.01]),
             ("node-b", [nan, 9.0, 0.1, 0.2, 0.5, 0.0, 0.01])]
    text = startup.table(ranks)
    lines = text.splitlines()
    assert lines[0] == "start-up of 3 ranks (AXOLOTL_DIST_STARTUP=1), seconds:"
    launch = next(line for line in lines if line.strip().startswith("launch"))
    assert launch.split()[1:] == ["1.00", "1.00", "rank", "1", "(node-a)"], launch
    imports = next(line for line in lines if line.strip().startswith("imports"))
    assert imports.split()[1:] == ["3.20", "9.00", "rank", "2", "(node-b)"], imports
    total = next(line for line in lines if line.strip().startswith("in all"))
    assert total.split()[2:] == ["5.01", "9.81", "rank", "2", "(node-b)"], total


def test_a_phase_no_rank_went_through_shows_a_dash():
    nan = float("nan")
    text = startup.table([("h", [nan, 1.0, nan, nan, 0.2, 0.0, 0.01])])
    store = next(line for line in text.splitlines() if "store connect" in line)
    assert store.split()[2:] == ["-", "-"], store
