"""Reading environment variables, in one place: fast raw lookups and the parsers every module
uses (integers with bounds, seconds, on/off switches), each raising
:class:`~axolotl_dist.errors.DistributedEnvError` that names the variable and the fix; and
:data:`KIT_VARS`, the table of the kit's own ``AXOLOTL_DIST_*`` variables, read only through
:func:`kit_seconds` / :func:`kit_switch` (so every reader of a variable agrees, and
``validate_env_vars()`` checks them all). docs/env.md lists exactly these.

Rank queries run in hot loops, and before init a query must look at every launcher's
variables to learn that none is set (up to seven names). ``os.environ.get`` of an unset name
costs about 0.55 us (``Mapping.get`` raises and catches ``KeyError``), so seven of them would
make ``is_main_process()`` cost 7x one ``os.environ.get``. A raw lookup therefore reads the dict
``os.environ`` keeps its encoded items in (``os.environ._data``, what ``os.environ``'s own
``__getitem__`` reads; 25 ns, no decoding), falling back to ``os.environ.get`` where that dict
does not exist. ``tests/test_queries.py`` checks that both always agree, through every way of
changing the environment. :func:`raw_getter` gives a zero-argument getter for one variable
whose result is the stored object itself, so callers can cache on its identity. Parsed
integers are cached per raw value.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from ..errors import DistributedEnvError

__all__ = [
    "TRUE_WORDS",
    "FALSE_WORDS",
    "TORCHRUN_NODE_ALIASES",
    "raw",
    "raw_getter",
    "text",
    "parse_int",
    "parse_flag",
    "read_seconds",
    "KitVar",
    "KIT_VARS",
    "kit_seconds",
    "kit_switch",
    "kit_path",
    "kit_bound",
    "kit_secret",
    "MIN_SECRET",
    "validate_kit_vars",
    "is_decimal",
    "HEARTBEAT_TIMEOUT_ENV_VAR",
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "WAIT_LOG_INTERVAL_ENV_VAR",
    "STARTUP_ENV_VAR",
    "CHECK_LAUNCH_ENV_VAR",
    "STANDIN_ENV_VAR",
    "DEAD_PEER_EXIT_ENV_VAR",
    "RETRY_SAME_FAILURE_ENV_VAR",
    "DEFAULT_WAIT_LOG_INTERVAL",
    "STORE_LINGER_ENV_VAR",
    "DEFAULT_STORE_LINGER",
    "DEBUG_ENV_VAR",
    "DEBUG_TIMEOUT_ENV_VAR",
    "DEFAULT_DEBUG_TIMEOUT",
    "DEFAULT_LOGGING_ENV_VAR",
    "SHARED_FS_ENV_VAR",
    "LAUNCHER_PID_ENV_VAR",
    "END_DIR_ENV_VAR",
    "FOLD_ENV_VAR",
    "LOG_DIR_ENV_VAR",
    "LAUNCHER_FOLDS_ENV_VAR",
    "LAUNCHER_TTY_ENV_VAR",
    "TRACE_ENV_VAR",
    "STUCK_AFTER_ENV_VAR",
    "OFF",
    "STRAGGLERS_ENV_VAR",
    "RUN_DIR_ENV_VAR",
    "SECRET_ENV_VAR",
    "SECRET_FILE_ENV_VAR",
    "SECRET_OFF",
    "AGENT_STORE_ENV_VAR",
]

#: Values that switch a flag on / off (case-insensitive, surrounding spaces ignored).
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("", "0", "false", "no", "off")
#: ``(the kit's name, torchrun's name)`` for the node rank and the number of nodes: the kit
#: reads either, the kit's name first.
TORCHRUN_NODE_ALIASES = (("NODE_RANK", "GROUP_RANK"), ("NUM_NODES", "GROUP_WORLD_SIZE"))

_DATA = getattr(os.environ, "_data", None)
_ENCODE: Optional[Callable[[str], object]] = getattr(os.environ, "encodekey", None)
_KEYS: Dict[str, object] = {}


def is_decimal(text: str) -> bool:
    """Whether ``text`` is one or more ASCII digits: a number the kit wrote, or one ``int()``
    reads back from an environment variable, a store record or a file name. Not
    ``str.isdigit``, which also takes ``'²'`` (``int()`` then raises)."""
    return text.isascii() and text.isdigit()


def raw_getter(name: str) -> Callable[[], Optional[object]]:
    """A zero-argument getter of ``name``'s stored value (the same object until it is set
    again), or None while unset. On CPython a bound dict lookup."""
    if _DATA is None or _ENCODE is None:  # pragma: no cover - non-CPython os.environ
        return functools.partial(os.environ.get, name)
    return functools.partial(_DATA.get, _ENCODE(name))


def raw(name: str) -> Optional[object]:
    """``name``'s stored value (bytes on POSIX), or None while unset."""
    if _DATA is None or _ENCODE is None:  # pragma: no cover - non-CPython os.environ
        return os.environ.get(name)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS[name] = _ENCODE(name)
    return _DATA.get(key)


def text(value: object) -> str:
    """A raw value as text."""
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


_INT_CACHE: Dict[Tuple[str, object], int] = {}


def parse_int(name: str, value: object, minimum: int, fix: str,
              maximum: Optional[int] = None, maximum_is: str = "") -> int:
    """``value`` of variable ``name`` as an int in ``[minimum, maximum]``; cached per value.

    :param fix: what to do, for the message ("set it to the number of nodes (>= 1)").
    :param maximum_is: what the maximum counts, for the message ("ranks torch's c10d store
        takes": "is larger than the 2147483647 ranks torch's c10d store takes").
    """
    cached = _INT_CACHE.get((name, value))
    if cached is not None:
        return cached
    stripped = text(value).strip()
    try:
        number = int(stripped)
    except ValueError:
        raise DistributedEnvError(f"{name}={stripped!r} is not an integer; {fix}") from None
    if number < minimum:
        raise DistributedEnvError(f"{name}={number} must be >= {minimum}; {fix}")
    if maximum is not None and number > maximum:
        raise DistributedEnvError(f"{name}={number} is larger than the {maximum} {maximum_is}; {fix}")
    _INT_CACHE[(name, value)] = number
    return number


def parse_flag(name: str, value: object, fix: str) -> bool:
    """``value`` of switch ``name``: one of :data:`TRUE_WORDS` / :data:`FALSE_WORDS`."""
    word = text(value).strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise DistributedEnvError(f"{name}={text(value)!r} is not a switch: {fix}")


def read_seconds(name: str, default: float) -> float:
    """Variable ``name`` as a positive, finite number of seconds (``default`` when unset or
    blank)."""
    value = raw(name)
    if value is None or not text(value).strip():
        return default
    try:
        seconds = float(text(value))
    except ValueError:
        seconds = -1.0
    if not (seconds > 0 and math.isfinite(seconds)):
        raise DistributedEnvError(
            f"{name}={text(value)!r} must be a positive number of seconds: set e.g. "
            f"{name}={default:g}")
    return seconds


# --- the kit's own variables -----------------------------------------------------------------

#: Seconds without a heartbeat after which a rank on another host counts as dead.
HEARTBEAT_TIMEOUT_ENV_VAR = "AXOLOTL_DIST_HEARTBEAT_TIMEOUT"
DEFAULT_HEARTBEAT_TIMEOUT = 15.0
#: Seconds a wait runs before its first warning (then at doubling intervals).
WAIT_LOG_INTERVAL_ENV_VAR = "AXOLOTL_DIST_WAIT_LOG_INTERVAL"
#: Switch: rank 0 logs where the start-up's time went, one table after init; rank 0 names the
#: ranks the kit's handshake still waits for after a few seconds.
STARTUP_ENV_VAR = "AXOLOTL_DIST_STARTUP"
#: Switch: ``0`` turns off the checks of the launch geometry (``srun`` or ``mpirun`` around a
#: per-node launcher, a ``RANK`` every task inherited, a loopback ``MASTER_ADDR`` on several
#: hosts).
CHECK_LAUNCH_ENV_VAR = "AXOLOTL_DIST_CHECK_LAUNCH"
#: ``1``: gloo groups are treated as accelerator groups (the kit's own tests: tests/standin.py).
STANDIN_ENV_VAR = "AXOLOTL_DIST_STANDIN_DEVICE"
#: ``0``: a rank whose peer died is not ended by the kit (:mod:`axolotl_dist._runtime.liveness.dead_peers`).
DEAD_PEER_EXIT_ENV_VAR = "AXOLOTL_DIST_DEAD_PEER_EXIT"
#: Switch: restart also when an attempt fails at start-up the way the attempt before did.
RETRY_SAME_FAILURE_ENV_VAR = "AXOLOTL_DIST_RETRY_SAME_FAILURE"
DEFAULT_WAIT_LOG_INTERVAL = 30.0
#: Seconds the store's host keeps a failure readable for its peers before it exits.
STORE_LINGER_ENV_VAR = "AXOLOTL_DIST_STORE_LINGER"
DEFAULT_STORE_LINGER = 5.0
#: Debug mode's switch, and seconds it waits for a missing rank after the last one arrived.
DEBUG_ENV_VAR = "AXOLOTL_DIST_DEBUG"
DEBUG_TIMEOUT_ENV_VAR = "AXOLOTL_DIST_DEBUG_TIMEOUT"
DEFAULT_DEBUG_TIMEOUT = 5.0
#: ``0`` turns off ``get_logger``'s stderr output while logging is unconfigured.
DEFAULT_LOGGING_ENV_VAR = "AXOLOTL_DIST_DEFAULT_LOGGING"
#: Whether all nodes share one filesystem (``get_fs_local_rank``, ``shared_map``).
SHARED_FS_ENV_VAR = "AXOLOTL_DIST_SHARED_FS"
#: Set by ``axolotl-dist`` for its ranks: the launcher's pid, and where a rank records its end.
LAUNCHER_PID_ENV_VAR = "AXOLOTL_DIST_LAUNCHER_PID"
END_DIR_ENV_VAR = "AXOLOTL_DIST_END_DIR"
#: ``0`` turns off folding of what several ranks print alike: ``axolotl-dist``'s (like
#: ``--no-fold``) and, under other launchers, the kit's folding of Python warnings.
FOLD_ENV_VAR = "AXOLOTL_DIST_FOLD"
#: A directory: ``axolotl-dist`` writes each rank's whole, unfolded output there (``--log-dir``).
LOG_DIR_ENV_VAR = "AXOLOTL_DIST_LOG_DIR"
#: Set by ``axolotl-dist`` for its ranks while it takes their output (folded, or kept with
#: ``--log-dir``): the address of its socket; the ranks then leave their warnings to it.
LAUNCHER_FOLDS_ENV_VAR = "AXOLOTL_DIST_LAUNCHER_FOLDS"
#: Set by ``axolotl-dist`` with the above where its own stdout or stderr is a terminal: which
#: (``1``, ``2``, ``1,2``) and its size (``1,2:24x80``); each rank's stream then is a
#: pseudo-terminal of that size.
LAUNCHER_TTY_ENV_VAR = "AXOLOTL_DIST_LAUNCHER_TTY"
#: A directory: every rank records its kit calls there for the timeline (off when unset).
TRACE_ENV_VAR = "AXOLOTL_DIST_TRACE"
#: Seconds without a finished collective after which a rank waiting in one reports the run
#: stuck (unset: from the run's rhythm, at least 60 s; :data:`OFF`: never).
STUCK_AFTER_ENV_VAR = "AXOLOTL_DIST_STUCK_AFTER"
OFF = "off"
#: Switch: rank 0 names a rank that issues the run's collectives last, most of the time (on).
STRAGGLERS_ENV_VAR = "AXOLOTL_DIST_STRAGGLERS"
#: A directory: where the runs of this host are recorded for ``axolotl-dist where`` (default
#: ``$XDG_RUNTIME_DIR/axolotl_dist/runs``, else ``<tmp>/axolotl_dist-<uid>/runs``).
RUN_DIR_ENV_VAR = "AXOLOTL_DIST_RUN_DIR"
#: The run's secret, which seals what the kit writes to the store and encrypts ``where``
#: answers (``axolotl-dist`` makes one for a one-node run), or a file holding it; the value
#: :data:`SECRET_OFF` runs without one.
SECRET_ENV_VAR = "AXOLOTL_DIST_SECRET"
SECRET_FILE_ENV_VAR = "AXOLOTL_DIST_SECRET_FILE"
SECRET_OFF = "off"
#: torch elastic's switch: ``True`` when the launcher's agent hosts the store.
AGENT_STORE_ENV_VAR = "TORCHELASTIC_USE_AGENT_STORE"

class KitVar(NamedTuple):
    """One ``AXOLOTL_DIST_*`` variable: how it is read, its default, and the fix a bad value's
    error suggests."""

    kind: str  #: "seconds", "bound" (seconds or off), "switch", "path", or "launcher"
    default: object  #: seconds (float) or a switch's state (bool); None otherwise
    fix: str


#: Every ``AXOLOTL_DIST_*`` variable the kit reads (``tests/test_docs.py`` checks that the code
#: names no other and that docs/env.md lists exactly these).
KIT_VARS: Dict[str, KitVar] = {
    DEBUG_ENV_VAR: KitVar("switch", False, f"set {DEBUG_ENV_VAR}=1 to turn debug mode on or "
                            f"{DEBUG_ENV_VAR}=0 (or unset it) to leave it off"),
    DEBUG_TIMEOUT_ENV_VAR: KitVar("seconds", DEFAULT_DEBUG_TIMEOUT, ""),
    DEFAULT_LOGGING_ENV_VAR: KitVar(
        "switch", True, f"set {DEFAULT_LOGGING_ENV_VAR}=0 to turn the stderr fallback off or "
        f"{DEFAULT_LOGGING_ENV_VAR}=1 (or unset it) to keep it"),
    SHARED_FS_ENV_VAR: KitVar("switch", False, "set it to 1 if all nodes share one "
                                "filesystem, else 0"),
    HEARTBEAT_TIMEOUT_ENV_VAR: KitVar("seconds", DEFAULT_HEARTBEAT_TIMEOUT, ""),
    WAIT_LOG_INTERVAL_ENV_VAR: KitVar("seconds", DEFAULT_WAIT_LOG_INTERVAL, ""),
    STORE_LINGER_ENV_VAR: KitVar("seconds", DEFAULT_STORE_LINGER, ""),
    STARTUP_ENV_VAR: KitVar("switch", False, f"set {STARTUP_ENV_VAR}=1 on every "
                               "rank for the start-up report, or 0 (or unset it) for none"),
    CHECK_LAUNCH_ENV_VAR: KitVar("switch", True, f"set {CHECK_LAUNCH_ENV_VAR}=0 to "
                                    "skip the launch geometry's checks, or 1 (or unset it) to "
                                    "keep them"),
    STANDIN_ENV_VAR: KitVar(
        "switch", False, f"set {STANDIN_ENV_VAR}=1 only in the kit's own tests (gloo "
        "groups run the accelerator branches), else 0 or unset"),
    DEAD_PEER_EXIT_ENV_VAR: KitVar(
        "switch", True, f"set {DEAD_PEER_EXIT_ENV_VAR}=0 to keep a rank whose peer "
        "died running, or 1 (or unset it) to end it"),
    RETRY_SAME_FAILURE_ENV_VAR: KitVar(
        "switch", False, f"set {RETRY_SAME_FAILURE_ENV_VAR}=1 to restart a run whose "
        "start-up fails the same way twice, or 0 (or unset it) to stop it"),
    FOLD_ENV_VAR: KitVar("switch", True, f"set {FOLD_ENV_VAR}=0 to print every rank's "
                           f"lines as they come or {FOLD_ENV_VAR}=1 (or unset it) to fold "
                           "lines that several ranks print alike"),
    LOG_DIR_ENV_VAR: KitVar("path", None, ""),
    LAUNCHER_FOLDS_ENV_VAR: KitVar("launcher", None, ""),
    LAUNCHER_TTY_ENV_VAR: KitVar("launcher", None, ""),
    TRACE_ENV_VAR: KitVar("path", None, ""),
    STUCK_AFTER_ENV_VAR: KitVar(
        "bound", None, f"set e.g. {STUCK_AFTER_ENV_VAR}=600 for a report after 10 minutes, "
        f"{STUCK_AFTER_ENV_VAR}={OFF} for none, or unset it for a bound from the run's rhythm"),
    STRAGGLERS_ENV_VAR: KitVar("switch", True, f"set {STRAGGLERS_ENV_VAR}=0 for no straggler "
                               f"report or {STRAGGLERS_ENV_VAR}=1 (or unset it) for one"),
    RUN_DIR_ENV_VAR: KitVar("path", None, ""),
    LAUNCHER_PID_ENV_VAR: KitVar("launcher", None, ""),
    END_DIR_ENV_VAR: KitVar("launcher", None, ""),
    SECRET_ENV_VAR: KitVar("secret", None, ""),
    SECRET_FILE_ENV_VAR: KitVar("path", None, ""),
}

#: The fewest characters a run's secret may have.
MIN_SECRET = 16
_SECRET_HOW = ("give every rank the same secret of at least 16 characters (e.g. "
               f"{SECRET_ENV_VAR}=$(openssl rand -hex 32)), or "
               f"{SECRET_ENV_VAR}={SECRET_OFF} to run without one")


def kit_secret() -> Optional[bytes]:
    """The run's secret: :data:`SECRET_ENV_VAR`'s value or the content of the file
    :data:`SECRET_FILE_ENV_VAR` names (this user's, readable by no one else); None
    where neither is set or the value is ``off``. Raises
    :class:`~axolotl_dist.errors.DistributedEnvError` naming the variable and the fix.
    Read again only when either variable's stored value changed (every sealed record asks)."""
    value, path = _SECRET_VALUE(), _SECRET_PATH()
    seen = _SECRET_SEEN
    if seen[3] and seen[0] is value and seen[1] is path:
        return seen[2]  # type: ignore[no-any-return]
    secret = _read_secret(value, _path(path))
    seen[:] = [value, path, secret, True]
    return secret


def _read_secret(value: Optional[object], path: Optional[str]) -> Optional[bytes]:
    """:func:`kit_secret`'s answer for the stored ``value`` and file ``path``."""
    if value is not None and path is not None:
        raise DistributedEnvError(f"both {SECRET_ENV_VAR} and "
                                  f"{SECRET_FILE_ENV_VAR} are set: keep one")
    if path is not None:
        return _secret_file(path)
    if value is None or text(value).strip().lower() == SECRET_OFF:
        return None
    secret = text(value).strip()
    if len(secret) < MIN_SECRET:
        raise DistributedEnvError(f"{SECRET_ENV_VAR} has {len(secret)} characters; "
                                  + _SECRET_HOW)
    return secret.encode()


#: Getters of the two variables' stored values, and the last :func:`kit_secret` answer with
#: the values it came from: ``[value, path, answer, answered]`` (a cache of a pure function).
_SECRET_VALUE, _SECRET_PATH = raw_getter(SECRET_ENV_VAR), raw_getter(SECRET_FILE_ENV_VAR)
_SECRET_SEEN: List[Any] = [None, None, None, False]


@functools.lru_cache(maxsize=4)
def _secret_file(path: str) -> bytes:
    """The secret in file ``path``, refused where another user could read or change it."""
    name = SECRET_FILE_ENV_VAR
    try:
        info = os.stat(path)
        with open(path, "rb") as fh:
            secret = fh.read(4096).strip()
    except OSError as exc:
        raise DistributedEnvError(f"{name}={path!r} cannot be read ({exc.strerror or exc}): "
                                  "point it at a file holding the run's secret") from None
    if hasattr(os, "geteuid") and info.st_uid != os.geteuid():
        raise DistributedEnvError(f"{name}={path!r} belongs to uid {info.st_uid}, not to this "
                                  f"user (uid {os.geteuid()}): use a file of your own")
    if info.st_mode & 0o077:
        raise DistributedEnvError(f"{name}={path!r} can be read by other users (mode "
                                  f"{info.st_mode & 0o777:o}): chmod 600 {path}")
    if len(secret) < MIN_SECRET:
        raise DistributedEnvError(f"{name}={path!r} holds {len(secret)} characters; "
                                  + _SECRET_HOW)
    return secret


def kit_seconds(name: str) -> float:
    """Seconds variable ``name`` of :data:`KIT_VARS` (its default when unset or blank). Read
    again only when its stored value changed: every kit wait asks for several."""
    getter = _SECONDS_GETTERS.get(name)
    if getter is None:
        getter = _SECONDS_GETTERS[name] = raw_getter(name)
    value = getter()
    seen = _SECONDS_SEEN.get(name)
    if seen is not None and seen[0] is value:
        return seen[1]
    seconds = read_seconds(name, float(KIT_VARS[name].default))  # type: ignore[arg-type]
    _SECONDS_SEEN[name] = (value, seconds)
    return seconds


_SECONDS_GETTERS: Dict[str, Callable[[], Optional[object]]] = {}
_SECONDS_SEEN: Dict[str, Tuple[Optional[object], float]] = {}


def kit_switch(name: str) -> bool:
    """Switch ``name`` of :data:`KIT_VARS` (its default when unset or blank)."""
    value = raw(name)
    if value is None or not text(value).strip():
        return bool(KIT_VARS[name].default)
    return parse_flag(name, value, KIT_VARS[name].fix)


def kit_path(name: str) -> Optional[str]:
    """Path variable ``name`` of :data:`KIT_VARS`; None when unset or blank."""
    return _path(raw(name))


def _path(value: Optional[object]) -> Optional[str]:
    """A stored path value, stripped; None when unset or blank."""
    path = None if value is None else text(value).strip()
    return path or None


def kit_bound(name: str) -> Optional[float]:
    """Bound variable ``name`` of :data:`KIT_VARS`: positive seconds, ``math.inf`` for
    :data:`OFF`, None when unset or blank (the kit derives one)."""
    value = raw(name)
    word = "" if value is None else text(value).strip().lower()
    if not word:
        return None
    if word == OFF:
        return math.inf
    try:
        seconds = float(word)
    except ValueError:
        seconds = -1.0
    if not (seconds > 0 and math.isfinite(seconds)):
        raise DistributedEnvError(f"{name}={text(value)!r} is neither a positive number of "
                                  f"seconds nor {OFF!r}: {KIT_VARS[name].fix}")
    return seconds


def validate_kit_vars() -> None:
    """Read every set variable of :data:`KIT_VARS`; raise for the first bad one."""
    for name, var in KIT_VARS.items():
        if var.kind == "seconds":
            kit_seconds(name)
        elif var.kind == "bound":
            kit_bound(name)
        elif var.kind == "switch":
            kit_switch(name)
        elif var.kind == "secret":
            kit_secret()
