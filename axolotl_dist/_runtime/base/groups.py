"""The kit's object for a process group, resolved once per call by :func:`group_of`.

Every helper, block, debug check and the timeline's recorder take a :class:`Group`: which
process group a call is on, computed once and kept for the group's lifetime (in
:data:`.state.GROUPS`, keyed by the group **weakly**: a group kept alive by a cache past
``destroy_process_group()`` would be destroyed during interpreter shutdown, where gloo's
threads abort the process). ``group=None`` means the default group, everywhere. It holds
what identifies the group, and nothing a room keeps about it (each room keeps that in its own
:class:`~.state.PerGroup` map: the call counters in :mod:`..liveness.progress`, the header
buffers in :mod:`..protocols.headers`, the store connections in :mod:`..store.store_state`):

* ``rank``, ``size``, ``device``: this rank in the group, its size, the device its
  collectives use (:mod:`.backends`); ``ranks``: every rank's global rank;
* ``channel``: where its metadata travels (None: the group itself, a CPU group);
* ``default``, ``pg_ref``: whether it is the world group, and the group itself (weakly);
* ``env``: the raw ``RANK`` and ``WORLD_SIZE`` it was checked against.

:func:`group_of` is the one function that turns a ``group=`` argument into a :class:`Group`;
its fast path (the default group, used last) is an identity test and two env reads. Nothing
outside this module writes a :class:`Group` (its ``__setattr__`` refuses).
"""

from __future__ import annotations

import enum
import weakref
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import backends, hooks
from ...env.variables import STANDIN_ENV_VAR, kit_switch
from .state import FAILURES, GROUPS
from ... import env as _env
from ...errors import DistributedEnvError, RankFailedError
from ...ranks import get_rank, get_world_size

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = ["world", "Group", "NOT_MADE", "STANDIN_ENV_VAR", "STANDIN_DEVICE", "channel_of",
           "group_of", "default_pg", "remember_failure", "known_failure",
           "forget_last_group", "failure_record", "restore_failure_record"]

#: torch's holder of the default group; reading it has no side effects.
world: Any = dist.distributed_c10d._world if dist.is_available() else None
_RANK_RAW, _WS_RAW = _env.rank_raw, _env.world_size_raw  # the raw env values (identity-stable)


def default_pg() -> Any:
    """The default process group now (None before init): what a record made under one group
    compares with, to tell that the group was replaced. Not a resolution of a ``group=``
    argument: that is :func:`group_of`."""
    return world.default_pg if world is not None else None


#: The device of a stand-in accelerator group: the CPU, named so that a test can tell the
#: tensors made on it (``device=`` given) from host ones.
STANDIN_DEVICE = torch.device("cpu", 0)


class _Unmade(enum.Enum):
    """:attr:`Group.channel` of an accelerator group before its first use."""

    NOT_MADE = "not made"


NOT_MADE = _Unmade.NOT_MADE


class Group:
    """Which process group a call is on (see the module docstring). Read-only outside this
    module: :func:`_set` writes it."""

    __slots__ = ("pg_ref", "default", "rank", "size", "device", "channel", "env", "_ranks",
                 "__weakref__")

    pg_ref: Callable[[], Optional["ProcessGroup"]]
    default: bool
    rank: int
    size: int
    device: torch.device
    #: where the group's metadata (headers, descriptions, shape checks) travels: None for a
    #: CPU group (itself), else a CPU group of the same ranks, made at its first use
    #: (:func:`channel_of`)
    channel: Union["Group", None, _Unmade]
    env: Tuple[object, object]
    _ranks: Optional[List[int]]

    def __init__(self, pg: "ProcessGroup", rank: int, size: int, device: torch.device,
                 accelerator: Optional[bool] = None) -> None:
        # ``accelerator``: treat the group as an accelerator's whatever its device (the CPU
        # stand-in of the kit's tests, :data:`STANDIN_ENV_VAR`)
        accel = device.type != "cpu" if accelerator is None else accelerator
        _set(self, pg_ref=weakref.ref(pg), default=pg is default_pg(), rank=rank, size=size,
             device=device, channel=NOT_MADE if accel else None, env=(_RANK_RAW(), _WS_RAW()),
             _ranks=None)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Group.{name} is written by _runtime/base/groups.py alone: what "
                             "a room keeps about a group goes in that room's PerGroup map")

    @property
    def cpu(self) -> bool:
        """Whether the group's collectives run on the CPU (gloo: sliced waits, host buffers)."""
        return self.channel is None

    @property
    def arg(self) -> Optional["ProcessGroup"]:
        """The group as torch's ``group=`` argument: None for the default group (its store
        is the world's, where a group's own store would add a prefix)."""
        return None if self.default else self.pg_ref()

    @property
    def ranks(self) -> List[int]:
        """The global rank of every group rank, in group-rank order."""
        if self._ranks is None:
            pg = self.pg_ref()
            _set(self, _ranks=(list(range(self.size)) if self.default or pg is None
                               else list(dist.get_process_group_ranks(pg))))
        return self._ranks  # type: ignore[return-value]

    def global_rank(self, group_rank: int) -> int:
        """The global rank of ``group_rank`` in this group."""
        return self.ranks[group_rank]


def _set(g: Group, **fields: object) -> None:
    """Write ``fields`` of ``g`` (the one writer of a :class:`Group`)."""
    for name, value in fields.items():
        object.__setattr__(g, name, value)


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
    hooks.first_use()  # the kit's services start (:mod:`.hooks`)
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
        _set(g, channel=Group(cpu_pg, g.rank, g.size, torch.device("cpu")))
    return g.channel  # type: ignore[return-value]


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
            and last.env[0] is _RANK_RAW() and last.env[1] is _WS_RAW()):
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
    elif found.env[0] is not _RANK_RAW() or found.env[1] is not _WS_RAW():
        get_rank(group), get_world_size(group), get_rank(), get_world_size()  # still agree?
        _set(found, env=(_RANK_RAW(), _WS_RAW()))
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
            hooks.peer_failure(error)
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
