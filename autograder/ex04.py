"""ex04: ZeRO-3's gather-on-demand Linear and Embedding (ZeRO §5.3).

The student writes `GatherLinear` and `GatherEmbedding`, autograd Functions with the reference's
signatures (`forward(ctx, x, param_shard, shard)`, `forward(ctx, ids, param_shard, shard)`); the checks
plug both into the reference ZeRO-3 (`functions={nn.Linear: GatherLinear, nn.Embedding: GatherEmbedding}`)
and train. Memory is where ZeRO-3 is judged: a gathered parameter must not outlive its layer's forward
or backward computation.
"""

from __future__ import annotations

import torch.nn as nn

from autograder.ex03 import gradient_memory_rules
from autograder.harness import GradedStage
from autograder.integrity import answer_modules
from autograder.records import Run
from autograder.stage_checks import StageExercise
from autograder.verdicts import check_released, compare_peaks, compare_registrations
from zero_core import memory
from zero_core.stages.zero3 import Zero3

ASSIGNMENT = "ex04_zero3_gather_linear"
ANSWER_MODULES = answer_modules(("zero_core.stages.zero1", "zero_core.stages.zero2", "zero_core.stages.zero3"))
"""Not loaded, and not loadable, where the student's code is graded (`autograder.sandbox`)."""

GATHER_REGISTER_ADVICE = (
    "Gather each layer's parameters twice per step, in forward and again in backward, and register each "
    "gathered buffer: shard.tracker.register(flat, memory.GATHER, padding_elements=shard.partition.padding)."
)
GATHER_RELEASE_ADVICE = (
    "Release the gathered buffer right after the layer's computation (shard.tracker.release(flat)) and keep "
    "no reference to it or to its weight/bias views (not on ctx, not in save_for_backward, not in a list): "
    "release does not free memory, the buffer counts until nothing references it."
)


def parameter_memory_rules(run: Run, reference: Run, label: str) -> None:
    """ZeRO-3's memory promise: a layer's full parameters exist only while that layer computes."""
    compare_registrations(run, reference, memory.GATHER, label, GATHER_REGISTER_ADVICE)
    check_released(run, memory.GATHER, label, GATHER_RELEASE_ADVICE)
    compare_peaks(run, reference, memory.GATHER, label, "At most one layer's parameters may be gathered at a time.")
    gradient_memory_rules(run, reference, label)


GRADED = GradedStage(Zero3, ASSIGNMENT)
"""The reference ZeRO-3, recorded: with the student's Linear and Embedding Functions, or its own."""


def _build(linear: type, embedding: type) -> tuple[GradedStage, dict]:
    return GRADED, {nn.Linear: linear, nn.Embedding: embedding}


EXERCISE = StageExercise(
    exercise=ASSIGNMENT,
    names=("GatherLinear", "GatherEmbedding"),
    reference="autograder.ex04:GRADED",
    students_collectives=tuple((what, kind) for what in ("grad", "param") for kind in (nn.Linear, nn.Embedding)),
    build=_build,
    memory_rules=parameter_memory_rules,
    memory_summary="every gathered buffer registered and released after its layer (none alive after forward "
    "or backward, at most one layer at a time), no full gradient kept",
    communication_summary="an all-gather per layer in forward, another in backward, a reduce-scatter per layer: "
    "the reference's 3Ψ",
)


check_training = EXERCISE.check_training
check_memory = EXERCISE.check_memory
check_communication = EXERCISE.check_communication
check_memory_and_communication = EXERCISE.check_memory_and_communication

NAMES = EXERCISE.names
CHECKS = EXERCISE.checks()
