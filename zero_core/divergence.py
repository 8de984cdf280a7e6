"""Why production runs diverge: the bit-identical training broken on purpose, one cause at a time.

The course's stages train to the same bits because of three contracts (the first in `docs/modules.md`, the
others in lesson 7): every reduction adds the ranks' values in rank order with fp32 partial sums and divides
by N once; every rank clips by the norm of the whole gradient; every rank takes or skips a step on the
verdict of all of them. Real systems keep these contracts only in part, and users meet the difference as
loss curves that drift apart (DeepSpeed#966, #1945, #4815, #5898; accelerate#3877; pytorch#88621).
`Switches` breaks one contract at a time on the virtual cluster, as a real variant of ZeRO-2's gradient
path or step:

- `order="ring"`: each rank's chunk is summed in ring order, starting on the next rank and ending on its
  owner, as a ring reduce-scatter adds along its hops; `sum_in_fp32=False`: each partial sum is rounded to
  the gradient's own dtype, as NCCL adds bf16 or fp16 tensors (DeepSpeed's `communication_data_type`);
- `predivide=True`: every rank divides its gradient by N before the sum, in the gradient's dtype, instead
  of the sum being divided once (DeepSpeed's `gradient_predivide_factor`, `prescale_gradients`);
- `every_backward_a_boundary=True`: each micro-batch's reduced gradient replaces the shard instead of
  adding to it, so only the last micro-batch of an optimizer step survives (allenai/open-instruct PR #1498);
- `clip_on_local_norm=True`: each rank clips its shard by that shard's norm, what
  `torch.nn.utils.clip_grad_norm_` computes on sharded parameters (pytorch#72548, #170862);
- `overflow_verdict_alone=True`: each rank checks only its own gradient shard for inf/NaN, so one rank
  can skip a step, and halve its loss scale, while the others step.

The gradient path runs as the `accumulate` piece of `AccumulatingZero2` (ex08's seam): an all-to-all gives
each rank every rank's copy of its chunk, the same bytes a ring reduce-scatter sends, and the rank adds
them in the order and dtype the switches say. With every switch off it adds them exactly as the virtual
cluster's reduce-scatter does (`reduce_in_rank_order`), so `Switches()` trains ZeRO-2 bit for bit, and a
run's divergence from it is the cause's alone. `train` runs a few steps and keeps each step's loss and fp32
master weights; `divergence` measures the largest |Δ loss| and |Δ master weight| per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from zero_core import dist, memory
from zero_core.backends.base import ReduceOp, reduce_in_rank_order
from zero_core.cluster import VirtualCluster, one_torch_thread
from zero_core.optim import has_overflow
from zero_core.report import assemble_master_weights
from zero_core.stages.base import TrainConfig, ZeroStage, layer_tag
from zero_core.stages.zero2 import Zero2
from zero_core.variants.accumulating import AccumulatingZero2

ORDERS = ("rank", "ring")
CLIP_EPS = 1e-6
"""What `torch.nn.utils.clip_grad_norm_` adds to the norm before dividing max_norm by it."""


def summation_order(order: str, rank: int, world_size: int) -> list[int]:
    """The ranks whose copies of `rank`'s chunk are added, first to last: 0..N-1 ("rank"), or from the
    next rank around the ring to `rank` itself ("ring", where chunk r is reduced on its way to rank r)."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    if order == "rank":
        return list(range(world_size))
    return [(rank + 1 + hop) % world_size for hop in range(world_size)]


def reduce_copies(copies: list[torch.Tensor], order: list[int], sum_in_fp32: bool, divide: bool) -> torch.Tensor:
    """The ranks' copies of one chunk combined in `order`: partial sums in fp32 (rounded to the copies'
    dtype once, at the end) or in the copies' own dtype (rounded at every addition); then divided by N,
    unless the ranks divided before sending (`divide=False`)."""
    ordered = [copies[rank] for rank in order]
    if sum_in_fp32:
        return reduce_in_rank_order(ordered, ReduceOp.AVG if divide else ReduceOp.SUM)
    total = ordered[0].clone()
    for copy in ordered[1:]:
        total.add_(copy)
    return total.div_(len(copies)) if divide else total


@dataclass(frozen=True)
class GradientPath:
    """How one micro-batch's gradient of a layer reaches the rank's shard (`AccumulatingZero2`'s `accumulate`).

    Each rank sends chunk j of its gradient to rank j (an all-to-all: (N-1)/N of the layer sent per rank,
    as a ring reduce-scatter sends), then combines the N copies of its own chunk as the fields say, and adds
    the result into the shard, or, with `every_backward_a_boundary`, writes it over the shard.
    """

    order: str = "rank"
    sum_in_fp32: bool = True
    predivide: bool = False
    every_backward_a_boundary: bool = False

    def __call__(self, shard, grads: list[torch.Tensor]) -> None:
        world_size = dist.get_world_size()
        bucket = shard.tracker.register(
            shard.partition.pack(grads), memory.GRAD_BUCKET, padding_elements=shard.partition.padding, label=shard.name
        )
        if self.predivide:
            bucket.div_(world_size)
        received = shard.tracker.register(torch.empty_like(bucket), memory.GRAD_BUCKET, label=shard.name)
        dist.all_to_all_single(received, bucket, tag=layer_tag("grad", shard.name))
        copies = list(received.view(world_size, -1).unbind(0))
        order = summation_order(self.order, shard.rank, world_size)
        reduced = reduce_copies(copies, order, self.sum_in_fp32, divide=not self.predivide)
        shard.tracker.release(bucket)
        shard.tracker.release(received)
        if self.every_backward_a_boundary:
            shard.grad.copy_(reduced)
        else:
            shard.grad.add_(reduced)


def clip_on_local_norm(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the rank's owned gradient slices by their own norm, as if they were the whole model's gradient:
    what `torch.nn.utils.clip_grad_norm_` does when handed a rank's shards. Returns that local norm."""
    norm = torch.nn.utils.get_total_norm(grads)
    torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0))
    return norm


class OverflowAloneZero2(Zero2):
    """ZeRO-2 whose ranks each decide alone whether a step overflowed, from their own gradient shard.

    A rank whose shard holds an inf skips the step and halves its loss scale; the others step. A rank that
    skips still joins the parameter all-gather when `join_all_gather` (its unchanged chunk), so the run goes
    on and diverges in silence; without it, the skipping rank leaves the others waiting in the all-gather, a
    hang on a real cluster, which the virtual cluster reports as a collective mismatch.
    """

    def __init__(self, config: TrainConfig, *, join_all_gather: bool = True) -> None:
        self.join_all_gather = join_all_gather
        super().__init__(config)

    def found_overflow(self, grad: torch.Tensor) -> bool:
        return has_overflow(grad)

    def optimizer_step(self) -> bool:
        taken = super().optimizer_step()
        if not taken and self.join_all_gather:
            self.publish_parameters()
        return taken


@dataclass(frozen=True)
class Switches:
    """Which contract of the bit-identical training to break; every switch off is ZeRO-2 as the course runs it."""

    order: str = "rank"
    sum_in_fp32: bool = True
    predivide: bool = False
    every_backward_a_boundary: bool = False
    clip_on_local_norm: bool = False
    overflow_verdict_alone: bool = False
    join_all_gather: bool = True
    """With `overflow_verdict_alone`: whether a rank that skips alone still joins the parameter all-gather."""

    def __post_init__(self) -> None:
        summation_order(self.order, 0, 1)

    def make_stage(self, config: TrainConfig, micro_steps: int = 1, max_norm: float | None = None) -> ZeroStage:
        """The stage these switches train, built on the calling rank."""
        if self.overflow_verdict_alone:
            alone = replace(self, overflow_verdict_alone=False, join_all_gather=True) == Switches()
            if micro_steps != 1 or max_norm is not None or not alone:
                raise ValueError(
                    "overflow_verdict_alone breaks plain ZeRO-2: one micro-batch, no clipping and no other switch"
                )
            return OverflowAloneZero2(config, join_all_gather=self.join_all_gather)
        path = GradientPath(self.order, self.sum_in_fp32, self.predivide, self.every_backward_a_boundary)
        clip = clip_on_local_norm if self.clip_on_local_norm else None
        return AccumulatingZero2(config, micro_steps=micro_steps, max_norm=max_norm, accumulate=path, clip=clip)


@dataclass(frozen=True)
class Trajectory:
    """What a run left after each step: the loss (mean over ranks) and every layer's fp32 master weights;
    per rank, the steps it skipped, its loss scale at the end, and the gradient norm it clipped by."""

    losses: list[float]
    masters: list[dict[str, torch.Tensor]] = field(repr=False)
    skipped: list[list[int]]
    loss_scales: list[float]
    grad_norms: list[list[float]]


def train(
    switches: Switches,
    config: TrainConfig,
    world_size: int,
    steps: int,
    *,
    micro_steps: int = 1,
    max_norm: float | None = None,
) -> Trajectory:
    """Train the stage `switches` make for `steps` steps on `world_size` virtual GPUs, keeping every step."""

    def on_rank() -> tuple:
        stage = switches.make_stage(config, micro_steps, max_norm)
        losses, shards, skipped = [], [], []
        for step in range(steps):
            before = stage.scaler.skipped_steps
            losses.append(stage.train_step(step, count_activations=False))
            shards.append(stage.master_shards())
            if stage.scaler.skipped_steps > before:
                skipped.append(step)
        return losses, shards, skipped, stage.scaler.scale, list(getattr(stage, "grad_norms", []))

    with one_torch_thread():
        ranks = VirtualCluster(world_size, seed=config.seed).run(on_rank)
    return Trajectory(
        losses=[sum(r[0][step] for r in ranks) / world_size for step in range(steps)],
        masters=[assemble_master_weights([r[1][step] for r in ranks]) for step in range(steps)],
        skipped=[r[2] for r in ranks],
        loss_scales=[r[3] for r in ranks],
        grad_norms=[r[4] for r in ranks],
    )


@dataclass(frozen=True)
class Divergence:
    """Per step, |Δ loss| and the largest |Δ fp32 master weight| of a run against its reference."""

    loss_deltas: list[float]
    master_deltas: list[float]

    @property
    def max_loss_delta(self) -> float:
        return max(self.loss_deltas)

    @property
    def max_master_delta(self) -> float:
        return max(self.master_deltas)

    @property
    def first_step(self) -> int | None:
        """The first step after which the master weights differ (None: they never do)."""
        return next((step for step, delta in enumerate(self.master_deltas) if delta > 0.0), None)

    @property
    def bit_identical(self) -> bool:
        return self.max_loss_delta == 0.0 and self.max_master_delta == 0.0


def divergence(reference: Trajectory, run: Trajectory) -> Divergence:
    """How far `run` is from `reference`, step by step (both trained for the same steps)."""
    if len(reference.losses) != len(run.losses):
        raise ValueError(f"compare runs of as many steps: {len(reference.losses)} against {len(run.losses)}")
    return Divergence(
        loss_deltas=[abs(a - b) for a, b in zip(reference.losses, run.losses, strict=True)],
        master_deltas=[
            max((mine[name] - theirs[name]).abs().max().item() for name in mine)
            for mine, theirs in zip(reference.masters, run.masters, strict=True)
        ],
    )

