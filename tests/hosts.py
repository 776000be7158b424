"""Nodes on one machine: each "node" runs its ranks in its own Linux namespaces, so the kit sees
another host where a real cluster would show one.

A node is ``unshare --pid --uts --mount --fork --mount-proc``: its own PID namespace (its
ranks' pids mean nothing in another node's ``/proc``), its own hostname (the same on every node
when asked: fixed container hostnames), and its own ``/proc``. Nodes share this machine's
network namespace, so the c10d store and gloo use 127.0.0.1. Before the ranks start, a node can
burn pids, so that a peer's pid in one node is not a live process in another by chance.

Options, per node:

* **its own network** (:func:`private_network`): a network namespace per node, each with a veth
  (:data:`IFNAME`, address ``10.213.0.<i+1>/24``) plugged into a bridge that lives in one more
  namespace of its own (this machine's network is not touched), ``lo`` up, and an
  ``/etc/hosts`` of its own (bind-mounted in the node's mount namespace) where its hostname is
  its own address and the other nodes' hostnames theirs. Every name is unique per network, and
  the namespaces go when the ``with`` block ends (a failed test too);
* **private directories** (``Node.private``): a tmpfs of its own over each (e.g. ``/tmp``), so
  nodes do not see each other's files there; the test's directory stays shared;
* **a command** instead of bare ranks (:func:`start_commands`): a launcher per node
  (``axolotl-dist --nnodes``, ``torchrun``), its output, exit code and exit time kept
  (:class:`Launched`); :func:`signal_command` signals it from here, :func:`node_run` runs a
  command inside a node's namespaces (``axolotl-dist where``).

Needs root (or unprivileged user namespaces) and ``unshare``: :func:`available` says whether
this machine has them (:func:`network_available`: and ``ip netns``, root only); tests skip with
its reason where it does not.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence

__all__ = ["available", "network_available", "Node", "Ranks", "Network", "Launched",
           "private_network", "start_nodes", "start_commands", "wait_nodes", "kill_nodes",
           "outer_pid", "signal_command", "node_run", "IFNAME"]

_UNSHARE = ["unshare", "--pid", "--uts", "--mount", "--fork", "--mount-proc"]
#: A node's interface on its private network (the same name in every node's namespace).
IFNAME = "veth0"
#: Prefix of the network namespaces :func:`private_network` makes (then the creator's pid).
_NETNS_PREFIX = "axd-"


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


def network_available() -> Optional[str]:
    """None where nodes can have networks of their own here; else why not (the skip reason)."""
    reason = available()
    if reason is not None:
        return reason
    if shutil.which("ip") is None or shutil.which("nsenter") is None:
        return "no ip(8) or nsenter(1) on this machine"
    name = f"{_NETNS_PREFIX}{os.getpid()}-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed (needs root): {made.stderr.strip()}"
    veth = subprocess.run(["ip", "-n", name, "link", "add", "name", "v0", "type", "veth", "peer",
                           "name", "v1"], capture_output=True, text=True)
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    if veth.returncode != 0:
        return f"cannot make a veth pair here: {veth.stderr.strip()}"
    return None


@dataclass
class Node:
    """One node: its ranks (global rank -> local rank), hostname and how many pids to burn;
    directories that get a tmpfs of its own (``private``); its network namespace, address and
    hosts file once :func:`private_network` gave it a network."""

    ranks: Sequence[int] = ()
    hostname: str = "node"
    burn_pids: int = 0
    private: Sequence[str] = ()
    process: Optional[subprocess.Popen] = None
    #: global rank -> the rank's pid inside the node (read from the rank's pid file)
    pids: Dict[int, int] = field(default_factory=dict)
    netns: Optional[str] = None
    address: Optional[str] = None
    hosts_file: Optional[str] = None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _sweep_stale_namespaces() -> None:
    """Delete the network namespaces a dead test process left (SIGKILLed before its teardown)."""
    try:
        names = os.listdir("/run/netns")
    except OSError:
        return
    for name in names:
        owner = name[len(_NETNS_PREFIX):].split("-")[0]
        if name.startswith(_NETNS_PREFIX) and owner.isdigit() and \
                not os.path.exists(f"/proc/{owner}"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@dataclass
class Network:
    """The private network of :func:`private_network`: its namespaces (one per node, then the
    switch's, where the bridge is) and subnet."""

    namespaces: List[str]
    subnet: str

    def close(self) -> None:
        """Delete every namespace (a node's goes with its last process; its veth with it)."""
        for name in self.namespaces:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


@contextlib.contextmanager
def private_network(nodes: Sequence[Node], directory: str,
                    subnet: str = "10.213.0") -> Iterator[Network]:
    """Give each of ``nodes`` a network namespace of its own: veth :data:`IFNAME` with address
    ``<subnet>.<i+1>/24`` (``node.address``) on a bridge in a namespace of its own, ``lo`` up,
    and a hosts file (in ``directory``, bind-mounted over ``/etc/hosts`` in the node) naming
    its hostname at its address and the other nodes' at theirs. Torn down on leaving, however
    the block ends; names are unique per call, so parallel tests do not collide."""
    _sweep_stale_namespaces()
    prefix = f"{_NETNS_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    switch = f"{prefix}-sw"
    network = Network([], subnet)
    try:
        _ip("netns", "add", switch)
        network.namespaces.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i, node in enumerate(nodes):
            node.netns, node.address = f"{prefix}-{i}", f"{subnet}.{i + 1}"
            _ip("netns", "add", node.netns)
            network.namespaces.insert(0, node.netns)
            _ip("-n", switch, "link", "add", "name", f"p{i}", "type", "veth", "peer", "name",
                IFNAME, "netns", node.netns)
            _ip("-n", switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", node.netns, "addr", "add", f"{node.address}/24", "dev", IFNAME)
            _ip("-n", node.netns, "link", "set", IFNAME, "up")
            _ip("-n", node.netns, "link", "set", "lo", "up")
        for i, node in enumerate(nodes):
            # the IPv4-mapped form too: the c10d store server (dual-stack) looks its clients
            # up by it, and with no DNS reachable glibc otherwise says "try again" (a warning
            # on every rank)
            named = [node] + [other for other in nodes if other.hostname != node.hostname]
            names = [f"{n.address} {n.hostname}" for n in named] + [
                f"::ffff:{n.address} {n.hostname}" for n in named]
            node.hosts_file = os.path.join(directory, f"hosts-{i}")
            with open(node.hosts_file, "w") as fh:
                fh.write("\n".join(["127.0.0.1 localhost", *names]) + "\n")
        yield network
    finally:
        kill_nodes(nodes)
        network.close()


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


def _under(path: str, top: str) -> bool:
    path, top = os.path.abspath(path), os.path.abspath(top)
    return path == top or path.startswith(top.rstrip("/") + "/")


#: What a node must still see under a private directory: this checkout (the kit and the tests
#: run from it: a CI clone may live under /tmp) and the Python installation.
_ALWAYS_KEPT = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), sys.prefix,
                sys.base_prefix)


def _prologue(node: Node, keep: str) -> List[str]:
    """Shell lines a node runs first, inside its namespaces: its hostname and hosts file, a
    tmpfs over each private directory (``keep``, the test's directory, this checkout and the
    Python installation stay visible: each held open across the mount on a descriptor of its
    own and bound back from it), burnt pids."""
    q = shlex.quote
    lines = ["set -e", f"hostname {q(node.hostname)}"]
    if node.hosts_file:
        lines.append(f"mount --bind {q(node.hosts_file)} /etc/hosts")
    wanted = sorted({os.path.abspath(p) for p in (keep, *_ALWAYS_KEPT)})
    kept = [p for p in wanted if not any(p != o and _under(p, o) for o in wanted)]
    for path in node.private:
        held = [k for k in kept if _under(k, path)]
        for fd, k in enumerate(held, start=3):
            lines.append(f"exec {fd + 3}< {q(k)}")
        lines.append(f"mount -t tmpfs -o mode=1777 tmpfs {q(path)}")
        for fd, k in enumerate(held, start=3):
            lines += [f"mkdir -p {q(k)}",
                      f"mount --no-canonicalize --bind /proc/self/fd/{fd + 3} {q(k)}",
                      f"exec {fd + 3}<&-"]
    lines.append("set +e")
    if node.burn_pids:
        lines.append(f"i=0; while [ $i -lt {node.burn_pids} ]; do /bin/true; i=$((i+1)); done")
    return lines


def _spawn(node: Node, lines: Sequence[str], env: Optional[Dict[str, str]] = None,
           cwd: Optional[str] = None) -> subprocess.Popen:
    """Start ``lines`` (a shell script) as ``node``'s init, in its namespaces (and its network
    namespace if it has one), in a session of its own."""
    enter = ["nsenter", f"--net=/run/netns/{node.netns}"] if node.netns else []
    return subprocess.Popen(enter + _UNSHARE + ["sh", "-c", "\n".join(lines)], env=env, cwd=cwd,
                            start_new_session=True)


def _node_command(node: Node, script: str, env: Dict[str, str], directory: str) -> List[str]:
    """The shell lines a node runs: its prologue, then start each rank (its output and exit
    code in ``directory``), wait for them all."""
    lines = _prologue(node, directory)
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
    return lines


def start_nodes(nodes: Sequence[Node], script: str, directory: str, port: int,
                extra_env: Optional[Dict[str, str]] = None, store: Any = None) -> Ranks:
    """Start ``script`` on every node's ranks with bare env vars: rank 0 hosts the store at
    127.0.0.1:``port``, as under srun or mpirun; or, with ``store`` (a ``TCPStore`` this
    process hosts on ``port``), every rank is its client, as under a launcher's agent. On a
    :func:`private_network`, the store is at node 0's address and gloo uses :data:`IFNAME`
    (``store`` cannot be used there: this process is on no node's network). The script should
    write its pid to ``$NODE_DIR/pid-$RANK`` if a test needs it."""
    world = sum(len(n.ranks) for n in nodes)
    networked = nodes[0].address is not None
    assert not (networked and store is not None), "this process cannot reach a private network"
    env = {"MASTER_ADDR": nodes[0].address or "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(world), "GLOO_SOCKET_IFNAME": IFNAME if networked else "lo",
           "NODE_DIR": directory, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(
               os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")) if p)}
    if store is not None:
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    env.update(extra_env or {})
    for node in nodes:
        node.process = _spawn(node, _node_command(node, script, env, directory))
    return Ranks(directory, world)


@dataclass
class Launched:
    """What the command :func:`start_commands` ran on node ``index`` left in ``directory``:
    its stdout, stderr, exit code, exit time (``time.time()``) and pid inside the node."""

    directory: str
    index: int

    def _read(self, suffix: str) -> str:
        path = os.path.join(self.directory, f"node-{self.index}.{suffix}")
        return open(path, errors="replace").read() if os.path.exists(path) else ""

    @property
    def stdout(self) -> str:
        return self._read("out")

    @property
    def stderr(self) -> str:
        return self._read("err")

    @property
    def code(self) -> Optional[int]:
        """The command's exit status (128 + signal for a signal death); None while it runs."""
        fields = self._read("rc").split()
        return int(fields[0]) if fields else None

    @property
    def ended_at(self) -> Optional[float]:
        """When the command exited (epoch seconds, as the node's shell saw it), or None."""
        fields = self._read("rc").split()
        return float(fields[1]) if len(fields) > 1 else None

    def pid_in_node(self, timeout: float = 30.0) -> int:
        """The command's pid as its node sees it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self._read("pid").strip()
            if text.isdigit():
                return int(text)
            time.sleep(0.05)
        raise TimeoutError(f"node {self.index}'s command wrote no pid in {timeout:g} s")

    def describe(self) -> str:
        return (f"--- node {self.index} (exit {self.code}) stdout ---\n{self.stdout}"
                f"--- node {self.index} stderr ---\n{self.stderr}")


def start_commands(nodes: Sequence[Node], commands: Sequence[Sequence[str]], directory: str,
                   env: Dict[str, str], cwd: Optional[str] = None) -> List[Launched]:
    """Run ``commands[i]`` (e.g. a launcher) on ``nodes[i]``, with ``env`` and ``cwd``, its
    output, exit code and exit time kept in ``directory`` (:class:`Launched`). The command is
    the child of the node's init shell, not the init itself: a PID namespace's init ignores
    signals it has no handler for, and the command must take them as anywhere else."""
    q = shlex.quote
    launched = []
    for i, (node, command) in enumerate(zip(nodes, commands)):
        base = os.path.join(directory, f"node-{i}")
        # the inner sh notes its pid, then becomes the command (same pid); a background job
        # (&, $!) would start with SIGINT ignored
        run = (f"sh -c 'echo $$ > \"$0\"; exec \"$@\"' {q(base + '.pid')} "
               f"{' '.join(q(c) for c in command)} > {q(base + '.out')} 2> {q(base + '.err')}")
        lines = _prologue(node, directory) + [
            run, f"echo \"$? $(date +%s.%N)\" > {q(base + '.rc.tmp')}",
            f"mv {q(base + '.rc.tmp')} {q(base + '.rc')}"]
        node.process = _spawn(node, lines, env=env, cwd=cwd)
        launched.append(Launched(directory, i))
    return launched


def signal_command(node: Node, launched: Launched, sig: int) -> None:
    """Send ``sig`` to the command :func:`start_commands` runs on ``node``, from here."""
    os.kill(outer_pid(node, launched.pid_in_node()), sig)


def _init_pid(node: Node) -> int:
    """The pid, as this process sees it, of ``node``'s init (the child of ``unshare --fork``)."""
    assert node.process is not None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{node.process.pid}/task/{node.process.pid}/children") as fh:
                children = fh.read().split()
        except OSError:
            children = []
        if children:
            return int(children[0])
        time.sleep(0.02)
    raise LookupError(f"node {node.hostname} has no init process")


def node_run(node: Node, command: Sequence[str], env: Dict[str, str], timeout: float,
             cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    """Run ``command`` inside ``node``'s namespaces (network, mount, hostname, PID), as a
    process of that node would; output captured as text."""
    enter = ["nsenter", "--target", str(_init_pid(node)), "--net", "--mount", "--uts", "--pid"]
    if cwd:
        enter.append(f"--wd={cwd}")
    return subprocess.run(enter + list(command), env=env, capture_output=True, text=True,
                          timeout=timeout)


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
