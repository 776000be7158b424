"""The kit's object for a process group, resolved once per call by :func:`group_of`.

Every helper, block, debug check and the timeline's recorder take a :class:`Group`: what the
kit knows of one process group, computed once and kept for the group's lifetime (in
:data:`.state.GROUPS`, keyed by the group **weakly**: a group kept alive by a cache past
``destroy_process_group()`` would be destroyed during interpreter shutdown, where gloo's
threads abort the process). ``group=None`` means the default group, everywhere. It holds:

* ``rank``, ``size``, ``device``, ``cpu``: this rank in the group, its size, the device its
  collectives use (:mod:`.backends`) and whether that is the CPU (gloo: sliced waits);
* ``seq``: per-kind call counters (``zero_first`` blocks, debug checks, traced calls...),
  and ``calls``, the kit's collectives on the group, which line up across ranks as long as
  every rank calls the same helpers in the same order (:mod:`..liveness.deadlock` compares them);
* the value helpers' preallocated buffers and the group's own collectives (the header
  exchange: docs/design.md, "Value encoding");
* ``store``: the group's c10d store, once a block asked for it; ``debug``: debug mode's log;
  ``world_mesh`` (default group); ``connections`` (:class:`GroupConnections`: the store
  connections beside the group's own, and the finished blocks' keys awaiting deletion); ``abandoned`` (a collective left pending: kept at exit);
  ``open_blocks`` (thread id -> its innermost open block: :mod:`..protocols.threads`).

:func:`group_of` is the one function that turns a ``group=`` argument into a :class:`Group`;
its fast path (the default group, used last) is an identity test and two env reads.
"""

from __future__ import annotations

import array
import weakref
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import backends
from ...env.variables import STANDIN_ENV_VAR, kit_switch
from .state import FAILURES, GROUPS
from ... import env as _env
from ...errors import DistributedEnvError, RankFailedError
from ...ranks import get_rank, get_world_size

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = ["world", "Group", "HeaderBuffers", "GroupConnections", "NOT_ASKED", "NOT_MADE",
           "STANDIN_ENV_VAR", "STANDIN_DEVICE", "channel_of", "group_of", "default_pg", "on_first_use", "remember_failure", "known_failure",
           "forget_last_group", "failure_record", "restore_failure_record",
           "HEADER_LEN", "A2A_MAX_RANKS", "CARRY_BYTES", "CARRY_MAX_RANKS"]

#: torch's holder of the default group; reading it has no side effects.
world: Any = dist.distributed_c10d._world if dist.is_available() else None
#: Slots of a value header (docs/design.md, "Value encoding").
HEADER_LEN = 4
#: Up to this many ranks, the CPU header exchange is an all-to-all, beyond it gloo's ring
#: all-gather (:mod:`..protocols.exchange`; docs/design.md, "Value encoding").
A2A_MAX_RANKS = 64
#: Bytes of small tensors a CPU group's header frame carries (groups of up to
#: :data:`CARRY_MAX_RANKS` ranks): an all-to-all this long costs gloo no more than one of the
#: bare header (docs/performance.md, "Shape checks").
CARRY_BYTES = 2048
#: The largest group whose frames carry tensors (each exchange moves ranks x frame bytes).
CARRY_MAX_RANKS = 16
_I64 = torch.int64
_RANK_RAW, _WS_RAW = _env.rank_raw, _env.world_size_raw  # the raw env values (identity-stable)


#: What runs when a group is first used (:func:`on_first_use`): the kit's services.
_FIRST_USE: List[Callable[[], None]] = []


def on_first_use(hook: Callable[[], None]) -> None:
    """Run ``hook`` whenever :func:`group_of` builds a :class:`Group` (the first use of a
    process group; ``init_distributed`` runs it too). :mod:`..lifecycle.services` registers the kit's
    services (exit hook, heartbeat) here: the floors below it cannot import it."""
    if hook not in _FIRST_USE:
        _FIRST_USE.append(hook)


#: What runs when this process learns of another rank's failure it is about to raise
#: (:func:`on_peer_failure`).
_ON_PEER_FAILURE: List[Callable[[RankFailedError], None]] = []


def on_peer_failure(hook: Callable[[RankFailedError], None]) -> None:
    """Run ``hook`` with each new failure of another rank that :func:`remember_failure`
    records: :mod:`..liveness.failures` lets the store's host keep it readable first."""
    if hook not in _ON_PEER_FAILURE:
        _ON_PEER_FAILURE.append(hook)


def default_pg() -> Any:
    """The default process group now (None before init): what a record made under one group
    compares with, to tell that the group was replaced. Not a resolution of a ``group=``
    argument: that is :func:`group_of`."""
    return world.default_pg if world is not None else None


def _options(cls: Any, async_op: bool) -> Any:
    opts = cls()
    if hasattr(opts, "asyncOp"):
        opts.asyncOp = async_op
    return opts


#: :attr:`Group.node_first` before the first block asked.
NOT_ASKED = object()
#: :attr:`Group.channel` of an accelerator group before its first use.
NOT_MADE = object()
#: The device of a stand-in accelerator group: the CPU, named so that a test can tell the
#: tensors made on it (``device=`` given) from host ones.
STANDIN_DEVICE = torch.device("cpu", 0)


class HeaderBuffers:
    """The value helpers' header exchange on one group (:mod:`..protocols.exchange`).

    A scalar is a 32-byte header, so per-call Python work shows directly in their latency. On
    CPU the header goes through preallocated buffers backed by an ``array`` (a Python store
    into it costs nanoseconds, a fresh tensor microseconds), and through the group's own
    collectives with options built once (what torch's functions call after their checks). The
    class's methods, not bound ones (those would keep the group alive); torch before 2.13 names
    the all-gather ``_allgather_base``.

    Each rank's part of an exchange is a *frame* of ``frame`` int64 words: the header, then,
    on a CPU group of 2 to :data:`CARRY_MAX_RANKS` ranks, :data:`CARRY_BYTES` of room for
    small tensors a checked helper sends with its header (:mod:`..protocols.packets`). Every
    exchange on the group sends frames of that one size, whichever helper runs it (gloo aborts
    the process when two ranks' sizes differ), so two helpers that meet still read each
    other's header."""

    __slots__ = ("opts", "allgather", "hdr_arr", "hdr", "all_arr", "hdr_all", "a2a", "a2a_opts",
                 "a2a_arr", "a2a_in", "bcast", "bcast_opts", "frame", "views")

    def __init__(self, pg: Any, size: int, cpu: bool) -> None:
        cls = type(pg)
        c10d = dist.distributed_c10d
        self.opts = _options(c10d.AllgatherOptions, False)
        self.allgather = getattr(cls, "all_gather_single", None) or getattr(cls, "_allgather_base", None)
        self.a2a = (getattr(cls, "all_to_all_single", None) or getattr(cls, "alltoall_base", None)
                    if cpu and 1 < size <= A2A_MAX_RANKS else None)
        self.a2a_opts = _options(c10d.AllToAllOptions, True)
        self.bcast = cls.broadcast if cpu else None
        self.bcast_opts = _options(c10d.BroadcastOptions, True)
        self.bcast_opts.rootTensor = 0
        carries = self.a2a is not None and size <= CARRY_MAX_RANKS
        self.frame = words = HEADER_LEN + (CARRY_BYTES // 8 if carries else 0)
        self.hdr_arr = array.array("q", bytes(8 * words))
        self.all_arr = array.array("q", bytes(8 * words * size))
        self.a2a_arr = array.array("q", bytes(8 * words * size))
        self.hdr = torch.frombuffer(self.hdr_arr, dtype=_I64) if cpu else None
        self.hdr_all = torch.frombuffer(self.all_arr, dtype=_I64) if cpu else None
        self.a2a_in = torch.frombuffer(self.a2a_arr, dtype=_I64) if self.a2a is not None else None
        #: carried tensors' views of ``all_arr`` by layout (:func:`..protocols.packets.carried_parts`)
        self.views: Dict[Tuple[Any, ...], Any] = {}


class GroupConnections:
    """A group's store connections beside its own, and what they serve (:mod:`..store`):
    ``cleanup`` deletes finished blocks' keys in the background (:mod:`..store.sweep`), whose
    keys wait in ``finished_keys`` (block kind -> keys); ``idle`` is the clone a key waiter of
    a group that is not the default one blocks on, kept for its next wait
    (:mod:`..store.wakeup`)."""

    __slots__ = ("cleanup", "idle", "finished_keys")

    def __init__(self) -> None:
        self.cleanup: Any = None
        self.idle: Any = None
        self.finished_keys: Dict[str, List[Any]] = {}


class Group:
    """What the kit knows of one process group (see the module docstring)."""

    __slots__ = ("pg_ref", "default", "rank", "size", "device", "channel", "env_rank", "env_ws", "seq",
                 "store", "debug", "world_mesh", "connections", "abandoned", "node_first", "calls", "open_blocks", "_ranks", "headers",
                 "gather_slots", "__weakref__")

    def __init__(self, pg: Any, rank: int, size: int, device: torch.device,
                 accelerator: Optional[bool] = None) -> None:
        self.pg_ref: Callable[[], Any] = weakref.ref(pg)
        self.default = pg is default_pg()  # the world group: torch's APIs take None for it
        self.rank, self.size, self.device = rank, size, device
        #: where the group's metadata (headers, descriptions, shape checks) travels: None for
        #: a CPU group (itself), else a CPU group of the same ranks, made at its first use
        #: (:func:`channel_of`); ``accelerator``: treat the group as an accelerator's whatever
        #: its device (the CPU stand-in of the kit's tests, :data:`STANDIN_ENV_VAR`)
        accel = device.type != "cpu" if accelerator is None else accelerator
        self.channel: Any = NOT_MADE if accel else None
        self.env_rank, self.env_ws = _RANK_RAW(), _WS_RAW()
        self.seq: Dict[str, int] = {}
        self.calls = 0  # the kit's collectives on this group so far (:mod:`..liveness.deadlock`)
        self.store: Any = None
        self.debug: Any = None
        self.world_mesh: Any = None
        self.connections = GroupConnections()
        #: a default zero_first's first rank(s) on this group: None (group rank 0 alone), or
        #: whether this rank is its node's first (several nodes, no shared filesystem); unset
        #: until the first block asks (:mod:`axolotl_dist.ordering`)
        self.node_first: Any = NOT_ASKED
        self.abandoned = False
        self.open_blocks: Dict[int, Any] = {}
        self._ranks: Optional[List[int]] = None
        #: helper -> bytes per rank of its last structure gather (:mod:`axolotl_dist.operations`):
        #: its next one sends that many in its first all-gather; the same on every rank
        self.gather_slots: Dict[str, int] = {}
        self.headers = HeaderBuffers(pg, size, self.cpu)

    @property
    def cpu(self) -> bool:
        """Whether the group's collectives run on the CPU (gloo: sliced waits, host buffers)."""
        return self.channel is None

    @property
    def arg(self) -> Any:
        """The group as torch's ``group=`` argument: None for the default group (its store
        is the world's, where a group's own store would add a prefix)."""
        return None if self.default else self.pg_ref()

    @property
    def ranks(self) -> List[int]:
        """The global rank of every group rank, in group-rank order."""
        if self._ranks is None:
            pg = self.pg_ref()
            self._ranks = (list(range(self.size)) if self.default or pg is None
                           else list(dist.get_process_group_ranks(pg)))
        return self._ranks

    def global_rank(self, group_rank: int) -> int:
        """The global rank of ``group_rank`` in this group."""
        return self.ranks[group_rank]

    def next_seq(self, kind: str) -> int:
        """The next number of this rank's ``kind`` counter on this group (1, 2, ...)."""
        seq = self.seq[kind] = self.seq.get(kind, 0) + 1
        return seq


def _needs_group(op: str, group: Any) -> None:
    """Raise when the env says several ranks (or a group was passed) but none exists."""
    ws = _env.env_world_size()
    if group is not None or ws > 1:
        raise DistributedEnvError(
            f"{op}() needs a process group: the environment says WORLD_SIZE={ws} but "
            "torch.distributed is not initialized; call axolotl_dist.init_distributed() first")


def _build(group: Optional["ProcessGroup"], pg: Any) -> Group:
    """A new :class:`Group` for ``pg``: its rank and size (the env must agree with the world
    group: raises otherwise), its device; the kit's services start at a group's first use."""
    rank, size = get_rank(group), get_world_size(group)
    if group is not None:
        get_rank(), get_world_size()  # the env must agree with the world group too
    for hook in _FIRST_USE:
        hook()
    device = backends.comm_device(str(dist.get_backend(group)), pg)
    if device.type == "cpu" and _standin():
        return Group(pg, rank, size, STANDIN_DEVICE, accelerator=True)
    return Group(pg, rank, size, device)


def _standin() -> bool:
    """Whether gloo groups stand in for accelerator groups (``AXOLOTL_DIST_STANDIN_DEVICE``)."""
    return kit_switch(STANDIN_ENV_VAR)


def channel_of(g: Group) -> Group:
    """The CPU group that carries ``g``'s metadata (``g`` itself on CPU): for an accelerator
    group, made at its first use by its ranks alone (every rank of ``g`` is in the same kit
    call then): the same process group where its backend serves CPU tensors too
    (``"cuda:nccl,cpu:gloo"``, what ``init_distributed`` makes), else a gloo group of the
    same ranks. Nothing of the metadata ever crosses the device: no host synchronisation."""
    if g.channel is None:
        return g
    if g.channel is NOT_MADE:
        pg = g.pg_ref()
        if backends.supports(str(dist.get_backend(pg)), "cpu") and not _standin():
            cpu_pg = pg
        else:
            cpu_pg = _gloo_group(g)
        g.channel = Group(cpu_pg, g.rank, g.size, torch.device("cpu"))
    return g.channel


def _gloo_group(g: Group) -> Any:
    """A gloo group of ``g``'s ranks, made by them alone; a failure (gloo finds no interface
    the ranks reach each other on) is one error saying what to set."""
    try:
        return dist.new_group(g.ranks, backend="gloo", use_local_synchronization=True)
    except RuntimeError as exc:
        raise DistributedEnvError(
            f"could not make the CPU channel of a {dist.get_backend(g.pg_ref())} process group "
            f"(a gloo group of its ranks {g.ranks}, which carries the kit's headers and shape "
            f"checks so that they never stall the GPU): {str(exc).splitlines()[0]}. Set "
            "GLOO_SOCKET_IFNAME to the network interface the nodes reach each other on, or "
            "create the group with backend='cuda:nccl,cpu:gloo'") from exc


def group_of(group: Optional["ProcessGroup"], op: str, create: bool = True) -> Optional[Group]:
    """The :class:`Group` for ``group`` (None: the default group), built at its first use.

    None for a single process without a process group (``op`` then runs locally); raises
    :class:`DistributedEnvError` naming ``op`` when the env says several ranks but no group
    exists, and when the env's ``RANK``/``WORLD_SIZE`` disagree with the group. With
    ``create=False`` (a query that must not start anything: the world mesh, at cleanup) only
    a group already in use is returned, else None, and nothing is checked.
    """
    last = GROUPS.last_group  # the group used last: most programs use one
    if (group is None and last is not None and last.pg_ref() is world.default_pg is not None
            and last.env_rank is _RANK_RAW() and last.env_ws is _WS_RAW()):
        return last
    return _resolve(group, op, create)


def _resolve(group: Optional["ProcessGroup"], op: str, create: bool) -> Optional[Group]:
    """:func:`group_of` past its fast path: look the group up, build it at its first use,
    check the env against it again when the env changed."""
    pg = group if group is not None else default_pg()
    if pg is None or world is None or world.default_pg is None:
        if create:
            _needs_group(op, group)
        return None
    try:
        found = GROUPS.groups.get(pg)
    except TypeError:  # torch's "not a member" sentinel cannot be weakly referenced
        return _build(group, pg) if create else None  # raises: not a member
    if not create:
        return found
    if found is None:
        found = GROUPS.groups[pg] = _build(group, pg)
    elif found.env_rank is not _RANK_RAW() or found.env_ws is not _WS_RAW():
        get_rank(group), get_world_size(group), get_rank(), get_world_size()  # still agree?
        found.env_rank, found.env_ws = _RANK_RAW(), _WS_RAW()
    if group is None or pg is world.default_pg:
        GROUPS.last_group = found
    return found


def remember_failure(error: RankFailedError) -> RankFailedError:
    """Remember ``error``, another rank's failure that this process is about to raise, under
    the current default group, and return it. A rank that ends after it (even normally)
    relays it in its exit record, so its peers name the rank that really failed. Called by the
    functions that build such an account (a decoded report, a lost peer, a lost store host):
    the exception itself records nothing. Kept as the error's fields, not the error: a raised error's
    traceback keeps every frame it passed through alive, with their tensors."""
    pg = default_pg()
    if pg is not None and error.rank != pg.rank():  # its own failure relayed back: not remembered
        report, known = error.__reduce__(), FAILURES.known  # its fields, no frames
        FAILURES.known = (weakref.ref(pg), report)
        if known is None or known[1] != report:
            for hook in _ON_PEER_FAILURE:
                hook(error)
    return error


def known_failure() -> Optional[RankFailedError]:
    """The failure :func:`remember_failure` last recorded under the current default group, if any."""
    record = FAILURES.known
    if record is None:
        return None
    pg = record[0]()
    if pg is None or pg is not default_pg():
        return None
    rebuild, fields = record[1]
    return rebuild(*fields)


def forget_last_group() -> None:
    """Drop the fast path's group (at cleanup: the next call resolves its group again)."""
    GROUPS.last_group = None


def failure_record() -> Any:
    """The failure :func:`remember_failure` keeps, as kept (for :func:`restore_failure_record`)."""
    return FAILURES.known


def restore_failure_record(record: Any) -> None:
    """Put back what :func:`failure_record` returned: a failure remembered since then was not
    another rank's (a block this rank entered alone)."""
    FAILURES.known = record
