"""The pytest plugin of axolotl-dist: ``@pytest.mark.distributed`` runs a test on forked ranks.

Installing axolotl-dist registers it (the ``pytest11`` entry point, named as this module);
``pytest -p no:pytest_axolotl_dist`` turns it off, ``-p pytest_axolotl_dist`` loads it from a
checkout that is not installed. See docs/testing.md, "pytest: the distributed
marker"::

    @pytest.mark.distributed(world_size=[1, 2, 3])
    def test_sum(tmp_path):
        assert ad.all_reduce_value(ad.get_rank() + 1) == sum(range(1, ad.get_world_size() + 1))

This module imports neither torch nor axolotl_dist: a session that marks no test pays nothing
for the plugin. It reads and checks the marker (at collection), parametrizes ``world_size``
lists and ``store="both"``, and hands a marked test's call to ``axolotl_dist.testing._marked``,
imported when the first marked test runs. That module belongs to the testing feature; this one
sits outside the package only because importing anything inside it imports torch.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import pytest

# pytest finds the hooks (pytest_configure, pytest_generate_tests, pytest_pyfunc_call,
# pytest_runtest_makereport) by name
__all__ = ["MARKER", "DEFAULT_TIMEOUT", "TIMEOUT_MARGIN"]

#: The marker's name: ``@pytest.mark.distributed(...)``.
MARKER = "distributed"
#: Seconds a marked test's ranks get when neither the marker nor pytest-timeout says.
DEFAULT_TIMEOUT = 60.0
#: Where the ranks' store lives: the test process, rank 0's process, or each in turn.
STORES = ("parent", "rank0", "both")
#: Seconds taken off pytest-timeout's limit for the ranks, so the ranks' own timeout, the
#: report of where each is (a few seconds) and the kill come before pytest-timeout's.
TIMEOUT_MARGIN = 8.0
#: The argument ``world_size`` lists and ``store="both"`` parametrize: ``(world_size, store)``.
CASE = "axolotl_dist_case"
_KEYWORDS = ("world_size", "store", "backend", "init", "timeout")


@dataclasses.dataclass(frozen=True)
class Options:
    """What a ``distributed`` marker asks for, checked."""

    world_sizes: Tuple[int, ...]
    #: whether ``world_size`` was a list (its ids then name the size: ``[ranks2]``)
    listed: bool
    stores: Tuple[str, ...]
    backend: str
    init: bool
    timeout: Optional[float]

    def cases(self) -> List[Tuple[int, str]]:
        return [(n, s) for n in self.world_sizes for s in self.stores]

    def case_id(self, case: Tuple[int, str]) -> str:
        parts = [f"ranks{case[0]}"] if self.listed else []
        if len(self.stores) > 1:
            parts.append(f"store-{case[1]}")
        return "-".join(parts)


def _refuse(where: str, what: str) -> None:
    pytest.fail(f"{where}: @pytest.mark.{MARKER}: {what}", pytrace=False)


def _is_count(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1


def _is_seconds(t: Any) -> bool:
    return t is None or (isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0)


#: The marker's other arguments: name -> (default, check, what to give instead).
_CHECKS: Dict[str, Tuple[Any, Callable[[Any], bool], str]] = {
    "store": ("parent", lambda v: v in STORES,
              f"give one of {', '.join(map(repr, STORES))} (where the c10d store lives: the "
              "test process, rank 0's process, or each in turn)"),
    "backend": ("gloo", lambda v: isinstance(v, str) and bool(v),
                "give a torch.distributed backend name such as 'gloo' or 'nccl'"),
    "init": (True, lambda v: isinstance(v, bool),
             "give True (each rank calls init_distributed() first) or False (the test inits "
             "itself)"),
    "timeout": (None, _is_seconds, "give seconds > 0, e.g. timeout=30"),
}


def options_of(marker: Any, where: str) -> Options:
    """The checked options of ``marker`` (a ``distributed`` mark); ``where`` (the test's node
    id) starts the message of a collection error naming the argument and its fix."""
    if marker.args:
        _refuse(where, f"takes keyword arguments only, got {marker.args!r}: write "
                       f"world_size=..., e.g. @pytest.mark.{MARKER}(world_size=2)")
    unknown = sorted(set(marker.kwargs) - set(_KEYWORDS))
    if unknown:
        _refuse(where, f"unknown argument(s) {', '.join(unknown)}; it takes "
                       f"{', '.join(_KEYWORDS)}")
    size: Union[int, Sequence[int]] = marker.kwargs.get("world_size", 2)
    listed = isinstance(size, (list, tuple))
    sizes = tuple(size) if isinstance(size, (list, tuple)) else (size,)
    if not sizes or not all(_is_count(n) for n in sizes):
        _refuse(where, f"world_size={size!r}: give a number of ranks >= 1 or a list of them, "
                       "e.g. world_size=2 or world_size=[1, 2, 3]")
    values = {}
    for name, (default, ok, fix) in _CHECKS.items():
        values[name] = marker.kwargs.get(name, default)
        if not ok(values[name]):
            _refuse(where, f"{name}={values[name]!r}: {fix}")
    store, timeout = values["store"], values["timeout"]
    stores = ("parent", "rank0") if store == "both" else (store,)
    return Options(sizes, listed, stores, values["backend"], values["init"],
                   None if timeout is None else float(timeout))


def timeout_of(item: Any, options: Options) -> Tuple[float, str]:
    """Seconds the ranks of ``item`` get, and where that number comes from: the marker's
    ``timeout=``, else pytest-timeout's (its marker, ``--timeout``, ini or
    ``PYTEST_TIMEOUT``) less :data:`TIMEOUT_MARGIN` (at least half of it), else
    :data:`DEFAULT_TIMEOUT`."""
    if options.timeout is not None:
        return options.timeout, f"the marker's timeout={options.timeout:g}"
    limit = _pytest_timeout(item)
    if limit:
        if limit - TIMEOUT_MARGIN >= limit / 2:
            return limit - TIMEOUT_MARGIN, \
                f"pytest-timeout's {limit:g} s less {TIMEOUT_MARGIN:g} s for this report"
        return limit / 2, f"half of pytest-timeout's {limit:g} s, the rest for this report"
    return DEFAULT_TIMEOUT, f"the default {DEFAULT_TIMEOUT:g} s"


def _pytest_timeout(item: Any) -> Optional[float]:
    """pytest-timeout's limit for ``item`` in seconds, None without one (or without it)."""
    config = item.config
    if not config.pluginmanager.has_plugin("timeout"):
        return None
    mark = item.get_closest_marker("timeout")
    found: Any = None
    if mark is not None:
        found = mark.args[0] if mark.args else mark.kwargs.get("timeout")
    if found is None:
        found = config.getoption("timeout", None)
    if found is None:
        try:
            found = config.getini("timeout")
        except ValueError:
            found = None
    if found in (None, "") and os.environ.get("PYTEST_TIMEOUT"):
        found = os.environ["PYTEST_TIMEOUT"]
    try:
        seconds = float(found) if found not in (None, "") else 0.0
    except (TypeError, ValueError):
        return None
    return seconds if seconds > 0 else None


def pytest_configure(config: Any) -> None:
    # torch's notice at import where NumPy is missing: the kit needs no NumPy, and the notice
    # would close every session that imports torch (the kit filters it the same way)
    config.addinivalue_line("filterwarnings",
                            "ignore:Failed to initialize NumPy:UserWarning")
    config.addinivalue_line(
        "markers",
        f"{MARKER}(world_size=2, store='parent', backend='gloo', init=True, timeout=None): run "
        "the test on world_size forked ranks, fixtures computed once here (axolotl-dist; "
        "docs/testing.md)")


def pytest_generate_tests(metafunc: Any) -> None:
    marker = metafunc.definition.get_closest_marker(MARKER)
    if marker is None:
        return
    options = options_of(marker, metafunc.definition.nodeid)
    if options.listed or len(options.stores) > 1:
        cases = options.cases()
        metafunc.fixturenames.append(CASE)  # an argument the test function does not take
        metafunc.parametrize(CASE, cases, ids=[options.case_id(c) for c in cases])


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: Any) -> Optional[bool]:
    marker = pyfuncitem.get_closest_marker(MARKER)
    if marker is None:
        return None
    options = options_of(marker, pyfuncitem.nodeid)
    fn = pyfuncitem.obj
    if inspect.iscoroutinefunction(fn) or inspect.isgeneratorfunction(fn):
        _refuse(pyfuncitem.nodeid, "the test must be a plain function (not async, not a "
                                   "generator): its body runs on every rank")
    callspec = getattr(pyfuncitem, "callspec", None)
    case = callspec.params.get(CASE) if callspec is not None else None
    world_size, store = case if case is not None else options.cases()[0]
    timeout, source = timeout_of(pyfuncitem, options)
    names = [n for n in inspect.signature(fn).parameters if n in pyfuncitem.funcargs]
    factory = getattr(pyfuncitem.config, "_tmp_path_factory", None)  # pytest's, per session
    if factory is not None:
        # made here, before the fork: ranks that each made it lazily raced (pytest empties a
        # given base directory and makes it again), one rank's mkdir failing, its files gone
        factory.getbasetemp()

    from axolotl_dist.testing import _marked  # the first marked test imports torch

    _marked.run(pyfuncitem, fn, {n: pyfuncitem.funcargs[n] for n in names},
                world_size=world_size, store=store, backend=options.backend,
                init=options.init, timeout=timeout, timeout_source=source)
    return True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Any:
    """A marked test's failure, as pytest reports its own: the ranks' account as the failure's
    text, and one line (``rank 1 of 2 failed: AssertionError: ...``, at the failing rank's
    file:line) as its crash, which the short summary, ``--tb=line`` and JUnit's ``message``
    show. Without it, pytest prints a ``pytest.fail`` message whole in the summary too on
    CI or under ``-vv``."""
    outcome = yield
    report = outcome.get_result()
    result = getattr(call.excinfo.value, "axolotl_dist_result", None) \
        if call.excinfo is not None else None
    if result is None or report.when != "call":
        return
    from _pytest._code.code import ReprExceptionInfo, ReprFileLocation, ReprTracebackNative

    if result.site is not None:
        path, line = result.site
    else:  # a hang, or a rank that died: the test's own line
        path, first, _ = item.reportinfo()
        line = (first or 0) + 1
    text = result.message.rstrip("\n") + "\n"
    report.longrepr = ReprExceptionInfo(
        reprtraceback=ReprTracebackNative(text.splitlines(keepends=True)),
        reprcrash=ReprFileLocation(str(path), line, result.summary))
