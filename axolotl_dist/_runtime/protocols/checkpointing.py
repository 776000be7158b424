"""The protocol and the files behind :func:`~axolotl_dist.checkpoint_dir` (its behaviour is
documented in :mod:`axolotl_dist.checkpoints` and docs/checkpoints.md; the bit words are
:mod:`.blocks`'s).

A ``checkpoint_dir`` call is two meetings of the group's ranks through the store, each a
:class:`CheckpointBlock` (the bit words of :mod:`.blocks`, keys ``axd/ck/<seq>/...``; a call
numbers two blocks):

1. **written**: every rank runs the body (writing into the staging directory), then sets its bit
   and waits for every bit. A body that raised publishes its failure instead: every other rank
   raises :class:`~axolotl_dist.errors.RankFailedError` naming it; a rank that died is named by
   the wait's liveness checks. No rank commits unless every body ended without raising.
2. **committed**: the committing rank of each filesystem (group rank 0; with ``per_node``, each
   node's first rank) fsyncs the staging directory's files and directories, writes the marker,
   renames the directory to ``step-<step>`` and rotates old checkpoints, then sets its bit; the
   other ranks set theirs at once; every rank waits for every bit. So when a rank leaves the
   block, the checkpoint is committed on every filesystem.

Both waits are the kit's store waits: bounded by the block's own ``timeout`` (default none),
never by the process group's collective timeout.

On disk, under ``root``: ``step-<step>`` is a committed checkpoint when it holds the marker
:data:`MARKER` (the rename is atomic: a directory of that name without the marker was not made
by the kit); ``.step-<step>.staging-<job>.<run>-<seq>`` is being written (or was, by a call
that failed or a run that died: never read; removed by the run's next commit, or once the run
ended by the next ``checkpoint_dir`` or ``latest_checkpoint`` of another: :mod:`.leases`);
``.step-<step>.old-<run>-<x>`` is a checkpoint being replaced or rotated away (removed right
after the rename that hid it).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..liveness.progress import advance
from ...env.variables import END_DIR_ENV_VAR, is_decimal
from ..base.kitlog import kit as log
from ..base.tracebacks import safe_str
from .blocks import Block, arrive, together
from .leases import staging_run
from ..store import records
from ...errors import RankFailedError, RankTimeoutError

from ..base.state import RoomState, register

__all__ = ["CheckpointBlock", "SAVES", "SavesState", "Save", "finish", "hand_over", "settle",
           "future_wait", "MARKER", "STEP_PREFIX", "final_dir", "committed_steps",
           "commit", "commit_record", "commit_save", "rotate", "remove_staging", "job_id",
           "not_committed", "note_saving", "unnote_saving", "unsaved", "SAVING_NOTE"]


class SavesState(RoomState):
    """``pending`` (this rank's ``checkpoint_dir`` calls whose bodies handed their writes over
    to futures, oldest first: committed once they are done, at the next ``checkpoint_dir``,
    ``latest_checkpoint``, cleanup or exit: :mod:`.checkpointing`); ``exit_wait_logged`` (the
    exit's wait for them was logged); ``exit_hook_set`` (the exit's hook that waits for them is
    registered); ``saving`` ((root, step) of the save this rank is inside, else None); ``term_handler``
    (the SIGTERM handler that save replaced, to restore at its end; None where it replaced
    none)"""

    def __init__(self) -> None:
        self.pending: List["Save"] = []
        self.exit_wait_logged = False
        self.exit_hook_set = False
        self.saving: Optional[Tuple[str, int]] = None
        self.term_handler: Any = None


SAVES = register("saves", SavesState())

#: A committed checkpoint is ``<root>/step-<step>``.
STEP_PREFIX = "step-"
#: The file that makes ``step-<step>`` a checkpoint of the kit's: JSON with the step, the world
#: size, the run and the time of the commit.
MARKER = ".axolotl_dist_checkpoint.json"
_STEP = re.compile(r"step-(\d+)")


class CheckpointBlock(Block):
    """One meeting of a ``checkpoint_dir`` call (see the module docstring)."""

    kind, family, noun = "ck", "checkpoint_dir", "checkpoint_dir block"
    __slots__ = ()

    @property
    def wakes_when_full(self) -> bool:  # type: ignore[override]
        return len(self.keys) == 1


def _others(block: CheckpointBlock) -> List[int]:
    """The global ranks a rank waits for in ``block``: every other one."""
    g = block.group
    return [g.global_rank(r) for r in range(g.size) if r != g.rank]


# --- a call's end, now or once its futures are done ------------------------------------------

class Save:
    """One ``checkpoint_dir`` call on this rank, from the end of its body to its commit."""

    __slots__ = ("written", "staging", "final", "should_save", "root", "step", "keep", "run",
                 "timeout", "futures")

    def __init__(self, written: Optional[CheckpointBlock], staging: str, final: str,
                 should_save: bool, root: str, step: int, keep: Optional[int], run: str,
                 timeout: Optional[float], futures: List[Callable[[Optional[float]], Any]]
                 ) -> None:
        self.written, self.staging, self.final, self.should_save = (written, staging, final,
                                                                    should_save)
        self.root, self.step, self.keep, self.run = root, step, keep, run
        self.timeout, self.futures = timeout, futures


def future_wait(future: Any) -> Callable[[Optional[float]], Any]:
    """How to wait for ``future``, at most a given number of seconds (None: for as long as it
    takes): a ``concurrent.futures.Future`` (a thread's, ``torch.distributed.checkpoint.
    async_save``'s), a ``torch.futures.Future``, or DCP's ``AsyncSaveResponse`` (its
    ``upload_completion``). TypeError for anything else."""
    future = getattr(future, "upload_completion", future)
    if callable(getattr(future, "result", None)) and callable(getattr(future, "done", None)):
        return lambda timeout: future.result(timeout=timeout)
    if callable(getattr(future, "wait", None)) and callable(getattr(future, "done", None)):
        def wait(timeout: Optional[float]) -> Any:
            deadline = None if timeout is None else time.monotonic() + timeout
            while not future.done():
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"the future was not done after {timeout} s")
                time.sleep(0.01)
            return future.wait()
        return wait
    raise TypeError(f"commit_after({future!r}): not a future: pass what "
                    "torch.distributed.checkpoint.async_save or an executor's submit returns "
                    "(an object with done() and result() or wait())")


def finish(save: Save, error: Optional[BaseException]) -> None:
    """End ``save`` on this rank: ``error`` (its body's, or a future's) is told to the others and
    raised; else every rank's end is awaited and the checkpoint committed on every filesystem
    (each rank leaves once it is), or the failure of another rank raised, saying that the step
    was not committed and which one was last."""
    try:
        _finish(save, error)
    except (RankFailedError, RankTimeoutError) as exc:
        exc.args = (f"{exc.args[0] if exc.args else ''}; {not_committed(save.root, save.step)}",
                    *exc.args[1:])
        raise
    finally:
        unnote_saving()


def _finish(save: Save, error: Optional[BaseException]) -> None:
    """:func:`finish`'s steps."""
    written = save.written
    if written is None:  # one process
        if error is not None:
            raise error
        commit_save(save, 1)
        return
    if error is not None:
        written.fail(error)
        raise error
    arrive(written, save.timeout, lambda: _others(written))  # every body (and future) ended well
    g = written.group
    committed = CheckpointBlock(g, advance(g, "checkpoint_dir"), written.site, None,
                                timeout=save.timeout)
    together(lambda: commit_save(save, g.size) if save.should_save else None, committed,
             save.timeout, lambda: _others(committed))


def not_committed(root: str, step: int) -> str:
    """What a save that did not end says: its step was not committed, and the last that was."""
    steps = committed_steps(root)
    last = (f"the latest committed is {final_dir(root, steps[-1])} (resume from it)" if steps
            else "no checkpoint is committed there yet")
    return f"the checkpoint of step {step} under {root} was not committed; {last}"


# --- what the launcher reads when a rank dies inside a save ----------------------------------

#: A rank's note of the save it is in, in its attempt's end directory (:mod:`axolotl_dist.launch`).
SAVING_NOTE = "saving-{rank}.note"


def _note_path() -> Optional[str]:
    directory, rank = os.environ.get(END_DIR_ENV_VAR), os.environ.get("RANK", "").strip()
    if not directory or not is_decimal(rank):
        return None
    return os.path.join(directory, SAVING_NOTE.format(rank=int(rank)))


def note_saving(root: str, step: int) -> None:
    """Note that this rank is inside the save of ``step`` under ``root`` (until
    :func:`unnote_saving`), so that if the run fails there it is said that the step was not
    committed: under ``axolotl-dist`` by the launcher (a note in the attempt's end directory),
    elsewhere by this rank when its launcher stops it (SIGTERM, where no handler is set: the
    line, then the signal's own death)."""
    SAVES.saving = (root, step)
    path = _note_path()
    if path is not None:
        try:
            with open(path, "w") as fh:
                json.dump({"root": os.path.abspath(root), "step": step}, fh)
        except OSError:  # the launcher then says less
            pass
    elif (threading.current_thread() is threading.main_thread()
          and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
        signal.signal(signal.SIGTERM, _stopped_while_saving)
        SAVES.term_handler = signal.SIG_DFL


def unnote_saving() -> None:
    """The save this rank was inside ended (committed or not)."""
    SAVES.saving = None
    if SAVES.term_handler is not None and threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGTERM) is _stopped_while_saving:
            signal.signal(signal.SIGTERM, SAVES.term_handler)
        SAVES.term_handler = None
    path = _note_path()
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass


def _stopped_while_saving(signum: int, frame: Any) -> None:
    """SIGTERM inside a save (a launcher stopping the ranks after another failed): say what was
    not committed, then die of the signal as without the handler."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if SAVES.saving is not None:
        log.error("stopped by SIGTERM inside checkpoint_dir: %s", not_committed(*SAVES.saving))
    os.kill(os.getpid(), signal.SIGTERM)


def unsaved(directory: Optional[str]) -> List[str]:
    """The launcher's lines for the saves its ranks were inside when the run failed (their
    notes in the attempt's end directory ``directory``), one per checkpoint."""
    if not directory or not os.path.isdir(directory):
        return []
    seen = set()
    for name in sorted(os.listdir(directory)):
        if name.startswith("saving-") and name.endswith(".note"):
            try:
                with open(os.path.join(directory, name)) as fh:
                    note = json.load(fh)
                seen.add((str(note["root"]), int(note["step"])))
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return [not_committed(root, step) for root, step in sorted(seen)]


def _await_futures(save: Save) -> Optional[BaseException]:
    """Wait for ``save``'s futures, at most its ``timeout`` in all; the first one's exception,
    if one raised (a future not done in time: a ``TimeoutError`` naming the step)."""
    error: Optional[BaseException] = None
    deadline = None if save.timeout is None else time.monotonic() + save.timeout
    for wait in save.futures:
        try:
            wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except BaseException as exc:  # noqa: BLE001 - told to every rank by finish()
            if isinstance(exc, TimeoutError) and error is None:
                exc = TimeoutError(f"the writes of the checkpoint of step {save.step}, handed to "
                                   f"futures, were not done after checkpoint_dir(timeout="
                                   f"{save.timeout})")
            error = error or exc
    return error


def hand_over(save: Save) -> None:
    """Keep ``save`` until its futures are done (:func:`settle`); at a normal exit, it is
    waited for and committed (an ``atexit`` hook, registered at the first: it runs before the
    kit's teardown, while the heartbeat still beats)."""
    SAVES.pending.append(save)
    if not SAVES.exit_hook_set:
        SAVES.exit_hook_set = True
        atexit.register(_settle_at_exit)


def _settle_at_exit() -> None:
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if exc is None or isinstance(exc, SystemExit):  # a script that failed commits nothing more
        settle(exiting=True)


def settle(exiting: bool = False) -> None:
    """Finish this rank's saves whose bodies handed their writes to futures, oldest first (every
    rank reaches the same point: the next ``checkpoint_dir``, ``latest_checkpoint``,
    ``cleanup_distributed()`` or the exit). ``exiting``: said once, and a failure is logged
    instead of raised (the process is ending)."""
    while SAVES.pending:
        save = SAVES.pending.pop(0)
        if exiting and not SAVES.exit_wait_logged:
            SAVES.exit_wait_logged = True
            log.warning("exiting: waiting for the checkpoint of step %d (handed to a future) to be "
                     "written and committed", save.step)
        try:
            finish(save, _await_futures(save))
        except BaseException as exc:
            SAVES.pending.clear()  # a failed save fails the ones after it on every rank alike
            if not exiting:
                raise
            log.error("the checkpoint of step %d was not committed: %s", save.step,
                      safe_str(exc))
            return


def commit_save(save: Save, world_size: int) -> None:
    """Commit ``save`` on this rank's filesystem (its committing rank): :func:`commit`, then
    :func:`rotate` and :func:`remove_staging`."""
    commit(save.staging, save.final, commit_record(save.step, world_size, save.run))
    if save.keep is not None:
        rotate(save.root, save.keep, save.step, save.run)
    remove_staging(save.root, save.run, keep=save.staging)
    log.info("committed the checkpoint of step %d: %s", save.step, save.final)


# --- the files ----------------------------------------------------------------------------------

def final_dir(root: str, step: int) -> str:
    """Where checkpoint ``step`` is once committed."""
    return os.path.join(root, f"{STEP_PREFIX}{step}")


def job_id() -> str:
    """The job this process belongs to, the same in every attempt of a restarted run: the
    launcher's ``TORCHELASTIC_RUN_ID`` (torchrun's ``--rdzv-id``), else ``SLURM_JOB_ID``, else
    ``"none"``; only letters, digits, ``_`` and ``-`` kept (a directory name's part)."""
    raw = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID") or "none"
    return re.sub(r"[^A-Za-z0-9_-]", "", raw)[:40] or "none"


def committed_steps(root: str) -> List[int]:
    """The steps of the committed checkpoints under ``root`` (with the marker), ascending; none
    when ``root`` does not exist."""
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    steps = []
    for name in names:
        match = _STEP.fullmatch(name)
        if match and os.path.isfile(os.path.join(root, name, MARKER)):
            steps.append(int(match.group(1)))
    return sorted(steps)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(top: str) -> None:
    """fsync every file and directory under ``top`` (``top`` included), deepest first."""
    for directory, _, files in os.walk(top, topdown=False):
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                _fsync_path(path)
        _fsync_path(directory)


def commit(staging: str, final: str, record: Dict[str, object]) -> None:
    """Make ``staging`` the committed checkpoint ``final``: its files durable, the marker
    written, then one rename. A checkpoint already at ``final`` (the same step saved again) is
    moved aside first and removed after; between the two renames ``final`` does not exist, so
    it is never half old, half new."""
    marker = os.path.join(staging, MARKER)
    with open(marker, "w") as fh:
        fh.write(records.document(record))
    _fsync_tree(staging)
    root = os.path.dirname(final)
    old = None
    if os.path.lexists(final):
        old = _hidden(root, os.path.basename(final), str(record["run"]))
        os.rename(final, old)
    os.rename(staging, final)
    _fsync_path(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _hidden(root: str, name: str, run: str) -> str:
    """A fresh name under ``root`` for checkpoint ``name`` on its way out (not a ``step-``
    name: never read as a checkpoint)."""
    return os.path.join(root, f".{name}.old-{run}-{uuid.uuid4().hex[:8]}")


def rotate(root: str, keep: int, just: int, run: str) -> List[int]:
    """Remove committed checkpoints under ``root`` until ``keep`` are left, oldest step first,
    never step ``just`` (the one just committed). Each is renamed out of the ``step-`` names
    first (so a reader never takes a half-removed one), then removed. Returns the steps
    removed."""
    others = [s for s in committed_steps(root) if s != just]
    removed = others[:max(0, len(others) - (keep - 1))]
    for step in removed:
        hidden = _hidden(root, f"{STEP_PREFIX}{step}", run)
        try:
            os.rename(final_dir(root, step), hidden)
        except FileNotFoundError:  # another writer of this root removed it first
            continue
        shutil.rmtree(hidden, ignore_errors=True)
    if removed:
        _fsync_path(root)
    return removed


def remove_staging(root: str, run: str, keep: str) -> None:
    """Remove what run ``run`` left under ``root`` but ``keep``: the staging directories of its
    calls whose bodies failed, and checkpoints hidden for removal by a commit or a rotation
    that did not finish. (What other runs left once they ended: :mod:`.leases`.)"""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        path = os.path.join(root, name)
        if path != keep and (staging_run(name) == run or (
                name.startswith(f".{STEP_PREFIX}") and ".old-" in name)):
            shutil.rmtree(path, ignore_errors=True)


def commit_record(step: int, world_size: int, run: str) -> Dict[str, object]:
    """What the marker of a checkpoint says."""
    return {"step": step, "world_size": world_size, "run": run, "committed": time.time()}
