"""Debug mode: catch ranks that call different helpers before the collective hangs or mixes data.

Turn it on with ``AXOLOTL_DIST_DEBUG=1`` in the environment (read at import and again by
:func:`~axolotl_dist.init_distributed`), or with :func:`enable_debug` / ``with debug_mode():``.
While it is on, every communicating helper of the kit (the tensor collectives, the value
helpers, :func:`~axolotl_dist.zero_first`, :func:`~axolotl_dist.do_n_at_a_time`, barriers)
first checks, through the process group's c10d store and not through a collective, that every
rank of the group is in the *same helper* at the *same call number* with *compatible
arguments* (``src``/``dst``, the reduction, tensor shapes and dtypes where they must agree):

* on a mismatch every rank raises :class:`~axolotl_dist.errors.CollectiveMismatchError` at
  once, listing rank by rank which helper it called, with which arguments, from which file and
  line;
* a rank that does not arrive is named after the debug timeout (``AXOLOTL_DIST_DEBUG_TIMEOUT``
  seconds without a new rank arriving, default 5), or within about 4 s if its process is gone,
  together with the last checked call it made. Like ``torch.distributed.monitored_barrier``,
  but for every helper, and independent of the group's collective timeout.

A check costs a few store round trips per rank at any world size (about 0.5-0.8 ms per call on
one host), so keep debug mode for hunting bugs. Off, the only cost is one wrapper call and one
global lookup per helper call, about 0.1-0.2 us (``benchmarks/debug.py``).
Calls made by a helper inside another (``synchronize_flag`` uses ``synchronize_value``) are
checked once, under the outer name. The ranks that go first in ``zero_first`` do not wait at
the check (the others wait for them, and blocks nest): they compare when their outermost block
ends. The store protocol is in :mod:`axolotl_dist._runtime.protocols.debug_checks`; the wrapper every
helper wears, which runs the check, in :mod:`axolotl_dist._runtime.protocols.helpers`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator, Optional

from .env import variables as _variables
from ._runtime.protocols import debug_checks as _debug_checks
from ._runtime.protocols import raw_checks as _raw_checks
from ._runtime.protocols.helpers import debug_timeout
from ._runtime.base.groups import group_of as _group_of
from ._runtime.liveness.progress import count
from .errors import DistributedConfigError, DistributedEnvError

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = [
    "DEBUG_ENV_VAR",
    "DEBUG_TIMEOUT_ENV_VAR",
    "DEFAULT_DEBUG_TIMEOUT",
    "enable_debug",
    "disable_debug",
    "is_debug_enabled",
    "debug_mode",
    "debug_timeout",
    "checked_calls",
]

#: The switch; seconds a rank waits, after the last rank to arrive, before naming the ranks
#: still missing (names and defaults of every kit variable: ``_runtime/constants.py``).
DEBUG_ENV_VAR = _variables.DEBUG_ENV_VAR
DEBUG_TIMEOUT_ENV_VAR = _variables.DEBUG_TIMEOUT_ENV_VAR
DEFAULT_DEBUG_TIMEOUT = _variables.DEFAULT_DEBUG_TIMEOUT

# --- switching it on and off ------------------------------------------------------------------

# debug mode's switches live in the protocols room (:mod:`axolotl_dist._runtime.protocols.debug_checks`)

def refresh_from_env() -> None:
    """Re-read :data:`DEBUG_ENV_VAR` unless :func:`enable_debug`/:func:`disable_debug` decided."""
    _debug_checks.refresh_from_env()
    _raw_checks.sync()


def _set(on: bool, timeout: Optional[float], explicit: bool, env_error: Optional[str]) -> None:
    """Set the switches; torch's own collectives are checked exactly while it is on."""
    _debug_checks.set_switches(on, timeout, explicit, env_error)
    _raw_checks.sync()


def enable_debug(timeout: Optional[float] = None) -> None:
    """Turn debug mode on in this process (every rank must turn it on, like the env var).

    :param timeout: seconds to wait, after the last rank arrived, for ranks still missing
        (default: ``AXOLOTL_DIST_DEBUG_TIMEOUT`` or 5).
    """
    if timeout is not None:
        _check_timeout(timeout, "enable_debug(timeout=...)")
    _set(True, timeout, True, None)


def disable_debug() -> None:
    """Turn debug mode off in this process (whatever the env var says)."""
    _set(False, None, True, None)


def is_debug_enabled() -> bool:
    """Whether helpers check their calls across ranks (see :mod:`axolotl_dist.debug`).

    Raises the :class:`~axolotl_dist.errors.DistributedEnvError` every helper raises while
    ``AXOLOTL_DIST_DEBUG`` holds a value that is not a switch (unless :func:`enable_debug` /
    :func:`disable_debug` decided): both readers of the switch agree."""
    on, _, _, env_error = _debug_checks.switches()
    if env_error is not None:
        raise DistributedEnvError(env_error)
    return on


def checked_calls(group: Optional["ProcessGroup"] = None) -> int:
    """How many calls debug mode has checked on ``group`` (default: the default group) in this
    process so far; 0 without a process group. Every rank checks the same calls, so the counts
    agree across ranks; a helper that calls another helper is checked once."""
    g = _group_of(group, "checked_calls")
    return 0 if g is None else count(g, _debug_checks.SEQUENCE_KIND)


@contextmanager
def debug_mode(timeout: Optional[float] = None) -> Iterator[None]:
    """Debug mode on inside the block, restored to its previous state after it."""
    saved = _debug_checks.switches()
    enable_debug(timeout)
    try:
        yield
    finally:
        _set(*saved)


def _check_timeout(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise DistributedConfigError(f"{name}={value!r} must be a positive number of seconds")
    return float(value)


refresh_from_env()  # at import: the env decides until a function call does
