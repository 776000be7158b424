"""Orderly teardown: at ``cleanup_distributed()`` and, whether or not it was called, at exit.

Why at exit: a gloo worker thread releases the last reference to a finished collective's
tensors a moment after the caller's ``wait()`` returned, and that release needs the GIL. If the
script ends in that moment (its last line is a collective), the thread asks for the GIL while
the interpreter finalizes, which ends the thread from inside a C++ destructor: "terminate
called without an active exception" and SIGABRT (exit code 134), after a run that succeeded.
Plain torch does the same without ``destroy_process_group()``; and a daemon thread of the kit's
inside a store call then (the deletion of finished blocks' keys, after the script destroyed
its group itself) ends the same way. So once a group exists the kit registers an ``atexit``
hook that, before finalization, lets the key deletions finish and:

0. on a normal exit, waits for the checkpoint this rank handed to futures and commits it
   (:func:`..protocols.checkpointing.settle`: said once; a failure is logged);
1. stops the heartbeat and leaves this rank's exit record in the store (an uncaught exception's
   report, or a normal exit), so peers name the real cause of a rank that ended;
2. destroys every process group (a destroyed group joins its worker threads, and its peers'
   pending collectives fail at once instead of waiting for this process to end), resetting
   forgetting the world mesh and waiting for the value helpers' buffers to be released;
3. elsewhere, a rank ending on a failure waits until the others in kit waits have read it,
   at most ``failures.failed_exit_grace()`` seconds: a launcher that stops every rank once one
   is gone (torchrun, ``axolotl-dist``, ``mpirun``) would stop a peer before it named the
   cause; then it marks itself gone, its last store call. If this process hosts the store
   (rank 0 under a plain env launch), it keeps the store up until every other rank has marked
   itself gone (or, ending on a failure, copied its record) or is gone, at most
   ``AXOLOTL_DIST_STORE_LINGER`` seconds: peers read the real cause of a failure, and their
   own exits find a live store (a store call to a host that ended makes torch print a C++
   trace);
3b. under a torch elastic agent (``torchrun``, ``accelerate launch``), a rank ending on another
   rank's failure (``RankFailedError``) waits, last, until the agent stops it: the agent names
   the first process it saw end as the summary's root cause (:func:`_await_agent_stop`);
4. if a group is still referenced elsewhere (a ``DistributedDataParallel`` module, a mesh), so
   its threads could not be joined, gives them a moment with the GIL released to finish;
5. a process ending on Ctrl-C with a collective left pending (its group kept: see
   :func:`keep_abandoned`) runs the other exit handlers and then ends by SIGINT at once,
   as Python would after finalizing (same exit status), without the finalization: tearing down
   torch's modules is ~0.45 s of CPU on an idle 2-core VM and seconds on a loaded one, and a
   Ctrl-C must stop a rank within 2 s.

:func:`cleanup` is safe to call twice or never. See docs/design/failures.md, "Exit records".
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import signal
import sys
import time
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..base import backends, groups, hooks, procs, torch_messages, tracebacks
from ...env.variables import LAUNCHER_PID_ENV_VAR
from ..base.groups import Group
from ..base.kitlog import kit as log
from ..base.state import GROUPS
from .lifecycle_state import LIFECYCLE
from ..protocols.headers import HEADERS
from ..protocols.blocks import BLOCKS
from ..store import access, sweep
from ..liveness import failures, heartbeat, peers, waits
from ..protocols import timeline
from ..protocols import checkpointing, zero_first
from ...errors import RankFailedError

__all__ = ["at_exit", "cleanup", "teardown", "keep_abandoned", "peer_failure"]

#: Seconds given to gloo worker threads of a group still referenced at exit.
_DRAIN = 0.05
#: Seconds a cleanup waits for the background deletion of finished blocks' keys.
_CLEANUP_FLUSH = 0.5
#: Seconds an exit waits for the store to take this rank's exit record.
_STORE_CALLS = 3.0
#: Seconds between a relaying rank's looks for its agent's SIGTERM (:func:`_await_agent_stop`).
_AGENT_LOOK = 0.02


def keep_abandoned() -> List[Any]:
    """Keep every group with a collective left pending, and that work, alive until the process
    ends; return those groups.

    Destroying a gloo group joins its worker threads, and a worker inside a pending collective
    stays there until every peer arrives or the group's timeout passes (30 minutes by default):
    the exit of a rank interrupted in a barrier would wait for the straggler. The backend's
    ``abort()`` does not wake it (torch 2.13). So such a group gets one reference more than
    anything will ever release: ``destroy_process_group()`` still unregisters it, its destructor
    never runs, and the process exits with the worker still waiting (the OS ends it)."""
    kept = []
    for g in waits.abandoned_groups():
        pg = g.pg_ref()
        if pg is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(pg))
            kept.append(pg)
    for work in waits.take_abandoned():
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(work))
    return kept


def cleanup(failed: bool = False) -> None:
    """Stop the heartbeat, run the cleanup hooks, let gloo's worker threads finish releasing
    their last collectives, and destroy the default process group. ``failed``: the process
    ends on a failure, with collectives that may never complete: it waits for no device work
    (no ``torch.cuda.synchronize()``) and aborts the NCCL communicators instead of destroying
    them (their destruction waits for pending work; abort does not).

    The pause matters: destroying a group joins its worker threads while this thread holds the
    GIL, so a worker still releasing a finished collective's tensors (which needs the GIL)
    would deadlock it, now or when a ``DistributedDataParallel`` module holding the group is
    deleted later. The kit's own helpers are waited for exactly (their buffers' references);
    other collectives (DDP's, raw torch calls) get :data:`_DRAIN` seconds.
    """
    recorder = timeline.finish()  # None if the exit's teardown closed it (with its exception)
    if recorder is None and LIFECYCLE.closed_recorder is not None:
        recorder, LIFECYCLE.closed_recorder = LIFECYCLE.closed_recorder, None
    heartbeat.stop_heartbeat()
    if not peers.store_host_gone() and not peers.host_leaving():
        _confirm_blocks()
        sweep.flush_cleanup(_CLEANUP_FLUSH)  # the last blocks' keys, deleted in the background
    known = list(GROUPS.groups.values())
    hooks.cleanup()  # what a higher module keeps goes first (the world mesh: its groups)
    groups.forget_last_group()
    _await_released(known)
    if dist.is_available() and dist.is_initialized():
        time.sleep(_DRAIN)
        cuda = torch.cuda.is_initialized() and backends.supports(str(dist.get_backend()), "cuda")
        if failed and cuda:
            _abort_nccl()  # the rest exits with the process: nothing waits on the device
        else:
            if cuda:  # CUDA work this rank queued finishes first (none if CUDA never started)
                torch.cuda.synchronize()
            LIFECYCLE.kept.extend(weakref.ref(pg) for pg in keep_abandoned())  # Ctrl-C
            dist.destroy_process_group()
    if recorder is not None and recorder.at_end is not None:
        recorder.at_end(recorder)  # the tracing feature's end: rank 0 merges the files


#: The group's tensors a gloo worker may still hold after a collective's wait returned.
_BUFFERS = ("hdr", "hdr_all", "a2a_in")
#: Seconds after which a buffer still referenced is taken to be held by a reference cycle (a
#: caught exception's frames), not by a gloo worker (which lets go within microseconds).
_COLLECT_AFTER = 0.02


def _await_released(groups: Sequence[Optional[Group]], limit: float = 1.0) -> None:
    """Wait (GIL released, at most ``limit`` s) until gloo's worker threads have dropped their
    references to the groups' buffers: a collective's ``wait()`` returns before the worker
    releases it, and releasing needs the GIL (see :func:`cleanup`)."""
    def busy(g: Group) -> bool:
        buffers = HEADERS.buffers.get(g)
        for name in _BUFFERS if buffers is not None else ():
            held = getattr(buffers, name)  # idle: the buffers' slot, this name, the argument
            if held is not None and sys.getrefcount(held) > 3:
                return True
        return False

    start = time.monotonic()
    collected = False
    for g in groups:
        while g is not None and busy(g) and time.monotonic() < start + limit:
            if not collected and time.monotonic() > start + _COLLECT_AFTER:
                collected = True
                gc.collect()  # not gloo: frames of a dropped traceback, in a reference cycle
                continue
            time.sleep(0.0005)


def _confirm_blocks() -> None:
    """The ``zero_first`` blocks this rank ran first and left unconfirmed: check, at most
    ``AXOLOTL_DIST_STORE_LINGER`` seconds each, that every rank reached them; a cleanup does
    not raise, so what is wrong is logged (a rank stuck in a block that does not pair is told
    by the mismatch this check publishes)."""
    if not BLOCKS.unconfirmed:
        return
    try:
        zero_first.confirm_at_exit(failures.host_exit_timeout())
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the process is ending
        log.warning("rank %d: not every rank reached a zero_first block this rank ran first: "
                    "%s", dist.get_rank() if dist.is_initialized() else 0, tracebacks.safe_str(exc))


def _uncaught() -> Optional[BaseException]:
    """The exception the interpreter is exiting on, if any (set before atexit hooks run)."""
    exc = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    return exc if isinstance(exc, BaseException) and not isinstance(exc, SystemExit) else None


def peer_failure(exc: BaseException) -> Optional[RankFailedError]:
    """The failure of another rank an uncaught torch error stands for (a raw collective, DDP's
    all-reduce in ``backward()``, that failed because that rank ended), or None: the kit's hook
    then prints that rank's account instead of the backend's message
    (:func:`..base.hooks.on_uncaught`)."""
    if not torch_messages.peer_lost(exc) or not dist.is_initialized():
        return None
    try:
        g = groups.group_of(None, "torch's collective")
    except Exception:  # noqa: BLE001 - the env disagrees with the group: torch's message then
        return None
    if g is None or g.size < 2:
        return None
    found = failures.diagnose_lost_peer(exc, "torch's collective", g)
    return found if isinstance(found, RankFailedError) else None


def at_exit() -> None:
    if LIFECYCLE.ending:
        return
    exc = _uncaught()
    # a lost peer is explained by the kit's hook (peer_failure): relay the cause it found
    if exc is not None and torch_messages.peer_lost(exc):
        exc = groups.known_failure() or exc
    teardown(exc)
    if isinstance(exc, KeyboardInterrupt) and any(ref() is not None for ref in LIFECYCLE.kept):
        _end_now()


def _end_now() -> None:
    """Step 5 of the module docstring: the exit handlers registered before this one (logging's
    flush, multiprocessing's children, torch's), the standard streams flushed, then SIGINT with
    its default action: the exit status Python gives an uncaught ``KeyboardInterrupt``."""
    LIFECYCLE.ending = True
    try:
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - ending anyway
        pass
    procs.flush_standard_streams()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)


def _release_kit_frames(exc: Optional[BaseException]) -> None:
    """Clear the locals of the kit's frames in the traceback(s) of ``exc``, the exception this
    process is ending on (already printed and reported): a helper's frame there holds its
    group's buffers, which :func:`_await_released` would otherwise wait a second for, taking
    them for a gloo worker's. The user's frames are left alone, and every frame where a
    collective was left pending (Ctrl-C in one: its work stays referenced)."""
    if waits.abandoned_groups():
        return
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            if tracebacks.kit_frame(tb.tb_frame.f_code.co_filename):
                try:
                    tb.tb_frame.clear()
                except RuntimeError:  # still executing (not for an exception being exited on)
                    pass
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__


def teardown(exc: Optional[BaseException] = None) -> None:
    """Steps 1-4 of the module docstring; ``exc``: the exception this process is ending on.
    A step that fails never skips the steps after it (:func:`_step`)."""
    if not (dist.is_available() and dist.is_initialized()):
        heartbeat.stop_heartbeat()
        if not peers.store_host_gone():
            # the script destroyed the group itself: the background deletion of its last
            # blocks' keys may still be inside a store call, which the interpreter's
            # finalization would end by SIGABRT ("terminate called without an active exception")
            sweep.flush_cleanup(_CLEANUP_FLUSH)
        return
    if exc is None and not peers.host_leaving():
        _step(checkpointing.settle, True)  # a checkpoint handed to futures: waited for, committed
    rank, world_size = dist.get_rank(), dist.get_world_size()
    recorder = _step(timeline.finish, exc)  # the trace's last line says how this process ended
    if recorder is not None:
        LIFECYCLE.closed_recorder = recorder
    hosts = access.hosts_store()
    # the group owns the store's server: keep it past destroy_process_group() while we linger
    server = access.world_store() if hosts else None
    heartbeat.stop_heartbeat()
    # store calls go through the bounded worker: a stopped store host must not hang the exit;
    # none at all once the host is ending on a failure this rank has a copy of (its store is
    # about to go: a call in flight then makes torch print a C++ trace)
    record = access.bounded(lambda: failures.publish_exit(exc), _STORE_CALLS) \
        if world_size > 1 and not peers.host_leaving() else None
    _step(_release_kit_frames, exc)
    groups = [weakref.ref(pg) for pg in list(dist.distributed_c10d._world.pg_map)]
    _step(cleanup, _failed(exc))  # exiting anyway: never turn an exit into a crash
    if record is not None:
        _step(_last_store_calls, record, hosts, rank, world_size, exc)
    del server
    _step(_await_groups_released, groups)
    if not hosts and isinstance(exc, RankFailedError) and under_elastic_agent():
        _step(_await_agent_stop, exc, world_size)


def _failed(exc: Optional[BaseException]) -> bool:
    """Whether the process ends on a failure (``sys.exit(0)`` is no failure; Ctrl-C is)."""
    return exc is not None and not (isinstance(exc, SystemExit) and exc.code in (0, None))


def _abort_nccl() -> None:
    """Abort every NCCL communicator of this process (torch's ``_abort_process_group``, which
    takes every group when given none), for an exit on a failure: a collective a lost peer
    never joins would hold ``destroy_process_group()`` until NCCL's timeout."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.is_nccl_available():
        try:
            abort()
        except Exception:  # noqa: BLE001 - a backend without abort: the process ends anyway
            pass


def _step(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, one step of the exit path; an error in it (a store or group already
    gone) ends that step only: the process is exiting anyway, and the steps after it (the
    exit record, the last store calls, the groups' release) still run. None if it failed."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - see the docstring
        return None


def _last_store_calls(record: Tuple[Any, int, bool], hosts: bool, rank: int, world_size: int,
                      exc: Optional[BaseException]) -> None:
    """After the exit record (``record``: store, rank, whether a failure): a failing rank
    waits for its waiting peers to read it, every rank marks itself gone, and the store's host
    keeps its store up for the others."""
    if not hosts and record[2]:  # a failure: the peers waiting for this rank name it
        relayed = exc is None or isinstance(exc, RankFailedError)  # another rank's failure
        access.bounded(lambda: failures.await_peers_told(record[0], rank, world_size, relayed),
                      failures.failed_exit_grace(world_size) + _STORE_CALLS)
    # the last store call: a store host (rank 0) may end as soon as every rank made it
    access.bounded(lambda: failures.mark_exited(record), _STORE_CALLS)
    if hosts:
        failures.await_peers_exit(record[0], rank, world_size, failed=record[2])


def under_elastic_agent() -> bool:
    """Whether a torch elastic agent (``torchrun``, ``accelerate launch``) started this
    process and watches it: it stops every worker once one has failed, and names the failure
    it saw first as the root cause. ``axolotl-dist`` sets the agent's variables for its
    ranks but keeps its own account (``launch/_report.py``)."""
    env = os.environ
    return bool(env.get("TORCHELASTIC_RUN_ID")) and not env.get(LAUNCHER_PID_ENV_VAR)


def _agent_stop_bound(world_size: int) -> float:
    """Seconds a relaying rank waits at most for its agent to stop it: the failing rank's own
    exit (its wait for readers, its last store calls, the store host's wait for its readers) and a margin."""
    return failures.failed_exit_grace(world_size) + _STORE_CALLS + failures.host_exit_timeout()


def _await_agent_stop(exc: RankFailedError, world_size: int) -> None:
    """Step 3b, under a torch elastic agent, for a rank ending on another rank's failure
    (``exc``): do not end this process before the rank that failed has ended its own.

    The agent polls its workers, takes the failures it finds in one poll (in local-rank order,
    each stamped with the second it was seen: torch's ``ProcessFailure``), stops the rest with
    SIGTERM and names the failure with the smallest stamp, the first found on a tie, as the
    summary's "Root Cause". A relaying rank that ended first, or in the same poll as a lower
    failing rank, would be named and the failing rank listed as SIGTERMed. So this rank waits
    until the agent stops it (it does once the failing rank's process is gone), then ends as
    it would have (exit status 1): the SIGTERM only ends the wait. Not when the failing rank
    is known to run on another machine (this machine's agent would not see it end), and at
    most :func:`_agent_stop_bound` seconds. Never raises."""
    if exc.machine is not None and exc.machine != procs.MACHINE:
        return
    stopped: List[bool] = []
    try:
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: stopped.append(True))
    except (ValueError, OSError):  # not the main thread: cannot wait for the signal
        return
    try:
        deadline = time.monotonic() + _agent_stop_bound(world_size)
        while not stopped and time.monotonic() < deadline:
            time.sleep(_AGENT_LOOK)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _await_groups_released(groups: List[Any]) -> None:
    """Give the destroyed groups (weak references) a moment to be freed, but those kept."""
    kept = {id(ref()) for ref in LIFECYCLE.kept}
    groups = [ref for ref in groups if id(ref()) not in kept]
    if any(ref() is not None for ref in groups):
        gc.collect()
        if any(ref() is not None for ref in groups):
            time.sleep(_DRAIN)  # GIL released: their worker threads finish releasing work
