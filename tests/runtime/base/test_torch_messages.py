"""Unit tests of the kit's one reader of torch's messages (``_runtime/base/torch_messages.py``)
against the installed torch: each test provokes the real error (a gloo peer that leaves
mid-collective, a ``Work.wait`` slice that times out, a store whose server goes away, a store
port another program holds) and checks that its function recognises it, and that a real
message of another kind is not taken for it. CI runs this file under each torch the kit
supports, so a torch that rewords a message fails here, naming that torch and the message.

NCCL's messages cannot be provoked without two GPUs: they are checked on the text torch
formats (``C10D_NCCL_CHECK``'s ``NCCL error in: FILE:LINE, <NCCL's error string>, NCCL
version X``; ``ProcessGroupNCCL``'s abort), and, where the installed torch is a CUDA build,
every fragment of that text is looked for in its ``libtorch_cuda`` and ``libnccl`` binaries.

Everything binds 127.0.0.1 only (the store's servers listen on a loopback socket handed to
them); every wait is bounded and every process started is killed on the way out.
"""

from __future__ import annotations

import gc
import json
import mmap
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist

from axolotl_dist._runtime.base import torch_messages
from axolotl_dist._runtime.base.procs import loopback_interface
from axolotl_dist.errors import RankFailedError
from fixtures import finish, free_port, start, subprocess_env
from probes import kill_tree

TORCH = f"torch {torch.__version__}"


def _said(what: str, exc: BaseException) -> str:
    """An assertion's message: the torch, what was provoked, and what torch said."""
    return f"{TORCH}: {what}: {type(exc).__module__}.{type(exc).__qualname__}: {exc}"


def _loopback_listener() -> socket.socket:
    """A listening socket on 127.0.0.1 with a free port, for a store server to serve on."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    return listener


def _server(listener: socket.socket, world_size: int = 1) -> dist.TCPStore:
    port = listener.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, world_size, True, timedelta(seconds=60),
                         wait_for_workers=False, master_listen_fd=listener.detach())


def _client(port: int, seconds: float = 30.0) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=seconds))


def _error(call) -> BaseException:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the error is what is tested
        return exc
    pytest.fail(f"{TORCH}: {call} raised nothing")


# --- a gloo peer lost, a wait slice timed out ---------------------------------------------

#: One gloo rank of two, on a store the test hosts. Rank 0 starts an all-reduce rank 1 never
#: joins, waits a 200 ms slice of it (timed out), then rank 1 exits and the wait fails (the
#: peer lost); each error is printed as a ``SEEN`` line: its step, type and message.
_RANK = r'''
import json, os, sys
from datetime import timedelta
import torch, torch.distributed as dist

rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                        timeout=timedelta(seconds=60))
dist.barrier()
if rank == 1:  # leaves once rank 0's slice has timed out, rank 0's all-reduce still pending
    store.wait(["slice seen"], timedelta(seconds=60))
    os._exit(0)


def seen(step, exc):
    kind = type(exc)
    print("SEEN " + json.dumps({"step": step, "module": kind.__module__,
                                "name": kind.__qualname__, "message": str(exc)}), flush=True)


work = dist.all_reduce(torch.ones(4), async_op=True)
for step, seconds in (("slice", 0.2), ("peer gone", 60)):
    try:
        work.wait(timedelta(seconds=seconds))
        print("SEEN " + json.dumps({"step": step, "name": None}), flush=True)
    except Exception as exc:
        seen(step, exc)
    store.set("slice seen", "1")
os._exit(0)
'''


def _rebuilt(seen: Dict[str, str]) -> BaseException:
    """The exception a rank printed, as the same type with the same message."""
    import importlib

    kind = getattr(importlib.import_module(seen["module"]), seen["name"])
    exc = kind(seen["message"])
    assert str(exc) == seen["message"], (kind, seen)
    return exc


@pytest.fixture(scope="module")
def gloo_errors() -> Dict[str, BaseException]:
    """The errors rank 0 of a 2-rank gloo group saw: ``slice`` (a ``Work.wait`` timeout) and
    ``peer gone`` (the same collective once rank 1 exited)."""
    listener = _loopback_listener()
    port = listener.getsockname()[1]
    server = _server(listener, world_size=2)  # noqa: F841 - serves the ranks till the end
    env = subprocess_env()
    lo = loopback_interface()
    if lo is not None:
        env.setdefault("GLOO_SOCKET_IFNAME", lo)
    ranks = [start([sys.executable, "-c", _RANK, str(r), str(port)], env) for r in (0, 1)]
    try:
        code, out, err = finish(ranks[0], timeout=90)
        assert code == 0, f"{TORCH}: rank 0 exited {code}:\n{out}\n{err[-3000:]}"
        finish(ranks[1], timeout=30)
    finally:
        for proc in ranks:
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait()
    lines = [json.loads(line[len("SEEN "):]) for line in out.splitlines()
             if line.startswith("SEEN ")]
    assert [s["step"] for s in lines] == ["slice", "peer gone"], out
    missing = [s["step"] for s in lines if s["name"] is None]
    assert not missing, f"{TORCH}: rank 0's wait raised nothing at {missing}"
    return {s["step"]: _rebuilt(s) for s in lines}


def test_peer_lost_knows_the_gloo_error_for_a_peer_gone_mid_collective(gloo_errors):
    gone = gloo_errors["peer gone"]
    assert torch_messages.peer_lost(gone), _said("a gloo peer exited mid-all-reduce", gone)
    slow = gloo_errors["slice"]  # a slow peer is never taken for a dead one
    assert not torch_messages.peer_lost(slow), _said("a Work.wait slice timed out", slow)


def test_peer_lost_leaves_the_kits_own_errors_alone(gloo_errors):
    # the kit's account of a dead rank quotes the backend's words; it is not the backend's error
    text = str(gloo_errors["peer gone"])
    account = RankFailedError(1, "RuntimeError", text, where="all_reduce")
    assert text in str(account)
    assert not torch_messages.peer_lost(account), f"{TORCH}: {account}"
    assert not torch_messages.peer_lost(ConnectionResetError(text))  # not a backend's error


def test_timed_out_knows_a_gloo_wait_slices_timeout(gloo_errors):
    slow = gloo_errors["slice"]
    assert torch_messages.timed_out(slow), _said("a Work.wait slice timed out", slow)
    gone = gloo_errors["peer gone"]  # a failed collective is not waited for again
    assert not torch_messages.timed_out(gone), _said("a gloo peer exited mid-all-reduce", gone)


#: NCCL's messages for a peer lost, as torch formats them, and the fragments each is built from
#: (looked for in a CUDA build's binaries): ``ProcessGroupNCCL``'s abort, and
#: ``C10D_NCCL_CHECK`` on ``ncclRemoteError`` (NCCL's own string for it, then torch's detail).
NCCL_MESSAGES = {
    "aborted": ("NCCL communicator was aborted on rank 1.",
                ["NCCL communicator was aborted on rank "]),
    "remote error": ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp"
                     ":2063, remote process exited or there was a network error, NCCL version "
                     "2.27.5\nncclRemoteError: A call failed possibly due to a network error "
                     "or a remote process exiting prematurely.\nLast error:\nsocket recv failed",
                     ["NCCL error in: ", "remote process exited or there was a network error",
                      "ncclRemoteError: A call failed possibly due to a network error or a "
                      "remote process exiting prematurely."]),
}


def _cuda_binaries() -> List[Path]:
    """The installed torch's CUDA library and the NCCL it loads (none on a CPU build)."""
    lib = Path(torch.__file__).parent / "lib"
    found = sorted(lib.glob("libtorch_cuda.so"))
    if found:
        found += sorted((Path(torch.__file__).parents[1] / "nvidia" / "nccl" / "lib")
                        .glob("libnccl.so*"))
    return found


def _in_binaries(fragment: str, binaries: List[Path]) -> bool:
    for path in binaries:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data.find(fragment.encode()) != -1:
                return True
    return False


@pytest.mark.parametrize("kind", sorted(NCCL_MESSAGES))
def test_peer_lost_knows_the_nccl_errors(kind):
    text, fragments = NCCL_MESSAGES[kind]
    error = getattr(dist, "DistBackendError", RuntimeError)(text)  # what ProcessGroupNCCL raises
    assert torch_messages.peer_lost(error), f"{TORCH}: NCCL's {kind}: {text}"


@pytest.mark.parametrize("kind", sorted(NCCL_MESSAGES))
def test_a_cuda_build_still_builds_nccls_errors_from_those_words(kind):
    _, fragments = NCCL_MESSAGES[kind]
    binaries = _cuda_binaries()
    if not binaries:
        pytest.skip(f"{TORCH} is not a CUDA build: its NCCL strings are not here to check")
    missing = [f for f in fragments if not _in_binaries(f, binaries)]
    assert not missing, (f"{TORCH}: NCCL's {kind} message is no longer built from {missing} "
                         f"(looked in {[str(b) for b in binaries]})")


# --- the store gone -------------------------------------------------------------------------

#: A store server on the listening socket it inherits, till it is killed.
_HOST = r'''
import sys, time
from datetime import timedelta
import torch.distributed as dist

server = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 1, True, timedelta(seconds=60),
                       wait_for_workers=False, master_listen_fd=int(sys.argv[2]))
time.sleep(120)
'''


def _gone_with_its_host() -> List[BaseException]:
    """A client's errors once its store's host process was killed."""
    listener = _loopback_listener()
    port = listener.getsockname()[1]
    host = subprocess.Popen([sys.executable, "-c", _HOST, str(port), str(listener.fileno())],
                            pass_fds=[listener.fileno()], env=subprocess_env(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    listener.close()  # the host's copy alone: its end closes the port
    try:
        client = _client(port)
        client.set("k", "v")  # the host serves
        _check_a_timeout_is_not_gone(client)
        host.kill()
        host.wait(timeout=30)
        return _calls_after(client)
    finally:
        if host.poll() is None:
            kill_tree(host.pid)
            host.wait()


def _gone_with_its_server() -> List[BaseException]:
    """A client's errors once its store's server (in this process) was closed."""
    listener = _loopback_listener()
    port = listener.getsockname()[1]
    server = _server(listener)
    client = _client(port)
    client.set("k", "v")
    _check_a_timeout_is_not_gone(client)
    del server
    gc.collect()
    return _calls_after(client)


def _calls_after(client: dist.TCPStore) -> List[BaseException]:
    """The errors of a few calls once the server is gone: the first one read says the
    connection closed; a later one (or a write first) may meet a broken pipe instead."""
    errors = []
    for call in (lambda: client.get("k"), lambda: client.set("k", "w"),
                 lambda: client.get("k")):
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - the errors are what is tested
            errors.append(exc)
    assert errors, f"{TORCH}: every call succeeded with the store's server gone"
    return errors


def _check_a_timeout_is_not_gone(client: dist.TCPStore) -> None:
    late = _error(lambda: client.wait(["absent"], timedelta(seconds=0.2)))
    assert not torch_messages.store_gone(late), _said("a store wait timed out", late)


@pytest.mark.parametrize("how", ["host killed", "server closed"])
def test_store_gone_knows_a_store_whose_server_went_away(how):
    errors = _gone_with_its_host() if how == "host killed" else _gone_with_its_server()
    for exc in errors:
        assert torch_messages.store_gone(exc), _said(f"a store call after its {how}", exc)


# --- the store's port taken -----------------------------------------------------------------

def test_address_in_use_knows_a_store_port_another_program_holds():
    other = _loopback_listener()  # another program listening on the port
    with other:
        port = other.getsockname()[1]
        taken = _error(lambda: dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=5),
                                             wait_for_workers=False))
    assert torch_messages.address_in_use(taken), _said("a store server on a taken port", taken)
    # a store nobody listens on is not a taken port
    unheard = _error(lambda: _client(free_port(), seconds=0.3))
    assert not torch_messages.address_in_use(unheard), _said("a client with no server", unheard)
