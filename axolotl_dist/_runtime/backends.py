"""What a backend string says about devices, in one place.

A backend is a name (``"gloo"``, ``"nccl"``, ``"mpi"``, ``"xccl"``, ``"fake"``) or a
per-device list (``"cuda:nccl,cpu:gloo"``). :func:`served` maps it to the device types it
takes tensors on; every other question is answered from that map, so the kit gives one answer
everywhere. In particular :func:`device_type`, the device a group's collectives, its meshes
and the sharded tensors use, is the accelerator the backend serves when this machine has it,
else the CPU: ``"cuda:nccl,cpu:gloo"`` means ``cuda`` on a GPU machine and ``cpu`` without one.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

__all__ = ["served", "supports", "usable", "usable_accelerator", "device_type", "comm_device",
           "only", "matches"]

#: The device type each single backend name serves (unknown names: the CPU).
_NAME_DEVICE = {"nccl": "cuda", "xccl": "xpu", "hccl": "hpu", "gloo": "cpu", "mpi": "cpu",
                "fake": "cpu", "ucc": "cpu"}


def served(backend: str) -> Dict[str, str]:
    """Device type -> backend name for every device ``backend`` takes tensors on."""
    out: Dict[str, str] = {}
    for part in backend.lower().replace(" ", "").split(","):
        if not part:
            continue
        if ":" in part:
            device, name = part.split(":", 1)
            out[device] = name
        else:
            out[_NAME_DEVICE.get(part, "cpu")] = part
    return out


def supports(backend: str, device: str) -> bool:
    """Whether ``backend`` takes tensors on ``device`` (``"cpu"``, ``"cuda"``...)."""
    return device in served(backend)


def usable(device: str) -> bool:
    """Whether this machine can run tensors on ``device`` now (not: whether torch was built
    for it: PyPI's CUDA build on a machine without a GPU answers False for ``"cuda"``)."""
    if device == "cpu":
        return True
    module = getattr(torch, device, None)
    check: Optional[Callable[[], bool]] = getattr(module, "is_available", None)
    return bool(check()) if check is not None else False


def usable_accelerator() -> Optional[str]:
    """The device type of this machine's accelerator when one is usable here, else None.

    ``torch.accelerator.current_accelerator()`` names the accelerator torch was *built* for:
    ``cuda`` for PyPI's default Linux wheel on any machine (docs/design.md, decision 17), and
    torch 2.6 raises there instead. Only an accelerator that :func:`usable` confirms counts.
    """
    current = getattr(getattr(torch, "accelerator", None), "current_accelerator", None)
    try:
        accel = current() if current is not None else None
    except RuntimeError:  # torch 2.6: "Cannot access accelerator device when none is available"
        accel = None
    kind = accel.type if accel is not None else ("cuda" if current is None else None)
    return kind if kind is not None and usable(kind) else None


def device_type(backend: str, available: Callable[[str], bool] = usable) -> str:
    """The device type the kit uses for ``backend``'s collectives, meshes and tensors.

    :param available: whether a device type is usable here (a parameter for tests).
    """
    devices = served(backend)
    for device in devices:
        if device != "cpu" and available(device):
            return device
    if "cpu" in devices:
        return "cpu"
    return next(iter(devices), "cpu")  # an accelerator backend on a machine without it


def comm_device(backend: str) -> torch.device:
    """The :class:`torch.device` for :func:`device_type`, with CUDA's current index."""
    kind = device_type(backend)
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def only(backend: str, name: str) -> bool:
    """Whether every device of ``backend`` is served by backend ``name`` (e.g. only NCCL)."""
    names = set(served(backend).values())
    return names == {name.lower()}


def matches(requested: str, existing: str) -> bool:
    """Whether ``requested`` (what a caller asks for) is what ``existing`` already provides."""
    requested, existing = requested.lower().replace(" ", ""), existing.lower().replace(" ", "")
    if requested == existing:
        return True
    have = served(existing)
    if ":" in requested or "," in requested:
        return served(requested).items() <= have.items()
    return requested in have.values()
