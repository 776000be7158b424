"""``axolotl-dist where``: where every rank of a running job is, from any shell on its host.

Told an address (``--master-port`` / ``MASTER_PORT``, ``--master-addr`` / ``MASTER_ADDR``), it
asks the c10d store there (any launcher's; torchrun's ``--rdzv-endpoint`` too). Told none, it reads
this host's run directory (:mod:`~axolotl_dist._runtime.liveness.runs`), where every run of this
user records its store: one run is reported, several are listed and each reported, none is one line
saying how to point it at a run (as is a run directory that is not this user's alone: nothing in it
is read). Where nothing listens at the address (connection refused), it says so in one line and
exits 1 at once; an address that does not answer at all is waited for until ``--timeout``. The run
is left untouched.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence

from .._runtime.liveness import runs, where_report
from .._runtime.store import access, clients
from ._report import PROG
from ..env.variables import is_decimal

__all__ = ["where_main", "plain", "LOOPBACK"]

LOOPBACK = "127.0.0.1"


def plain(text: Optional[str]) -> str:
    """A docstring as ``--help`` shows it: one paragraph, no reST markup."""
    return " ".join((text or "").replace("``", "'").replace(":func:", "").split())


def _fail(text: str) -> None:
    print(f"{PROG} where: {text}", file=sys.stderr, flush=True)


@contextmanager
def _stderr_held(held: List[bytes]) -> Iterator[None]:
    """File descriptor 2 into a temporary file while the ``with`` runs; what was written there
    is appended to ``held`` (the caller writes it, or drops torch's warning of a store that
    went away: it has said so in one line)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as file:
        os.dup2(file.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            file.seek(0)
            held.append(file.read())


def _store_at(addr: str, port: int, timeout: float) -> Optional[Any]:
    """A client of the c10d store at ``addr:port``, or None after saying, in one line, that
    none answered (at once where nothing listens)."""
    try:
        return clients.connect(addr, port, timeout=timeout, retry_refused=False)
    except clients.Refused:
        _fail(f"nothing listens at {addr}:{port} (connection refused): no run's c10d store is "
              "there (the run ended, or the address is not its MASTER_ADDR:MASTER_PORT)")
        return None
    except Exception as exc:  # noqa: BLE001 - no store there (or its host is gone)
        _fail(f"no c10d store answered at {addr}:{port} ({type(exc).__name__}: "
              f"{str(exc).splitlines()[0] if str(exc) else ''})")
        return None


def _report(addr: str, port: int, timeout: float, title: str = "") -> int:
    """Print where every rank of the run whose store is at ``addr:port`` is; 0, or 1 if no
    store answered there."""
    store = _store_at(addr, port, timeout)
    target = clients.rendezvous_target(store) if store is not None else None
    if target is not None:  # torchrun's --rdzv-endpoint: the ranks' store is elsewhere
        rdzv = f"{addr}:{port}"
        addr, port = target
        print(f"{rdzv} is torchrun's rendezvous; the ranks' store is at {addr}:{port}")
        store = _store_at(addr, port, timeout)
    if store is None:
        return 1
    print(f"where every rank of the run at {addr}:{port}{title} is:", flush=True)
    held: List[bytes] = []
    try:
        with _stderr_held(held):  # torch's C++ warns there, with its frames, if the store goes
            report = where_report.where(store)
    except Exception as exc:  # noqa: BLE001 - only the store's going is said, else raised
        if not access.is_store_error(exc):
            os.write(2, held[0])
            raise
        _fail(f"the run's store at {addr}:{port} went away while its ranks were asked (the run "
              "ended, or the process hosting its store did); ask again while it runs")
        return 1
    os.write(2, held[0])
    print(report, flush=True)
    if clients.listens_widely(port):
        print(f"  note: the run's c10d store (port {port}) listens on every interface of this "
              "host: other hosts can reach it and read or write its keys. A multi-node run needs "
              "that; a one-node run under axolotl-dist keeps it on 127.0.0.1 (torchrun cannot: "
              "README, \"Security\")", flush=True)
    return 0


def _recorded(addr: Optional[str], timeout: float) -> int:
    """``where`` without a port: the runs this host's run directory records (those at
    ``addr`` where given)."""
    try:
        found: List[Dict[str, Any]] = runs.live_runs(warn=_fail)
    except runs.NotPrivateError as exc:  # nothing in it is read: another user could write it
        _fail(f"{exc}; or point it at a run with --master-addr A --master-port P")
        return 1
    if addr is not None:
        found = [e for e in found if e.get("addr") == addr]
    if not found:
        at = f" at {addr}" if addr is not None else ""
        _fail(f"no run of this user is recorded on this host{at} (run directory "
              f"{runs.run_dir(create=False)}); point it at one with --master-addr A "
              "--master-port P (or MASTER_ADDR / MASTER_PORT): the run's c10d store")
        return 1
    if len(found) > 1:
        print(f"{len(found)} runs are recorded on this host (pick one with --master-port):")
        for entry in found:
            print(f"  {runs.describe(entry)}")
    code = 0
    for entry in found:
        if len(found) > 1:
            print()
        script = os.path.basename(str(entry.get("script", "")))
        title = f" ({script}, {entry.get('world')} rank(s))" if script else ""
        runs.use_secret(entry)
        code = max(code, _report(str(entry["addr"]), int(entry["port"]), timeout, title))
    return code


def where_main(argv: Sequence[str]) -> int:
    """``axolotl-dist where [--master-addr A] [--master-port P]``: where every rank of a
    running job is. Without a port, the runs of this user recorded on this host (by every
    launcher: axolotl-dist, torchrun, srun, env vars); with one, the run whose c10d store is
    at ``A:P`` (for torchrun, its ``--rdzv-endpoint`` too). The run is left untouched."""
    parser = argparse.ArgumentParser(prog=f"{PROG} where", description=plain(where_main.__doc__))
    parser.add_argument("--master-addr", "--master_addr", dest="addr", default=None,
                        help="the run's MASTER_ADDR (default: $MASTER_ADDR, else 127.0.0.1)")
    parser.add_argument("--master-port", "--master_port", dest="port", type=int, default=None,
                        help="the run's MASTER_PORT (default: $MASTER_PORT; unset: the runs "
                        "recorded on this host)")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="seconds to wait for a store that does not answer (default 10; "
                        "a refused connection fails at once)")
    args = parser.parse_args(argv)
    port = args.port if args.port is not None else os.environ.get("MASTER_PORT")
    if port is None:
        return _recorded(args.addr, args.timeout)
    if not is_decimal(str(port)):
        parser.error(f"MASTER_PORT={port!r} is not a port number")
    addr = args.addr or os.environ.get("MASTER_ADDR") or LOOPBACK
    _recorded_secret(int(port))
    return _report(addr, int(port), args.timeout)


def _recorded_secret(port: int) -> None:
    """Take the secret of a run recorded on this host whose store is on ``port`` (its ranks'
    or its rendezvous'), if any: a run with a secret answers only its holders."""
    try:
        found = runs.live_runs()
    except Exception:  # noqa: BLE001 - no run directory: the secret must come from the env
        return
    for entry in found:
        if entry.get("port") == port:
            runs.use_secret(entry)
