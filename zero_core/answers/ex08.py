"""Exercise ex08's answer: gradient accumulation and global-norm clipping on ZeRO-2's gradient shards.

`AccumulatingZero2` (`zero_core.variants.accumulating`) names these functions through `zero_core.registry`
and imports them only when it runs them. Where a student's ex08 is graded, the grading sandbox leaves this
module out (`autograder.walls`): the grader trains the stage with the student's functions in a process
where this module is never loaded, and cannot be.

- `accumulate_gradient`: each micro-batch's layer gradient is averaged over the ranks by a reduce-scatter
  right away, as ZeRO-2 does (ZeRO §5.2), and *added* into the rank's shard: only shards persist between
  micro-batches, never a full gradient (what DDP's `no_sync` keeps instead).
- `clip_global_norm`: `torch.nn.utils.clip_grad_norm_` over the whole model when no rank holds the whole
  gradient. Every element is owned by exactly one rank, so the squared norm is a sum of per-rank sums of
  squares: one all-reduce of one fp32 element.
"""

from __future__ import annotations

import torch

from zero_core import dist, memory
from zero_core.variants.accumulating import NORM_TAG

CLIP_EPS = 1e-6
"""What `torch.nn.utils.clip_grad_norm_` adds to the norm before dividing: clip_coef = max_norm / (norm + 1e-6)."""


def accumulate_gradient(shard, grads: list[torch.Tensor]) -> None:
    """Average one micro-batch's gradients of a layer over the ranks and add this rank's chunk into `shard.grad`."""
    bucket = shard.partition.pack(grads)
    shard.tracker.register(bucket, memory.GRAD_BUCKET, padding_elements=shard.partition.padding, label=shard.name)
    reduced = torch.empty_like(shard.grad)
    dist.reduce_scatter_single(reduced, bucket, op=dist.ReduceOp.AVG, tag=f"grad {shard.name}")
    shard.tracker.release(bucket)
    shard.grad.add_(reduced)


def clip_global_norm(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Scale the rank's owned fp32 gradient slices in place so that the model's global L2 norm is at most
    `max_norm`, exactly as `clip_grad_norm_` would on one device; returns the norm before clipping."""
    squares = torch.zeros(1, dtype=torch.float32, device=grads[0].device)
    for grad in grads:
        squares += grad.float().square().sum()
    dist.all_reduce(squares, op=dist.ReduceOp.SUM, tag=NORM_TAG)
    total_norm = squares.sqrt()[0]
    clip_coef = torch.clamp(max_norm / (total_norm + CLIP_EPS), max=1.0)
    torch._foreach_mul_(grads, clip_coef)
    return total_norm
