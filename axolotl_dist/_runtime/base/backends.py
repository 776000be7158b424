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

__all__ = ["served", "supports", "usable", "cuda_usable", "usable_accelerator", "device_type",
           "comm_device", "only", "matches"]

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
    for it: PyPI's CUDA build on a machine without a GPU answers False for ``"cuda"``).

    For CUDA the answer leaves this process fit to fork (:func:`cuda_usable`)."""
    if device == "cpu":
        return True
    if device == "cuda":
        return cuda_usable()
    module = getattr(torch, device, None)
    check: Optional[Callable[[], bool]] = getattr(module, "is_available", None)
    return bool(check()) if check is not None else False


def cuda_usable() -> bool:
    """Whether a CUDA GPU is usable here, asked without initializing CUDA in this process.

    ``torch.cuda.is_available()`` initializes the CUDA driver (unless
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1``), and a process forked after that cannot use CUDA:
    the ranks of :func:`axolotl_dist.testing.run_distributed`, forked data loader workers. So
    the kit counts devices the way torch does under that variable (NVML first, the CUDA
    runtime only where NVML cannot answer), unless CUDA is initialized here already.
    """
    cuda = torch.cuda
    if cuda.is_initialized():
        return bool(cuda.is_available())
    return cuda.device_count() > 0


def usable_accelerator() -> Optional[str]:
    """The device type of this machine's accelerator when one is usable here, else None.

    ``torch.accelerator.current_accelerator()`` names the accelerator torch was *built* for:
    ``cuda`` for PyPI's default Linux wheel on any machine (docs/design.md, decision 17), and
    torch 2.6 raises there instead. Only an accelerator that :func:`usable` confirms counts.
    CUDA is asked first, through :func:`cuda_usable`: torch's accelerator query may count the
    devices through the CUDA runtime, which initializes it.
    """
    if torch.backends.cuda.is_built() and cuda_usable():
        return "cuda"
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
