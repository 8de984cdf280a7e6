"""ex03: ZeRO-2's Linear layer, whose backward reduce-scatters its gradient (ZeRO §5.2).

The student writes `ReduceScatterLinear`, an autograd Function with the reference's signature
(`forward(ctx, x, weight, bias, shard)`); the checks plug it into the reference ZeRO-2 in place of the
reference's Linear Function (`functions={nn.Linear: ReduceScatterLinear}`) and train.
"""

from __future__ import annotations

import torch.nn as nn

from autograder.harness import GradedStage
from autograder.integrity import answer_modules
from autograder.records import Run
from autograder.stage_checks import StageExercise
from autograder.verdicts import (
    ACTIVATIONS_ADVICE,
    GRAD_ADVICE,
    GRAD_BUCKET_ADVICE,
    check_no_stray_gradients,
    compare_peaks,
    compare_registrations,
)
from zero_core import memory
from zero_core.stages.zero2 import Zero2

ASSIGNMENT = "ex03_zero2_reduce_scatter_backward"
ANSWER_MODULES = answer_modules(("zero_core.stages.zero1", "zero_core.stages.zero2"))
"""Not loaded, and not loadable, where the student's code is graded (`autograder.sandbox`)."""


def gradient_memory_rules(run: Run, reference: Run, label: str) -> None:
    """ZeRO-2's memory promise: only the gradient shard stays; one layer's bucket lives at a time."""
    check_no_stray_gradients(run, label)
    compare_peaks(run, reference, memory.GRAD, label, GRAD_ADVICE)
    compare_registrations(run, reference, memory.GRAD_BUCKET, label, GRAD_BUCKET_ADVICE)
    compare_peaks(run, reference, memory.GRAD_BUCKET, label, "Release each bucket before the next layer's backward.")
    compare_peaks(run, reference, memory.ACTIVATIONS, label, ACTIVATIONS_ADVICE)


GRADED = GradedStage(Zero2, ASSIGNMENT)
"""The reference ZeRO-2, recorded: with the student's Linear Function, or its own."""


def _build(linear: type) -> tuple[GradedStage, dict]:
    return GRADED, {nn.Linear: linear}


EXERCISE = StageExercise(
    exercise=ASSIGNMENT,
    names=("ReduceScatterLinear",),
    reference="autograder.ex03:GRADED",
    students_collectives=(("grad", nn.Linear),),
    build=_build,
    memory_rules=gradient_memory_rules,
    memory_summary="no full gradient kept (no .grad, grad.fp16 = the shards), one registered bucket per layer "
    "and step, at most one alive at a time",
    communication_summary="one reduce-scatter per Linear layer in backward, the reference's collectives and bytes",
)


check_training = EXERCISE.check_training
check_memory = EXERCISE.check_memory
check_communication = EXERCISE.check_communication
check_memory_and_communication = EXERCISE.check_memory_and_communication

NAMES = EXERCISE.names
CHECKS = EXERCISE.checks()
