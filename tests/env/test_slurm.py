"""Unit tests of SLURM's compressed host lists and task counts (``axolotl_dist/env/slurm.py``):
what ``SLURM_NODELIST`` and ``SLURM_TASKS_PER_NODE`` expand to, the ``MASTER_PORT`` a job step
agrees on, and the ``DistributedEnvError`` naming the variable that malformed input raises.
No ``scontrol``, no process."""

from __future__ import annotations

import re

import pytest

from axolotl_dist.env.slurm import (default_master_port, expand_nodelist,
                                              expand_tasks_per_node, first_host)
from axolotl_dist.errors import DistributedEnvError


@pytest.mark.parametrize("text, hosts", [
    ("gpu5", ["gpu5"]),
    ("a,b,c", ["a", "b", "c"]),
    (" a , b ", ["a", "b"]),
    ("node-1.cluster", ["node-1.cluster"]),
    ("n[5]", ["n5"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("node[001-003]", ["node001", "node002", "node003"]),
    ("n[08-11]", ["n08", "n09", "n10", "n11"]),
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),
    ("n[9-11]", ["n9", "n10", "n11"]),
    ("n[0-2]", ["n0", "n1", "n2"]),
    ("n[1-2,5]", ["n1", "n2", "n5"]),
    ("n[1, 3-4]", ["n1", "n3", "n4"]),
    ("node[01-04,07],gpu5", ["node01", "node02", "node03", "node04", "node07", "gpu5"]),
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
    ("r[1-2]-ib", ["r1-ib", "r2-ib"]),
    ("a[1-2],b[3,5],c", ["a1", "a2", "b3", "b5", "c"]),
])
def test_a_host_list_expands_in_order_keeping_zero_padding(text, hosts):
    assert expand_nodelist(text) == hosts


def test_commas_inside_brackets_do_not_split_hosts():
    assert expand_nodelist("x[1,2],y") == ["x1", "x2", "y"]
    assert len(expand_nodelist("x[1,2,3,4]")) == 4


def test_first_host_is_where_task_0_of_a_block_layout_runs():
    assert first_host("node[07-09],gpu1") == "node07"
    assert first_host("gpu1,node[07-09]") == "gpu1"
    assert first_host("r[2-3]n[10-11]") == "r2n10"


@pytest.mark.parametrize("text, why", [
    ("", " is empty: expected host names such as node[01-04]"),
    ("   ", " is empty"),
    ("n[[1]]", "='n[[1]]' has nested brackets"),
    ("n]1", "='n]1' has an unmatched ']'"),
    ("n[1-2]]", "='n[1-2]]' has an unmatched ']'"),
    ("n[1-2", "='n[1-2' has an unclosed '['"),
    ("a,,b", "='a,,b' has an empty entry (stray comma)"),
    ("a,", "='a,' has an empty entry (stray comma)"),
    ("n[a-b]", "='n[a-b]': 'a-b' in brackets is not a number or a range like 01-04"),
    ("n[]", "='n[]': '' in brackets is not a number"),
    ("n[1,,2]", "='n[1,,2]': '' in brackets is not a number"),
    ("n[5-3]", "='n[5-3]': the range '5-3' runs backwards"),
])
def test_a_malformed_host_list_raises_naming_the_variable_and_the_fault(text, why):
    with pytest.raises(DistributedEnvError, match="^" + re.escape("MY_NODES" + why)):
        expand_nodelist(text, name="MY_NODES")


def test_the_default_variable_name_is_slurm_nodelist():
    with pytest.raises(DistributedEnvError, match=re.escape("SLURM_NODELIST='n[2-1]': ")):
        expand_nodelist("n[2-1]")
    with pytest.raises(DistributedEnvError, match=re.escape("SLURM_NODELIST='n[' has an")):
        first_host("n[")


@pytest.mark.parametrize("text, counts", [
    ("4", [4]),
    (" 8 ", [8]),
    ("4(x2),1", [4, 4, 1]),
    ("2(x3),1", [2, 2, 2, 1]),
    ("1,2(x2), 3", [1, 2, 2, 3]),
    ("16(x1)", [16]),
])
def test_tasks_per_node_expand_to_one_count_per_node(text, counts):
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text, why", [
    ("", "='': '' is not a task count like 4 or 4(x2)"),
    ("four", "='four': 'four' is not a task count like 4 or 4(x2)"),
    ("4(x2", "='4(x2': '4(x2' is not a task count"),
    ("4(2)", "='4(2)': '4(2)' is not a task count"),
    ("2 (x3)", "='2 (x3)': '2 (x3)' is not a task count"),
    ("-1", "='-1': '-1' is not a task count"),
    ("0", "='0': every node needs at least one task"),
    ("2,0(x3)", "='2,0(x3)': every node needs at least one task"),
    ("2(x0)", "='2(x0)': '2(x0)' covers no node: the repeat in (xN) is at least 1"),
    ("2(x0),1", "='2(x0),1': '2(x0)' covers no node"),  # was read as [1]
])
def test_malformed_tasks_per_node_raise_naming_the_variable_and_the_fault(text, why):
    with pytest.raises(DistributedEnvError, match="^" + re.escape("MY_TASKS" + why)):
        expand_tasks_per_node(text, name="MY_TASKS")


def test_the_default_tasks_variable_name_is_slurm_tasks_per_node():
    with pytest.raises(DistributedEnvError,
                       match=re.escape("SLURM_TASKS_PER_NODE='x': 'x' is not a task count")):
        expand_tasks_per_node("x")


@pytest.mark.parametrize("job, step, port", [
    ("1234", "0", 16234),
    ("1234", "5", 16239),
    ("1234", None, 16234),
    ("1234", "batch", 16234),  # a step id that is not a number counts as 0
    (" 1234 ", " 2 ", 16236),
    ("25000", "0", 20000),  # 15000 + 25000 % 20000
    ("19999", "1", 15000),  # wraps round to the base
    ("0", None, 15000),
    ("1234", "4294967294", 23528),  # the batch step: 15000 + (1234 + 4294967294) % 20000
])
def test_the_master_port_is_the_base_plus_job_and_step_modulo_the_span(job, step, port):
    assert default_master_port(job, step) == port


@pytest.mark.parametrize("job", [None, "", "  ", "abc", "12a", "-5", "1.5"])
def test_no_master_port_without_a_numeric_job_id(job):
    assert default_master_port(job, "0") is None


def test_every_task_of_a_step_agrees_and_the_next_step_moves_on():
    assert default_master_port("777", "3") == default_master_port("777", "3") == 15780
    assert default_master_port("777", "4") == 15781


@pytest.mark.parametrize("job, step, port", [("\u00b2", "0", None), ("1234", "\u00b2", 16234)])
def test_a_digit_int_cannot_read_is_not_a_numeric_id(job, step, port):
    assert default_master_port(job, step) == port
