"""Exercise ex04's answer: ZeRO-3's Linear and Embedding layers, whose parameters are all-gathered on
demand, in forward and again in backward, and released right after (ZeRO §5.3).

`Zero3` names `GatherLinear` and `GatherEmbedding` through `zero_core.registry` and imports them only when
it runs them. Where a student's ex04 is graded, the grading sandbox leaves this module out
(`autograder.walls`): the grader trains ZeRO-3 with the student's Functions in a process where this module
is never loaded, and cannot be.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from zero_core.stages.sharding import LayerShard


class GatherLinear(torch.autograd.Function):
    """y = x·Wᵀ + b with W and b gathered on demand, in forward and again in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, param_shard: torch.Tensor, shard: LayerShard) -> torch.Tensor:
        weight, bias = shard.gather_parameters()
        y = F.linear(x, weight, bias)
        shard.release_parameters()
        ctx.save_for_backward(x)
        ctx.shard = shard
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        weight, _ = ctx.shard.gather_parameters()
        grad_x = grad_out @ weight if ctx.needs_input_grad[0] else None
        ctx.shard.release_parameters()
        grad_out_2d = grad_out.reshape(-1, grad_out.size(-1))
        x_2d = x.reshape(-1, x.size(-1))
        ctx.shard.reduce_scatter_gradients([grad_out_2d.T @ x_2d, grad_out_2d.sum(0)])
        return grad_x, None, None


class GatherEmbedding(torch.autograd.Function):
    """y = W[ids] with W gathered on demand, in forward and again in backward.

    An embedding's gradient does not read W, yet backward gathers it again: the paper's 3Ψ counts a
    second gather of every parameter, as DeepSpeed's and FSDP's per-module backward hooks do. Skipping
    it would save (N-1)/N·|W| elements per embedding per step: a question in the ZeRO-3 lesson.
    """

    @staticmethod
    def forward(ctx, ids: torch.Tensor, param_shard: torch.Tensor, shard: LayerShard) -> torch.Tensor:
        (weight,) = shard.gather_parameters()
        y = F.embedding(ids, weight)
        shard.release_parameters()
        ctx.save_for_backward(ids)
        ctx.shard = shard
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (ids,) = ctx.saved_tensors
        (weight,) = ctx.shard.gather_parameters()
        grad_weight = torch.ops.aten.embedding_dense_backward(grad_out, ids, weight.size(0), -1, False)
        ctx.shard.release_parameters()
        ctx.shard.reduce_scatter_gradients([grad_weight])
        return None, None, None
