"""Checkpoints every rank agrees on: written once, committed atomically, waited for without the
group's timeout, failures named on every rank (docs/checkpoints.md).

.. code-block:: python

    with ad.checkpoint_dir("ckpt", step, keep=3) as path:
        if path.should_save:
            torch.save(model.state_dict(), os.path.join(path, "model.pt"))
        torch.save(rng_state(), os.path.join(path, f"rng-{ad.get_rank()}.pt"))

    resume = ad.latest_checkpoint("ckpt")  # the same on every rank; None on a first run

The protocol is in :mod:`axolotl_dist._runtime.protocols.checkpointing`.
"""

from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Union

from ._runtime.liveness.progress import advance
from . import env as _env
from ._runtime.base.callsite import call_site
from ._runtime.base.groups import Group, group_of
from ._runtime.liveness.liveness_state import HEARTBEAT
from ._runtime.base.kitlog import kit as _log
from ._runtime.protocols import checkpointing as _checkpointing
from ._runtime.protocols import leases as _leases
from ._runtime.protocols.codes import register_helper
from ._runtime.protocols.exchange import all_gather_values
from ._runtime.protocols import shared_fs as _shared_fs
from ._runtime.protocols.checkpointing import CheckpointBlock
from ._runtime.protocols.helpers import call
from ._runtime.protocols.threads import enter_block, leave_block
from .errors import DistributedConfigError
from .ranks import get_local_rank, get_rank

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = ["checkpoint_dir", "latest_checkpoint", "CheckpointPath", "Checkpoint"]

PathArg = Union[str, "os.PathLike[str]"]

# Their exchanges of what each rank sees under root are named after them (a rank elsewhere
# meets "checkpoint_dir", not an all-gather it never called).
register_helper("checkpoint_dir")
register_helper("latest_checkpoint")


class CheckpointPath(str):
    """The directory a :func:`checkpoint_dir` block writes into (its staging directory): a
    ``str``, so ``os.path.join``, ``torch.save`` and ``torch.distributed.checkpoint``'s
    ``checkpoint_id`` take it as it is.

    :ivar step: the checkpoint's step.
    :ivar final: where the checkpoint is once the block commits it (``<root>/step-<step>``).
    :ivar should_save: whether this rank writes the files one copy of which is enough (the
        model's weights, a config): group rank 0, or with ``per_node=True`` each node's first
        rank (Hugging Face's ``should_save``).
    """

    step: int
    final: str
    should_save: bool

    def __new__(cls, path: str, step: int, final: str, should_save: bool) -> "CheckpointPath":
        self = super().__new__(cls, path)
        self.step, self.final, self.should_save = step, final, should_save
        self._futures: List[Callable[[Optional[float]], Any]] = []
        return self

    def commit_after(self, future: Any) -> None:
        """Hand this rank's writes over to ``future`` (what
        ``torch.distributed.checkpoint.async_save`` or an executor's ``submit`` returns): the
        block then ends at once, and the checkpoint is committed once every rank's futures are
        done, when the ranks next meet the kit's checkpoints (the next :func:`checkpoint_dir`,
        :func:`latest_checkpoint`, ``cleanup_distributed()`` or the exit, which waits for it).
        A future that raises is raised there on its rank, and as
        :class:`~axolotl_dist.errors.RankFailedError` naming the rank on every other; nothing
        is committed. The block's ``timeout`` bounds the wait for them too (at the exit as
        well: a future not done by then is a ``TimeoutError``)."""
        self._futures.append(_checkpointing.future_wait(future))


class Checkpoint(str):
    """A committed checkpoint, as :func:`latest_checkpoint` finds it: a ``str`` (its directory,
    ``<root>/step-<step>``), so ``os.path.join``, ``torch.load`` and DCP's ``checkpoint_id``
    take it as it is, and ``step``, the step to resume after.

    :ivar step: the checkpoint's step (the ``step`` its ``checkpoint_dir`` was given).
    """

    step: int

    def __new__(cls, path: str, step: int) -> "Checkpoint":
        self = super().__new__(cls, path)
        self.step = step
        return self

    def __reduce__(self) -> Tuple[Any, Tuple[str, int]]:  # pickled with its step
        return (Checkpoint, (str(self), self.step))


def _root_arg(call: str, root: Any) -> str:
    """``root`` as a path (else a TypeError naming the call and the argument)."""
    if not isinstance(root, (str, os.PathLike)) or not os.fspath(root):
        raise TypeError(f"{call}(root={root!r}) must be a directory path (str or os.PathLike)")
    return os.fspath(root)


def _check_args(root: Any, step: Any, keep: Any, timeout: Any) -> str:
    """``root`` as a path, once every argument is valid (else a clear error naming it)."""
    path = _root_arg("checkpoint_dir", root)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"checkpoint_dir(step={step!r}) must be an int >= 0 (the training "
                         "step the checkpoint is of: it names the directory step-<step>)")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"checkpoint_dir(keep={keep!r}) must be an int >= 1 (how many "
                         "checkpoints to keep, the new one included) or None (keep all)")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or timeout <= 0):
        raise ValueError(f"checkpoint_dir(timeout={timeout!r}) must be a positive number of "
                         "seconds or None (wait as long as the slowest writer takes)")
    return path


def _writes(g: Group, root: str, per_node: bool) -> bool:
    """Whether this rank commits the checkpoint on its filesystem: group rank 0, or, on the
    world group of nodes that do not share ``root``, each node's first rank (``per_node``;
    without it, a clear error on every rank)."""
    if not g.default or _env.env_num_nodes(g.size) == 1:
        return g.rank == 0
    if _shared_fs.said():
        shared: Optional[bool] = _env.env_shared_filesystem()
    else:
        shared = _shared_fs.shares(f"checkpoint_dir:{root}", root, get_rank(), get_local_rank(),
                                   g.size)
    if shared is not False:  # shared, or undecided (rank 0 could not write there: it says so)
        return g.rank == 0
    if per_node:
        return get_local_rank() == 0
    raise DistributedConfigError(
        f"checkpoint_dir(root={root!r}): the {_env.env_num_nodes(g.size)} nodes do not share "
        "this directory (each sees its own disk), so a checkpoint written there would be on "
        "one node only. Put root on a filesystem every node mounts, or pass per_node=True to "
        "commit a copy on each node (like Hugging Face's save_on_each_node); if they do share "
        "it, set AXOLOTL_DIST_SHARED_FS=1.")


class _CheckpointDir:
    """The context manager :func:`checkpoint_dir` returns."""

    def __init__(self, root: str, step: int, keep: Optional[int], timeout: Optional[float],
                 per_node: bool, group: Optional["ProcessGroup"]) -> None:
        self.root, self.step, self.keep, self.timeout = root, step, keep, timeout
        self.per_node, self.group = per_node, group
        self.written: Optional[CheckpointBlock] = None
        self.opened: Any = None
        self.path: Optional[CheckpointPath] = None
        self.run = ""

    def __enter__(self) -> CheckpointPath:
        _checkpointing.settle()  # the saves handed to futures before: committed, or raised
        g = group_of(self.group, "checkpoint_dir")
        final = _checkpointing.final_dir(self.root, self.step)
        job, self.run = _checkpointing.job_id(), _run_of(g)
        live = _take_root(self.root, g, job, self.run)
        if live:
            _leases.release(self.root, self.run, 0 if g is None else g.rank)
            raise _held_by(self.root, live)
        if g is None or g.size == 1:
            staging = _leases.staging_dir(self.root, self.step, job, self.run,
                                          time.monotonic_ns())  # unique in this process
            os.makedirs(staging)
            self.path = CheckpointPath(staging, self.step, final, True)
            _checkpointing.note_saving(self.root, self.step)
            return self.path
        writes = _writes(g, self.root, self.per_node)
        site = call_site()
        self.opened = enter_block(g, "checkpoint_dir", site, None)
        try:
            self.written = CheckpointBlock(g, advance(g, "checkpoint_dir"), site, None,
                                           timeout=self.timeout)
            staging = _leases.staging_dir(self.root, self.step, job, self.run,
                                          self.written.seq)
            os.makedirs(staging, exist_ok=True)
        except BaseException:
            leave_block(self.opened)
            raise
        self.path = CheckpointPath(staging, self.step, final, writes)
        _checkpointing.note_saving(self.root, self.step)
        return self.path

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        path = self.path
        assert path is not None
        save = _checkpointing.Save(self.written, str(path), path.final, path.should_save,
                                   self.root, self.step, self.keep, self.run, self.timeout,
                                   path._futures)
        try:
            if exc_type is None and save.futures:  # committed once they are done
                _checkpointing.hand_over(save)
                return False
            if exc_type is not None and exc is None:
                exc = exc_type()
            try:
                _checkpointing.finish(save, exc)
            except BaseException as error:
                if error is exc:
                    return False  # the body's own exception goes on as it is
                raise
            return False
        finally:
            if self.opened is not None:
                leave_block(self.opened)


@call("checkpoint_dir", lambda a: {"root": os.fspath(a["root"]), "step": a["step"],
                                   "keep": a["keep"], "per_node": a["per_node"]})
def checkpoint_dir(root: PathArg, step: int, keep: Optional[int] = None,
                   timeout: Optional[float] = None, *, per_node: bool = False,
                   group: Optional["ProcessGroup"] = None) -> _CheckpointDir:
    """A checkpoint every rank writes into and every rank agrees on; every rank enters it.

    ``with checkpoint_dir(root, step) as path:`` gives each rank the staging directory
    ``path`` (a :class:`CheckpointPath`) to write into: the model from the rank whose
    ``path.should_save`` is true, each rank's own shard or RNG state, or everything through
    ``torch.distributed.checkpoint.save(..., checkpoint_id=path)``. When the block ends on every
    rank without an exception, the checkpoint is committed: its files and directories fsynced,
    a marker written, and the directory renamed at once to ``<root>/step-<step>`` (one rename
    per filesystem); only then does :func:`latest_checkpoint` return it, and only then does any
    rank leave the block.

    :param root: the directory that holds the checkpoints (made if missing).
    :param step: the training step (an int >= 0); saving a step again replaces its checkpoint.
    :param keep: after the commit, keep this many committed checkpoints (the new one
        included), removing the oldest steps; None keeps all.
    :param timeout: seconds a rank waits for the others to finish writing (and for the
        commit) before raising :class:`~axolotl_dist.errors.RankTimeoutError`; default
        forever. The process group's collective timeout does not apply: a save may take hours.
    :param per_node: on nodes that do not share ``root`` (node-local disks), commit a copy on
        each node, each node's first rank committing (``path.should_save`` is true there);
        without it, such nodes raise :class:`~axolotl_dist.errors.DistributedConfigError` at
        the first save. Nodes that share ``root`` ignore it.
    :param group: the process group (default: the world).

    If a rank raises inside the block, it re-raises, and every other rank raises
    :class:`~axolotl_dist.errors.RankFailedError` naming it and its line; a rank that dies
    (killed, ``os._exit``) is named the same way. Nothing is committed then: the staging
    directory (``<root>/.step-<step>.staging-...``) is never taken for a checkpoint, and the
    next commit of the run removes it. A single process just writes and commits.
    """
    return _CheckpointDir(_check_args(root, step, keep, timeout), step, keep, timeout,
                          per_node, group)


def _seen(root: str) -> Tuple[List[int], str]:
    return _checkpointing.committed_steps(root), socket.gethostname()


@call("latest_checkpoint", lambda a: {"root": os.fspath(a["root"])})
def latest_checkpoint(root: PathArg, *, group: Optional["ProcessGroup"] = None
                      ) -> Optional[Checkpoint]:
    """The newest committed checkpoint under ``root``, or None when there is none: the same
    answer on every rank, so call it on every rank. It is a :class:`Checkpoint`: the directory
    ``<root>/step-<step>`` as a ``str``, with its ``step``.

    Only what :func:`checkpoint_dir` committed counts (a staging directory, a checkpoint cut
    short by a crash or a directory the kit did not write never does), and only a checkpoint
    every rank can see: on node-local disks, the newest step every node has. If some ranks see
    checkpoints and others none (a checkpoint saved on one node's disk), every rank raises
    :class:`~axolotl_dist.errors.DistributedConfigError` naming the ranks and their hosts.
    The partial saves that runs which ended left under ``root`` are removed here, as at the
    next :func:`checkpoint_dir` (docs/checkpoints.md, "What it guarantees").
    """
    root = _root_arg("latest_checkpoint", root)
    _checkpointing.settle()  # a save handed to futures counts once committed
    g = group_of(group, "latest_checkpoint")
    view = _look(root, g, _checkpointing.job_id(), _run_of(g), reading=True)
    if g is None or g.size == 1:
        _clear_over(root, 0, [view])
        steps = _checkpointing.committed_steps(root)
        return Checkpoint(_checkpointing.final_dir(root, steps[-1]), steps[-1]) if steps else None
    seen = all_gather_values(g, lambda: _seen(root) + (view,), "latest_checkpoint")
    _clear_over(root, g.rank, [s[2] for s in seen])
    common = set(seen[0][0]).intersection(*(set(s[0]) for s in seen[1:]))
    if common:
        return Checkpoint(_checkpointing.final_dir(root, max(common)), max(common))
    if not any(s[0] for s in seen):
        return None
    raise _unseen(root, [(s[0], s[1]) for s in seen])


def _run_of(g: Optional[Group]) -> str:
    """The run a call's files belong to: the ranks' run id (the same on every rank), or in one
    process this process (its pid and start time: unique on its machine)."""
    if g is not None and g.size > 1:
        return HEARTBEAT.run or "local"
    pid = os.getpid()
    return f"p{pid:x}t{_leases.process_start(pid) or 0:x}"


def _take_root(root: str, g: Optional[Group], job: str, run: str) -> Dict[str, _leases.Holder]:
    """Hold this rank's lease on ``root``, pool every rank's view of the other runs there and
    remove what the runs that are over left; returns the other runs still live there."""
    view = _look(root, g, job, run)
    views = [view] if g is None or g.size == 1 else \
        all_gather_values(g, lambda: view, "checkpoint_dir")
    return _clear_over(root, 0 if g is None else g.rank, views)


def _look(root: str, g: Optional[Group], job: str, run: str, reading: bool = False
          ) -> Dict[str, _leases.View]:
    """Hold this rank's lease on ``root`` and return its view of the other runs there.
    ``reading`` (a resume): a root that does not exist is not made, and one this rank cannot
    write (a read-only copy) is read without a lease."""
    if not reading or os.path.isdir(root):
        try:
            _leases.hold(root, job, run, 0 if g is None else g.rank)
        except OSError:
            if not reading:
                raise
    return _leases.survey(root, run)


def _clear_over(root: str, rank: int, views: List[Dict[str, _leases.View]]
                ) -> Dict[str, _leases.Holder]:
    """Remove, on the ranks chosen for it, what the runs that every rank's ``views`` show over
    left under ``root``, said once per run; returns the live ones."""
    over, live = _leases.pool(views)
    for run, removers in over.items():
        if rank in removers:
            removed = _leases.remove_run(root, run)
            if removed:
                _log.warning("removed %d partial save(s) under %s left by run %s, which ended "
                             "before committing them: %s", len(removed), root, run,
                             ", ".join(os.path.basename(p) for p in removed))
    return live


def _held_by(root: str, live: Dict[str, _leases.Holder]) -> DistributedConfigError:
    """The error for a save on a ``root`` that other live runs hold (``live``)."""
    run, (job, holders, _) = next(iter(sorted(live.items())))
    who = ", ".join(f"rank {r} pid {pid} on {host}" for r, host, pid in holders[:4])
    more = f" and {len(holders) - 4} more" if len(holders) > 4 else ""
    return DistributedConfigError(
        f"checkpoint_dir(root={root!r}): another run still uses this directory: run {run} "
        f"(job {job or 'none'}: {who}{more}). Two runs saving into one root would remove each "
        "other's checkpoints: give this run a root of its own, or stop the other run first "
        f"(its lease: {os.path.join(root, _leases.LEASES_DIR, run)}).")


def _unseen(root: str, seen: List[Tuple[List[int], str]]) -> DistributedConfigError:
    """The error for checkpoints under ``root`` that not every rank sees (``seen``: each
    rank's committed steps and host)."""
    blind = [f"rank {r} ({host})" for r, (steps, host) in enumerate(seen) if not steps]
    some = next((r, steps, host) for r, (steps, host) in enumerate(seen) if steps)
    return DistributedConfigError(
        f"latest_checkpoint(root={root!r}): no checkpoint there is seen by every rank: rank "
        f"{some[0]} ({some[2]}) sees step-{some[1][-1]}, "
        + (", ".join(blind) + (" sees" if len(blind) == 1 else " see") + " none" if blind
           else "the others see other steps")
        + ". The nodes do not share root: put it on a filesystem every node mounts, or save "
        "with checkpoint_dir(..., per_node=True) so each node commits its own copy (or copy "
        "the checkpoint to every node).")
