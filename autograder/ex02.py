"""ex02: ZeRO-1's optimizer step, Adam on the owned slice of each layer (ZeRO §5.1).

The student writes `zero1_step(flat_param, flat_grad, partition, adam, step)`, the whole step for one
layer on one rank: average the gradient over the ranks keeping this rank's chunk (reduce-scatter),
update the owned slice's fp32 masters with `adam.step`, write them back into the owned slice of the
low-precision parameters, and all-gather the parameters. The check runs the reference ZeRO-1 training
loop with the student's function in place of the reference's gradient sync and optimizer step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from autograder.checks import CheckFailed
from autograder.harness import GradedStage
from autograder.integrity import answer_modules
from autograder.records import RankRecord, Run
from autograder.stage_checks import StageExercise
from zero_core import cluster, dist
from zero_core.stages.base import ReplicatedStage, TrainConfig

ASSIGNMENT = "ex02_zero1_sharded_adam"
ANSWER_MODULES = answer_modules()
"""Not loaded, and not loadable, where the student's code is graded (`autograder.sandbox`)."""
_COLLECTIVE_FILES = (dist.__file__, cluster.__file__)
_LIBRARY_DIRS = tuple(str(Path(module.__file__).parent) for module in (torch, dist, sys.modules[__name__]))


def _student_line() -> str | None:
    """`file, line` of the student's code running now, or None inside a collective (not the student's)."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename in _COLLECTIVE_FILES:
            return None
        if not filename.startswith(_LIBRARY_DIRS):
            return f"{filename}, line {frame.f_lineno}"
        frame = frame.f_back
    return None


class LargestFloat32(TorchDispatchMode):
    """The largest fp32 tensor the student's code creates (collectives' own buffers excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel, self.where = 0, ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.numel() > self.numel:
            where = _student_line()
            if where is not None:
                self.numel, self.where = out.numel(), where
        return out


class StudentZero1(ReplicatedStage):
    """The reference ZeRO-1 training loop, whose gradient sync and optimizer step are `step_function`, the
    student's.

    It derives from the stage scaffolding, not from `Zero1`, whose two collectives are this exercise's
    answer: `zero_core.stages.zero1` is never loaded where the student's code runs."""

    stage = 1
    record: RankRecord | None = None
    """Where the largest fp32 tensor of each layer's step goes (set by `harness.record_rank`)."""

    def __init__(self, config: TrainConfig, functions: dict | None = None, *, step_function: Callable[..., None]):
        self.step_function = step_function
        super().__init__(config, functions)

    def sync_gradients(self) -> None:
        """Nothing here: the student's step reduces the gradients itself."""

    def optimizer_step(self) -> bool:
        self.adam_steps += 1
        for layer in self.layers:
            with LargestFloat32() as meter:
                self.step_function(
                    self.params[layer.name], self.grads[layer.name], layer.partition, layer.master, self.adam_steps
                )
            self.record.largest_fp32[layer.name] = (meter.numel, meter.where)
        self.zero_gradients()
        return True


def fp32_memory_rules(run: Run, reference: Run, label: str) -> None:
    """ZeRO-1 keeps fp32 values only for the owned 1/N slice: no fp32 copy of a whole layer, even briefly."""
    for rank, record in enumerate(run.ranks):
        for layer, (numel, where) in record.largest_fp32.items():
            limit = run.partitions[layer].chunk_numel
            if numel > limit:
                raise CheckFailed(
                    f"{label}: on rank {rank}, zero1_step made an fp32 tensor of {numel:,} elements for layer "
                    f"{layer} ({where}); this rank owns {limit:,} (one chunk). Convert only the owned slice "
                    "to fp32: ZeRO-1's point is that no rank holds fp32 values for the whole model."
                )


def _build(zero1_step: Callable[..., None]) -> tuple[GradedStage, None]:
    return GradedStage(StudentZero1, ASSIGNMENT, {"step_function": zero1_step}), None


EXERCISE = StageExercise(
    exercise=ASSIGNMENT,
    names=("zero1_step",),
    reference="zero_core.stages.zero1:Zero1",
    students_collectives=tuple(
        (what, kind) for what in ("grad", "param") for kind in (nn.Linear, nn.Embedding, nn.LayerNorm)
    ),
    build=_build,
    memory_rules=fp32_memory_rules,
    memory_summary="fp32 values only for the owned slice of each layer",
    communication_summary="a reduce-scatter of each layer's gradient and an all-gather of its low-precision "
    "parameters: 2Ψ per step, as the reference",
)


check_training = EXERCISE.check_training
check_memory = EXERCISE.check_memory
check_communication = EXERCISE.check_communication
check_memory_and_communication = EXERCISE.check_memory_and_communication

NAMES = EXERCISE.names
CHECKS = EXERCISE.checks()
