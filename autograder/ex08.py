"""ex08: global-norm gradient clipping and k-step gradient accumulation on ZeRO-2's gradient shards.

The student writes two functions that `AccumulatingZero2` (zero_core/variants/accumulating.py) calls:
`accumulate_gradient(shard, grads)`, once per layer and micro-batch in backward, which must average the
micro-batch's gradient over the ranks and add this rank's chunk into `shard.grad`; and
`clip_global_norm(grads, max_norm)`, once per optimizer step, which must scale the rank's owned fp32
gradient slices so that the model's global norm is at most `max_norm`, as `torch.nn.utils.clip_grad_norm_`
does on one device. The checks train the stage with them, with a number of micro-batches k and a max_norm
per world size (`ACCUMULATION` for the visible checks, drawn at grading time for the hidden ones:
`draw_accumulation`), and judge, each from what the course's code observed:

- values: losses, the clipped gradient given to Adam and the fp32 masters, within the rounding of the fp32
  single-device oracle that accumulates and clips with `clip_grad_norm_` (`zero_core.oracle`); a gradient
  that is what an overwritten shard or a rank-local norm gives is named as such (`likely_cause`);
- memory: only the shards hold gradients between micro-batches (no category above the reference's peak),
  k registered buckets per layer and step, each released, nothing left behind;
- communication: k reduce-scatters per layer and step, the all-gathers, and one collective of a few bytes
  for the norm: k·Ψ + Ψ + ε, from the ledger;
- schedule: every micro-batch's gradient reduce-scattered before backward goes on to the next layer (the
  ledger's start times against the stage's `GRADIENTS_READY` marks).
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left
from collections import Counter
from functools import cache
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from autograder import recorded
from autograder.checks import Check, CheckFailed
from autograder.harness import STEPS, TRAINING_CONFIG, GradedStage
from autograder.integrity import StudentShard, answer_modules
from autograder.records import Collective, Run
from autograder.stage_checks import HIDDEN_CELL_WORLD_SIZES, VISIBLE_WORLD_SIZES, Setting, StageExercise
from autograder.verdicts import (
    check_no_stray_gradients,
    check_nothing_left_behind,
    check_released,
    compare_peaks,
    compare_registrations,
    compare_training,
    tolerance_from_oracle,
)
from zero_core import comm, memory, schedule
from zero_core.registry import answer_module
from zero_core.stages.base import OVERFLOW_TAG
from zero_core.variants.accumulating import NORM_TAG, AccumulatingZero2

ASSIGNMENT = "ex08_clip_and_accumulate"
ANSWER_MODULES = answer_modules(("zero_core.stages.zero1", "zero_core.stages.zero2", answer_module("ex03")))
"""Not loaded, and not loadable, where the student's code is graded (`autograder.sandbox`). ZeRO-2's layer
Functions are ex03's answer, due before this exercise: here they are the scaffolding."""


class Accumulation(NamedTuple):
    """What an optimizer step is made of in a graded run: k micro-batches, then clipping to `max_norm`."""

    micro_steps: int
    max_norm: float


ACCUMULATION = {
    2: Accumulation(2, 1.0),
    3: Accumulation(2, 1.0),
    4: Accumulation(2, 5.0),
    5: Accumulation(3, 1.2),
    7: Accumulation(4, 1.1),
}
"""k and max_norm per world size of a check that sets none (5 and 7: the solution notebook's hidden cells). On
2, 3, 5 and 7 ranks the micro model's gradient norm (1.3 to 1.8 in the two graded steps) is above max_norm,
so every graded step clips; on 4 ranks it is well below: no step clips, and a coefficient that is not
clamped to 1 shows (tests/test_ex08_clip_and_accumulate.py)."""
UNCLIPPED_WORLD_SIZES = [4]
NORM_BYTES = 128
"""What the norm's collective may send per rank: a few fp32 numbers (one per layer fits), whatever N."""
HIDDEN_MICRO_STEPS = (2, 3, 4)
HIDDEN_MAX_NORMS = (0.5, 1.1)
"""The range of a hidden check's max_norm: below the gradient norm of every graded step on 4 to 8 ranks with
2 to 4 micro-batches (1.24 at the least), so every step clips (tests/test_hidden_parameters.py)."""


def draw_accumulation(rng: random.Random, world_size: int) -> list:
    """[k, max_norm] of a hidden check: k of `HIDDEN_MICRO_STEPS`, max_norm of `HIDDEN_MAX_NORMS` (0.01 apart)."""
    return [rng.choice(HIDDEN_MICRO_STEPS), round(rng.uniform(*HIDDEN_MAX_NORMS), 2)]


def accumulating_options(world_size: int, dtype: torch.dtype, accumulation: Accumulation | None) -> dict[str, Any]:
    """k micro-batches and `max_norm` of `accumulation` (None: `ACCUMULATION` of the world size)."""
    micro_steps, max_norm = accumulation or ACCUMULATION[world_size]
    return {"micro_steps": micro_steps, "max_norm": max_norm}


GRADED = GradedStage(AccumulatingZero2, ASSIGNMENT, per_rank=accumulating_options)
"""The accumulating ZeRO-2, recorded, with the check's k and max_norm. The stage clips the gradient in place
before Adam, so the record of what Adam receives (`harness.RecordingAdam`) is the clipped gradient, as the
oracle's is."""


def _guarded(shard: Any) -> StudentShard:
    return StudentShard(shard, ASSIGNMENT)


def _build(accumulate: Any, clip: Any) -> tuple[GradedStage, None]:
    """The graded stage with the student's two functions, handed each layer's shard as a `StudentShard`."""
    return GRADED.with_options(accumulate=accumulate, clip=clip, hand=_guarded), None


# -- memory ------------------------------------------------------------------------------------------------

PEAK_ADVICE = {
    memory.GRAD: "Only the shards (shard.grad) hold gradients between micro-batches: add each micro-batch's "
    "reduced chunk into shard.grad; never keep a full-size gradient, not even a local sum.",
    memory.GRAD_BUCKET: "One layer's bucket at a time: release it right after its reduce-scatter.",
    memory.ACTIVATIONS: "Keep nothing of a micro-batch after its backward.",
}
BUCKET_ADVICE = (
    "Make, register and reduce-scatter one bucket per layer and micro-batch (k = {k}), as backward produces it "
    "(shard.tracker.register(bucket, memory.GRAD_BUCKET, padding_elements=shard.partition.padding)): ZeRO-2 "
    "cannot wait for the last micro-batch, that would keep a full gradient alive until then."
)


def accumulation_memory_rules(run: Run, reference: Run, label: str, accumulation: Accumulation) -> None:
    """Between micro-batches only the shards hold gradients; buckets one per layer and micro-batch, released."""
    check_nothing_left_behind(run, label)
    check_no_stray_gradients(run, label)
    for category in (*memory.MODEL_STATES, memory.GRAD_BUCKET, memory.ACTIVATIONS):
        advice = PEAK_ADVICE.get(category, f"Register nothing of your own as {category}.")
        compare_peaks(run, reference, category, label, advice)
    advice = BUCKET_ADVICE.format(k=accumulation.micro_steps)
    compare_registrations(run, reference, memory.GRAD_BUCKET, label, advice)
    check_released(
        run, memory.GRAD_BUCKET, label, "Release each bucket after its reduce-scatter and keep no reference to it."
    )


# -- communication and schedule ----------------------------------------------------------------------------


def _key(c: Collective) -> tuple[str, str, int]:
    return c.op, c.dtype, c.elements


def _listed(keys: Counter) -> str:
    return "; ".join(f"{count}x {op} of {elements:,} {dtype}" for (op, dtype, elements), count in keys.items())


def compare_accumulated_collectives(run: Run, reference: Run, label: str, k: int) -> None:
    """The reference's layer collectives (k reduce-scatters per layer, one all-gather per layer), op for op,
    and one more collective per step, for the norm, of at most `NORM_BYTES` bytes sent."""
    for step in range(run.steps):
        for rank in range(run.world_size):
            where = f"{label}: at step {step}, rank {rank}"
            mine = run.entries(rank, step, exclude_tag=OVERFLOW_TAG)
            layers = Counter(_key(c) for c in reference.entries(rank, step, OVERFLOW_TAG) if c.tag != NORM_TAG)
            missing = layers - Counter(map(_key, mine))
            if missing:
                raise CheckFailed(
                    f"{where} is missing {_listed(missing)}. Each of the k = {k} micro-batches reduce-scatters "
                    "every layer's gradient (op=AVG) as its backward produces it, and the stage all-gathers the "
                    "updated parameters once per step."
                )
            left, extra = Counter(layers), []
            for c in mine:
                if left[_key(c)]:
                    left[_key(c)] -= 1
                else:
                    extra.append(c)
            if not extra:
                raise CheckFailed(
                    f"{where} made no collective for the gradient norm. A rank holds only its shards: the norm "
                    "of those alone is not the model's. Combine every rank's contribution (one small all-reduce)."
                )
            if len(extra) > 1:
                raise CheckFailed(
                    f"{where} made {len(extra)} collectives besides the layers' ({_listed(Counter(map(_key, extra)))})"
                    "; the global norm needs one, of a few numbers, per optimizer step."
                )
            (norm,) = extra
            if norm.bytes_sent > NORM_BYTES:
                raise CheckFailed(
                    f"{where}'s collective for the norm ({norm.op} of {norm.elements:,} {norm.dtype} elements) sent "
                    f"{norm.bytes_sent:,} bytes; one number per rank carries everything the global norm needs "
                    f"(at most {NORM_BYTES} bytes). Reduce the sum of squares, not the gradient."
                )


def check_reduced_every_micro_batch(run: Run, label: str, k: int) -> None:
    """Each time backward hands a layer's gradient over (`GRADIENTS_READY`), a reduce-scatter starts before it
    hands over the next one (k micro-batches a step): no micro-batch's gradient waits, full-size, for a later one."""
    per_step = k * len(run.partitions)
    for rank, record in enumerate(run.ranks):
        ready = sorted((mark[0], mark[2]) for mark in record.schedule if mark[1] == schedule.GRADIENTS_READY)
        starts = sorted(c.started_s for c in run.collectives[rank] if c.op == comm.REDUCE_SCATTER)
        for index, (t, layer) in enumerate(ready):
            end = ready[index + 1][0] if index + 1 < len(ready) else math.inf
            first = bisect_left(starts, t)
            if first == len(starts) or starts[first] >= end:
                step, micro_step = divmod(index, per_step)[0], index % per_step // len(run.partitions)
                raise CheckFailed(
                    f"{label}: rank {rank} did not reduce-scatter layer {layer}'s gradient of micro-batch "
                    f"{micro_step} (step {step}) before backward went on. Under ZeRO-2 each micro-batch's "
                    "gradient is reduced while backward produces it: only the shard may carry it forward."
                )


# -- values --------------------------------------------------------------------------------------------------


@cache
def oracle_run(
    world_size: int, accumulation: Accumulation
) -> tuple[list[float], dict[str, Any], dict[tuple[str, int], Any]]:
    """The graded training on one device in fp32, accumulating k micro-batches and clipping with
    `clip_grad_norm_`. Imported here, by the judge: the oracle is never loaded where students' code runs."""

    def make() -> recorded.Oracle:
        from zero_core.oracle import train_single_device

        gradients: dict[tuple[str, int], Any] = {}
        k, max_norm = accumulation
        losses, weights = train_single_device(
            TRAINING_CONFIG, world_size, STEPS, gradients, micro_steps=k, max_norm=max_norm
        )
        return losses, weights, gradients

    key = (world_size, tuple(accumulation))
    return recorded.outcome("oracle", key, make, recorded.oracle_to_data, recorded.oracle_from_data)


MicroGradients = list[dict[str, torch.Tensor]]


def micro_batch_gradients(world_size: int, micro_steps: int) -> MicroGradients:
    """What each of step 0's k micro-batches adds to the accumulated gradient, per layer (flattened as the
    oracle's): the gradient of micro-batch j's loss divided by k (as the stage scales it), averaged over the
    ranks, at the initial weights, on one device in fp32. Their sum is step 0's gradient before clipping.
    Made here, by the judge, for `likely_cause`: a few milliseconds, so not cached, and so always recorded
    when a student release is built (`student_release.record_references`)."""

    def make() -> MicroGradients:
        from zero_core.model import build_model, global_batch, loss_fn, parameter_layers
        from zero_core.partition import flatten
        from zero_core.variants.accumulating import accumulation_data_step

        config = TRAINING_CONFIG
        model = build_model(config.model, config.seed)
        gradients = []
        for micro_step in range(micro_steps):
            data_step = accumulation_data_step(0, micro_step, micro_steps)
            inputs, targets = global_batch(config.model, world_size, data_step, config.seed)
            model.zero_grad(set_to_none=True)
            (loss_fn(model(inputs), targets) / micro_steps).backward()
            gradients.append(
                {name: flatten([p.grad.detach() for p in module.parameters()]).clone()
                 for name, module in parameter_layers(model)}
            )
        return gradients

    def encode(gradients: MicroGradients) -> list:
        return [{layer: recorded.tensor_to_data(g) for layer, g in micro.items()} for micro in gradients]

    def decode(data: list) -> MicroGradients:
        return [{layer: recorded.tensor_from_data(g) for layer, g in micro.items()} for micro in data]

    return recorded.outcome("micro gradients", (world_size, micro_steps), make, encode, decode)


CLIP_EPS = 1e-6
"""What `torch.nn.utils.clip_grad_norm_` adds to the norm before dividing."""
CAUSE_RESOLUTION = 1e-3
"""How close (relative to its norm) a rank's gradient must be to what a mistake gives for `likely_cause` to
name that mistake: far above fp32 rounding, far below the difference between the mistakes and the answer."""


def _owned(full: dict[str, torch.Tensor], run: Run, rank: int) -> torch.Tensor:
    """Rank `rank`'s owned slices of every layer of `full`, concatenated in the layers' order, in fp64."""
    pieces = [full[layer][slice(*partition.owned_range(rank))] for layer, partition in run.partitions.items()]
    return torch.cat(pieces).double()


def _given_to_adam(run: Run, rank: int, step: int) -> torch.Tensor | None:
    """What rank `rank` gave Adam at `step`, every layer's owned slice concatenated, in fp64; None if some is
    missing or not the owned slice's size."""
    pieces = []
    for layer, partition in run.partitions.items():
        grad = run.ranks[rank].adam_grads.get((layer, step))
        if grad is None or grad.numel() != partition.owned_numel(rank):
            return None
        pieces.append(grad)
    return torch.cat(pieces).double()


def _near(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return float((got - expected).norm()) <= CAUSE_RESOLUTION * max(float(expected.norm()), 1e-12)


def _scaled_copy(got: torch.Tensor, of: torch.Tensor) -> bool:
    """Whether `got` is c·`of` for some c > 0 (a clip coefficient, whichever), up to `CAUSE_RESOLUTION`."""
    norm = float(of @ of)
    if norm == 0:
        return float(got.norm()) == 0
    factor = float(got @ of) / norm
    return factor > 0 and _near(got, factor * of)


def _clipped(grad: torch.Tensor, max_norm: float) -> torch.Tensor:
    """`grad` scaled as clip_grad_norm_ scales a gradient whose whole norm is `grad`'s."""
    return grad * min(1.0, max_norm / (float(grad.norm()) + CLIP_EPS))


def likely_cause(run: Run, accumulation: Accumulation, micro: MicroGradients) -> str | None:
    """The mistake the step-0 gradient the ranks gave Adam looks like, told by comparing it with what each
    mistake gives, computed here from the micro-batches' gradients (`micro_batch_gradients`), never from the
    student's code: a shard overwritten by each micro-batch (every rank's gradient a positive multiple of the
    last micro-batch's, whatever clipped it), or clipping by a norm of the rank's own slices (every rank's
    gradient its slices clipped by their own norm, where that differs from clipping by the model's). None if
    it looks like neither."""
    k, max_norm = accumulation
    given = [_given_to_adam(run, rank, 0) for rank in range(run.world_size)]
    if any(g is None for g in given):
        return None
    last = [_owned(micro[-1], run, rank) for rank in range(run.world_size)]
    if k > 1 and all(_scaled_copy(g, of) for g, of in zip(given, last, strict=True)):
        return (
            f"after k = {k} micro-batches the shard equals the last micro-batch's gradient (up to the clip "
            "coefficient): it looks overwritten instead of accumulated (+=). A reduce-scatter writes its output, "
            "it does not add to it: reduce each micro-batch into a buffer of your own, then add that into shard.grad."
        )
    total = {layer: sum(m[layer] for m in micro) for layer in micro[0]}
    unclipped = [_owned(total, run, rank) for rank in range(run.world_size)]
    whole = _clipped(torch.cat(unclipped), max_norm)
    local = [_clipped(g, max_norm) for g in unclipped]
    if not _near(torch.cat(local), whole) and all(_near(g, e) for g, e in zip(given, local, strict=True)):
        return (
            "at step 0 each rank's clipped gradient is its own slices scaled by max_norm / (the norm of those "
            "slices alone): a norm computed from this rank's shard only (not all-reduced) clips by the wrong "
            "factor. Sum the squares of the rank's elements, all-reduce that sum over the ranks (op=SUM), then take "
            "its square root: every rank then clips by the model's norm, with the same coefficient."
        )
    return None


def clipped_steps(world_size: int, accumulation: Accumulation) -> int:
    """How many of the graded steps clip: those whose oracle gradient, clipped, has norm max_norm."""
    gradients = oracle_run(world_size, accumulation)[2]
    norms = [torch.cat([g for (_, s), g in gradients.items() if s == step]).norm().item() for step in range(STEPS)]
    return sum(math.isclose(norm, accumulation.max_norm, rel_tol=1e-4) for norm in norms)


def uniform_factor(run: Run, reference: Run, step: int = 0) -> float | None:
    """c if the whole model's gradient given to Adam at `step` is c times the reference's (one factor for
    every element: a clip coefficient or a scaling gone wrong), else None."""
    got, want = [], []
    for layer in run.partitions:
        mine, theirs = run.averaged_gradient(layer, step), reference.averaged_gradient(layer, step)
        if mine is None or theirs is None or mine.shape != theirs.shape:
            return None
        got.append(mine)
        want.append(theirs)
    mine, theirs = torch.cat(got).double(), torch.cat(want).double()
    factor = float(mine @ theirs / (theirs @ theirs))
    residual = float((mine - factor * theirs).norm() / theirs.norm())
    return factor if math.isfinite(factor) and residual < 1e-3 and abs(factor - 1) > 1e-3 else None


def judge_training(observation: Any, world_sizes: list[int], **given: Any) -> str:
    clipped = 0
    for label, run, reference, accumulation in EXERCISE.runs(observation, world_sizes, TRAINING_CONFIG, **given):
        tolerance = tolerance_from_oracle(reference, *oracle_run(run.world_size, accumulation))
        clipped += clipped_steps(run.world_size, accumulation)
        micro = micro_batch_gradients(run.world_size, accumulation.micro_steps)  # made (and recorded) every time
        try:
            compare_training(run, reference, label, tolerance, gradient="clipped gradient")
        except CheckFailed as failure:
            cause = likely_cause(run, accumulation, micro)
            if cause is not None:
                raise CheckFailed(f"{failure}\n  likely cause: {cause}") from None
            factor = uniform_factor(run, reference)
            if factor is None:
                raise
            raise CheckFailed(
                f"{failure}\n  at step 0 the whole model's clipped gradient given to Adam is {factor:.4g} times "
                "the reference's, one factor for every element: look at the clip coefficient (the norm over every "
                "rank's elements, each once; at most 1) and at any scaling of the accumulated gradient."
            ) from None
    steps = STEPS * len(world_sizes)
    clipping = {steps: "clipping in every step", 0: "no step clips"}.get(clipped, f"{clipped} of {steps} steps clip")
    return (
        f"{EXERCISE.sizes(world_sizes, **given)} ({clipping}), {STEPS} steps: every loss, clipped gradient and "
        "fp32 master weight within rounding of the single-device oracle's (clip_grad_norm_)"
    )


def judge_communication(observation: Any, world_sizes: list[int], **given: Any) -> str:
    for label, run, reference, accumulation in EXERCISE.runs(observation, world_sizes, **given):
        compare_accumulated_collectives(run, reference, label, accumulation.micro_steps)
        check_reduced_every_micro_batch(run, label, accumulation.micro_steps)
    return f"{EXERCISE.sizes(world_sizes, **given)}: {EXERCISE.communication_summary}"


def judge_memory_and_communication(observation: Any, world_sizes: list[int], **given: Any) -> str:
    memory_verdict = EXERCISE.judge_memory(observation, world_sizes, **given).split(": ", 1)[1]
    return f"{judge_communication(observation, world_sizes, **given)}; and {memory_verdict}"


EXERCISE = StageExercise(
    exercise=ASSIGNMENT,
    names=("accumulate_gradient", "clip_global_norm"),
    reference="autograder.ex08:GRADED",
    students_collectives=tuple(("grad", kind) for kind in (nn.Linear, nn.Embedding, nn.LayerNorm)),
    build=_build,
    memory_rules=accumulation_memory_rules,
    memory_summary="only the gradient shards persist between micro-batches (no full gradient), one registered "
    "bucket per layer and micro-batch, each released",
    communication_summary="k reduce-scatters per layer (each during its micro-batch's backward), one all-gather "
    "per layer and one collective of a few bytes for the norm: k·Ψ + Ψ + ε per optimizer step",
    setting=Setting(
        "accumulation",
        default=ACCUMULATION.__getitem__,
        draw=draw_accumulation,
        describe=lambda accumulation: f"k = {accumulation.micro_steps}, max_norm = {accumulation.max_norm:g}",
        read=lambda value: Accumulation(*value),
    ),
)


check_training = EXERCISE.check_with(
    "check_training", judge_training, "training within rounding of the oracle", EXERCISE.observe_training
)
check_memory = EXERCISE.check_memory
check_communication = EXERCISE.check_with("check_communication", judge_communication, EXERCISE.communication_summary)
check_memory_and_communication = EXERCISE.check_with(
    "check_memory_and_communication", judge_memory_and_communication, "memory and communication"
)

NAMES = EXERCISE.names
_VISIBLE, _HIDDEN = {"world_sizes": VISIBLE_WORLD_SIZES}, {"world_sizes": HIDDEN_CELL_WORLD_SIZES}
CHECKS = (
    Check("test_training", 2, check_training, NAMES, _VISIBLE),
    Check("test_training_without_clipping", 1, check_training, NAMES, {"world_sizes": UNCLIPPED_WORLD_SIZES}),
    Check("test_memory", 2, check_memory, NAMES, _VISIBLE),
    Check("test_communication", 2, check_communication, NAMES, _VISIBLE),
    Check("test_hidden_training", 2, check_training, NAMES, _HIDDEN, hidden=True, draw=EXERCISE.draw),
    Check(
        "test_hidden_memory_communication",
        1,
        check_memory_and_communication,
        NAMES,
        _HIDDEN,
        hidden=True,
        draw=EXERCISE.draw,
    ),
)
