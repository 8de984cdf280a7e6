"""ZeRO-3 (P_os+g+p): partition the parameters too, 16Ψ/N per rank (ZeRO §5.3).

Rank r keeps only its 1/N shard of every layer's fp16 parameters, gradients and fp32 states. A layer's
full parameters exist only while it runs: its autograd Function all-gathers them right before the
forward computation and releases them right after, saves only its input for backward (not the
gathered weights), and in backward gathers them again, computes the gradients, releases the
parameters and reduce-scatters the gradients as ZeRO-2 does. Peak gathered memory is one layer.

On the wire: an all-gather in forward, one in backward, a reduce-scatter: 3Ψ per step, 1.5x data
parallelism (ZeRO §7.2.2), in three times as many collectives as layers.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from zero_core import memory
from zero_core.stages.sharding import InFlightReduceScatter, LayerShard, swap_module
from zero_core.stages.zero2 import FunctionLayer, Zero2


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


class GatherLayerNorm(torch.autograd.Function):
    """LayerNorm with affine weights gathered on demand, in forward and again in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, param_shard: torch.Tensor, shard: LayerShard, eps: float) -> torch.Tensor:
        weight, bias = shard.gather_parameters()
        y, mean, rstd = torch.ops.aten.native_layer_norm(x, list(weight.shape), weight, bias, eps)
        shard.release_parameters()
        ctx.save_for_backward(x, mean, rstd)
        ctx.shard = shard
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, mean, rstd = ctx.saved_tensors
        weight, bias = ctx.shard.gather_parameters()
        grad_x, grad_weight, grad_bias = torch.ops.aten.native_layer_norm_backward(
            grad_out, x, list(weight.shape), mean, rstd, weight, bias, [ctx.needs_input_grad[0], True, True]
        )
        ctx.shard.release_parameters()
        ctx.shard.reduce_scatter_gradients([grad_weight, grad_bias])
        return grad_x, None, None, None


class Zero3(Zero2):
    stage = 3
    FUNCTIONS = {nn.Linear: GatherLinear, nn.Embedding: GatherEmbedding, nn.LayerNorm: GatherLayerNorm}

    def setup(self, model: nn.Module, initial: dict[str, torch.Tensor]) -> None:
        self.shards: dict[str, LayerShard] = {}
        self.in_flight = InFlightReduceScatter(self.tracker, overlap=self.overlap_reduce_scatter)
        for layer in self.layers:
            shard = LayerShard(layer, self.rank, self.tracker, self.dtype, self.in_flight)
            shard.param = nn.Parameter(layer.partition.shard(initial[layer.name], self.rank).to(self.dtype))
            self.tracker.register(
                shard.param, memory.PARAM, padding_elements=layer.partition.padding_of(self.rank), label=layer.name
            )
            function = self.functions[layer.kind]
            swap_module(
                model, layer.name, FunctionLayer(function, [shard.param], shard, *layer.extra)
            )
            self.shards[layer.name] = shard

    def owned_parameters(self) -> list[torch.Tensor]:
        return [self.shards[layer.name].param[: layer.partition.owned_numel(self.rank)] for layer in self.layers]

    def publish_parameters(self) -> None:
        """Nothing to publish: the next forward gathers each layer when it needs it."""
