"""Nodes on one machine: each "node" runs its ranks in its own Linux namespaces, so the kit sees
another host where a real cluster would show one.

A node is ``unshare --pid --uts --mount --fork --mount-proc``: its own PID namespace (its
ranks' pids mean nothing in another node's ``/proc``), its own hostname (the same on every node
when asked: fixed container hostnames), and its own ``/proc``. Nodes share this machine's
network namespace, so the c10d store and gloo use 127.0.0.1. Before the ranks start, a node can
burn pids, so that a peer's pid in one node is not a live process in another by chance.

Needs root (or unprivileged user namespaces) and ``unshare``: :func:`available` says whether
this machine has them; tests skip with its reason where it does not.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["available", "Node", "Ranks", "start_nodes", "wait_nodes", "kill_nodes", "outer_pid"]

_UNSHARE = ["unshare", "--pid", "--uts", "--mount", "--fork", "--mount-proc"]


def available() -> Optional[str]:
    """None where nodes can be built here; else why not (the skip reason)."""
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    try:
        probe = subprocess.run(_UNSHARE + ["sh", "-c", "hostname probe-node && echo $$"],
                               capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare failed: {exc}"
    if probe.returncode != 0 or probe.stdout.strip() != "1":
        return f"unshare cannot make PID/UTS namespaces here (needs root): {probe.stderr.strip()}"
    return None


@dataclass
class Node:
    """One node: its ranks (global rank -> local rank), hostname and how many pids to burn."""

    ranks: Sequence[int]
    hostname: str = "node"
    burn_pids: int = 0
    process: Optional[subprocess.Popen] = None
    #: global rank -> the rank's pid inside the node (read from the rank's pid file)
    pids: Dict[int, int] = field(default_factory=dict)


@dataclass
class Ranks:
    """What the nodes' ranks left: their output and exit codes, by global rank."""

    directory: str
    world_size: int

    def output(self, rank: int) -> str:
        path = os.path.join(self.directory, f"out-{rank}.txt")
        return open(path).read() if os.path.exists(path) else ""

    def code(self, rank: int) -> Optional[int]:
        path = os.path.join(self.directory, f"rc-{rank}")
        text = open(path).read().strip() if os.path.exists(path) else ""
        return int(text) if text.lstrip("-").isdigit() else None

    def pid_in_node(self, rank: int, timeout: float = 60.0) -> int:
        """The rank's pid as its node sees it (the rank script writes ``pid-<rank>``)."""
        path = os.path.join(self.directory, f"pid-{rank}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.path.exists(path):
                text = open(path).read().strip()
                if text.isdigit():
                    return int(text)
            time.sleep(0.05)
        raise TimeoutError(f"rank {rank} wrote no pid file in {timeout:g} s:\n{self.output(rank)}")

    def describe(self) -> str:
        return "\n".join(f"--- rank {r} (exit {self.code(r)}) ---\n{self.output(r)}"
                         for r in range(self.world_size))


def _node_command(node: Node, script: str, env: Dict[str, str], directory: str) -> List[str]:
    """The shell line a node runs: set the hostname, burn pids, start each rank (its output
    and exit code in ``directory``), wait for them all."""
    lines = [f"hostname {shlex.quote(node.hostname)}"]
    if node.burn_pids:
        lines.append(f"i=0; while [ $i -lt {node.burn_pids} ]; do /bin/true; i=$((i+1)); done")
    local_world = len(node.ranks)
    for local, rank in enumerate(node.ranks):
        assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in {
            **env, "RANK": str(rank), "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(local_world)}.items())
        out = os.path.join(directory, f"out-{rank}.txt")
        rc = os.path.join(directory, f"rc-{rank}")
        lines.append(f"( env {assigns} {shlex.quote(sys.executable)} {shlex.quote(script)} "
                     f"> {shlex.quote(out)} 2>&1; echo $? > {shlex.quote(rc)} ) &")
    lines.append("wait")
    return _UNSHARE + ["sh", "-c", "\n".join(lines)]


def start_nodes(nodes: Sequence[Node], script: str, directory: str, port: int,
                extra_env: Optional[Dict[str, str]] = None, store: Any = None) -> Ranks:
    """Start ``script`` on every node's ranks with bare env vars: rank 0 hosts the store at
    127.0.0.1:``port``, as under srun or mpirun; or, with ``store`` (a ``TCPStore`` this
    process hosts on ``port``), every rank is its client, as under a launcher's agent. The
    script should write its pid to ``$NODE_DIR/pid-$RANK`` if a test needs it."""
    world = sum(len(n.ranks) for n in nodes)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world),
           "GLOO_SOCKET_IFNAME": "lo", "NODE_DIR": directory, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(
               os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")) if p)}
    if store is not None:
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    env.update(extra_env or {})
    for node in nodes:
        node.process = subprocess.Popen(_node_command(node, script, env, directory),
                                        start_new_session=True)
    return Ranks(directory, world)


def wait_nodes(nodes: Sequence[Node], timeout: float) -> bool:
    """Wait for every node to end (True), or kill them all after ``timeout`` seconds (False)."""
    deadline = time.monotonic() + timeout
    ended = True
    for node in nodes:
        assert node.process is not None
        try:
            node.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            ended = False
    if not ended:
        kill_nodes(nodes)
    return ended


def kill_nodes(nodes: Sequence[Node]) -> None:
    """SIGKILL every node's namespace (its init, then the kernel ends the rest)."""
    for node in nodes:
        if node.process is not None and node.process.poll() is None:
            try:
                os.killpg(node.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            node.process.wait(timeout=30)


def outer_pid(node: Node, inner: int) -> int:
    """The pid, as this process sees it, of the process ``inner`` inside ``node``'s PID
    namespace (``NSpid`` in ``/proc/<pid>/status``), to signal it from here."""
    assert node.process is not None
    todo, seen = [node.process.pid], set()
    while todo:
        pid = todo.pop()
        seen.add(pid)
        try:
            with open(f"/proc/{pid}/status") as fh:
                for line in fh:
                    if line.startswith("NSpid:") and pid != node.process.pid and \
                            int(line.split()[-1]) == inner:
                        return pid
            with open(f"/proc/{pid}/task/{pid}/children") as fh:
                todo.extend(int(c) for c in fh.read().split() if int(c) not in seen)
        except OSError:
            continue
    raise LookupError(f"no process {inner} in the node of ranks {list(node.ranks)}")
