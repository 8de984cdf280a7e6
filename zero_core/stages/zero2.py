"""ZeRO-2 (P_os+g): partition gradients too, 2Ψ + 14Ψ/N per rank (ZeRO §5.2).

Like ZeRO-1, but a full gradient never exists. Each parameter layer runs through an autograd Function
whose backward computes the layer's weight and bias gradients by hand, reduce-scatters them right there
(mean over ranks), keeps only this rank's shard, and returns `None` to autograd for the parameters, so
no `.grad` is ever filled. At most one layer's gradient is alive at a time, in a transient bucket.

The Linear layers' Function, `ReduceScatterLinear`, is exercise ex03's answer: it lives in
`zero_core/answers/ex03.py`, named through `zero_core.registry` and imported only when a stage runs it,
so the grader can train ZeRO-2 without it.

On the wire it is ZeRO-1 exactly: a reduce-scatter of every gradient, an all-gather of every updated
parameter, 2Ψ per step. What changes is *when* the gradient is reduced, and so what stays resident.

`Zero2` derives from `ZeroStage` itself, not from `Zero1`: it keeps its parameters as ZeRO-1 does and
publishes them with ZeRO-1's all-gather, and writes both out here rather than inherit them, so that the
stage reads top to bottom and every stage sits one class below the scaffolding.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from zero_core import dist, memory, registry
from zero_core.partition import unflatten
from zero_core.stages.base import ZeroStage, layer_tag
from zero_core.stages.sharding import FunctionLayer, InFlightReduceScatter, LayerShard, swap_module


class ReduceScatterEmbedding(torch.autograd.Function):
    """y = W[ids], whose backward reduce-scatters dW (rows summed per id) instead of returning it."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, shard: LayerShard) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.num_embeddings = weight.size(0)
        ctx.shard = shard
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (ids,) = ctx.saved_tensors
        grad_weight = torch.ops.aten.embedding_dense_backward(grad_out, ids, ctx.num_embeddings, -1, False)
        ctx.shard.reduce_scatter_gradients([grad_weight])
        return None, None, None


class ReduceScatterLayerNorm(torch.autograd.Function):
    """LayerNorm with affine weights, whose backward reduce-scatters dW and db instead of returning them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, shard: LayerShard, eps: float):
        y, mean, rstd = torch.native_layer_norm(x, list(weight.shape), weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.shard = shard
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        grad_x, grad_weight, grad_bias = torch.ops.aten.native_layer_norm_backward(
            grad_out, x, list(weight.shape), mean, rstd, weight, bias, [ctx.needs_input_grad[0], True, True]
        )
        ctx.shard.reduce_scatter_gradients([grad_weight, grad_bias])
        return grad_x, None, None, None, None


class Zero2(ZeroStage):
    stage = 2
    label = "ZeRO-2"
    partitioned = "+ gradients"
    configuration = "zero2"
    FUNCTIONS = {
        nn.Linear: registry.answer("ex03", "ReduceScatterLinear"),
        nn.Embedding: ReduceScatterEmbedding,
        nn.LayerNorm: ReduceScatterLayerNorm,
    }

    overlap_reduce_scatter = True
    """Let each layer's gradient reduce-scatter run on while backward goes on (see `InFlightReduceScatter`)."""
    shard_class: type[LayerShard] = LayerShard
    """What holds a rank's part of each layer; a variant stage (bucketed, prefetching) swaps in a subclass."""

    def setup(self, model: nn.Module, initial: Mapping[str, torch.Tensor]) -> None:
        self.params: dict[str, torch.Tensor] = {}
        self.shards: dict[str, LayerShard] = {}
        self.in_flight = InFlightReduceScatter(self.tracker, overlap=self.overlap_reduce_scatter)
        for layer in self.layers:
            flat_param = self.new_buffer(initial[layer.name], memory.PARAM, layer)
            shard = self.shard_class(layer, self.rank, self.tracker, self.dtype, self.in_flight, self.device)
            params = [nn.Parameter(view) for view in unflatten(flat_param, layer.shapes)]
            function = self.functions[layer.kind]
            swap_module(model, layer.name, FunctionLayer(function, params, shard, *layer.extra))
            self.params[layer.name], self.shards[layer.name] = flat_param, shard

    def sync_gradients(self) -> None:
        """Only the wait for the last layer's reduce-scatter: backward started every layer's."""
        self.in_flight.wait()

    def owned_gradients(self) -> list[torch.Tensor]:
        return [shard.owned_grad() for shard in self.shards.values()]

    def owned_parameters(self) -> list[torch.Tensor]:
        return [self.owned_slice(self.params[layer.name], layer) for layer in self.layers]

    def publish_parameters(self) -> None:
        """ZeRO-1's all-gather: every rank's updated chunk of each layer's parameters to every rank."""
        for layer in self.layers:
            flat_param = self.params[layer.name]
            dist.all_gather_single(flat_param, self.chunk(flat_param, layer), tag=layer_tag("param", layer.name))

    def zero_gradients(self) -> None:
        torch._foreach_zero_([shard.grad for shard in self.shards.values()])
