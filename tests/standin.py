"""The CPU stand-in for an accelerator, and a detector of host reads of device tensors.

With ``AXOLOTL_DIST_STANDIN_DEVICE=1`` the kit treats a gloo group as an accelerator group: its
device is ``cpu:0`` (the CPU, named apart), its metadata goes through a CPU channel of the same
ranks, and every branch only an accelerator group takes runs, in CI, without a GPU.

:class:`HostReads` is a torch function mode that tells the device's tensors from the host's and
records each time the host reads one (what would wait for the GPU, a host synchronisation):

* a device tensor is one a factory made with ``device=cpu:0`` (``torch.empty(..., device=
  g.device)``), one moved there (``.to(cpu:0)``), or the result of any operation on one (a
  view, a slice, a copy); user inputs made inside the mode on ``cpu:0`` count too;
* a read is ``tolist``, ``item``, ``numpy``, ``data_ptr`` (the bytes read through it), a
  conversion to a Python number or bool, ``cpu()`` or ``to("cpu")``, or a copy of a device
  tensor into a host one.

The mode sees Python-level torch calls only; what torch does in C++ (a collective's own
buffers) is not a host read.
"""

from __future__ import annotations

import traceback
import weakref
from typing import Any, Dict, List, Tuple

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["DEVICE", "ENV", "HostReads"]

#: The stand-in device (the kit's ``STANDIN_DEVICE``).
DEVICE = torch.device("cpu", 0)
#: The environment that turns the stand-in on.
ENV = {"AXOLOTL_DIST_STANDIN_DEVICE": "1"}

_T = torch.Tensor
_READS = {_T.tolist, _T.item, _T.numpy, _T.data_ptr, _T.__bool__, _T.__int__, _T.__float__,
          _T.__index__, _T.__complex__, _T.cpu}
_FACTORIES = {torch.empty, torch.zeros, torch.ones, torch.full, torch.tensor, torch.arange,
              torch.randn, torch.rand, torch.empty_like, torch.zeros_like, torch.ones_like,
              torch.full_like, torch.as_tensor, torch.randint}


def _is_device(device: Any) -> bool:
    try:
        return torch.device(device) == DEVICE
    except (TypeError, RuntimeError):
        return False


def _tensors(value: Any) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


class HostReads(TorchFunctionMode):
    """See the module docstring. ``reads``: ``(what, where)`` of each host read of a device
    tensor, ``where`` the innermost frame of the kit's package that made it."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: Dict[int, "weakref.ref[torch.Tensor]"] = {}  # id -> the device tensor
        self.reads: List[Tuple[str, str]] = []

    def on_device(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a device tensor (by identity: no tensor comparison)."""
        ref = self.ids.get(id(t))
        return ref is not None and ref() is t

    def _add(self, t: torch.Tensor) -> None:
        self.ids[id(t)] = weakref.ref(t)

    def __torch_function__(self, func: Any, types: Any, args: Tuple[Any, ...] = (),
                           kwargs: Dict[str, Any] = None) -> Any:
        kwargs = kwargs or {}
        inputs = _tensors(args) + _tensors(kwargs)
        on_device = [t for t in inputs if self.on_device(t)]
        name = getattr(func, "__name__", str(func))
        if on_device and (func in _READS or self._to_host(func, args, kwargs)):
            self.reads.append((name, _where()))
        if func is _T.copy_ and len(args) > 1 and self.on_device(args[1]) and \
                not self.on_device(args[0]):
            self.reads.append(("copy_ into a host tensor", _where()))
        out = func(*args, **kwargs)
        made = func in _FACTORIES and _is_device(kwargs.get("device"))
        moved = name == "to" and any(_is_device(a) for a in list(args[1:]) +
                                     [kwargs.get("device")])
        if (on_device and func not in _READS and not self._to_host(func, args, kwargs)) or \
                made or moved:
            for t in _tensors(out):
                self._add(t)
        return out

    @staticmethod
    def _to_host(func: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
        """``t.to("cpu")`` (or a ``torch.device("cpu")``): a copy to the host."""
        if getattr(func, "__name__", "") != "to":
            return False
        targets = list(args[1:]) + [kwargs.get("device")]
        return any(isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu"
                   and not _is_device(a) for a in targets if a is not None)


def _where() -> str:
    """The innermost frame of the kit's package on the stack (the code that read)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/axolotl_dist/" in frame.filename:
            return f"{frame.filename.split('/axolotl_dist/')[-1]}:{frame.lineno} {frame.name}"
    return "?"
