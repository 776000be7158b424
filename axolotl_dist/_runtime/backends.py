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

__all__ = ["served", "supports", "device_type", "comm_device", "only", "matches"]

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


def _available(device: str) -> bool:
    if device == "cpu":
        return True
    module = getattr(torch, device, None)
    check: Optional[Callable[[], bool]] = getattr(module, "is_available", None)
    return bool(check()) if check is not None else False


def device_type(backend: str, available: Callable[[str], bool] = _available) -> str:
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
