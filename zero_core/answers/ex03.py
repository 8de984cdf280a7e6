"""Exercise ex03's answer: ZeRO-2's Linear layer, whose backward reduce-scatters dW and db (ZeRO §5.2).

`Zero2` names `ReduceScatterLinear` through `zero_core.registry` and imports it only when it runs it. Where
a student's ex03 is graded, the grading sandbox leaves this module out (`autograder.walls`): the grader
trains ZeRO-2 with the student's Linear Function in a process where this module is never loaded, and
cannot be.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zero_core.stages.sharding import LayerShard


class ReduceScatterLinear(torch.autograd.Function):
    """y = x·Wᵀ + b, whose backward reduce-scatters dW and db instead of handing them to autograd."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, shard: LayerShard) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.shard = shard
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_out_2d = grad_out.reshape(-1, grad_out.size(-1))
        x_2d = x.reshape(-1, x.size(-1))
        ctx.shard.reduce_scatter_gradients([grad_out_2d.T @ x_2d, grad_out_2d.sum(0)])
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None
