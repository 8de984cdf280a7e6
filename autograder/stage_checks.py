"""The checks every "plug your piece into a ZeRO stage" exercise shares (ex02, ex03, ex04).

An exercise says which reference stage it grades against, how to build the stage with the student's
objects, and which memory rules apply; training and communication are compared with the reference run
the same way for all of them: training in fp32, within the rounding that the single-device fp32 oracle
measures (`verdicts.Tolerance`), collectives op for op. The student's runs are made where the student's
code runs and reach the verdicts as validated data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

from autograder.checks import Check, CheckFailed, ObservationInvalid, graded
from autograder.harness import (
    CONFIG,
    STEPS,
    TRAINING_CONFIG,
    graded_stage,
    layer_kinds,
    layer_partitions,
    run_once,
    train,
)
from autograder.integrity import REFERENCE_MODULES, require_own_code
from autograder.records import Run, run_from_data, run_to_data
from autograder.verdicts import (
    bit_identical,
    check_nothing_left_behind,
    check_own_collectives,
    compare_collectives,
    compare_training,
    tolerance_from_oracle,
)
from zero_core.stages.base import OVERFLOW_TAG, TrainConfig, ZeroStage, layer_tag, named_object

VISIBLE_WORLD_SIZES = [2, 3]
HIDDEN_WORLD_SIZES = [5, 7]
"""N = 3, 5 and 7 do not divide the micro model's layers (64-element LayerNorms): padding is needed, in a
visible check as in the hidden ones."""


@dataclass(frozen=True)
class StageExercise:
    """How to grade one exercise that plugs student code into a reference ZeRO stage.

    `observe` runs where the student's code runs: it trains the stage with the student's objects on each
    N and returns the runs as data (`autograder.records`). The `judge_*` methods run where it never
    does: they read the runs back, validated, and compare them with reference runs they make themselves.
    """

    exercise: str
    names: tuple[str, ...]
    reference: str
    """The reference stage, "module:Class": imported only by the judge (`reference_stage`), never where
    the student's code runs."""
    build: Callable[..., tuple[type[ZeroStage], dict | None]]
    """build(*student objects) -> (stage class, functions) for the student's run."""
    students_collectives: tuple[tuple[str, type], ...]
    """The collectives the student's code issues, as ("grad" or "param", kind of layer): ex03's Linear
    layers' gradient reduce-scatters, say. The stage issues the others."""
    memory_rules: Callable[[Run, Run, str], None]
    memory_summary: str
    communication_summary: str
    forbidden: tuple[str, ...] = REFERENCE_MODULES

    # -- in the process that runs the student's code ----------------------------------------------------

    def observe(self, *objects: Any, world_sizes: list[int], config: TrainConfig = CONFIG) -> dict[str, Any]:
        """{"runs": {N: {"run": data} or {"failure": why the run did not finish}}}."""
        require_own_code(dict(zip(self.names, objects, strict=True)), self.names, self.forbidden, self.exercise)
        stage, functions = self.build(*objects)

        def entry(n: int) -> dict[str, Any]:
            make = lambda: train(stage, n, functions, config=config)  # noqa: E731
            key = (self.exercise, objects, n, config.precision)
            return {"run": run_to_data(run_once(key, objects, make, _yours(n)))}

        return observed_runs(world_sizes, entry)

    def observe_training(self, *objects: Any, world_sizes: list[int]) -> dict[str, Any]:
        """The runs of the training check: fp32 (`TRAINING_CONFIG`), to be judged against the oracle."""
        return self.observe(*objects, world_sizes=world_sizes, config=TRAINING_CONFIG)

    # -- in the process that decides ----------------------------------------------------------------------

    def runs(
        self, observation: Any, world_sizes: list[int], config: TrainConfig = CONFIG
    ) -> Iterator[tuple[str, Run, Run]]:
        """(label, student run, reference run) per world size; raises CheckFailed for a run that failed."""
        reference_stage = graded_stage(self.reference_stage, self.exercise)
        for n, entry in observed_entries(observation, world_sizes, {"run"}):
            run = run_from_data(entry["run"], n, STEPS, layer_partitions(n))
            check_own_collectives(run, self.reference_tags(), self.exercise)
            make = lambda n=n: train(reference_stage, n, config=config)  # noqa: E731
            key = (self.exercise, "reference", n, config.precision)
            reference = run_once(key, (), make, f"reference on {n} ranks")
            yield f"{n} ranks", run, reference

    def reference_tags(self) -> set[str]:
        """The tags of the collectives the course's code may issue in the student's run: every layer's
        "grad <layer>" and "param <layer>" (`LayerShard`'s, the stage's) but those the student writes."""
        every = {(what, layer, kind) for layer, kind in layer_kinds().items() for what in ("grad", "param")}
        return {OVERFLOW_TAG} | {
            layer_tag(what, layer) for what, layer, kind in every if (what, kind) not in self.students_collectives
        }

    @property
    def reference_stage(self) -> type[ZeroStage]:
        stage: type[ZeroStage] = named_object(self.reference)
        return stage

    def sizes(self, world_sizes: list[int]) -> str:
        return ", ".join(map(str, world_sizes))

    def judge_training(self, observation: Any, world_sizes: list[int]) -> str:
        exact = []
        for label, run, reference in self.runs(observation, world_sizes, TRAINING_CONFIG):
            compare_training(run, reference, label, tolerance_from_oracle(reference, *oracle_run(run.world_size)))
            exact.append(f"{run.world_size}: {'yes' if bit_identical(run, reference) else 'no'}")
        return (
            f"{self.sizes(world_sizes)} ranks, {STEPS} steps: every loss, averaged gradient and fp32 master weight "
            f"within rounding of the reference ZeRO-{self.reference_stage.stage}'s (bit-identical on N = "
            f"{', '.join(exact)})"
        )

    def judge_memory(self, observation: Any, world_sizes: list[int]) -> str:
        for label, run, reference in self.runs(observation, world_sizes):
            self.memory_rules(run, reference, label)
            check_nothing_left_behind(run, label)
        return f"{self.sizes(world_sizes)} ranks: {self.memory_summary}; nothing left alive after a pass"

    def judge_communication(self, observation: Any, world_sizes: list[int]) -> str:
        for label, run, reference in self.runs(observation, world_sizes):
            compare_collectives(run, reference, label)
        return f"{self.sizes(world_sizes)} ranks: {self.communication_summary}"

    def judge_memory_and_communication(self, observation: Any, world_sizes: list[int]) -> str:
        memory = self.judge_memory(observation, world_sizes).split(": ", 1)[1]
        return f"{self.judge_communication(observation, world_sizes)}; and {memory}"

    def checks(self) -> tuple[Check, ...]:
        """The five checks of the exercise, 2 points each: three visible on 2 and 3 ranks, two hidden on 5 and 7
        (3, 5 and 7 need padding). Exercises with checks of their own list them (`check_with`)."""
        visible, hidden = {"world_sizes": VISIBLE_WORLD_SIZES}, {"world_sizes": HIDDEN_WORLD_SIZES}
        return (
            Check("test_training", 2, self.check_training, self.names, visible),
            Check("test_memory", 2, self.check_memory, self.names, visible),
            Check("test_communication", 2, self.check_communication, self.names, visible),
            Check("test_hidden_training", 2, self.check_training, self.names, hidden, hidden=True),
            Check("test_hidden_memory_communication", 2, self.check_memory_and_communication, self.names, hidden, True),
        )

    @property
    def check_training(self) -> Callable[..., None]:
        return _check(
            self,
            "check_training",
            self.judge_training,
            "losses, gradients and master weights within rounding of the reference's",
            self.observe_training,
        )

    @property
    def check_memory(self) -> Callable[..., None]:
        return _check(self, "check_memory", self.judge_memory, self.memory_summary)

    @property
    def check_communication(self) -> Callable[..., None]:
        return _check(self, "check_communication", self.judge_communication, self.communication_summary)

    @property
    def check_memory_and_communication(self) -> Callable[..., None]:
        return _check(self, "check_memory_and_communication", self.judge_memory_and_communication, "")

    def check_with(
        self, name: str, judge: Callable[..., str], doc: str, observe: Callable[..., Any] | None = None
    ) -> Callable[..., None]:
        """A check of the exercise's own: `judge` reads what `observe` (default: the bf16 runs) returned."""
        return _check(self, name, judge, doc, observe)


@cache
def oracle_run(world_size: int) -> tuple[list[float], dict[str, Any], dict[tuple[str, int], Any]]:
    """The graded training on one device in fp32 (`zero_core.oracle`): losses, final weights, gradients.
    Imported here, by the judge: the oracle is reference code, never loaded where students' code runs."""
    from zero_core.oracle import train_single_device

    gradients: dict[tuple[str, int], Any] = {}
    losses, weights = train_single_device(TRAINING_CONFIG, world_size, STEPS, gradients)
    return losses, weights, gradients


MAX_FAILURE_CHARS = 4000
"""A failed run's message, as the child wrote it: shown to the student, truncated."""


def observed_runs(world_sizes: list[int], entry: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    """{"runs": {N: entry(N), or {"failure": why} where it raised CheckFailed}}: what the student's process sends."""
    runs: dict[str, dict[str, Any]] = {}
    for n in world_sizes:
        try:
            runs[str(n)] = entry(n)
        except CheckFailed as failure:
            runs[str(n)] = {"failure": str(failure)}
    return {"runs": runs}


def observed_entries(observation: Any, world_sizes: list[int], keys: set[str]) -> Iterator[tuple[int, dict]]:
    """(N, its entry) of an `observed_runs` observation, in order, each holding exactly `keys`; a run that failed
    raises CheckFailed with its message when reached, anything else malformed ObservationInvalid."""
    runs = observation.get("runs") if isinstance(observation, dict) else None
    if not isinstance(runs, dict) or set(runs) != {str(n) for n in world_sizes}:
        raise ObservationInvalid("the grading process returned malformed data (not one run per N): no points")
    for n in world_sizes:
        entry = runs[str(n)]
        if isinstance(entry, dict) and isinstance(entry.get("failure"), str):
            raise CheckFailed(entry["failure"][:MAX_FAILURE_CHARS])
        if not isinstance(entry, dict) or set(entry) != keys:
            raise ObservationInvalid(f"the grading process returned malformed data (run on {n} ranks): no points")
        yield n, entry


def _yours(n: int) -> str:
    return f"your code on {n} ranks"


@cache
def _check(
    exercise: StageExercise,
    name: str,
    judge: Callable[..., str],
    doc: str,
    observe: Callable[..., Any] | None = None,
) -> Callable[..., None]:
    return graded(name, observe or exercise.observe, judge, doc)
