"""The checks every "plug your piece into a ZeRO stage" exercise shares (ex02, ex03, ex04).

An exercise says which reference stage it grades against, how to build the stage with the student's
objects, and which memory rules apply; training and communication are compared with the reference run
the same way for all of them: training in fp32, within the rounding that the single-device fp32 oracle
measures (`verdicts.Tolerance`), collectives op for op. The student's runs are made where the student's
code runs and reach the verdicts as validated data (`records.run_from_data`, `records.require_course_records`).

The hidden checks run on world sizes drawn at grading time (`draw_world_sizes`, `checks.drawn`); an exercise
whose stage has a parameter per world size (ex06's bucket size, ex07's window, ...) names it as a `Setting`,
which the hidden checks draw too, and which reaches the student's run and the reference run alike as the
check's argument.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any, NamedTuple

from autograder import kernel_memory, recorded
from autograder.checks import Check, CheckFailed, graded
from autograder.harness import (
    CONFIG,
    STEPS,
    TRAINING_CONFIG,
    GradedStage,
    graded_stage,
    layer_kinds,
    layer_partitions,
    run_once,
    train,
    witnessed,
)
from autograder.integrity import REFERENCE_MODULES, require_own_code
from autograder.plain_data import runs_asked, well_formed
from autograder.recorded import identity
from autograder.records import Run, require_course_records, run_from_data, run_to_data
from autograder.verdicts import (
    Tolerance,
    bit_identical,
    check_nothing_left_behind,
    check_own_collectives,
    compare_collectives,
    compare_training,
    tolerance_from_oracle,
)
from zero_core.registry import named_object
from zero_core.stages.base import OVERFLOW_TAG, TrainConfig, layer_tag

VISIBLE_WORLD_SIZES = [2, 3]
HIDDEN_CELL_WORLD_SIZES = [5, 7]
"""What the solution notebooks' hidden test cells call in a kernel; a grade draws its own (`draw_world_sizes`)."""
HIDDEN_WORLD_SIZE_RANGE = range(4, 9)
"""The hidden checks' N: two of 4 to 8, not both powers of two. N = 3 (visible) and 5, 6, 7 do not divide the
micro model's layers (64-element LayerNorms): padding is needed, in a visible check as in a hidden one."""


def draw_world_sizes(rng: random.Random) -> list[int]:
    """Two world sizes of `HIDDEN_WORLD_SIZE_RANGE`, at least one of which needs padding: about the ranks
    that 5 and 7 make, so the hidden checks take about as long as ever."""
    while True:
        sizes = sorted(rng.sample(HIDDEN_WORLD_SIZE_RANGE, 2))
        if any(n & (n - 1) for n in sizes):
            return sizes


@dataclass(frozen=True)
class Setting:
    """A parameter of an exercise's stage that takes one value per world size (ex06's bucket size B): the
    checks take it as a list beside `world_sizes` (`bucket_bytes=[9216, 20480]`), drawn for the hidden ones;
    a check that gives none runs on the exercise's defaults."""

    name: str
    default: Callable[[int], Any]
    """The value on N ranks when the check gives none (the visible checks, a notebook's call)."""
    draw: Callable[[random.Random, int], Any]
    """A hidden check's value on N ranks, from a range that keeps the check meaningful; JSON data."""
    describe: Callable[[Any], str]
    """The value as a message shows it: "B = 9,216 bytes"."""
    read: Callable[[Any], Any] = lambda value: value
    """The value from a check's argument, which crossed as JSON."""
    sized: Any = None
    """The value for the sized run whose memory the kernel counts (`kernel_memory`); None: `default(N)`."""


class GradedRun(NamedTuple):
    """One world size of a check: the student's run and the reference run, made with the same setting."""

    label: str
    run: Run
    reference: Run
    setting: Any


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
    build: Callable[..., tuple[GradedStage, dict | None]]
    """build(*student objects) -> (graded stage, functions) for the student's run."""
    students_collectives: tuple[tuple[str, type], ...]
    """The collectives the student's code issues, as ("grad" or "param", kind of layer): ex03's Linear
    layers' gradient reduce-scatters, say. The stage issues the others."""
    memory_rules: Callable[..., None]
    """rules(run, reference, label), and the run's setting after them if the exercise has a `Setting`."""
    memory_summary: str
    communication_summary: str
    forbidden: tuple[str, ...] = REFERENCE_MODULES
    setting: Setting | None = None
    hidden_world_sizes: Callable[[random.Random], list[int]] = draw_world_sizes
    likely_cause: Callable[[Run, Run, Tolerance], str | None] | None = None
    """cause(run, reference, tolerance) of a training that differs: the mistake of the exercise the run looks
    like, told from the run's values and the reference's (never from the student's source), or None."""

    def settings(self, world_sizes: list[int], given: dict[str, Any]) -> dict[int, Any]:
        """{N: its setting}: the check's (`given`, under the setting's name), else the defaults; None each
        for an exercise without a setting."""
        name = self.setting.name if self.setting else None
        if set(given) - {name}:
            raise TypeError(f"{self.exercise}'s checks take no {', '.join(sorted(set(given) - {name}))}")
        if self.setting is None:
            return dict.fromkeys(world_sizes)
        values = given.get(name) or [self.setting.default(n) for n in world_sizes]
        if len(values) != len(world_sizes):
            raise TypeError(f"{self.exercise}: {len(values)} {name} for {len(world_sizes)} world sizes")
        return {n: self.setting.read(value) for n, value in zip(world_sizes, values, strict=True)}

    def configured(self, stage: GradedStage, setting: Any) -> GradedStage:
        """`stage` with the setting of a run (the graded stage's `per_rank` reads it)."""
        return stage.with_setting(setting)

    def label(self, world_size: int, setting: Any) -> str:
        return f"{world_size} ranks" + (f" ({self.setting.describe(setting)})" if self.setting else "")

    def draw(self, rng: random.Random) -> dict[str, Any]:
        """A hidden check's arguments: world sizes (`hidden_world_sizes`) and, per size, a setting."""
        sizes = self.hidden_world_sizes(rng)
        if self.setting is None:
            return {"world_sizes": sizes}
        return {"world_sizes": sizes, self.setting.name: [self.setting.draw(rng, n) for n in sizes]}

    # -- in the process that runs the student's code ----------------------------------------------------

    def observe(
        self, *objects: Any, world_sizes: list[int], config: TrainConfig = CONFIG, **given: Any
    ) -> dict[str, Any]:
        """{"runs": {N: {"run": data} or {"failure": why the run did not finish}}}."""
        require_own_code(dict(zip(self.names, objects, strict=True)), self.names, self.forbidden, self.exercise)
        stage, functions = self.build(*objects)
        settings = self.settings(world_sizes, given)

        def entry(n: int) -> dict[str, Any]:
            make = lambda: train(self.configured(stage, settings[n]), n, functions, config=config)  # noqa: E731
            key = (self.exercise, objects, n, config.precision, settings[n])
            return {"run": run_to_data(run_once(key, objects, make, _yours(n)))}

        return observed_runs(world_sizes, entry)

    def observe_memory(self, *objects: Any, world_sizes: list[int], **given: Any) -> dict[str, Any]:
        """The bf16 runs, and the sized run whose memory the grading parent has the kernel count
        (`autograder.kernel_memory`): under "kernel"."""
        observation = self.observe(*objects, world_sizes=world_sizes, **given)
        stage, functions = self.build(*objects)
        key = (self.exercise, objects, "sized")
        make = lambda: run_once(key, objects, lambda: self.sized_run(stage, functions), _yours(4))  # noqa: E731
        try:
            observation["kernel"] = kernel_memory.observe(make, witnessed())
        except CheckFailed as failure:
            observation["kernel"] = {"failure": str(failure)}
        return observation

    def sized_run(self, stage: GradedStage, functions: dict | None) -> Run:
        """`stage` trained on the sized model (`kernel_memory.SIZED_CONFIG`), with its setting for that N."""
        n = kernel_memory.SIZED_WORLD_SIZE
        setting = None if self.setting is None else self.setting.sized or self.setting.default(n)
        configured = self.configured(stage, setting)
        steps, config = kernel_memory.SIZED_STEPS, kernel_memory.SIZED_CONFIG
        return train(configured, n, functions, steps, config, witnessed_collectives=False)

    def observe_training(self, *objects: Any, world_sizes: list[int], **given: Any) -> dict[str, Any]:
        """The runs of the training check: fp32 (`TRAINING_CONFIG`), to be judged against the oracle."""
        return self.observe(*objects, world_sizes=world_sizes, config=TRAINING_CONFIG, **given)

    # -- in the process that decides ----------------------------------------------------------------------

    def runs(
        self, observation: Any, world_sizes: list[int], config: TrainConfig = CONFIG, **given: Any
    ) -> Iterator[GradedRun]:
        """The student's and the reference's run per world size, validated; CheckFailed for a run that failed."""
        settings = self.settings(world_sizes, given)
        for n, entry in observed_entries(observation, world_sizes, {"run"}):
            run = run_from_data(entry["run"], n, STEPS, layer_partitions(n))
            check_own_collectives(run, self.reference_tags(), self.exercise)
            reference = self.reference_for(n, settings[n], config)
            require_course_records(run, reference)
            yield GradedRun(self.label(n, settings[n]), run, reference, settings[n])

    def reference_for(self, n: int, setting: Any, config: TrainConfig) -> Run:
        """The reference run on `n` ranks, made once per process (`run_once`; read back from the reference store
        where an earlier process made it); CheckFailed if it failed."""
        key = (self.exercise, "reference", n, config.precision, setting)
        make = functools.partial(self.reference_run, key, n, setting, config)
        return run_once(key, (), make, f"reference on {n} ranks")

    def prepare(self, check: Check) -> None:
        """Make what judging `check` will read that does not depend on the student: its reference runs, the
        oracle's for a training check, the kernel's reference figures for a memory check. The grading parent
        calls it while the child runs the student's code (`sandbox.grade_notebook`); each is kept once made,
        so the judges then read it instead of making it. A failure raises here and again when a judge asks."""
        given = dict(check.kwargs)
        world_sizes = given.pop("world_sizes")
        training = getattr(check.function, "observe", None) == self.observe_training
        for n, setting in self.settings(world_sizes, given).items():
            self.reference_for(n, setting, TRAINING_CONFIG if training else CONFIG)
            if training:
                oracle_run(n)
        if getattr(check.function, "measured_by_the_kernel", False) and not recorded.replaying():
            kernel_memory.reference_figures(self.exercise)

    def reference_run(self, key: Hashable, n: int, setting: Any, config: TrainConfig) -> Run:
        """The reference stage trained on `n` ranks with `setting`: made here, or read from a student
        release's record (`autograder.recorded`)."""

        def make() -> Run:
            return train(self.configured(self.reference_stage, setting), n, config=config)

        decode = lambda data: run_from_data(data, n, STEPS, layer_partitions(n))  # noqa: E731
        return recorded.outcome("run", key, make, run_to_data, decode)

    @property
    def reference_stage_number(self) -> int:
        """The ZeRO stage of the reference (a message names it), without importing it in a student release."""
        return recorded.outcome("stage", self.exercise, lambda: self.reference_stage.stage, identity, int)

    def reference_tags(self) -> set[str]:
        """The tags of the collectives the course's code may issue in the student's run: every layer's
        "grad <layer>" and "param <layer>" (`LayerShard`'s, the stage's) but those the student writes."""
        every = {(what, layer, kind) for layer, kind in layer_kinds().items() for what in ("grad", "param")}
        return {OVERFLOW_TAG} | {
            layer_tag(what, layer) for what, layer, kind in every if (what, kind) not in self.students_collectives
        }

    @property
    def reference_stage(self) -> GradedStage:
        """The reference stage as the grader builds it: "module:Class" of a stage, or of an exercise's `GradedStage`."""
        return graded_stage(named_object(self.reference), self.exercise)

    def sizes(self, world_sizes: list[int], **given: Any) -> str:
        """The world sizes as a message names them: "2, 3 ranks", or with a setting "2 ranks (B = 12,288 bytes),
        3 ranks (B = 12,288 bytes)"."""
        if self.setting is None:
            return f"{', '.join(map(str, world_sizes))} ranks"
        return ", ".join(self.label(n, setting) for n, setting in self.settings(world_sizes, given).items())

    def judge_training(self, observation: Any, world_sizes: list[int], **given: Any) -> str:
        exact = []
        for label, run, reference, _ in self.runs(observation, world_sizes, TRAINING_CONFIG, **given):
            tolerance = tolerance_from_oracle(reference, *oracle_run(run.world_size))
            try:
                compare_training(run, reference, label, tolerance)
            except CheckFailed as failure:
                cause = self.likely_cause(run, reference, tolerance) if self.likely_cause else None
                if cause is None:
                    raise
                raise CheckFailed(f"{failure}\n  likely cause: {cause}") from None
            exact.append(f"{run.world_size}: {'yes' if bit_identical(run, reference) else 'no'}")
        return (
            f"{self.sizes(world_sizes, **given)}, {STEPS} steps: every loss, averaged gradient and fp32 master "
            f"weight within rounding of the reference ZeRO-{self.reference_stage_number}'s (bit-identical on N = "
            f"{', '.join(exact)})"
        )

    def judge_memory(self, observation: Any, world_sizes: list[int], **given: Any) -> str:
        for label, run, reference, setting in self.runs(observation, world_sizes, **given):
            self.memory_rules(run, reference, label, *([setting] if self.setting else []))
            check_nothing_left_behind(run, label)
        return f"{self.sizes(world_sizes, **given)}: {self.memory_summary}; nothing left alive after a pass"

    def judge_memory_and_kernel(self, observation: Any, world_sizes: list[int], **given: Any) -> str:
        """`judge_memory`, and the memory the kernel saw in the sized run against the reference's."""
        verdict = self.judge_memory(observation, world_sizes, **given)
        entry = observation.get("kernel") if isinstance(observation, dict) else None
        if isinstance(entry, dict) and isinstance(entry.get("failure"), str) and len(entry) == 1:
            raise CheckFailed(f"the sized run: {entry['failure'][:MAX_FAILURE_CHARS]}")
        figures = kernel_memory.measured(entry)
        reference = lambda: kernel_memory.reference_figures(self.exercise)  # noqa: E731
        return f"{verdict}; {kernel_memory.judge(figures, reference)}"

    def judge_communication(self, observation: Any, world_sizes: list[int], **given: Any) -> str:
        for label, run, reference, _ in self.runs(observation, world_sizes, **given):
            compare_collectives(run, reference, label)
        return f"{self.sizes(world_sizes, **given)}: {self.communication_summary}"

    def judge_memory_and_communication(self, observation: Any, world_sizes: list[int], **given: Any) -> str:
        memory = self.judge_memory(observation, world_sizes, **given).split(": ", 1)[1]
        return f"{self.judge_communication(observation, world_sizes, **given)}; and {memory}"

    def checks(self) -> tuple[Check, ...]:
        """The five checks of the exercise, 2 points each: three visible on 2 and 3 ranks, two hidden on world
        sizes drawn at grading time (`draw`). Exercises with checks of their own list them (`check_with`)."""
        visible, hidden = {"world_sizes": VISIBLE_WORLD_SIZES}, {"world_sizes": HIDDEN_CELL_WORLD_SIZES}
        return (
            Check("test_training", 2, self.check_training, self.names, visible),
            Check("test_memory", 2, self.check_memory, self.names, visible),
            Check("test_communication", 2, self.check_communication, self.names, visible),
            Check("test_hidden_training", 2, self.check_training, self.names, hidden, True, self.draw),
            Check(
                "test_hidden_memory_communication",
                2,
                self.check_memory_and_communication,
                self.names,
                hidden,
                True,
                self.draw,
            ),
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
        check = _check(self, "check_memory", self.judge_memory_and_kernel, self.memory_summary, self.observe_memory)
        check.measured_by_the_kernel = True  # type: ignore[attr-defined]  (the grading child observes it first)
        return check

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

    def make() -> recorded.Oracle:
        from zero_core.oracle import train_single_device

        gradients: dict[tuple[str, int], Any] = {}
        losses, weights = train_single_device(TRAINING_CONFIG, world_size, STEPS, gradients)
        return losses, weights, gradients

    return recorded.outcome("oracle", world_size, make, recorded.oracle_to_data, recorded.oracle_from_data)


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
    raises CheckFailed with its message when reached; runs on other world sizes than the check asked for, or
    anything else malformed, ObservationInvalid."""
    runs = runs_asked(observation, world_sizes)
    for n in world_sizes:
        entry = runs[str(n)]
        if isinstance(entry, dict) and isinstance(entry.get("failure"), str):
            raise CheckFailed(entry["failure"][:MAX_FAILURE_CHARS])
        well_formed(isinstance(entry, dict) and set(entry) == keys, f"the run on {n} ranks")
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
