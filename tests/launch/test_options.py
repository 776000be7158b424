"""Unit tests of the launcher's options (``launch/_options.py``): what ``validate`` refuses and
how, and what a node says while it waits in the rendezvous. No process is started."""

from __future__ import annotations

import re
from pathlib import Path
from typing import List

import pytest

from axolotl_dist.launch import _options


DOCS = Path(__file__).resolve().parents[2] / "docs" / "launching.md"


def test_every_option_of_the_kit_has_its_row_in_the_docs_options_table():
    # the way to add an option (docs/design/rooms.md, "Where a change goes"): the parser and
    # its check, its use, this table, a test; a row forgotten fails here
    parser = _options.build_parser()
    kit = next(g for g in parser._action_groups if g.title == "axolotl-dist's own options")
    flags = [max(a.option_strings, key=len) for a in kit._group_actions]
    table = DOCS.read_text().split("\n## Options\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    missing = [f for f in flags if not any(re.search(rf"`{re.escape(f)}\b", r) for r in rows)]
    assert flags and missing == [], f"no row in docs/launching.md's Options table for {missing}"


def options(args: List[str], tmp_path: Path) -> _options.Options:
    script = tmp_path / "t.py"
    script.write_text("")
    return _options.validate(_options.build_parser().parse_args([*args, str(script)]))


@pytest.mark.parametrize("args, said", [
    (["--nnodes", "2", "--master-addr", "10.0.0.1", "--master-port", "6000"],
     "node 0 of 2 is waiting for the other node(s) to join the rendezvous at 10.0.0.1:6000"),
    (["--nnodes", "1:2", "--rdzv-backend", "c10d"],
     "this node is waiting for the other node(s) to join the c10d rendezvous at localhost:29400 "
     "(torch's default: no --rdzv-endpoint given), run id 'none' (1 to 2 nodes: it starts once "
     "1 joined and no other joined for the rendezvous's last-call time)"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "node0", "--rdzv-id", "j7"],
     "this node is waiting for the other node(s) to join the c10d rendezvous at node0:29400, "
     "run id 'j7' (2 nodes)"),
    (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "[::1]:7"],
     "this node is waiting for the other node(s) to join the c10d rendezvous at [::1]:7, "
     "run id 'none' (2 nodes)"),
])
def test_the_rendezvous_wait_names_the_endpoint_torch_uses(args, said, tmp_path):
    assert _options.rendezvous_note(options(args, tmp_path)) == said


def test_one_node_waits_for_nobody(tmp_path):
    assert _options.rendezvous_note(options(["-n", "2"], tmp_path)) is None


@pytest.mark.parametrize("args, said", [
    (["--nnodes", "2", "--node-rank", "2"], "--node-rank 2 must be smaller than --nnodes 2"),
    (["--master-port", "70000"], "--master-port must be a TCP port in [0, 65535], got 70000"),
    (["--nnodes", "2", "--master-port", "0"], "--nnodes 2 needs a non-zero --master-port"),
    (["--monitor-interval", "0"], "--monitor-interval must be > 0 seconds, got 0"),
    (["--grace-period", "-1"], "--grace-period must be >= 0 seconds, got -1"),
    (["--local-ranks-filter", "0,x"], "--local-ranks-filter must be local ranks separated by "
                                      "commas, e.g. 0,1; got '0,x'"),
])
def test_a_bad_option_is_refused_naming_it_and_the_fix(args, said, tmp_path):
    with pytest.raises(ValueError) as caught:
        options(args, tmp_path)
    assert said in str(caught.value)
