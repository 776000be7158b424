"""What a backend string says about devices, in one place.

A backend is a name (``"gloo"``, ``"nccl"``, ``"mpi"``, ``"xccl"``, ``"fake"``) or a
per-device list (``"cuda:nccl,cpu:gloo"``). :func:`~axolotl_dist.ranks.backend_devices` (a rank
query, re-exported here) maps it to the device types it takes tensors on; every other question
is answered from that map, so the kit gives one answer everywhere. In particular
:func:`device_type`, the device a group's collectives, its meshes and the sharded tensors use,
is the accelerator the backend serves when this machine has it, else the CPU:
``"cuda:nccl,cpu:gloo"`` means ``cuda`` on a GPU machine and ``cpu`` without one.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch

from ...errors import DistributedEnvError
from ...ranks import backend_devices, cuda_usable
from ...env.variables import is_decimal

__all__ = ["backend_devices", "supports", "usable", "cuda_usable", "usable_accelerator",
           "device_type", "comm_device", "cuda_index", "only", "matches"]


def supports(backend: str, device: str) -> bool:
    """Whether ``backend`` takes tensors on ``device`` (``"cpu"``, ``"cuda"``...)."""
    return device in backend_devices(backend)


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


def usable_accelerator() -> Optional[str]:
    """The device type of this machine's accelerator when one is usable here, else None.

    ``torch.accelerator.current_accelerator()`` names the accelerator torch was *built* for:
    ``cuda`` for PyPI's default Linux wheel on any machine (docs/design/decisions.md, decision 17), and
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
    devices = backend_devices(backend)
    for device in devices:
        if device != "cpu" and available(device):
            return device
    if "cpu" in devices:
        return "cpu"
    return next(iter(devices), "cpu")  # an accelerator backend on a machine without it


def cuda_index(count: int, current: int, local_rank: Optional[int],
               bound: Optional[int] = None) -> int:
    """The CUDA device a rank's group uses: the device the group is bound to
    (``init_process_group(device_id=...)``, ``bound``), else ``LOCAL_RANK`` modulo the
    ``count`` visible devices, else (no ``LOCAL_RANK``) the ``current`` one.

    Where that is not this process's current device, NCCL would run the group on the device
    the user's tensors are not on (or every local rank on cuda:0: "Duplicate GPU detected", or
    a hang): :class:`~axolotl_dist.errors.DistributedEnvError` naming both and the fix."""
    if bound is not None:
        chosen, why = bound, f"the group is bound to cuda:{bound} (device_id=)"
    elif local_rank is not None and count > 0:
        chosen = local_rank % count
        why = f"LOCAL_RANK={local_rank} of {count} visible GPU(s) gives cuda:{chosen}"
    else:
        return current
    if chosen != current:
        raise DistributedEnvError(
            f"this rank's current CUDA device is cuda:{current}, but {why}: its collectives "
            f"would run on cuda:{chosen} while its tensors are made on cuda:{current}. Call "
            f"torch.cuda.set_device({chosen}) before init_process_group (init_distributed() "
            f"does), or bind the group to the device you use: init_process_group(..., "
            f"device_id=torch.device('cuda', {current}))")
    return chosen


def _local_rank() -> Optional[int]:
    value = os.environ.get("LOCAL_RANK", "").strip()
    return int(value) if is_decimal(value) else None


def comm_device(backend: str, pg: Any = None) -> torch.device:
    """The :class:`torch.device` for :func:`device_type`; for CUDA, :func:`cuda_index` of the
    group ``pg`` (its bound device, else ``LOCAL_RANK``'s), checked against the current one."""
    kind = device_type(backend)
    if kind == "cuda":
        bound = getattr(pg, "bound_device_id", None)
        index = cuda_index(torch.cuda.device_count(), torch.cuda.current_device(), _local_rank(),
                           bound.index if bound is not None and bound.type == "cuda" else None)
        return torch.device("cuda", index)
    return torch.device(kind)


def only(backend: str, name: str) -> bool:
    """Whether every device of ``backend`` is served by backend ``name`` (e.g. only NCCL)."""
    names = set(backend_devices(backend).values())
    return names == {name.lower()}


def matches(requested: str, existing: str) -> bool:
    """Whether ``requested`` (what a caller asks for) is what ``existing`` already provides."""
    requested, existing = requested.lower().replace(" ", ""), existing.lower().replace(" ", "")
    if requested == existing:
        return True
    have = backend_devices(existing)
    if ":" in requested or "," in requested:
        return backend_devices(requested).items() <= have.items()
    return requested in have.values()
