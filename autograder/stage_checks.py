"""The checks every "plug your piece into a ZeRO stage" exercise shares (ex02, ex03, ex04).

An exercise says which reference stage it grades against, how to build the stage with the student's
objects, and which memory rules apply; training and communication are compared with the reference run
the same way for all of them: losses and fp32 master weights bit for bit, collectives op for op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from autograder.checks import Check
from autograder.harness import STEPS, Run, graded_stage, run_once, train
from autograder.integrity import REFERENCE_MODULES, require_own_code
from autograder.verdicts import check_nothing_left_behind, compare_collectives, compare_training
from zero_core.stages import ZeroStage

VISIBLE_WORLD_SIZES = [2, 4]
HIDDEN_WORLD_SIZES = [3, 5, 7]


def stage_exercise_checks(
    names: tuple[str, ...],
    training: Callable[..., str],
    memory: Callable[..., str],
    communication: Callable[..., str],
    memory_and_communication: Callable[..., str],
) -> tuple[Check, ...]:
    """The five checks of every stage exercise, 2 points each: three visible on 2 and 4 ranks, two hidden
    on 3, 5 and 7 ranks (where the layers need padding)."""
    visible, hidden = {"world_sizes": VISIBLE_WORLD_SIZES}, {"world_sizes": HIDDEN_WORLD_SIZES}
    return (
        Check("test_training", 2, training, names, visible),
        Check("test_memory", 2, memory, names, visible),
        Check("test_communication", 2, communication, names, visible),
        Check("test_hidden_training", 2, training, names, hidden, hidden=True),
        Check("test_hidden_memory_communication", 2, memory_and_communication, names, hidden, hidden=True),
    )


"""The hidden tests' N do not divide the micro model's layers (64-element LayerNorms): padding is needed."""


@dataclass(frozen=True)
class StageExercise:
    """How to grade one exercise that plugs student code into a reference ZeRO stage."""

    exercise: str
    names: tuple[str, ...]
    reference: type[ZeroStage]
    build: Callable[..., tuple[type[ZeroStage], dict | None]]
    """build(*student objects) -> (stage class, functions) for the student's run."""
    memory_rules: Callable[[Run, Run, str], None]
    memory_summary: str
    communication_summary: str
    forbidden: tuple[str, ...] = REFERENCE_MODULES

    def runs(self, objects: tuple[Any, ...], world_sizes: list[int]) -> Iterator[tuple[str, Run, Run]]:
        """(label, student run, reference run) per world size; raises CheckFailed if a run fails."""
        require_own_code(dict(zip(self.names, objects, strict=True)), self.names, self.forbidden, self.exercise)
        reference_stage = graded_stage(self.reference, self.exercise)
        stage, functions = self.build(*objects)
        for n in world_sizes:
            label = f"{n} ranks"
            reference = run_once(
                (self.exercise, "reference", n), (), lambda n=n: train(reference_stage, n), f"reference on {label}"
            )
            run = run_once(
                (self.exercise, objects, n), objects, lambda n=n: train(stage, n, functions), f"your code on {label}"
            )
            yield label, run, reference

    def sizes(self, world_sizes: list[int]) -> str:
        return ", ".join(map(str, world_sizes))

    def training(self, objects: tuple[Any, ...], world_sizes: list[int]) -> str:
        for label, run, reference in self.runs(objects, world_sizes):
            compare_training(run, reference, label)
        return (
            f"{self.sizes(world_sizes)} ranks, {STEPS} steps: every loss and every fp32 master weight is "
            f"bit-identical to the reference ZeRO-{self.reference.stage}'s"
        )

    def memory(self, objects: tuple[Any, ...], world_sizes: list[int]) -> str:
        for label, run, reference in self.runs(objects, world_sizes):
            self.memory_rules(run, reference, label)
            check_nothing_left_behind(run, label)
        return f"{self.sizes(world_sizes)} ranks: {self.memory_summary}; nothing left alive after a pass"

    def communication(self, objects: tuple[Any, ...], world_sizes: list[int]) -> str:
        for label, run, reference in self.runs(objects, world_sizes):
            compare_collectives(run, reference, label)
        return f"{self.sizes(world_sizes)} ranks: {self.communication_summary}"

    def memory_and_communication(self, objects: tuple[Any, ...], world_sizes: list[int]) -> str:
        memory = self.memory(objects, world_sizes).split(": ", 1)[1]
        return f"{self.communication(objects, world_sizes)}; and {memory}"
