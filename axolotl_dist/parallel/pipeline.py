"""A thin wrapper over ``torch.distributed.pipelining`` schedules (OLMo-core's ``PipelineSchedule``).

``torch.distributed.pipelining`` takes about a second to import, so it is imported only when a
:class:`PipelineSchedule` is created; ``import axolotl_dist`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, Tuple

import torch

from ..errors import DistributedConfigError
from .config import PipelineScheduleType

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.pipelining import PipelineStage

__all__ = ["PipelineSchedule"]


class PipelineSchedule:
    """Run one training step through pipeline ``stages`` with a torch schedule.

    :param model_parts: the modules of the stages this rank runs (one per stage).
    :param stages: this rank's ``torch.distributed.pipelining.PipelineStage`` objects.
    :param pp_mesh: the pipeline mesh (:func:`~axolotl_dist.parallel.get_pp_mesh`).
    :param schedule_name: a :class:`PipelineScheduleType` or its name (``"1F1B"``, ``"GPipe"``,
        ``"Interleaved1F1B"``, ...). Single-stage schedules need exactly one stage per rank.
    :param loss_fn: ``loss_fn(output, target)`` applied per microbatch on the last stage.
    :param num_microbatches: how many microbatches to split the batch into (default: the PP
        mesh size); the batch size must be divisible by it.
    :raises DistributedConfigError: for an unknown schedule or stage/part counts that do not
        fit it.
    :raises ImportError: without NumPy, which torch's pipelining needs (the rest of the kit
        does not).
    """

    def __init__(
        self,
        *,
        model_parts: Sequence[torch.nn.Module],
        stages: Sequence["PipelineStage"],
        pp_mesh: "DeviceMesh",
        schedule_name: Any,
        loss_fn: Optional[Callable[[Any, torch.Tensor], torch.Tensor]] = None,
        num_microbatches: Optional[int] = None,
    ) -> None:
        try:
            import numpy  # noqa: F401
        except ImportError as exc:
            raise ImportError(
                "PipelineSchedule needs NumPy, which is not installed: torch.distributed."
                "pipelining sends each stage's shapes between ranks as Python objects, which "
                "torch converts through NumPy: pip install numpy") from exc
        from torch.distributed.pipelining.schedules import get_schedule_class

        schedule = PipelineScheduleType.coerce(schedule_name, "PipelineSchedule.schedule_name")
        self.model_parts = list(model_parts)
        self.stages = list(stages)
        self.pp_mesh = pp_mesh
        self.loss_fn = loss_fn
        self.schedule_name = schedule
        where = f"PipelineSchedule(schedule_name={str(schedule)!r})"
        if not self.stages or len(self.stages) != len(self.model_parts):
            raise DistributedConfigError(
                f"{where}: got {len(self.model_parts)} model part(s) and {len(self.stages)} "
                "stage(s): pass one stage per model part, at least one")
        if num_microbatches is None:
            num_microbatches = pp_mesh.size()
        if not isinstance(num_microbatches, int) or num_microbatches < 1:
            raise DistributedConfigError(f"{where}: num_microbatches={num_microbatches!r} must be >= 1")
        self.num_microbatches = num_microbatches
        schedule_class = get_schedule_class(str(schedule))
        if schedule.is_single_stage:
            if len(self.model_parts) != 1:
                raise DistributedConfigError(
                    f"{where} is a single-stage schedule and needs exactly 1 model part per rank, "
                    f"got {len(self.model_parts)}: use a multi-stage schedule such as "
                    "'Interleaved1F1B'")
            self.base_schedule = schedule_class(self.stages[0], n_microbatches=num_microbatches,
                                                loss_fn=loss_fn)
        else:
            self.base_schedule = schedule_class(self.stages, n_microbatches=num_microbatches,
                                                loss_fn=loss_fn)
        self._has_first = any(stage.is_first for stage in self.stages)
        self._has_last = any(stage.is_last for stage in self.stages)

    @property
    def has_first_stage(self) -> bool:
        """Whether this rank runs the first stage (and so needs the inputs)."""
        return self._has_first

    @property
    def has_last_stage(self) -> bool:
        """Whether this rank runs the last stage (and so gets outputs and losses)."""
        return self._has_last

    def step(self, *args: Any, target: Optional[torch.Tensor] = None,
             **kwargs: Any) -> Tuple[Any, Optional[torch.Tensor]]:
        """Run forward and backward over all microbatches.

        :param args: inputs, only used by the first stage.
        :param target: targets for ``loss_fn``, only used by the last stage.
        :param kwargs: passed to every stage.
        :returns: ``(output, losses)``: the merged output on the last stage (else None), and
            the per-microbatch losses stacked into one tensor on the last stage when a
            ``loss_fn`` was given (else None). Gradients are scaled by ``1/num_microbatches``,
            so they match the mean of the microbatch losses.
        """
        if not self.has_first_stage:
            args = ()
        if not self.has_last_stage:
            target = None
        losses: Optional[List[torch.Tensor]] = (
            [] if self.has_last_stage and self.loss_fn is not None else None)
        output = self.base_schedule.step(*args, target=target, losses=losses, **kwargs)
        return output, (None if not losses else torch.stack(losses))
