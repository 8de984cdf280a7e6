"""ex06: ZeRO-2's gradients reduced in buckets of at most B bytes while backward goes on (ZeRO §5.2, §7.1).

The student writes `GradientBuckets`, the class `BucketedZero2` hands every layer's gradients to in
backward (`add(shard, grads)`) and asks to finish after it (`finish()`). The checks train the bucketed
stage with it, with a bucket size B per world size (`BUCKET_BYTES` for the visible checks, drawn at grading
time for the hidden ones: `draw_bucket_bytes`), and judge four things, each from what the course's code
observed, never from what the student's code reports:

- values: the training, within the fp32 oracle's rounding (`StageExercise.judge_training`); right values in
  wrong places are named as a bucket layout problem (`bucket_layout_cause`);
- memory: every bucket registered and at most B bytes, no full gradient kept, nothing left behind;
- communication: the reference's all-gathers, and as few reduce-scatters as buckets of at most B bytes
  allow, each at most B bytes, carrying every layer's gradient once;
- schedule: every bucket but the last was still in flight when backward had computed another layer's
  gradients (the ledger's start and wait times against the stage's `GRADIENTS_READY` marks).
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import torch
import torch.nn as nn

from autograder.checks import Check, CheckFailed
from autograder.harness import GradedStage, layer_partitions
from autograder.integrity import REFERENCE_MODULES, StudentShard, answer_modules
from autograder.records import Run, element_size
from autograder.stage_checks import HIDDEN_CELL_WORLD_SIZES, VISIBLE_WORLD_SIZES, Setting, StageExercise
from autograder.verdicts import (
    ACTIVATIONS_ADVICE,
    GRAD_ADVICE,
    SCALAR_BYTES,
    Tolerance,
    check_no_stray_gradients,
    compare_peaks,
    misplaced_elements,
    registrations,
)
from zero_core import comm, memory, schedule
from zero_core.registry import answer_module
from zero_core.stages.base import OVERFLOW_TAG
from zero_core.variants.bucketed import BucketedZero2

ASSIGNMENT = "ex06_bucketed_overlap"
FORBIDDEN = REFERENCE_MODULES + ("zero_core.schedule",)
"""The overlap check reads the stage's schedule marks: a submission may not make marks of its own."""
ANSWER_MODULES = answer_modules(("zero_core.stages.zero1", "zero_core.stages.zero2", answer_module("ex03")))
"""Not loaded, and not loadable, where the student's code is graded (`autograder.sandbox`). ZeRO-2's layer
Functions are ex03's answer, due before this exercise: here they are the scaffolding."""

BUCKET_BYTES = {2: 12 * 1024, 3: 12 * 1024, 5: 9 * 1024, 7: 20 * 1024}
"""B per world size for the bf16 runs of a check that sets none: 4 buckets on the visible sizes (and 5 and 2
on the sizes of the solution notebook's hidden cells). Every B holds the largest layer (mlp.fc, 8,450 bytes
at N = 5). The fp32 training runs get twice as many bytes: the same buckets."""
SIZED_BUCKET_BYTES = 8 * 2**20
"""B for the sized run whose memory the kernel counts (`autograder.kernel_memory`): about two of its layers."""


def bucket_bounds(world_size: int) -> tuple[int, int]:
    """The B a hidden check draws from on N ranks: from the largest layer's padded gradient (every layer
    fits a bucket) to half of all of them (at least two buckets, so that one can overlap backward)."""
    sizes = [2 * partition.padded_numel for partition in layer_partitions(world_size).values()]
    return max(sizes), sum(sizes) // 2


def draw_bucket_bytes(rng: random.Random, world_size: int) -> int:
    """An even B of `bucket_bounds`: the micro model's gradients in two buckets (the largest B) to six (the
    smallest), as 9 and 20 KiB make five and two."""
    low, high = bucket_bounds(world_size)
    return rng.randrange(low, high + 1, 2)


def bucketed_options(world_size: int, dtype: torch.dtype, bucket_bytes: int | None) -> dict[str, Any]:
    """Buckets of `bucket_bytes` in bf16 (None: `BUCKET_BYTES` of the world size), as many elements in fp32."""
    bf16_bytes = bucket_bytes or BUCKET_BYTES[world_size]
    return {"bucket_bytes": bf16_bytes * dtype.itemsize // 2}


GRADED = GradedStage(BucketedZero2, ASSIGNMENT, per_rank=bucketed_options)
"""The bucketed ZeRO-2, recorded, with the check's bucket size."""


def _guarded(shard: Any) -> StudentShard:
    return StudentShard(shard, ASSIGNMENT)


def _build(buckets: type) -> tuple[GradedStage, None]:
    """The graded stage with the student's `GradientBuckets`, handed each layer's shard as a `StudentShard`."""
    return GRADED.with_options(buckets=buckets, hand=_guarded), None


def _reduce_scatters(run: Run, rank: int, step: int) -> list:
    return [c for c in run.collectives[rank] if c.step == step and c.op == comm.REDUCE_SCATTER]


def bucket_memory_rules(run: Run, reference: Run, label: str, limit: int) -> None:
    """Only the shards stay; each bucket is registered, holds at most B = `limit` bytes (the memory checks
    run in bf16), and buckets never exceed B."""
    check_no_stray_gradients(run, label)
    compare_peaks(run, reference, memory.GRAD, label, GRAD_ADVICE)
    compare_peaks(run, reference, memory.ACTIVATIONS, label, ACTIVATIONS_ADVICE)
    for rank in range(run.world_size):
        for step in range(run.steps):
            buckets = registrations(run, rank, memory.GRAD_BUCKET, step)
            sent = len(_reduce_scatters(run, rank, step))
            if len(buckets) != sent:
                raise CheckFailed(
                    f"{label}: at step {step}, rank {rank} reduce-scattered {sent} bucket(s) but registered "
                    f"{len(buckets)} as {memory.GRAD_BUCKET}. Register each bucket when you make it: "
                    "shard.tracker.register(bucket, memory.GRAD_BUCKET, padding_elements=...)."
                )
        check_nothing_kept_between_layers(run, reference, rank, label)
        peak = run.memory[rank].peak_bytes(memory.GRAD_BUCKET)
        if peak > limit:
            raise CheckFailed(
                f"{label}: rank {rank} held {peak:,} bytes of gradient buckets at once; the budget is B = "
                f"{limit:,}. Complete the bucket in flight and free it before making the next one."
            )


def check_nothing_kept_between_layers(run: Run, reference: Run, rank: int, label: str) -> None:
    """When a layer's gradients are ready, the rank holds no more unregistered memory than the reference does
    then (`schedule.Mark`'s unnamed bytes): a layer's gradients kept for a later bucket show up here."""
    marks = [m for m in run.ranks[rank].schedule if m[1] == schedule.GRADIENTS_READY]
    expected = [m for m in reference.ranks[rank].schedule if m[1] == schedule.GRADIENTS_READY]
    for (_, _, layer, held), (_, _, _, reference_held) in zip(marks, expected, strict=False):
        if held > reference_held + SCALAR_BYTES:
            raise CheckFailed(
                f"{label}: when {layer}'s gradients were ready, rank {rank} held {held - reference_held:,} bytes "
                "more unregistered memory than the reference: gradients kept waiting for their bucket (or a "
                "copy of them). Copy each layer's gradients into its bucket in add(); keep nothing else."
            )


def bucket_layout_cause(run: Run, reference: Run, tolerance: Tolerance) -> str | None:
    """A training that differs because the gradient values are right but land in the wrong places: what
    rank r gave Adam is made of the reference's averaged gradient elements taken from elsewhere (another
    layer, another rank's chunk), which a bucket whose layers are not laid out as the reduce-scatter splits it
    gives (`verdicts.misplaced_elements`). None for a training that differs otherwise."""
    misplaced = misplaced_elements(run, reference, tolerance)
    if misplaced is None:
        return None
    return (
        f"the bucket's elements are not where the reference puts them: {misplaced.describe()}. Check the bucket "
        "layout (order and offsets of the layers in the flat bucket): a reduce-scatter hands rank r the r-th "
        "N-th of the bucket, so that N-th must hold rank r's chunk of every layer of the bucket, each at the "
        "same offset on every rank, and the results must be read back from those offsets."
    )


def compare_bucketed_collectives(run: Run, reference: Run, label: str, limit: int) -> None:
    """The reference's collectives but the reduce-scatters; those: the fewest buckets of at most B = `limit`
    bytes (the communication checks run in bf16), together carrying every layer's padded gradient once."""
    for step in range(run.steps):
        for rank in range(run.world_size):
            if _others(run, rank, step) != _others(reference, rank, step):
                raise CheckFailed(
                    f"{label}: at step {step}, rank {rank}'s collectives other than the gradient reduce-scatters "
                    "differ from the reference's: reduce gradients with reduce-scatters only (op=AVG)."
                )
            mine, theirs = _reduce_scatters(run, rank, step), _reduce_scatters(reference, rank, step)
            where = f"{label}: at step {step}, rank {rank}"
            for c in mine:
                if c.elements * element_size(c.dtype, where) > limit:
                    raise CheckFailed(
                        f"{where} reduce-scattered a bucket of {c.elements * element_size(c.dtype, where):,} bytes; "
                        f"a bucket may hold at most B = {limit:,}."
                    )
            carried, expected = sum(c.elements for c in mine), sum(c.elements for c in theirs)
            if carried != expected or {c.dtype for c in mine} != {c.dtype for c in theirs}:
                raise CheckFailed(
                    f"{where} reduce-scattered {carried:,} elements in all; every layer's gradient, padded to a "
                    f"multiple of N, is {expected:,} {theirs[0].dtype} elements. Send each layer's once."
                )
            if len(mine) != len(theirs):
                raise CheckFailed(
                    f"{where} made {len(mine)} reduce-scatters; buckets of at most B = {limit:,} bytes need only "
                    f"{len(theirs)}. Fill a bucket with the next layers, in the order backward reaches them, "
                    "until the next would not fit."
                )


def _others(run: Run, rank: int, step: int) -> Counter:
    """The rank's collectives of `step` but the reduce-scatters and the overflow flag, as (op, dtype, size)."""
    return Counter(
        (c.op, c.dtype, c.elements)
        for c in run.collectives[rank]
        if c.step == step and c.op != comm.REDUCE_SCATTER and c.tag != OVERFLOW_TAG
    )


def check_overlap(run: Run, label: str) -> None:
    """Each bucket but the last in a step was in flight while backward computed another layer: it started
    before some layer's GRADIENTS_READY mark and was waited for only after it."""
    for rank, record in enumerate(run.ranks):
        ready = [t for t, event, _, _ in record.schedule if event == schedule.GRADIENTS_READY]
        for step in range(run.steps):
            for c in _reduce_scatters(run, rank, step)[:-1]:
                where = f"{label}: at step {step}, rank {rank}'s reduce-scatter {c.tag!r}"
                if not c.wait_started_s:
                    raise CheckFailed(
                        f"{where} blocked backward until it completed. Start it with async_op=True and wait for "
                        "the Work it returns later, when you need the bucket's memory back."
                    )
                if not any(c.started_s < t < c.wait_started_s for t in ready):
                    raise CheckFailed(
                        f"{where} was waited for before backward computed any further layer: nothing overlapped. "
                        "Wait for a bucket only when you must (before making the next one, or after backward)."
                    )


EXERCISE = StageExercise(
    exercise=ASSIGNMENT,
    names=("GradientBuckets",),
    reference="autograder.ex06:GRADED",
    students_collectives=tuple(("grad", kind) for kind in (nn.Linear, nn.Embedding, nn.LayerNorm)),
    build=_build,
    memory_rules=bucket_memory_rules,
    memory_summary="every bucket registered, at most B bytes of buckets alive at once, no full gradient kept",
    communication_summary="the fewest reduce-scatters buckets of at most B bytes allow, each layer's gradient once; "
    "the reference's all-gathers",
    forbidden=FORBIDDEN,
    likely_cause=bucket_layout_cause,
    setting=Setting(
        "bucket_bytes",
        default=BUCKET_BYTES.__getitem__,
        draw=draw_bucket_bytes,
        describe=lambda limit: f"B = {limit:,} bytes",
        sized=SIZED_BUCKET_BYTES,
    ),
)


def judge_communication(observation: Any, world_sizes: list[int], **given: Any) -> str:
    for label, run, reference, limit in EXERCISE.runs(observation, world_sizes, **given):
        compare_bucketed_collectives(run, reference, label, limit)
    return f"{EXERCISE.sizes(world_sizes, **given)}: {EXERCISE.communication_summary}"


def judge_overlap(observation: Any, world_sizes: list[int], **given: Any) -> str:
    for label, run, _, _ in EXERCISE.runs(observation, world_sizes, **given):
        check_overlap(run, label)
    return f"{EXERCISE.sizes(world_sizes, **given)}: every bucket but the last in flight while backward went on"


def judge_memory_communication_overlap(observation: Any, world_sizes: list[int], **given: Any) -> str:
    memory_verdict = EXERCISE.judge_memory(observation, world_sizes, **given)
    judge_communication(observation, world_sizes, **given)
    judge_overlap(observation, world_sizes, **given)
    return f"{memory_verdict}; {EXERCISE.communication_summary}; buckets overlap backward"


check_training = EXERCISE.check_training
check_memory = EXERCISE.check_memory
check_communication = EXERCISE.check_with("check_communication", judge_communication, EXERCISE.communication_summary)
check_overlap_with_backward = EXERCISE.check_with(
    "check_overlap_with_backward", judge_overlap, "buckets overlap backward"
)
check_memory_communication_overlap = EXERCISE.check_with(
    "check_memory_communication_overlap", judge_memory_communication_overlap, "memory, communication and overlap"
)

NAMES = EXERCISE.names
_VISIBLE, _HIDDEN = {"world_sizes": VISIBLE_WORLD_SIZES}, {"world_sizes": HIDDEN_CELL_WORLD_SIZES}
CHECKS = (
    Check("test_training", 2, check_training, NAMES, _VISIBLE),
    Check("test_memory", 2, check_memory, NAMES, _VISIBLE),
    Check("test_communication", 2, check_communication, NAMES, _VISIBLE),
    Check("test_overlap", 2, check_overlap_with_backward, NAMES, _VISIBLE),
    Check("test_hidden_training", 1, check_training, NAMES, _HIDDEN, True, EXERCISE.draw),
    Check(
        "test_hidden_memory_communication_overlap",
        1,
        check_memory_communication_overlap,
        NAMES,
        _HIDDEN,
        True,
        EXERCISE.draw,
    ),
)
