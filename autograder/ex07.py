"""ex07: ZeRO-3 with a prefetch window of k layers (ZeRO §5.3).

The student writes `Prefetcher`, the class `PrefetchingZero3` hands every layer's request for its full
parameters to (`gather(shard, backward)`, then `release(shard)` when the layer is done). The checks train
the prefetching stage with it, with a window k per world size (`WINDOW` for the visible checks, drawn at
grading time for the hidden ones: `HIDDEN_WINDOWS`), and judge four things, each from what the course's
code observed, never from what the student's code reports:

- values: the training, within the fp32 oracle's rounding (`StageExercise.judge_training`);
- memory: every gathered buffer registered, at most k + 1 layers' gathered parameters alive at once (the
  largest k + 1 consecutive layers), none alive after forward, backward or the step, nothing left behind;
- communication: the reference's collectives, an all-gather per layer in forward and in backward, a
  reduce-scatter: 3Ψ;
- schedule: every layer's all-gather, but the first of each pass, started before the layer needed its
  parameters, as early as the window allows (when the layer k places earlier in the pass asked for its
  own), and was waited for only once the layer needed it (the ledger's start and wait times against the
  stage's `NEEDS_PARAMETERS` marks, which the stage's shards make before they ask the prefetcher).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.nn as nn

from autograder.checks import Check, CheckFailed
from autograder.harness import GradedStage
from autograder.integrity import REFERENCE_MODULES, StudentShard, answer_modules
from autograder.records import Collective, Run
from autograder.stage_checks import HIDDEN_CELL_WORLD_SIZES, VISIBLE_WORLD_SIZES, Setting, StageExercise
from autograder.verdicts import check_released, compare_registrations
from zero_core import comm, memory, schedule
from zero_core.registry import answer_module
from zero_core.stages.base import layer_tag
from zero_core.variants.prefetching import PrefetchingZero3

ASSIGNMENT = "ex07_zero3_prefetch"
FORBIDDEN = REFERENCE_MODULES + ("zero_core.schedule",)
"""The schedule check reads the stage's marks: a submission may not make marks of its own."""
ANSWER_MODULES = answer_modules(
    ("zero_core.stages.zero1", "zero_core.stages.zero2", "zero_core.stages.zero3", answer_module("ex04"))
)
"""Not loaded, and not loadable, where the student's code is graded (`autograder.sandbox`). ZeRO-3's layer
Functions are ex04's answer, due before this exercise: here they are the scaffolding."""

WINDOW = {2: 1, 3: 2, 5: 3, 7: 2}
"""k per world size of a check that sets none: 1 and 2 layers on the visible sizes (and 3 and 2 on the sizes
of the solution notebook's hidden cells). Any other N trains with k = `DEFAULT_WINDOW`."""
DEFAULT_WINDOW = 1
HIDDEN_WINDOWS = (1, 2, 3)
"""The k a hidden check draws per world size: every window prefetches (k > 0), none gathers the whole model."""
GATHERED_ELEMENT_BYTES = 2
"""The memory and schedule checks train in bf16 (`harness.CONFIG`)."""


def window_of(world_size: int) -> int:
    """k on `world_size` ranks for a check that sets none."""
    return WINDOW.get(world_size, DEFAULT_WINDOW)


def prefetching_options(world_size: int, dtype: torch.dtype, window: int | None) -> dict[str, Any]:
    """A window of `window` layers (None: `window_of` the world size)."""
    return {"window": window_of(world_size) if window is None else window}


GRADED = GradedStage(PrefetchingZero3, ASSIGNMENT, per_rank=prefetching_options)
"""The prefetching ZeRO-3, recorded, with the check's window."""


def _guarded(shard: Any) -> StudentShard:
    return StudentShard(shard, ASSIGNMENT)


def _build(prefetcher: type) -> tuple[GradedStage, None]:
    """The graded stage with the student's `Prefetcher`, handed each layer's shard as a `StudentShard`."""
    return GRADED.with_options(prefetcher=prefetcher, hand=_guarded), None


def gathered_bytes_bound(run: Run, window: int) -> int:
    """The most gathered bytes k + 1 layers in a row hold (padding aside): what a window of k may keep alive."""
    sizes = [partition.numel for partition in run.partitions.values()]
    span = window + 1
    return GATHERED_ELEMENT_BYTES * max(sum(sizes[i : i + span]) for i in range(len(sizes)))


GATHER_REGISTER_ADVICE = (
    "Register each gathered buffer when you allocate it, before its all-gather starts: "
    "shard.tracker.register(flat, memory.GATHER, padding_elements=shard.partition.padding), one per layer per pass."
)
GATHER_RELEASE_ADVICE = (
    "Prefetch only within the pass (the last layers of forward have no one to prefetch for) and free each "
    "layer's buffer in release(): drop every reference to it (your dict of buffers, a Work, a list), since the "
    "grader counts a buffer until nothing references it."
)


def prefetch_memory_rules(run: Run, reference: Run, label: str, window: int) -> None:
    """Every gathered buffer registered, at most k + 1 consecutive layers alive at once, none after a pass."""
    compare_registrations(run, reference, memory.GATHER, label, GATHER_REGISTER_ADVICE)
    check_released(run, memory.GATHER, label, GATHER_RELEASE_ADVICE)
    bound = gathered_bytes_bound(run, window)
    for rank in range(run.world_size):
        peak = run.memory[rank].peak_bytes(memory.GATHER)
        if peak > bound:
            raise CheckFailed(
                f"{label}: rank {rank} held {peak:,} bytes of gathered parameters at once; with a window of "
                f"k = {window}, at most k + 1 = {window + 1} layers may be gathered, {bound:,} bytes for the "
                f"largest {window + 1} in a row. Start a layer's gather only when the layer {window} places before "
                "it asks for its parameters, and release before you prefetch further."
            )


PASSES = ("forward", "backward")


def _gathers_by_layer(run: Run, rank: int, step: int, label: str) -> dict[str, list[Collective]]:
    """The rank's all-gathers of `step`, per layer (read from the tag), in the order they were issued."""
    by_layer: dict[str, list[Collective]] = defaultdict(list)
    tags = {layer_tag("param", layer): layer for layer in run.partitions}
    for c in run.collectives[rank]:
        if c.step != step or c.op != comm.ALL_GATHER:
            continue
        layer = tags.get(c.tag)
        if layer is None or c.elements != run.partitions[layer].padded_numel:
            raise CheckFailed(
                f"{label}: at step {step}, rank {rank} made an all-gather of {c.elements:,} elements tagged "
                f'{c.tag!r}. Tag each layer\'s gather with the layer: tag=f"param {{shard.name}}", and gather '
                "its padded_numel elements."
            )
        by_layer[layer].append(c)
    return by_layer


def _needs(run: Run, rank: int, label: str) -> list[list[tuple[float, str]]]:
    """Per step and pass, the stage's NEEDS_PARAMETERS marks: (time, layer) in the order the layers asked."""
    layers = list(run.partitions)
    marks = [(m[0], m[2]) for m in run.ranks[rank].schedule if m[1] == schedule.NEEDS_PARAMETERS]
    if [layer for _, layer in marks] != (layers + layers[::-1]) * run.steps:
        raise CheckFailed(
            f"{label}: rank {rank}'s layers did not ask for their parameters once per pass in forward order, then "
            "in reverse (the stage's marks): a run this check cannot read"
        )
    per_pass = len(layers)
    return [marks[i : i + per_pass] for i in range(0, len(marks), per_pass)]


def check_prefetch_schedule(run: Run, label: str, window: int) -> None:
    """Each layer's gather async, waited for only once the layer needs it, and (but for the first of each
    pass) started before it: when the layer k places earlier in the pass asked, or earlier."""
    for rank in range(run.world_size):
        passes = _needs(run, rank, label)
        for step in range(run.steps):
            gathers = _gathers_by_layer(run, rank, step, label)
            for layer in run.partitions:
                if len(gathers[layer]) != len(PASSES):
                    raise CheckFailed(
                        f"{label}: at step {step}, rank {rank} all-gathered {layer} {len(gathers[layer])} time(s); it "
                        "needs its parameters once in forward and once in backward: gather it once per pass, and "
                        "prefetch in the order the pass needs the layers (forward order, then the reverse)."
                    )
            for index, name in enumerate(PASSES):
                needs = passes[2 * step + index]
                where = f"{label}: in the {name} pass of step {step}, on rank {rank}"
                for position, (_, layer) in enumerate(needs):
                    _judge_gather(gathers[layer][index], needs, position, window, where)


def _judge_gather(c: Collective, needs: list[tuple[float, str]], position: int, window: int, where: str) -> None:
    """One gather against the moments the layers of its pass asked for their parameters (`needs`)."""
    needed_at, layer = needs[position]
    what = f"{where}, {layer}'s all-gather"
    if not c.wait_started_s:
        raise CheckFailed(
            f"{what} was blocking: the rank waited for it as it issued it, so no computation overlapped it. "
            "Start each gather with async_op=True and wait for its Work only when the layer asks for its parameters."
        )
    if c.wait_started_s < needed_at:
        asking = [other for t, other in needs if t <= c.wait_started_s]
        raise CheckFailed(
            f"{what} was waited for before {layer} asked for its parameters (while "
            f"{asking[-1] if asking else 'no layer of the pass'} was being served): waiting early holds the rank up "
            "while the layers in between could compute. Wait for a layer's gather when that layer asks."
        )
    if position == 0 or c.started_s < needs[max(1, position - window + 1)][0]:
        return
    if c.started_s >= needed_at:
        late = "started only when the layer asked for its parameters: it was not prefetched."
    else:
        ahead = position - max(i for i, (t, _) in enumerate(needs) if t <= c.started_s)
        late = f"started only {ahead} layer(s) ahead of its layer."
    raise CheckFailed(
        f"{what} {late} With a window of k = {window}, start it by the time {needs[max(0, position - window)][1]} "
        f"(up to k = {window} place(s) earlier in the pass) asks for its parameters."
    )


EXERCISE = StageExercise(
    exercise=ASSIGNMENT,
    names=("Prefetcher",),
    reference="autograder.ex07:GRADED",
    students_collectives=tuple(("param", kind) for kind in (nn.Linear, nn.Embedding, nn.LayerNorm)),
    build=_build,
    memory_rules=prefetch_memory_rules,
    memory_summary="every gathered buffer registered, at most k + 1 layers' parameters gathered at once, none "
    "alive after forward, backward or the step",
    communication_summary="an all-gather per layer in forward, another in backward, a reduce-scatter per layer: "
    "the reference's 3Ψ",
    forbidden=FORBIDDEN,
    setting=Setting(
        "windows",
        default=window_of,
        draw=lambda rng, world_size: rng.choice(HIDDEN_WINDOWS),
        describe=lambda window: f"k = {window}",
    ),
)


def judge_schedule(observation: Any, world_sizes: list[int], **given: Any) -> str:
    for label, run, _, window in EXERCISE.runs(observation, world_sizes, **given):
        check_prefetch_schedule(run, label, window)
    return (
        f"{EXERCISE.sizes(world_sizes, **given)}: every gather async, started k layers ahead of its layer (the "
        "first of a pass when it began), waited for only when its layer needed it"
    )


def judge_memory_communication_schedule(observation: Any, world_sizes: list[int], **given: Any) -> str:
    memory_verdict = EXERCISE.judge_memory(observation, world_sizes, **given)
    EXERCISE.judge_communication(observation, world_sizes, **given)
    judge_schedule(observation, world_sizes, **given)
    return f"{memory_verdict}; {EXERCISE.communication_summary}; every gather prefetched k layers ahead"


check_training = EXERCISE.check_training
check_memory = EXERCISE.check_memory
check_communication = EXERCISE.check_communication
check_schedule = EXERCISE.check_with(
    "check_schedule", judge_schedule, "every gather prefetched k layers ahead, waited for late"
)
check_memory_communication_schedule = EXERCISE.check_with(
    "check_memory_communication_schedule", judge_memory_communication_schedule, "memory, communication and schedule"
)

NAMES = EXERCISE.names
_VISIBLE, _HIDDEN = {"world_sizes": VISIBLE_WORLD_SIZES}, {"world_sizes": HIDDEN_CELL_WORLD_SIZES}
CHECKS = (
    Check("test_training", 2, check_training, NAMES, _VISIBLE),
    Check("test_memory", 2, check_memory, NAMES, _VISIBLE),
    Check("test_communication", 1, check_communication, NAMES, _VISIBLE),
    Check("test_schedule", 2, check_schedule, NAMES, _VISIBLE),
    Check("test_hidden_training", 1, check_training, NAMES, _HIDDEN, True, EXERCISE.draw),
    Check(
        "test_hidden_memory_communication_schedule",
        2,
        check_memory_communication_schedule,
        NAMES,
        _HIDDEN,
        True,
        EXERCISE.draw,
    ),
)
