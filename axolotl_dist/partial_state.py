"""accelerate's process-state names: :class:`PartialState` and :func:`wait_for_everyone`.

A script written against accelerate's ``PartialState`` keeps its attribute names with the kit:
``process_index``, ``local_process_index``, ``num_processes``, ``is_main_process``,
``is_local_main_process``, ``is_last_process``, ``device``, ``backend``, ``use_distributed``,
``wait_for_everyone()``, ``main_process_first()``, ``split_between_processes()``, the
``on_*_process`` decorators and ``print``. Unlike accelerate's (a singleton that freezes its
values when first built), every attribute is a live query of :mod:`axolotl_dist.ranks`, so it
is right before and after init, and the blocks and barriers are the kit's (failure-safe,
bounded, named in stall reports). Constructing one starts the process group when the launcher
asked for several processes, as accelerate's does; with one process it starts nothing.
docs/porting.md maps every other name of accelerate's.
"""

from __future__ import annotations

import enum
import sys
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Optional, Union

import torch

from . import data as _data
from . import process as _process
from .collectives import barrier, comm_device
from .initialize import cleanup_distributed, init_distributed
from .ranks import (get_backend, get_local_rank, get_local_world_size, get_rank,
                    get_world_size, is_initialized, is_last_process)

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed import ProcessGroup

__all__ = ["PartialState", "DistributedType", "wait_for_everyone"]


class DistributedType(str, enum.Enum):
    """accelerate's ``DistributedType`` values (``accelerate.utils.DistributedType``): a str
    enum whose members equal accelerate's of the same name (``==``, ``in``, hashing), so
    ``state.distributed_type == DistributedType.MULTI_GPU`` reads the same with either import.
    The kit reports ``NO``, ``MULTI_CPU``, ``MULTI_GPU`` and the other ``MULTI_*`` of an
    accelerator torch knows; the rest are accelerate's plugins' (DeepSpeed, FSDP, Megatron-LM,
    XLA), never reported by the kit."""

    NO = "NO"
    MULTI_CPU = "MULTI_CPU"
    MULTI_GPU = "MULTI_GPU"
    MULTI_NPU = "MULTI_NPU"
    MULTI_MLU = "MULTI_MLU"
    MULTI_SDAA = "MULTI_SDAA"
    MULTI_MUSA = "MULTI_MUSA"
    MULTI_XPU = "MULTI_XPU"
    MULTI_HPU = "MULTI_HPU"
    MULTI_NEURON = "MULTI_NEURON"
    DEEPSPEED = "DEEPSPEED"
    FSDP = "FSDP"
    XLA = "XLA"
    MEGATRON_LM = "MEGATRON_LM"


#: The device type of a multi-process run's collectives -> its DistributedType.
_MULTI = {"cpu": DistributedType.MULTI_CPU, "cuda": DistributedType.MULTI_GPU,
          "npu": DistributedType.MULTI_NPU, "mlu": DistributedType.MULTI_MLU,
          "sdaa": DistributedType.MULTI_SDAA, "musa": DistributedType.MULTI_MUSA,
          "xpu": DistributedType.MULTI_XPU, "hpu": DistributedType.MULTI_HPU}
#: accelerate's module that defines its DistributedType.
_ACCELERATE_DATACLASSES = "accelerate.utils.dataclasses"


def _as_accelerates(value: DistributedType) -> Any:
    """``value`` as accelerate's own member where the script imported accelerate (the kit never
    imports it), else the kit's equal one."""
    theirs = getattr(sys.modules.get(_ACCELERATE_DATACLASSES), "DistributedType", None)
    try:
        return theirs(value.value) if theirs is not None else value
    except (TypeError, ValueError):  # an accelerate without this member
        return value


def wait_for_everyone(group: Optional["ProcessGroup"] = None) -> None:
    """accelerate's ``wait_for_everyone()``: :func:`~axolotl_dist.barrier` by its name (a
    no-op for one process; a rank that fails meanwhile is named instead of a hang)."""
    barrier(group)


class PartialState:
    """accelerate's ``PartialState``, as live queries of the kit.

    ``cpu=True`` asks for the gloo backend (as ``PartialState(cpu=True)`` does); ``backend``
    and ``timeout`` (seconds or a timedelta) go to :func:`~axolotl_dist.init_distributed` when
    this starts the group. Other keyword arguments raise ``TypeError`` naming them.
    """

    def __init__(self, cpu: bool = False, *, backend: Optional[str] = None,
                 timeout: Union[timedelta, float, None] = None, **kwargs: Any) -> None:
        if kwargs:
            raise TypeError(
                f"PartialState() got {sorted(kwargs)}: the kit's PartialState takes cpu=, "
                "backend= and timeout=; call axolotl_dist.init_distributed(...) yourself for "
                "other init_process_group arguments")
        if cpu and backend not in (None, "gloo"):
            raise ValueError(f"PartialState(cpu=True, backend={backend!r}): cpu=True means "
                             "backend='gloo'; drop one of them")
        self._cpu = cpu
        #: accelerate's debug flag; the kit's shape checks are always on, so it changes
        #: nothing (the kit's own debug mode: :func:`axolotl_dist.enable_debug`)
        self.debug = False
        if get_world_size() > 1 and not is_initialized():
            if timeout is None:
                init_distributed(backend="gloo" if cpu else backend)
            else:
                init_distributed(backend="gloo" if cpu else backend, timeout=timeout)

    def __repr__(self) -> str:
        kind = getattr(self.distributed_type, "value", self.distributed_type)
        return (f"PartialState(distributed_type={kind}, "
                f"process_index={self.process_index}, num_processes="
                f"{self.num_processes}, local_process_index={self.local_process_index}, "
                f"device={self.device}, backend={self.backend})")

    # ---- ranks and sizes (live) ----
    @property
    def process_index(self) -> int:
        """This process's global rank (``ad.get_rank()``)."""
        return get_rank()

    @property
    def local_process_index(self) -> int:
        """This process's rank on its node (``ad.get_local_rank()``)."""
        return get_local_rank()

    @property
    def num_processes(self) -> int:
        """How many processes the run has (``ad.get_world_size()``)."""
        return get_world_size()

    @property
    def num_local_processes(self) -> int:
        """How many processes run on this node (``ad.get_local_world_size()``)."""
        return get_local_world_size()

    @property
    def is_main_process(self) -> bool:
        """Global rank 0 (and a single process)."""
        return get_rank() == 0

    @property
    def is_local_main_process(self) -> bool:
        """Local rank 0 of each node (and a single process)."""
        return get_local_rank() == 0

    @property
    def is_last_process(self) -> bool:
        """The last global rank (and a single process)."""
        return is_last_process()

    @property
    def use_distributed(self) -> bool:
        """Whether the run has several processes."""
        return get_world_size() > 1

    @property
    def initialized(self) -> bool:
        """Always True, as accelerate's once built."""
        return True

    @property
    def distributed_type(self) -> Any:
        """accelerate's :class:`DistributedType` of this run: ``NO`` for one process, else
        ``MULTI_CPU``, ``MULTI_GPU`` (CUDA) or the ``MULTI_*`` of :attr:`device` (another
        accelerator). accelerate's own member where the script imported accelerate, else the kit's
        (equal to it)."""
        if get_world_size() <= 1:
            return _as_accelerates(DistributedType.NO)
        return _as_accelerates(_MULTI.get(self.device.type, DistributedType.MULTI_CPU))

    @property
    def default_device(self) -> torch.device:
        """accelerate's ``default_device``: :attr:`device`."""
        return self.device

    @property
    def fork_launched(self) -> bool:
        """accelerate's ``fork_launched`` (``notebook_launcher``'s forked processes): False, the
        kit's ranks are launched processes."""
        return False

    @property
    def backend(self) -> Optional[str]:
        """The process group's backend, or None without one."""
        return get_backend()

    @property
    def device(self) -> torch.device:
        """Where this process's tensors go, as accelerate's says: the CPU where ``cpu=True``
        was asked; else CUDA device ``local_process_index`` where CUDA is usable, whatever the
        backend (gloo on a GPU machine included); else the group's device once it exists
        (another accelerator's backend), else the CPU."""
        if self._cpu:
            return torch.device("cpu")
        if torch.cuda.is_available():
            return torch.device("cuda", get_local_rank() % torch.cuda.device_count())
        return comm_device() if is_initialized() else torch.device("cpu")

    # ---- collectives, blocks, decorators ----
    def wait_for_everyone(self) -> None:
        """:func:`wait_for_everyone`."""
        barrier()

    def main_process_first(self, *, timeout: Optional[float] = None,
                           desc: Optional[str] = None) -> ContextManager[None]:
        """:func:`~axolotl_dist.main_process_first`."""
        return _process.main_process_first(timeout=timeout, desc=desc)

    def local_main_process_first(self, *, timeout: Optional[float] = None,
                                 desc: Optional[str] = None) -> ContextManager[None]:
        """:func:`~axolotl_dist.local_main_process_first`."""
        return _process.local_main_process_first(timeout=timeout, desc=desc)

    def split_between_processes(self, inputs: Any, apply_padding: bool = False
                                ) -> ContextManager[Any]:
        """:func:`~axolotl_dist.split_between_processes`."""
        return _data.split_between_processes(inputs, apply_padding=apply_padding)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only (:func:`axolotl_dist.print`)."""
        _process.print(*args, **kwargs)

    def destroy_process_group(self, group: Optional["ProcessGroup"] = None) -> None:
        """:func:`~axolotl_dist.cleanup_distributed` (the world's group; ``group`` must be
        None)."""
        if group is not None:
            raise ValueError("PartialState.destroy_process_group(group=...): the kit destroys "
                             "the world's group only; call torch.distributed."
                             "destroy_process_group(group) for a subgroup")
        cleanup_distributed()

    # accelerate's decorators, checked per call as the kit's are
    on_main_process = staticmethod(_process.on_main_process)
    on_local_main_process = staticmethod(_process.on_local_main_process)
    on_last_process = staticmethod(_process.on_last_process)
    on_process: Callable[..., Any] = staticmethod(_process.on_process)
    on_local_process: Callable[..., Any] = staticmethod(_process.on_local_process)
