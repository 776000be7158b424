"""Whether the nodes of a run share a filesystem, asked of the filesystem itself.

``zero_first`` builds a cache once and lets the other ranks load it: right when every node sees
the cache directory, wrong when each node has its own disk (the other nodes find nothing, or
every rank of theirs builds it at once). Launchers cannot say which, so on a run of several
nodes where nobody said (``AXOLOTL_DIST_SHARED_FS``, ``OLMO_SHARED_FS``,
``init_distributed(shared_filesystem=)``), the kit probes it, once per directory per run, with
every rank of the world taking part (at ``init_distributed``, for the datasets cache; in a
``zero_first(path=...)`` block on the world group, for that path):

1. global rank 0 writes an empty file named for the run into the directory (the deepest one
   that exists on its node: the cache may not be made yet) and sets ``axd/fs/<h>`` to its
   name (``""`` if it could not write: then nothing is decided);
2. each node's first rank (local rank 0) reads that key, looks for the file, and counts its
   answer in ``axd/fs/<h>/seen``;
3. every rank adds its arrival to the same count, and reads it until every rank arrived (so
   every node's first rank answered): shared if every node found the file; rank 0 then
   removes it.

A few store calls per rank, once; a single-node run probes nothing (its ranks share a
filesystem by definition).
"""

from __future__ import annotations

import hashlib
import os
from typing import List, Optional

from ..base.kitlog import kit as log
from ..liveness.liveness_state import HEARTBEAT
from .protocols_state import NOTES
from ..store import keys
from ..store.access import genuine, put, world_store
from ..liveness.polls import poll_until
from ... import env as _env

__all__ = ["default_cache_dir", "probe_dir", "shares", "said", "export"]

#: ``axd/fs/<h>/seen``: every rank adds one arrival (bits 0-23); each node's first rank adds its
#: answer too, counted per kind: found (bits 24-36), not found (37-49), nothing to look for
#: (50-62: rank 0 could not write the file).
_ARRIVED, _FOUND, _NOT_FOUND, _UNKNOWN = 1, 1 << 24, 1 << 37, 1 << 50
_FIELD, _NODES = (1 << 24) - 1, (1 << 13) - 1

#: The value of ``AXOLOTL_DIST_SHARED_FS`` this process exported from a probe (None: none).
_EXPORTED: List[Optional[str]] = [None]


def said() -> bool:
    """Whether the user said if the nodes share a filesystem (``AXOLOTL_DIST_SHARED_FS`` or
    ``OLMO_SHARED_FS`` set, other than by :func:`export`)."""
    value = os.environ.get(_env.SHARED_FS_ENV_VAR)
    return (value is not None and value != _EXPORTED[0]) or _env.is_set(
        _env.OLMO_SHARED_FS_ENV_VAR)


def export(shared: bool) -> None:
    """Export a probe's answer as ``AXOLOTL_DIST_SHARED_FS`` (not a user's word: see
    :func:`said`)."""
    _EXPORTED[0] = os.environ[_env.SHARED_FS_ENV_VAR] = "1" if shared else "0"


def default_cache_dir() -> str:
    """Where Hugging Face ``datasets`` caches: ``HF_DATASETS_CACHE``, else
    ``$HF_HOME/datasets``, else ``$XDG_CACHE_HOME/huggingface/datasets`` (default
    ``~/.cache``)."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return os.environ["HF_DATASETS_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "huggingface")
    return os.path.join(home, "datasets")


def probe_dir(path: str) -> str:
    """The deepest existing directory at or above ``path`` (absolute)."""
    path = os.path.abspath(os.path.expanduser(path))
    while not os.path.isdir(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def shares(label: str, path: str, rank: int, local_rank: int, world_size: int) -> Optional[bool]:
    """Whether every node sees ``path`` (see the module docstring); None if undecided (rank 0
    could not write there). Every rank of the world must call it with the same ``label`` (what
    names the probe across ranks: the ``path=`` argument as written, before any expansion
    that may differ per node); rank 0's ``path`` decides where to look. Nodes are counted by
    their first ranks' answers once every rank arrived, not from ``LOCAL_WORLD_SIZE`` (nodes
    may run different numbers of ranks)."""
    run = HEARTBEAT.run or ""
    cached = NOTES.fs_answers.get((run, label), False)
    if cached is not False:
        return cached
    store = world_store()
    key = keys.shared_fs(hashlib.blake2b(label.encode(), digest_size=6).hexdigest())
    made = ""
    if rank == 0:
        made = _write_probe(probe_dir(path), run)
        put(store, key, made)
    if local_rank == 0:
        if rank != 0:
            found: List[bytes] = []

            def probed() -> bool:  # rank 0's record (one not this run's is none: ignored)
                data = genuine(key, store.get(key)) if store.check([key]) else None
                found[:] = [] if data is None else [data]
                return bool(found)

            poll_until(probed, watch=lambda: [0], timeout=None,
                       what=f"the shared-filesystem probe of {path}", me=rank)
            made = found[0][:4096].decode(errors="replace")  # a path: only looked at
        answer = _UNKNOWN if not made else _FOUND if os.path.exists(made) else _NOT_FOUND
    else:
        answer = 0
    seen = [store.add(f"{key}/seen", _ARRIVED + answer)]

    def all_arrived() -> bool:
        seen[0] = store.add(f"{key}/seen", 0)
        return seen[0] & _FIELD >= world_size

    if seen[0] & _FIELD < world_size:
        poll_until(all_arrived, watch=lambda: list(range(world_size)), timeout=None,
                   what=f"the shared-filesystem probe of {path}", me=rank)
    if rank == 0 and made:
        try:
            os.remove(made)
        except OSError:
            pass
    missed, unknown = (seen[0] >> shift & _NODES for shift in (37, 50))
    result = None if unknown else not missed
    NOTES.fs_answers[(run, label)] = result
    return result


def _write_probe(directory: str, run: str) -> str:
    """Write the probe file in ``directory``; its path, or "" if it could not be written."""
    name = os.path.join(directory, f".axolotl_dist-fs-probe-{run or os.getpid()}")
    try:
        with open(name, "w"):
            pass
    except OSError as exc:
        log.warning("rank 0 could not write a probe file in %s (%s): whether the nodes share "
                    "it stays unknown; set AXOLOTL_DIST_SHARED_FS=1 or 0", directory, exc)
        return ""
    return name
