"""Where every stage and every exercise answer is found: stages by number or name, answers by exercise and name.

Stages. The paper's four are numbers, 0 to 3 (`zero_core.stages`); the systems beyond the paper that
`compare`, the tables and the plots run are names (`zero_core.variants`): "offload" (ZeRO-Offload: ZeRO-2
with the optimizer on the host), "hsdp" (ZeRO-3 inside a node, replicated across nodes), "hpz" (ZeRO++'s
hierarchical partitioning), "qwz" (ZeRO++'s int8 weight all-gathers), "qgz" (ZeRO++'s int4 all-to-all for
gradients) and "zeropp" (ZeRO++: hpZ, qwZ and qgZ). `NODE_STAGE_NAMES` are the named stages that need to
know the nodes (`gpus_per_node`). A stage's module is imported when its class is asked for, never with
this module.

Answers. The pieces the exercises ask students to write live in `zero_core.answers`, one module per
exercise. A stage names the piece it plugs in by exercise and name (`answer("ex03", "ReduceScatterLinear")`),
and the piece is imported only when the stage runs it (`resolve`). So the grader can train a stage with a
student's piece, set where the stage would take the reference's (`functions={nn.Linear: ...}`, or a class
attribute such as `BucketedZero2.BUCKETS`), in a process where `zero_core.answers` holds no answer.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

_STAGE_CLASSES: dict[int | str, str] = {
    0: "zero_core.stages.zero0:Zero0",
    1: "zero_core.stages.zero1:Zero1",
    2: "zero_core.stages.zero2:Zero2",
    3: "zero_core.stages.zero3:Zero3",
    "offload": "zero_core.variants.offload:OffloadZero2",
    "hsdp": "zero_core.variants.hsdp:HybridZero3",
    "hpz": "zero_core.variants.hpz:HpzZero3",
    "qwz": "zero_core.variants.qwz:QwzZero3",
    "qgz": "zero_core.variants.qgz:QgzZero3",
    "zeropp": "zero_core.variants.zeropp:ZeroppZero3",
}
PAPER_STAGES = (0, 1, 2, 3)
NAMED_STAGE_NAMES = tuple(stage for stage in _STAGE_CLASSES if isinstance(stage, str))
"""The named stages in the order tables list them, known without importing their modules."""
NODE_STAGE_NAMES = ("hsdp", "hpz", "qgz", "zeropp")
"""The named stages whose layout depends on the nodes (`gpus_per_node`)."""


def named_object(value: Any) -> Any:
    """`value`, or for a string "package.module:Name" the object it names, imported now."""
    if not isinstance(value, str):
        return value
    module, _, name = value.partition(":")
    return getattr(importlib.import_module(module), name)


def stage_class(stage: int | str) -> type:
    """The class of a stage number (0-3) or name ("offload", "hsdp", "hpz", "qwz", ...), its module imported now."""
    if stage not in _STAGE_CLASSES:
        raise ValueError(f"unknown stage {stage!r}; choose from 0, 1, 2, 3, {', '.join(map(repr, NAMED_STAGE_NAMES))}")
    return named_object(_STAGE_CLASSES[stage])


def __getattr__(name: str) -> Any:
    """`STAGES` (the paper's four, by number), `NAMED_STAGES` and `NODE_STAGES` (by name): their modules are
    imported when one of these is first read, not with the registry."""
    if name == "STAGES":
        return {stage: stage_class(stage) for stage in PAPER_STAGES}
    if name == "NAMED_STAGES":
        return {stage: stage_class(stage) for stage in NAMED_STAGE_NAMES}
    if name == "NODE_STAGES":
        return {stage: stage_class(stage) for stage in NODE_STAGE_NAMES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


ANSWERS: dict[str, tuple[str, ...]] = {
    "ex03": ("ReduceScatterLinear",),
    "ex04": ("GatherLinear", "GatherEmbedding"),
    "ex06": ("GradientBuckets",),
    "ex07": ("Prefetcher",),
    "ex08": ("accumulate_gradient", "clip_global_norm"),
    "ex09": ("hierarchical_all_gather",),
}
"""Per exercise, the pieces of its answer that a stage plugs in. ex01, ex02 and ex05 ask for library code
(the collectives' arithmetic, ZeRO-1's step, the formulas), which stays where the library needs it."""


def answer_module(exercise: str) -> str:
    """The module holding `exercise`'s answer: "zero_core.answers.ex03"."""
    if exercise not in ANSWERS:
        raise ValueError(f"no stage plugs in an answer of {exercise!r}; exercises that have one: {', '.join(ANSWERS)}")
    return f"zero_core.answers.{exercise}"


@dataclass(frozen=True)
class Answer:
    """One exercise's piece as a stage names it, before anything is imported: `load()` imports it."""

    exercise: str
    name: str

    def load(self) -> Any:
        return getattr(importlib.import_module(answer_module(self.exercise)), self.name)


def answer(exercise: str, name: str) -> Answer:
    """The reference piece `name` of `exercise` (one of `ANSWERS`), to be imported when a stage runs it."""
    if name not in ANSWERS.get(exercise, ()):
        raise ValueError(f"{exercise} has no answer called {name!r}; its answers: {ANSWERS.get(exercise, ())}")
    return Answer(exercise, name)


def resolve(piece: Any) -> Any:
    """What a stage runs: the reference answer a piece names (imported now), or the piece itself (a student's)."""
    return piece.load() if isinstance(piece, Answer) else piece
