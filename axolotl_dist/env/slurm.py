"""SLURM's compressed host lists and task counts, parsed without calling ``scontrol``.

* :func:`expand_nodelist` turns ``"node[01-04,07],gpu5"`` into
  ``["node01", "node02", "node03", "node04", "node07", "gpu5"]`` (zero padding kept, several
  bracket groups per name allowed, e.g. ``"r[1-2]n[01-02]"``).
* :func:`expand_tasks_per_node` turns ``"4(x2),1"`` into ``[4, 4, 1]``.
* :func:`default_master_port` derives a port that every task of one job step agrees on.

Malformed input raises :class:`~axolotl_dist.errors.DistributedEnvError` naming the variable.
"""

from __future__ import annotations

import re
from typing import List, Optional

from ..errors import DistributedEnvError
from .variables import is_decimal

__all__ = [
    "SLURM_BASE_PORT",
    "SLURM_PORT_SPAN",
    "SPECIAL_STEP",
    "expand_nodelist",
    "first_host",
    "expand_tasks_per_node",
    "default_master_port",
]

#: ``MASTER_PORT`` under SLURM defaults to ``SLURM_BASE_PORT + (job id + step id) % SLURM_PORT_SPAN``.
SLURM_BASE_PORT = 15000
SLURM_PORT_SPAN = 20000
#: Step ids at or above this are SLURM's special steps (batch, extern, interactive), not srun.
SPECIAL_STEP = 0xFFFFFFF0

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _split_top_level(text: str, name: str) -> List[str]:
    """Split on commas that are outside brackets."""
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise DistributedEnvError(f"{name}={text!r} has nested brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise DistributedEnvError(f"{name}={text!r} has an unmatched ']'")
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if depth != 0:
        raise DistributedEnvError(f"{name}={text!r} has an unclosed '['")
    parts.append("".join(current))
    return parts


def _expand_range(spec: str, text: str, name: str) -> List[str]:
    out: List[str] = []
    for item in spec.split(","):
        match = _RANGE.match(item.strip())
        if match is None:
            raise DistributedEnvError(
                f"{name}={text!r}: {item!r} in brackets is not a number or a range like 01-04")
        lo, hi = match.group(1), match.group(2) or match.group(1)
        if int(hi) < int(lo):
            raise DistributedEnvError(f"{name}={text!r}: the range {item!r} runs backwards")
        width = len(lo) if lo.startswith("0") else 0
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def _expand_host(pattern: str, text: str, name: str) -> List[str]:
    start = pattern.find("[")
    if start < 0:
        if "]" in pattern:
            raise DistributedEnvError(f"{name}={text!r} has an unmatched ']'")
        return [pattern]
    end = pattern.find("]", start)
    if end < 0:
        raise DistributedEnvError(f"{name}={text!r} has an unclosed '['")
    head, spec, tail = pattern[:start], pattern[start + 1:end], pattern[end + 1:]
    return [head + mid + rest for mid in _expand_range(spec, text, name)
            for rest in _expand_host(tail, text, name)]


def expand_nodelist(text: str, name: str = "SLURM_NODELIST") -> List[str]:
    """Expand a SLURM host list such as ``"node[01-04,07],gpu5"`` into host names."""
    text = text.strip()
    if not text:
        raise DistributedEnvError(f"{name} is empty: expected host names such as node[01-04]")
    hosts: List[str] = []
    for part in _split_top_level(text, name):
        part = part.strip()
        if not part:
            raise DistributedEnvError(f"{name}={text!r} has an empty entry (stray comma)")
        hosts.extend(_expand_host(part, text, name))
    return hosts


def first_host(text: str, name: str = "SLURM_NODELIST") -> str:
    """The first host of a SLURM host list (where task 0 of a block layout runs)."""
    return expand_nodelist(text, name)[0]


def expand_tasks_per_node(text: str, name: str = "SLURM_TASKS_PER_NODE") -> List[int]:
    """Expand ``"4(x2),1"`` into ``[4, 4, 1]`` (one count per node)."""
    counts: List[int] = []
    for item in text.strip().split(","):
        match = _COUNT.match(item.strip())
        if match is None:
            raise DistributedEnvError(
                f"{name}={text!r}: {item!r} is not a task count like 4 or 4(x2)")
        nodes = 1 if match.group(2) is None else int(match.group(2))
        if nodes < 1:
            raise DistributedEnvError(
                f"{name}={text!r}: {item!r} covers no node: the repeat in (xN) is at least 1")
        counts.extend([int(match.group(1))] * nodes)
    if not counts or min(counts) < 1:
        raise DistributedEnvError(f"{name}={text!r}: every node needs at least one task")
    return counts


def default_master_port(job_id: Optional[str], step_id: Optional[str]) -> Optional[int]:
    """A port all tasks of one job step agree on, or None without a numeric job id."""
    if job_id is None or not is_decimal(job_id.strip()):
        return None
    step = int(step_id) if step_id is not None and is_decimal(step_id.strip()) else 0
    return SLURM_BASE_PORT + (int(job_id) + step) % SLURM_PORT_SPAN
