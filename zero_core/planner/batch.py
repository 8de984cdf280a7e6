"""The batch a plan trains: micro-batch, gradient accumulation and data-parallel degree, consistent with each other.

DeepSpeed names three numbers and refuses a configuration unless
`train_batch_size = train_micro_batch_size_per_gpu × gradient_accumulation_steps × world_size`
(`deepspeed.runtime.config.DeepSpeedConfig._batch_assertion`); FSDP2 leaves the same arithmetic to the training
loop. The plan adds a fourth: it timed a step of `tokens_per_gpu` tokens per GPU, so the sequences a GPU trains
per step, micro-batch × accumulation, times the sequence length must be those tokens, or the emitted
configuration would train a step the plan never predicted. `plan_batch` checks all of it and says what to change.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Batch:
    """Sequences per GPU per micro-step, micro-steps per optimizer step, GPUs that split the batch (N)."""

    micro_batch_per_gpu: int
    gradient_accumulation_steps: int
    world_size: int
    sequence: int

    @property
    def train_batch_size(self) -> int:
        """Sequences per optimizer step across all GPUs: micro-batch × accumulation × N."""
        return self.micro_batch_per_gpu * self.gradient_accumulation_steps * self.world_size

    @property
    def tokens_per_gpu(self) -> int:
        """Tokens one GPU trains per optimizer step: micro-batch × accumulation × sequence."""
        return self.micro_batch_per_gpu * self.gradient_accumulation_steps * self.sequence


def plan_batch(
    tokens_per_gpu: int,
    sequence: int,
    world_size: int,
    micro_batch: int = 1,
    accumulation: int | None = None,
    global_batch: int | None = None,
) -> Batch:
    """The batch of a plan timed at `tokens_per_gpu` tokens per GPU on `world_size` GPUs.

    `accumulation` defaults to what the tokens need: tokens / (micro_batch × sequence). A `ValueError` names
    every number involved when they disagree: tokens that are no whole number of micro-batches of sequences,
    an accumulation that trains other tokens than the plan timed, or a `global_batch` (sequences per
    optimizer step) other than micro-batch × accumulation × N.
    """
    for name, value in (("micro-batch", micro_batch), ("world size", world_size), ("sequence", sequence)):
        if value < 1:
            raise ValueError(f"the {name} must be at least 1, got {value}")
    per_micro_step = micro_batch * sequence
    if accumulation is None:
        if tokens_per_gpu % per_micro_step:
            raise ValueError(
                f"{tokens_per_gpu:,} tokens per GPU are no whole number of micro-batches of {micro_batch} x "
                f"{sequence:,} tokens: choose --tokens-per-gpu as a multiple of {per_micro_step:,}, or another "
                "--micro-batch or --seq-len"
            )
        accumulation = tokens_per_gpu // per_micro_step
    if accumulation < 1:
        raise ValueError(f"the gradient accumulation must be at least 1, got {accumulation}")
    batch = Batch(micro_batch, accumulation, world_size, sequence)
    if batch.tokens_per_gpu != tokens_per_gpu:
        raise ValueError(
            f"micro-batch {micro_batch} x accumulation {accumulation} x sequence {sequence:,} = "
            f"{batch.tokens_per_gpu:,} tokens per GPU per step, but the plan timed {tokens_per_gpu:,}: "
            "change --grad-accum, --micro-batch or --tokens-per-gpu so that they agree"
        )
    if global_batch is not None and global_batch != batch.train_batch_size:
        raise ValueError(
            f"a global batch of {global_batch:,} sequences is not micro-batch {micro_batch} x accumulation "
            f"{accumulation} x {world_size:,} GPUs = {batch.train_batch_size:,}: change --global-batch, "
            "--micro-batch or --grad-accum"
        )
    return batch
