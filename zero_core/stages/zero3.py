"""ZeRO-3 (P_os+g+p): partition the parameters too, 16Ψ/N per rank (ZeRO §5.3).

Rank r keeps only its 1/N shard of every layer's fp16 parameters, gradients and fp32 states. A layer's
full parameters exist only while it runs: its autograd Function all-gathers them right before the
forward computation and releases them right after, saves only its input for backward (not the
gathered weights), and in backward gathers them again, computes the gradients, releases the
parameters and reduce-scatters the gradients as ZeRO-2 does. Peak gathered memory is one layer.

The Linear and Embedding Functions, `GatherLinear` and `GatherEmbedding`, are exercise ex04's answer:
they live in `zero_core/answers/ex04.py`, named through `zero_core.registry` and imported only when a stage
runs them, so the grader can train ZeRO-3 without them.

On the wire: an all-gather in forward, one in backward, a reduce-scatter: 3Ψ per step, 1.5x data
parallelism (ZeRO §7.2.2), in three times as many collectives as layers.

`Zero3` derives from `ZeroStage`, not from `Zero2`: the few lines it shares with ZeRO-2 (the in-flight
reduce-scatter, the gradient shards) are written out here, so the stage reads top to bottom.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn

from zero_core import memory, registry
from zero_core.stages.base import ZeroStage
from zero_core.stages.sharding import FunctionLayer, InFlightReduceScatter, LayerShard, swap_module


class GatherLayerNorm(torch.autograd.Function):
    """LayerNorm with affine weights gathered on demand, in forward and again in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, param_shard: torch.Tensor, shard: LayerShard, eps: float) -> torch.Tensor:
        weight, bias = shard.gather_parameters()
        y, mean, rstd = torch.native_layer_norm(x, list(weight.shape), weight, bias, eps)
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


class Zero3(ZeroStage):
    stage = 3
    label = "ZeRO-3"
    partitioned = "+ parameters"
    configuration = "zero3"
    FUNCTIONS = {
        nn.Linear: registry.answer("ex04", "GatherLinear"),
        nn.Embedding: registry.answer("ex04", "GatherEmbedding"),
        nn.LayerNorm: GatherLayerNorm,
    }

    overlap_reduce_scatter = True
    """Let each layer's gradient reduce-scatter run on while backward goes on (see `InFlightReduceScatter`)."""
    shard_class: type[LayerShard] = LayerShard
    """What holds a rank's part of each layer; a variant stage (prefetching, hpZ, ...) swaps in a subclass."""

    def setup(self, model: nn.Module, initial: Mapping[str, torch.Tensor]) -> None:
        self.shards: dict[str, LayerShard] = {}
        self.in_flight = InFlightReduceScatter(self.tracker, overlap=self.overlap_reduce_scatter)
        for layer in self.layers:
            shard = self.shard_class(layer, self.rank, self.tracker, self.dtype, self.in_flight, self.device)
            shard.param = nn.Parameter(
                layer.partition.shard(initial[layer.name], self.rank).to(self.device, self.dtype)
            )
            self.tracker.register(
                shard.param, memory.PARAM, padding_elements=layer.partition.padding_of(self.rank), label=layer.name
            )
            function = self.functions[layer.kind]
            swap_module(model, layer.name, FunctionLayer(function, [shard.param], shard, *layer.extra))
            self.shards[layer.name] = shard

    def sync_gradients(self) -> None:
        """Only the wait for the last layer's reduce-scatter: backward started every layer's."""
        self.in_flight.wait()

    def owned_gradients(self) -> list[torch.Tensor]:
        return [shard.owned_grad() for shard in self.shards.values()]

    def owned_parameters(self) -> list[torch.Tensor]:
        return [shard.owned_param() for shard in self.shards.values()]

    def publish_parameters(self) -> None:
        """Nothing to publish: the next forward gathers each layer when it needs it."""

    def zero_gradients(self) -> None:
        torch._foreach_zero_([shard.grad for shard in self.shards.values()])
