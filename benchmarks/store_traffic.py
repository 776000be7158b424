"""How many c10d TCPStore requests (and bytes) the kit sends per rank, phase by phase, next to
plain torch, and what that means at thousands of ranks.

Run it from the repository root (it imports this checkout's ``axolotl_dist``)::

    python benchmarks/store_traffic.py                         # W = 2, 4, 8, 16; kit and torch
    python benchmarks/store_traffic.py --worlds 4,16 --seconds 6 --mode kit
    python benchmarks/store_traffic.py --worlds 8 --by-type barrier     # per query type
    python benchmarks/store_traffic.py --selftest              # decoder check, every query type
    python benchmarks/store_traffic.py --save before.json      # then: --load before.json

How it measures:

* The parent process starts a real ``torch.distributed.TCPStore`` (``is_master=True``, on
  127.0.0.1, a free port; libuv backend unless ``--legacy-store``) and, for each rank, a proxy
  listener on its own free port that forwards bytes both ways to it. The proxy decodes the
  client->server stream with TCPStore's wire protocol as torch 2.13 has it (below), so it
  counts *requests* (one per query) and bytes per query type, each with the time its first
  byte arrived; server->client bytes are counted per chunk. Every connection on rank r's
  proxy port (the rank's store, the kit's clones for its heartbeat and store worker, any
  torch opens) is rank r's.
* W rank processes run with ``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT=<their proxy port>``,
  ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` and
  ``TORCHELASTIC_USE_AGENT_STORE=True``: torch's ``env://`` rendezvous then makes every rank,
  rank 0 included, a client of the parent's store (``_create_c10d_store``). Backend gloo.
* Phases are attributed by time, never by extra store requests: each rank appends
  ``<mark> <time.monotonic()>`` lines to its own file (CLOCK_MONOTONIC is one clock for every
  process of the machine, the proxy stamps requests with it too), and the parent starts every
  phase on all ranks at once through files (a rank says ``ready_<phase>`` in its marks file
  and polls for ``go_<phase>`` in a shared directory). A request counts in a phase when it
  arrived inside that rank's window for it; what arrives between windows (the rank waiting
  for the parent's go) is counted nowhere.

Phases (the kit, then plain torch's equivalent):

* ``init``: ``axolotl_dist.init_distributed()`` / ``dist.init_process_group("gloo")``;
  requests per rank.
* ``idle``: every rank sleeps T seconds; requests per second per rank.
* ``training``: every rank issues :data:`TRAIN_STEPS` torch ``all_reduce`` calls 50 ms apart
  (over 40 s: the straggler report publishes every 30 s); requests per second per rank.
* ``zero_first wait``: ``with axolotl_dist.zero_first(): if rank == 0: time.sleep(T)``;
  requests per second per *waiting* rank (1..W-1), the first and last 0.5 s left out; with
  T > 10 also the first 10 s and the rest apart. Torch: rank 0 sleeps then ``dist.barrier()``,
  the others call ``dist.barrier()`` at once.
* ``barrier wait``: rank 0 sleeps T then ``axolotl_dist.barrier()`` (``dist.barrier()``), the
  others call it at once; requests per second per waiting rank.
* ``spread exits``: rank r sleeps ``r * 1.5 / (W - 1)`` s and its script ends (no further
  call, as a user script ends); requests per rank from the phase's start until the process
  is gone (mean and max over the ranks).

Then: per phase, a least-squares line ``a + b*W`` through the per-rank figures (and its
residuals); the store's capacity here (``--capacity-clients`` processes doing
``add(key, 0)`` in a loop against one store, requests/s); and the projection, for W = 1,024
and 8,192, of the kit's total requests/s at the store while idle and while all ranks but one
wait, as a share of that capacity. The machine's cores are shared by every rank, the proxy
and the store: rates of busy phases at large W, and the capacity, are those of this machine.

The wire protocol decoded (torch 2.13: ``QueryType`` and ``validationMagicNumber`` in
``torch/csrc/distributed/c10d/TCPStoreBackend.hpp``, as shipped in the wheel's
``torch/include``; the client's encoding in ``TCPStore.cpp`` (``SendBuffer``) and the
server's parsing in ``TCPStoreLibUvBackend.cpp``; ``SizeType = uint64_t`` in ``Utils.hpp``):
each query is one type byte, then its fields, native (little-endian) integers, a string or a
byte vector being a uint64 length and the bytes::

    0 VALIDATE    u32 magic (0x3C85F7CE)       the first query of every connection
    1 SET         key, value                  2 COMPARE_SET  key, expected, desired
    3 GET         key                         4 ADD          key, i64 delta
    5 CHECK       u64 n, n keys               6 WAIT         u64 n, n keys
    7 GETNUMKEYS  -                           8 DELETE_KEY   key
    9 APPEND      key, value                 10 MULTI_GET    u64 n, n keys
   11 MULTI_SET   u64 n, n (key, value)      12 CANCEL_WAIT  -
   13 PING        u32 nonce (the pid)        14 QUEUE_PUSH   key, value
   15 QUEUE_POP   key                        16 QUEUE_LEN    key
   17 LIST_KEYS   -                          18 BARRIER      key, i64 world size

A ``get`` is two requests on the wire (``WAIT`` then ``GET``); a client's connect is two
(``VALIDATE``, ``PING``). A type byte outside this table is reported loudly (printed, counted
as ``UNKNOWN``); that connection's remaining bytes are then counted but not decoded. The
bytes are always forwarded unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Iterable, List, Optional, Sequence, Tuple, Union

if TYPE_CHECKING:
    from torch.distributed import TCPStore

# this checkout's axolotl_dist, not whichever one is installed (as benchmarks/collectives.py does)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

# --------------------------------------------------------------------------------------------
# The TCPStore wire protocol (torch 2.13), client -> server
# --------------------------------------------------------------------------------------------

#: ``c10d::detail::validationMagicNumber`` (TCPStoreBackend.hpp)
VALIDATION_MAGIC = 0x3C85F7CE

#: ``enum class QueryType : uint8_t`` (TCPStoreBackend.hpp), value -> name
QUERY_NAMES: Dict[int, str] = {
    0: "VALIDATE", 1: "SET", 2: "COMPARE_SET", 3: "GET", 4: "ADD", 5: "CHECK", 6: "WAIT",
    7: "GETNUMKEYS", 8: "DELETE_KEY", 9: "APPEND", 10: "MULTI_GET", 11: "MULTI_SET",
    12: "CANCEL_WAIT", 13: "PING", 14: "QUEUE_PUSH", 15: "QUEUE_POP", 16: "QUEUE_LEN",
    17: "LIST_KEYS", 18: "BARRIER",
}
UNKNOWN = "UNKNOWN"

#: The fields after the type byte: "u32", "i64" (8 bytes), "blob" (u64 length + bytes: a key
#: or a value), "blobs" (u64 count + that many blobs), "pairs" (u64 count + (blob, blob) each).
LAYOUTS: Dict[str, Tuple[str, ...]] = {
    "VALIDATE": ("u32",), "SET": ("blob", "blob"), "COMPARE_SET": ("blob", "blob", "blob"),
    "GET": ("blob",), "ADD": ("blob", "i64"), "CHECK": ("blobs",), "WAIT": ("blobs",),
    "GETNUMKEYS": (), "DELETE_KEY": ("blob",), "APPEND": ("blob", "blob"),
    "MULTI_GET": ("blobs",), "MULTI_SET": ("pairs",), "CANCEL_WAIT": (), "PING": ("u32",),
    "QUEUE_PUSH": ("blob", "blob"), "QUEUE_POP": ("blob",), "QUEUE_LEN": ("blob",),
    "LIST_KEYS": (), "BARRIER": ("blob", "i64"),
}

#: Lengths and counts above these mean the decoder lost its place (torch caps a query's key
#: count at 128k; values this large never travel in these runs).
_MAX_BLOB = 1 << 31
_MAX_COUNT = 1 << 20


class ProtocolError(Exception):
    """The client->server stream does not follow the protocol as decoded here."""


@dataclass
class Decoded:
    """One complete query: its type, where it ends in the buffer, its first key (or value)."""

    name: str
    end: int
    key: str
    value: Optional[int] = None  # VALIDATE's magic, PING's nonce, ADD's delta, BARRIER's size


Buffer = Union[bytes, bytearray]


def _u64(buf: Buffer, pos: int) -> Optional[int]:
    if len(buf) < pos + 8:
        return None
    return int.from_bytes(buf[pos:pos + 8], "little")


def _blob(buf: Buffer, pos: int) -> Optional[Tuple[int, bytes]]:
    """A length-prefixed string or vector at ``pos``: (end, first 96 bytes), None if short."""
    size = _u64(buf, pos)
    if size is None:
        return None
    if size > _MAX_BLOB:
        raise ProtocolError(f"a length of {size} bytes")
    end = pos + 8 + size
    if len(buf) < end:
        return None
    return end, bytes(buf[pos + 8:pos + 8 + min(size, 96)])


def decode_query(buf: Buffer, pos: int = 0) -> Optional[Decoded]:
    """The query starting at ``buf[pos]``, or None while it is incomplete.

    Raises :class:`ProtocolError` for a type byte outside :data:`QUERY_NAMES` or a length no
    query of these runs has."""
    if len(buf) <= pos:
        return None
    qtype = buf[pos]
    name = QUERY_NAMES.get(qtype)
    if name is None:
        raise ProtocolError(f"unknown query type {qtype}")
    at, key, value = pos + 1, None, None
    for kind in LAYOUTS[name]:
        if kind in ("u32", "i64"):
            width = 4 if kind == "u32" else 8
            if len(buf) < at + width:
                return None
            value = int.from_bytes(buf[at:at + width], "little", signed=kind == "i64")
            at += width
        elif kind == "blob":
            got = _blob(buf, at)
            if got is None:
                return None
            at, first = got
            key = first if key is None else key
        else:  # "blobs" / "pairs"
            count = _u64(buf, at)
            if count is None:
                return None
            if count > _MAX_COUNT:
                raise ProtocolError(f"a count of {count} keys")
            at += 8
            for _ in range(count * (2 if kind == "pairs" else 1)):
                got = _blob(buf, at)
                if got is None:
                    return None
                at, first = got
                key = first if key is None else key
    text = key.decode("utf-8", "replace") if key is not None else ""
    return Decoded(name, at, text, value)


# --------------------------------------------------------------------------------------------
# What the proxy records
# --------------------------------------------------------------------------------------------

@dataclass
class Request:
    t: float
    rank: int
    conn: int
    name: str
    nbytes: int
    key: str


@dataclass
class Reply:
    t: float
    rank: int
    conn: int
    nbytes: int


@dataclass
class ConnInfo:
    rank: int
    opened: float
    closed: Optional[float] = None
    requests: int = 0
    desynced: bool = False


class Recorder:
    """Every request and reply chunk of one run, with their times (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: List[Request] = []
        self.replies: List[Reply] = []
        self.conns: Dict[int, ConnInfo] = {}
        self.problems: List[str] = []
        self._next = 0

    def open_conn(self, rank: int) -> int:
        with self.lock:
            self._next += 1
            self.conns[self._next] = ConnInfo(rank, time.monotonic())
            return self._next

    def close_conn(self, conn: int) -> None:
        with self.lock:
            info = self.conns[conn]
            if info.closed is None:
                info.closed = time.monotonic()

    def open_count(self) -> int:
        with self.lock:
            return sum(1 for c in self.conns.values() if c.closed is None)

    def request(self, req: Request) -> None:
        with self.lock:
            self.requests.append(req)
            self.conns[req.conn].requests += 1

    def reply(self, rep: Reply) -> None:
        with self.lock:
            self.replies.append(rep)

    def problem(self, text: str) -> None:
        """Say it loudly, and keep it for the report."""
        with self.lock:
            self.problems.append(text)
        print(f"\n!!! store_traffic DECODER: {text}\n", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# The proxy: one listener per rank, two pumping threads per connection
# --------------------------------------------------------------------------------------------

def _listen() -> socket.socket:
    """A listening socket on a free port of 127.0.0.1."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    return sock


def _shut(sock: socket.socket, how: int) -> None:
    try:
        sock.shutdown(how)
    except OSError:
        pass


def _pump_requests(client: socket.socket, server: socket.socket, rec: Recorder, rank: int,
                   conn: int) -> None:
    """Client -> server: forward every chunk as it comes, decode the queries in it."""
    buf = bytearray()
    first_byte_at = 0.0
    desynced = False
    try:
        while True:
            chunk = client.recv(65536)
            now = time.monotonic()
            if not chunk:
                break
            server.sendall(chunk)
            if desynced:
                rec.request(Request(now, rank, conn, UNKNOWN, len(chunk), ""))
                continue
            if not buf:
                first_byte_at = now
            buf += chunk
            pos = 0
            while True:
                try:
                    got = decode_query(buf, pos)
                except ProtocolError as exc:
                    rest = bytes(buf[pos:pos + 32]).hex(" ")
                    rec.problem(f"rank {rank} connection {conn}: {exc} (next bytes: {rest}); "
                                f"this connection's remaining bytes are counted as {UNKNOWN}, "
                                f"not decoded")
                    rec.request(Request(first_byte_at, rank, conn, UNKNOWN, len(buf) - pos, ""))
                    rec.conns[conn].desynced = desynced = True
                    pos = len(buf)
                    break
                if got is None:
                    break
                if got.name == "VALIDATE" and got.value != VALIDATION_MAGIC:
                    rec.problem(f"rank {rank} connection {conn}: VALIDATE with magic "
                                f"{got.value:#x}, expected {VALIDATION_MAGIC:#x}")
                rec.request(Request(first_byte_at, rank, conn, got.name, got.end - pos, got.key))
                pos = got.end
                first_byte_at = now  # what follows in this buffer came with this chunk
            del buf[:pos]
    except OSError:
        pass
    finally:
        if buf and not desynced:
            rec.problem(f"rank {rank} connection {conn}: closed with {len(buf)} bytes of an "
                        f"incomplete query ({bytes(buf[:32]).hex(' ')})")
        _shut(server, socket.SHUT_WR)


def _pump_replies(server: socket.socket, client: socket.socket, rec: Recorder, rank: int,
                  conn: int) -> None:
    """Server -> client: forward and count."""
    try:
        while True:
            chunk = server.recv(65536)
            if not chunk:
                break
            rec.reply(Reply(time.monotonic(), rank, conn, len(chunk)))
            client.sendall(chunk)
    except OSError:
        pass
    finally:
        _shut(client, socket.SHUT_WR)


def _serve_connection(client: socket.socket, store_port: int, rec: Recorder, rank: int) -> None:
    conn = rec.open_conn(rank)
    try:
        server = socket.create_connection(("127.0.0.1", store_port), timeout=30)
        server.settimeout(None)
    except OSError as exc:
        rec.problem(f"rank {rank}: cannot reach the store: {exc}")
        client.close()
        rec.close_conn(conn)
        return
    for sock in (client, server):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    back = threading.Thread(target=_pump_replies, args=(server, client, rec, rank, conn),
                            daemon=True)
    back.start()
    _pump_requests(client, server, rec, rank, conn)
    back.join()
    client.close()
    server.close()
    rec.close_conn(conn)


class RankProxy:
    """Rank ``rank``'s listener: every connection on its port is that rank's."""

    def __init__(self, rank: int, store_port: int, rec: Recorder) -> None:
        self.rank, self.store_port, self.rec = rank, store_port, rec
        self.sock = _listen()
        self.port: int = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._accept, daemon=True,
                                       name=f"proxy-{rank}")
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=_serve_connection, daemon=True,
                             args=(client, self.store_port, self.rec, self.rank)).start()

    def close(self) -> None:
        _shut(self.sock, socket.SHUT_RDWR)
        self.sock.close()


# --------------------------------------------------------------------------------------------
# The ranks
# --------------------------------------------------------------------------------------------

PHASES = ("init", "idle", "train", "zero_first", "barrier", "exit")
#: The training phase's steps, 50 ms apart (a fixed count: the ranks issue the same collectives).
TRAIN_STEPS = 800

RANK_SCRIPT = r'''
import os, sys, time
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
mode, seconds, sync_dir = sys.argv[1], float(sys.argv[2]), sys.argv[3]
marks = open(os.path.join(sync_dir, "marks-%d.txt" % rank), "a", buffering=1)

def mark(name):
    marks.write("%s %.6f\n" % (name, time.monotonic()))

def sync(phase):
    """Wait for the parent's go (a file): no store request."""
    mark("ready_" + phase)
    go, deadline = os.path.join(sync_dir, "go_" + phase), time.monotonic() + 300
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.01)

import torch.distributed as dist
if mode == "kit":
    import axolotl_dist as ad
    repo = os.path.dirname(os.path.dirname(os.path.abspath(ad.__file__)))
    if repo != os.environ["STORE_TRAFFIC_REPO"]:
        print("imported the wrong axolotl_dist: %s" % ad.__file__, flush=True)
        sys.exit(4)

look_as = int(os.environ.get("STORE_TRAFFIC_LOOK_AS") or 0)
if mode == "kit" and look_as:  # --look-as: wait as a rank of a world of look_as ranks would
    from axolotl_dist._runtime.base import constants
    from axolotl_dist._runtime.liveness import stalls as watch
    watch.look_interval = lambda _world: constants.look_interval(look_as)

sync("init")
mark("init_start")
if mode == "kit":
    ad.init_distributed()
else:
    dist.init_process_group("gloo")
mark("init_end")

sync("idle")
mark("idle_start")
time.sleep(seconds)
mark("idle_end")

sync("train")
mark("train_start")
import torch
tensor = torch.ones(256)
for _ in range(TRAIN_STEPS):
    dist.all_reduce(tensor)
    time.sleep(0.05)
mark("train_end")

sync("zero_first")
mark("zero_first_start")
if mode == "kit":
    with ad.zero_first():
        if rank == 0:
            time.sleep(seconds)
else:
    if rank == 0:
        time.sleep(seconds)
    dist.barrier()
mark("zero_first_end")

sync("barrier")
mark("barrier_start")
if rank == 0:
    time.sleep(seconds)
if mode == "kit":
    ad.barrier()
else:
    dist.barrier()
mark("barrier_end")

sync("exit")
mark("exit_start")
time.sleep(rank * 1.5 / max(world - 1, 1))
mark("exit_script_end")
'''


@dataclass
class RunResult:
    """One run (a mode, a world size): marks per rank and what the proxy saw."""

    mode: str
    world: int
    seconds: float
    marks: List[Dict[str, float]]
    gone: List[float]
    rec: Recorder
    error: Optional[str] = None
    look_as: int = 0  # --look-as: the world size whose look interval the ranks used



def _read_marks(path: str) -> Dict[str, float]:
    found: Dict[str, float] = {}
    try:
        with open(path) as fh:
            for line in fh:
                parts = line.split()
                if len(parts) == 2:
                    found[parts[0]] = float(parts[1])
    except OSError:
        pass
    return found


def _rank_env(rank: int, world: int, port: int, look_as: int = 0) -> Dict[str, str]:
    env = dict(os.environ)
    env.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
        "TORCHELASTIC_USE_AGENT_STORE": "True", "GLOO_SOCKET_IFNAME": "lo",
        "STORE_TRAFFIC_LOOK_AS": str(look_as),
        "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "STORE_TRAFFIC_REPO": REPO_ROOT,
        "PYTHONPATH": os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH"))
                                      if p),
    })
    for name in ("TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK"):
        env.pop(name, None)
    return env


def _kill(procs: Iterable[subprocess.Popen]) -> None:
    """End the rank processes this script started (each in its own session), by pid."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _wait_ready(phase: str, sync_dir: str, procs: Sequence[subprocess.Popen],
                timeout: float) -> Optional[str]:
    """Wait until every rank said ``ready_<phase>``; the reason it failed, or None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(f"ready_{phase}" in _read_marks(os.path.join(sync_dir, f"marks-{r}.txt"))
               for r in range(len(procs))):
            return None
        dead = [r for r, p in enumerate(procs) if p.poll() is not None]
        if dead:
            return f"rank(s) {dead} ended before phase {phase} (exit codes " \
                   f"{[procs[r].returncode for r in dead]})"
        time.sleep(0.02)
    return f"ranks not ready for phase {phase} after {timeout:.0f} s"


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as fh:
            return "".join(fh.readlines()[-lines:])
    except OSError:
        return ""


def _new_store(legacy: bool) -> "TCPStore":
    import torch.distributed as dist
    from datetime import timedelta
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=600), use_libuv=not legacy)


def run_world(mode: str, world: int, seconds: float, legacy: bool, verbose: bool,
              look_as: int = 0) -> RunResult:
    """Run the phases on ``world`` ranks (``mode``: "kit" or "torch") behind the proxy;
    ``look_as``: the kit's ranks look at the store as in a world of that many ranks."""
    store = _new_store(legacy)
    rec = Recorder()
    proxies = [RankProxy(r, store.port, rec) for r in range(world)]
    work = tempfile.mkdtemp(prefix=f"store_traffic_{mode}{world}_")
    script = os.path.join(work, "rank.py")
    with open(script, "w") as fh:
        fh.write(RANK_SCRIPT.replace("TRAIN_STEPS", str(TRAIN_STEPS)))
    procs: List[subprocess.Popen] = []
    gone: List[float] = [float("nan")] * world
    error: Optional[str] = None
    started = time.monotonic()
    try:
        for r in range(world):
            log = open(os.path.join(work, f"log-{r}.txt"), "w")
            procs.append(subprocess.Popen(
                [sys.executable, script, mode, str(seconds), work], cwd=REPO_ROOT,
                env=_rank_env(r, world, proxies[r].port, look_as), stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True))
            log.close()
        budgets = {"init": 90 + 8 * world, "idle": 120 + 4 * world,
                   "train": 120 + 4 * world + seconds,
                   "zero_first": seconds + 60 + 2 * world + 0.2 * TRAIN_STEPS,  # after training
                   "barrier": seconds + 60 + 2 * world,
                   "exit": seconds + 60 + 2 * world}
        for phase in PHASES:
            error = _wait_ready(phase, work, procs, budgets[phase])
            if error is not None:
                break
            if verbose:
                print(f"  [{mode} W={world}] {phase} at +{time.monotonic() - started:.1f} s",
                      flush=True)
            open(os.path.join(work, f"go_{phase}"), "w").close()
        if error is None:  # the exits: wait for every process to end
            deadline = time.monotonic() + 60 + 2 * world
            while time.monotonic() < deadline and any(p.poll() is None for p in procs):
                for r, p in enumerate(procs):
                    if p.poll() is not None and gone[r] != gone[r]:
                        gone[r] = time.monotonic()
                time.sleep(0.01)
            for r, p in enumerate(procs):
                if p.poll() is not None and gone[r] != gone[r]:
                    gone[r] = time.monotonic()
            late = [r for r, p in enumerate(procs) if p.poll() is None]
            bad = [(r, p.returncode) for r, p in enumerate(procs)
                   if p.returncode not in (None, 0)]
            if late:
                error = f"rank(s) {late} still running 60 s after their script ended"
            elif bad:
                error = f"rank(s) ended with exit codes {bad}"
        # let the proxy see the last bytes of the closing connections
        deadline = time.monotonic() + 10
        while rec.open_count() and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        _kill(procs)
        for proxy in proxies:
            proxy.close()
        del store
    if error is not None:
        print(f"\n!!! {mode} W={world}: {error}", file=sys.stderr)
        for r in range(world):
            tail = _tail(os.path.join(work, f"log-{r}.txt"))
            if tail.strip():
                print(f"--- rank {r} output (last lines):\n{tail}", file=sys.stderr)
    marks = [_read_marks(os.path.join(work, f"marks-{r}.txt")) for r in range(world)]
    if error is None and not verbose:
        shutil.rmtree(work, ignore_errors=True)
    elif error is None:
        print(f"  [{mode} W={world}] rank logs kept in {work}")
    return RunResult(mode, world, seconds, marks, gone, rec, error, look_as)


# --------------------------------------------------------------------------------------------
# Figures per phase
# --------------------------------------------------------------------------------------------

#: Seconds left out at both ends of a wait (entering and leaving it).
EDGE = 0.5

#: Table rows: (key, label, unit)
ROWS: List[Tuple[str, str, str]] = [
    ("init", "init", "req/rank"),
    ("idle", "idle", "req/s/rank"),
    ("train", "training", "req/s/rank"),
    ("zero_first", "zero_first wait", "req/s/waiter"),
    ("zero_first_whole", "  whole wait", "req/s/waiter"),
    ("zero_first_first10", "  first 10 s", "req/s/waiter"),
    ("zero_first_later", "  after 10 s", "req/s/waiter"),
    ("barrier", "barrier wait", "req/s/waiter"),
    ("barrier_whole", "  whole wait", "req/s/waiter"),
    ("exit", "spread exits", "req/rank"),
]


def rows_for(seconds: float) -> List[Tuple[str, str, str]]:
    """The table's rows: the first 10 s of a wait and the rest apart only when T > 10."""
    return [row for row in ROWS
            if seconds > 10 or not row[0].endswith(("_first10", "_later"))]


@dataclass
class Figure:
    """One row's figure for one run: per rank (or per rank-second), mean and max over ranks."""

    requests: float
    bytes: float
    requests_max: float
    ranks: int


@dataclass
class Window:
    rank: int
    start: float
    end: float  # inf: until the connections closed


def windows(run: RunResult, row: str) -> Tuple[List[Window], bool]:
    """The per-rank windows of a table row, and whether the figure is a rate."""
    out: List[Window] = []
    phase = row.split("_first10")[0].split("_later")[0].split("_whole")[0]
    for r, m in enumerate(run.marks):
        if row == "init":
            if "init_start" in m and "init_end" in m:
                out.append(Window(r, m["init_start"], m["init_end"]))
        elif row in ("idle", "train"):
            if f"{row}_start" in m and f"{row}_end" in m:
                out.append(Window(r, m[f"{row}_start"], m[f"{row}_end"]))
        elif row == "exit":
            if "exit_start" in m:
                out.append(Window(r, m["exit_start"], float("inf")))
        else:  # the waits: ranks 1.. only, edges left out
            if r == 0 or f"{phase}_start" not in m or f"{phase}_end" not in m:
                continue
            start, end = m[f"{phase}_start"], m[f"{phase}_end"]
            edge = 0.0 if row.endswith("_whole") else min(EDGE, (end - start) / 4)
            start, end = start + edge, end - edge
            if row.endswith("_first10"):
                end = min(end, m[f"{phase}_start"] + 10.0)
            elif row.endswith("_later"):
                start = m[f"{phase}_start"] + 10.0
            if end > start:
                out.append(Window(r, start, end))
    return out, row not in ("init", "exit")


def _in_window(t: float, rank: int, win: Dict[int, Window]) -> bool:
    w = win.get(rank)
    return w is not None and w.start <= t < w.end


def figure(run: RunResult, row: str) -> Optional[Figure]:
    """A row's figure for ``run``: None where no rank has that window."""
    wins, rate = windows(run, row)
    if not wins:
        return None
    by_rank = {w.rank: w for w in wins}
    reqs = {w.rank: 0 for w in wins}
    nbytes = {w.rank: 0 for w in wins}
    for req in run.rec.requests:
        if _in_window(req.t, req.rank, by_rank):
            reqs[req.rank] += 1
            nbytes[req.rank] += req.nbytes
    for rep in run.rec.replies:
        if _in_window(rep.t, rep.rank, by_rank):
            nbytes[rep.rank] += rep.nbytes
    if rate:
        per = {w.rank: reqs[w.rank] / (w.end - w.start) for w in wins}
        per_bytes = {w.rank: nbytes[w.rank] / (w.end - w.start) for w in wins}
    else:
        per = {r: float(v) for r, v in reqs.items()}
        per_bytes = {r: float(v) for r, v in nbytes.items()}
    return Figure(statistics.mean(per.values()), statistics.mean(per_bytes.values()),
                  max(per.values()), len(wins))


def key_pattern(key: str) -> str:
    """A key with its run ids (hex, 8+ characters) as <id> and its numbers as N."""
    key = re.sub(r"(?<![0-9a-z])(?=[0-9a-f]*[0-9])[0-9a-f]{8,}(?![0-9a-z])", "<id>", key)
    return re.sub(r"[0-9]+", "N", key)[:64]


def by_type(run: RunResult, row: str) -> Tuple[Dict[str, float], Dict[str, float], str]:
    """Per query type, and per (type, key pattern), a row's per-rank figure for ``run``."""
    wins, rate = windows(run, row)
    by_rank = {w.rank: w for w in wins}
    scale = 1.0 / max(len(wins), 1)
    types: Dict[str, float] = {}
    keys: Dict[str, float] = {}
    for req in run.rec.requests:
        w = by_rank.get(req.rank)
        if w is None or not (w.start <= req.t < w.end):
            continue
        weight = scale / (w.end - w.start) if rate else scale
        types[req.name] = types.get(req.name, 0.0) + weight
        pattern = f"{req.name:<11} {key_pattern(req.key)}"
        keys[pattern] = keys.get(pattern, 0.0) + weight
    return types, keys, "req/s/rank" if rate else "req/rank"


# --------------------------------------------------------------------------------------------
# Store capacity
# --------------------------------------------------------------------------------------------

CAPACITY_SCRIPT = r'''
import os, sys, time
from datetime import timedelta
import torch.distributed as dist
port, seconds, sync_dir, me = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                      timeout=timedelta(seconds=120))
open(os.path.join(sync_dir, "ready-" + me), "w").close()
go, deadline = os.path.join(sync_dir, "go"), time.monotonic() + 300
while not os.path.exists(go):
    if time.monotonic() > deadline:
        sys.exit(3)
    time.sleep(0.005)
key, n = "cap/" + me, 0
t0 = time.monotonic()
end = t0 + seconds
while time.monotonic() < end:
    store.add(key, 0)
    n += 1
print(n, time.monotonic() - t0, flush=True)
'''


def measure_capacity(clients: int, seconds: float, legacy: bool) -> Tuple[float, List[float]]:
    """Total ``add(key, 0)`` requests/s one store served to ``clients`` looping processes
    (directly, no proxy), and each client's rate."""
    store = _new_store(legacy)
    work = tempfile.mkdtemp(prefix="store_traffic_capacity_")
    script = os.path.join(work, "client.py")
    with open(script, "w") as fh:
        fh.write(CAPACITY_SCRIPT)
    procs: List[subprocess.Popen] = []
    try:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        for c in range(clients):
            procs.append(subprocess.Popen(
                [sys.executable, script, str(store.port), str(seconds), work, str(c)],
                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True))
        deadline = time.monotonic() + 60 + 5 * clients
        while time.monotonic() < deadline:
            if all(os.path.exists(os.path.join(work, f"ready-{c}")) for c in range(clients)):
                break
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.02)
        else:
            raise RuntimeError("capacity clients not ready in time")
        open(os.path.join(work, "go"), "w").close()
        rates: List[float] = []
        for p in procs:
            out, err = p.communicate(timeout=seconds + 60)
            parts = out.split()
            if p.returncode != 0 or len(parts) != 2:
                raise RuntimeError(f"capacity client failed ({p.returncode}): {err[-500:]}")
            rates.append(int(parts[0]) / float(parts[1]))
        return sum(rates), rates
    finally:
        _kill(procs)
        del store
        shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Fits, projection, printing
# --------------------------------------------------------------------------------------------

def fit_line(xs: Sequence[float], ys: Sequence[float]) -> Tuple[float, float]:
    """Least squares ``y = a + b*x``; a constant (b = 0) from one point."""
    n = len(xs)
    if n == 0:
        return float("nan"), float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    if n == 1 or var == 0:
        return my, 0.0
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var
    return my - b * mx, b


def _num(value: Optional[float], width: int = 9, digits: int = 1) -> str:
    if value is None or value != value:
        return "-".rjust(width)
    return f"{value:{width}.{digits}f}"


def _bytes(value: Optional[float], width: int = 10) -> str:
    if value is None or value != value:
        return "-".rjust(width)
    for unit, size in (("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.1f} {unit}".rjust(width)
    return f"{value:.0f} B".rjust(width)


def print_world_table(world: int, runs: Dict[str, RunResult]) -> None:
    seconds = next(iter(runs.values())).seconds
    print(f"\nW = {world}  (T = {seconds:g} s; 'waiter' = ranks 1..W-1 while waiting, "
          f"{EDGE:g} s left out at each end; bytes = both directions)")
    print(f"{'phase':<17}{'unit':<14}{'kit req':>9}{'(max)':>8}{'kit bytes':>11}"
          f"{'torch req':>10}{'(max)':>8}{'torch bytes':>12}{'kit-torch':>10}")
    for row, label, unit in rows_for(seconds):
        figs = {m: figure(r, row) if r.error is None or row in ("init", "idle") else None
                for m, r in runs.items()}
        if all(f is None for f in figs.values()):
            continue
        kit, torch_ = figs.get("kit"), figs.get("torch")
        extra = kit.requests - torch_.requests if kit and torch_ else None
        print(f"{label:<17}{unit:<14}"
              f"{_num(kit.requests if kit else None)}{_num(kit.requests_max if kit else None, 8)}"
              f"{_bytes(kit.bytes if kit else None, 11)}"
              f"{_num(torch_.requests if torch_ else None, 10)}"
              f"{_num(torch_.requests_max if torch_ else None, 8)}"
              f"{_bytes(torch_.bytes if torch_ else None, 12)}"
              f"{(f'{extra:+10.1f}' if extra is not None else '-'.rjust(10))}")
    for mode, run in runs.items():
        rec = run.rec
        conns: Dict[int, int] = {}
        for info in rec.conns.values():
            conns[info.rank] = conns.get(info.rank, 0) + 1
        unknown = sum(1 for q in rec.requests if q.name == UNKNOWN)
        linger = [g - m["exit_script_end"] for g, m in zip(run.gone, run.marks)
                  if g == g and "exit_script_end" in m]
        print(f"  {mode}: {len(rec.requests)} requests decoded, connections per rank "
              f"{min(conns.values()) if conns else 0}-{max(conns.values()) if conns else 0}, "
              f"unknown {unknown}"
              + (f"; script end to process gone: mean {statistics.mean(linger):.2f} s, max "
                 f"{max(linger):.2f} s" if linger else "")
              + (f", FAILED: {run.error}" if run.error else "")
              + (f", decoder problems: {len(rec.problems)}" if rec.problems else ""))


#: A slope whose change over the measured W is below this share of the level is noise: the
#: projection then uses the level (the mean), not the line.
FLAT_SHARE = 0.10


@dataclass
class Fit:
    """``a + b*W`` through one row's per-rank figures; ``flat``: the slope is within noise."""

    a: float
    b: float
    mean: float
    flat: bool
    top: float = 0.0  # the largest measured figure

    def at(self, world: float) -> float:
        """The model used for the projection: the mean where flat; the largest measured
        figure where the line falls (a per-rank rate does not shrink to zero, let alone below,
        with more ranks: extrapolating a falling line would promise what nothing measured);
        else the line."""
        if self.flat:
            return self.mean
        return self.top if self.b < 0 else self.a + self.b * world

    def line(self, world: float) -> float:
        return self.a + self.b * world


Fits = Dict[str, Dict[str, Fit]]


def fit_points(pts: Sequence[Tuple[int, float]]) -> Fit:
    """The least-squares line through ``(W, figure)`` points, judged flat or not."""
    xs, ys = [float(p[0]) for p in pts], [p[1] for p in pts]
    a, b = fit_line(xs, ys)
    mean = sum(ys) / len(ys)
    spread = abs(b) * (max(xs) - min(xs))
    flat = len(pts) < 2 or spread <= FLAT_SHARE * max(abs(mean), 1e-9)
    return Fit(a, b, mean, flat, max(ys))


def print_fits(results: Dict[str, Dict[int, RunResult]]) -> Fits:
    """Per mode and row, the fitted ``a + b*W`` of the per-rank figure; prints it with the
    residuals at the measured W."""
    fits: Fits = {}
    print("\nGrowth in W: least squares of the per-rank figure, a + b*W "
          "(residual = measured - line; 'flat': the line changes by less than "
          f"{100 * FLAT_SHARE:.0f} % of the level over the measured W, so the projection "
          "uses the mean)")
    for mode, runs in results.items():
        fits[mode] = {}
        seconds = next(iter(runs.values())).seconds if runs else 0.0
        for row, label, unit in rows_for(seconds):
            pts = [(w, f.requests) for w, r in sorted(runs.items()) if r.error is None
                   for f in [figure(r, row)] if f is not None]
            if not pts:
                continue
            fit = fits[mode][row] = fit_points(pts)
            resid = "  ".join(f"W={w}: {y:.2f} ({y - fit.line(w):+.2f})" for w, y in pts)
            flat = (f"flat, mean {fit.mean:.2f}" if fit.flat else
                    f"falls, max {fit.top:.2f}" if fit.b < 0 else "grows")
            print(f"  {mode:<5} {label.strip():<16} {fit.a:7.2f} + {fit.b:6.3f}*W "
                  f"{unit:<13} {flat:<17} {resid}")
    return fits


#: The projection's rows: (table row, label, ranks in it out of W, the others idle)
PROJECTED = [
    ("idle", "idle (every rank)"),
    ("zero_first", "zero_first wait (W-1 waiting)"),
    ("zero_first_later", "  same, after its first 10 s"),
    ("barrier", "barrier wait (W-1 waiting)"),
]


def _look(world: int) -> float:
    """The kit's look interval in a world of ``world`` ranks (this checkout's)."""
    sys.path.insert(0, REPO_ROOT)
    from axolotl_dist._runtime.base.constants import look_interval
    return look_interval(world)


def print_projection(fits: Fits, capacity: Optional[float], measured_as: int) -> None:
    """``measured_as``: the world size whose look interval the measured kit runs used."""
    kit = fits.get("kit")
    if not kit or "idle" not in kit:
        print("\n(no projection: the kit's idle phase was not measured)")
        return
    idle = kit["idle"]
    print("\nProjection of the kit's total requests/s at the store, from the fits above "
          "(waits: W-1 ranks waiting, the one not waiting at the idle rate; a waiter's "
          "requests beyond the idle rate are its looks, one per look interval, which grows "
          "with W: scaled by look(measured)/look(W); 'raw line': the least-squares line "
          "extrapolated even where flat, unscaled)")
    print("  look interval: " + ", ".join(
        f"W={w:,}: {_look(w):g} s" for w in sorted({measured_as, 1024, 8192})) +
        f" (the measured runs looked as W={measured_as:,})")
    cap = f"{capacity:,.0f} req/s" if capacity else "not measured"
    print(f"  store capacity measured here: {cap}")
    print(f"  {'':<9}{'phase':<31}{'model req/s':>15}{'% capacity':>12}{'raw line req/s':>16}")
    for world in (1024, 8192):
        for row, label in PROJECTED:
            fit = kit.get(row)
            if fit is None:
                continue
            if row == "idle":
                total, raw = world * fit.at(world), world * fit.line(world)
            else:
                looks = max(0.0, fit.at(world) - idle.at(world)) * _look(measured_as) / _look(world)
                total = (world - 1) * (idle.at(world) + looks) + idle.at(world)
                raw = (world - 1) * fit.line(world) + idle.line(world)
            share = f"{100 * total / capacity:11,.0f}%" if capacity else "-".rjust(12)
            print(f"  W={world:<7,}{label:<31}{total:>15,.0f}{share}{raw:>16,.0f}")


def print_by_type(results: Dict[str, Dict[int, RunResult]], phase: str) -> None:
    rows = [r for r, _, _ in ROWS if r == phase or (phase == "zero_first" and r == phase)]
    if not rows:
        print(f"\n--by-type: unknown phase {phase!r} (one of {', '.join(r for r, _, _ in ROWS)})")
        return
    for mode, runs in results.items():
        for world, run in sorted(runs.items()):
            types, keys, unit = by_type(run, phase)
            who = "the waiting ranks 1..W-1" if windows(run, phase)[0] and phase not in (
                "init", "idle", "exit") else "every rank"
            print(f"\nBy query type, phase {phase}, {mode}, W = {world} ({unit}, mean over "
                  f"{who})")
            for name, val in sorted(types.items(), key=lambda kv: -kv[1]):
                print(f"    {name:<12} {val:9.2f}")
            print("  by type and key (numbers shown as N, run ids as <id>):")
            for name, val in sorted(keys.items(), key=lambda kv: -kv[1])[:25]:
                print(f"    {val:9.2f}  {name}")


# --------------------------------------------------------------------------------------------
# Self-test: every query type through the proxy, decoded as expected
# --------------------------------------------------------------------------------------------

SELFTEST_CLIENT = r'''
import os, sys
from datetime import timedelta
import torch.distributed as dist
port, legacy = int(sys.argv[1]), sys.argv[2] == "1"
s = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                  timeout=timedelta(seconds=30), use_libuv=not legacy)
s.set("k1", b"v" * 3000)
s.get("k1")
s.add("c", 5)
s.compare_set("k1", b"x", b"y")
s.check(["k1", "c"])
s.wait(["k1"])
s.multi_set(["a", "b"], [b"1", b"2"])
s.multi_get(["a", "b"])
s.append("a", b"3")
s.delete_key("b")
s.num_keys()
if not legacy:
    s.queue_push("q", b"item")
    s.queue_len("q")
    s.queue_pop("q")
    s.list_keys()
    s.barrier("bar", 1)
c = s.clone()
c.add("c", 0)
print("done")
'''

SELFTEST_EXPECTED = [
    "VALIDATE", "PING", "SET", "WAIT", "GET", "ADD", "COMPARE_SET", "CHECK", "WAIT",
    "MULTI_SET", "WAIT", "MULTI_GET", "APPEND", "DELETE_KEY", "GETNUMKEYS",
    "QUEUE_PUSH", "QUEUE_LEN", "WAIT", "QUEUE_POP", "LIST_KEYS", "BARRIER",
    "VALIDATE", "PING", "ADD",
]


def _selftest_unknown() -> bool:
    """A query type outside the table is reported (not miscounted) and still forwarded."""
    rec = Recorder()
    sink = _listen()  # a stand-in server that only receives
    proxy = RankProxy(0, sink.getsockname()[1], rec)
    print("selftest: a deliberately unknown query type follows; the decoder must report it:",
          file=sys.stderr)
    try:
        add = bytes([4]) + (2).to_bytes(8, "little") + b"/c" + (0).to_bytes(8, "little")
        wire = add + bytes([99]) + b"junk-after-it"
        client = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
        server, _ = sink.accept()
        server.settimeout(10)
        client.sendall(wire)
        client.shutdown(socket.SHUT_WR)
        got = b""
        while True:
            chunk = server.recv(4096)
            if not chunk:
                break
            got += chunk
        client.close()
        server.close()
        deadline = time.monotonic() + 10
        while rec.open_count() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        proxy.close()
        sink.close()
    names = [q.name for q in rec.requests]
    ok = got == wire and names[:1] == ["ADD"] and UNKNOWN in names and len(rec.problems) == 1
    print(f"selftest (unknown query type): {'OK' if ok else 'FAILED'} (decoded {names}, "
          f"{len(rec.problems)} problem reported, bytes forwarded intact: {got == wire})")
    return ok


def selftest(legacy: bool, check_unknown: bool = True) -> bool:
    """Drive every client call through one proxy (from another process) and compare the
    decoded sequence with the one the protocol implies."""
    store = _new_store(legacy)
    rec = Recorder()
    proxy = RankProxy(0, store.port, rec)
    try:
        out = subprocess.run([sys.executable, "-c", SELFTEST_CLIENT, str(proxy.port),
                              "1" if legacy else "0"], capture_output=True, text=True,
                             timeout=120)
        deadline = time.monotonic() + 10
        while rec.open_count() and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        proxy.close()
        del store
    problems, rec.problems = list(rec.problems), []
    unknown_ok = _selftest_unknown() if check_unknown else True
    got = [q.name for q in sorted(rec.requests, key=lambda q: (q.conn, q.t))]
    expected = [n for n in SELFTEST_EXPECTED if not legacy or not (
        n.startswith("QUEUE") or n in ("LIST_KEYS", "BARRIER"))]
    if legacy:  # the queue_pop's WAIT goes with the queue calls
        expected = [n for i, n in enumerate(expected)
                    if not (n == "WAIT" and i > 0 and expected[i - 1] == "GETNUMKEYS")]
    ok = out.returncode == 0 and got == expected and not problems and unknown_ok
    print(f"selftest ({'legacy' if legacy else 'libuv'} store): {'OK' if ok else 'FAILED'}")
    print(f"  decoded:  {' '.join(got)}")
    if got != expected:
        print(f"  expected: {' '.join(expected)}")
    sizes = {q.name: q.nbytes for q in rec.requests}
    keys = {q.name: q.key for q in rec.requests}
    print(f"  bytes: SET {sizes.get('SET')} (key {keys.get('SET')!r}: TCPStore prefixes '/'; "
          f"1+8+3+8+3000 = 3020), ADD {sizes.get('ADD')} (1+8+2+8 = 19), "
          f"VALIDATE {sizes.get('VALIDATE')} (1+4 = 5), PING {sizes.get('PING')} (1+4 = 5)")
    if out.returncode != 0:
        print(out.stderr[-2000:])
    return ok and sizes.get("SET") == 3020 and sizes.get("ADD") == 19 and \
        sizes.get("VALIDATE") == 5 and sizes.get("PING") == 5


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------

def _worlds(text: str) -> List[int]:
    worlds = sorted({int(w) for w in text.split(",") if w.strip()})
    if not worlds or min(worlds) < 2:
        raise argparse.ArgumentTypeError("world sizes must be integers >= 2")
    return worlds


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Count the c10d TCPStore requests and bytes per rank, per phase (init, "
                    "idle, zero_first wait, barrier wait, spread exits), of the kit and of "
                    "plain torch, through a decoding proxy; fit their growth in W; measure "
                    "the store's capacity; project to 1,024 and 8,192 ranks.",
        epilog="Run from the repository root: python benchmarks/store_traffic.py",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--worlds", type=_worlds, default=[2, 4, 8, 16],
                        help="comma-separated world sizes, e.g. 4,16")
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="T: the idle phase and each wait last this long")
    parser.add_argument("--mode", choices=("kit", "torch", "both"), default="both")
    parser.add_argument("--by-type", metavar="PHASE", default=None,
                        help="also print per-query-type (and per-key) figures of one phase: "
                             + ", ".join(r for r, _, _ in ROWS))
    parser.add_argument("--capacity-clients", type=int, default=8,
                        help="client processes of the capacity measurement (0: skip it)")
    parser.add_argument("--capacity-seconds", type=float, default=3.0)
    parser.add_argument("--legacy-store", action="store_true",
                        help="the non-libuv TCPStore server (no queues, list_keys, barrier)")
    parser.add_argument("--selftest", action="store_true",
                        help="only check the decoder against every client call, and exit")
    parser.add_argument("--save", metavar="FILE", default=None,
                        help="also write every request and mark measured to FILE (JSON)")
    parser.add_argument("--load", metavar="FILE", default=None,
                        help="measure nothing: print the report from a --save FILE")
    parser.add_argument("--look-as", type=int, default=0, metavar="W",
                        help="the kit's ranks look at the store as in a world of W ranks "
                             "(axolotl_dist's look_interval(W)): measures a large world's "
                             "waits with few ranks")
    parser.add_argument("--verbose", action="store_true",
                        help="print phase progress and keep the ranks' logs")
    return parser.parse_args(argv)


def save(path: str, results: Dict[str, Dict[int, RunResult]], capacity: Optional[float],
         capacity_note: str) -> None:
    """Everything measured, as JSON (``--load`` prints the same report from it)."""
    runs = []
    for by_world in results.values():
        for run in by_world.values():
            rec = run.rec
            runs.append({
                "mode": run.mode, "world": run.world, "seconds": run.seconds,
                "marks": run.marks, "gone": [g if g == g else None for g in run.gone],
                "error": run.error, "problems": rec.problems, "look_as": run.look_as,
                "requests": [[q.t, q.rank, q.conn, q.name, q.nbytes, q.key]
                             for q in rec.requests],
                "replies": [[r.t, r.rank, r.conn, r.nbytes] for r in rec.replies],
                "conns": {str(k): [c.rank, c.opened, c.closed, c.requests, c.desynced]
                          for k, c in rec.conns.items()},
            })
    with open(path, "w") as fh:
        json.dump({"capacity": capacity, "capacity_note": capacity_note, "runs": runs}, fh)


def load(path: str) -> Tuple[Dict[str, Dict[int, RunResult]], Optional[float], str]:
    """What :func:`save` wrote."""
    with open(path) as fh:
        data = json.load(fh)
    results: Dict[str, Dict[int, RunResult]] = {}
    for item in data["runs"]:
        rec = Recorder()
        rec.requests = [Request(*q) for q in item["requests"]]
        rec.replies = [Reply(*r) for r in item["replies"]]
        rec.conns = {int(k): ConnInfo(*c) for k, c in item["conns"].items()}
        rec.problems = list(item["problems"])
        gone = [float("nan") if g is None else g for g in item["gone"]]
        results.setdefault(item["mode"], {})[item["world"]] = RunResult(
            item["mode"], item["world"], item["seconds"], item["marks"], gone, rec,
            item["error"], item.get("look_as", 0))
    return results, data["capacity"], data["capacity_note"]


def measure(args: argparse.Namespace) -> Tuple[Dict[str, Dict[int, RunResult]],
                                                Optional[float], str]:
    """Run every world size and mode (printing each world's table as it completes), then
    the capacity."""
    modes = ["kit", "torch"] if args.mode == "both" else [args.mode]
    results: Dict[str, Dict[int, RunResult]] = {m: {} for m in modes}
    for world in args.worlds:
        for mode in modes:
            began = time.monotonic()
            results[mode][world] = run_world(mode, world, args.seconds, args.legacy_store,
                                             args.verbose, args.look_as)
            print(f"  ran {mode} W={world} in {time.monotonic() - began:.0f} s", flush=True)
        print_world_table(world, {m: results[m][world] for m in modes})
    capacity: Optional[float] = None
    note = "not measured"
    if args.capacity_clients > 0:
        try:
            capacity, rates = measure_capacity(args.capacity_clients, args.capacity_seconds,
                                               args.legacy_store)
            note = (f"add(key, 0) requests/s in total from {args.capacity_clients} client "
                    f"processes over {args.capacity_seconds:g} s (each "
                    f"{min(rates):,.0f}-{max(rates):,.0f}/s; clients and server share this "
                    f"machine's {os.cpu_count()} CPUs)")
        except Exception as exc:  # noqa: BLE001 - report and go on with the rest
            note = f"measurement failed: {exc}"
            print(f"\n!!! capacity {note}", file=sys.stderr)
    return results, capacity, note


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.selftest:
        return 0 if selftest(args.legacy_store) else 1
    t0 = time.monotonic()
    if args.load:
        results, capacity, note = load(args.load)
        print(f"store_traffic: the measurements saved in {args.load}")
        for world in sorted({w for runs in results.values() for w in runs}):
            print_world_table(world, {m: runs[world] for m, runs in results.items()
                                      if world in runs})
    else:
        import torch
        print(f"store_traffic: torch {torch.__version__}, {os.cpu_count()} CPUs, "
              f"{'legacy' if args.legacy_store else 'libuv'} store, W in {args.worlds}, "
              f"T = {args.seconds:g} s, mode {args.mode}", flush=True)
        if not selftest(args.legacy_store, check_unknown=False):
            print("!!! the decoder's self-test failed: the figures below may be miscounted",
                  file=sys.stderr)
        results, capacity, note = measure(args)
        if args.save:
            save(args.save, results, capacity, note)
    shown = f"{capacity:,.0f} " if capacity else ""
    print(f"\nStore capacity: {shown}{note}")
    fits = print_fits(results)
    kit_runs = list(results.get("kit", {}).values())
    print_projection(fits, capacity, max((r.look_as or r.world for r in kit_runs), default=0))
    if args.by_type:
        print_by_type(results, args.by_type)
    problems = [p for runs in results.values() for r in runs.values() for p in r.rec.problems]
    failed = [f"{r.mode} W={r.world}" for runs in results.values() for r in runs.values()
              if r.error]
    if problems:
        print(f"\n!!! {len(problems)} decoder problem(s); first: {problems[0]}")
    if failed:
        print(f"\n!!! failed runs: {', '.join(failed)}")
    if not args.load:
        print(f"\n(total {time.monotonic() - t0:.0f} s)")
    return 1 if problems or failed else 0


if __name__ == "__main__":
    sys.exit(main())
