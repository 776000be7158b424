"""The kit's modules pickle by name, so functions that mention the kit hash the same everywhere.

``datasets`` fingerprints a ``map`` function with dill, and dill copies a module *by value*
(its whole ``__dict__``) when the module lives outside ``site-packages``: an editable install,
a clone on ``PYTHONPATH``. A map function that calls ``ad.get_rank()`` then drags the kit's
per-process state (thread-locals, locks, this rank's peers) into the hash: the hash fails or
differs per process, ``datasets`` falls back to a random fingerprint, and ``zero_first``'s
cache is never reused (docs/design/machine.md, "Installs").

:func:`by_name` gives the kit's module objects a :class:`types.ModuleType` subclass whose
``__reduce__`` is "import this module": pickle, dill and ``datasets`` then write the module's
name, in every install mode, so the fingerprint is the same in every process and install.
"""

from __future__ import annotations

import importlib
import types
from typing import Any, Callable, List, Set, Tuple

__all__ = ["KitModule", "by_name"]

_ROOT = __name__.split(".")[0]


class KitModule(types.ModuleType):
    """A module of the kit: pickled as a reference to its name, never as a copy of its dict."""

    def __reduce__(self) -> Tuple[Callable[[str], Any], Tuple[str]]:
        return importlib.import_module, (self.__name__,)


def by_name(package: str) -> None:
    """Make ``package`` and every module of the kit imported beneath it pickle by name.

    Idempotent and cheap (a walk over the imported modules' attributes); called at the end of
    each package that is imported on its own (the top level, ``testing``, ``launch``).
    """
    if package != _ROOT and not package.startswith(_ROOT + "."):
        return  # run as a script (__main__): not the kit's module object
    seen: Set[int] = set()
    stack: List[types.ModuleType] = [importlib.import_module(package)]
    while stack:
        module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        if type(module) is types.ModuleType:
            module.__class__ = KitModule
        for value in list(vars(module).values()):
            if isinstance(value, types.ModuleType) and value.__name__.startswith(_ROOT + "."):
                stack.append(value)
