"""ZeRO-2 (P_os+g): partition gradients too, 2Ψ + 14Ψ/N per rank (ZeRO §5.2).

Like ZeRO-1, but a full gradient never exists. Each parameter layer runs through an autograd Function
whose backward computes the layer's weight and bias gradients by hand, reduce-scatters them right there
(mean over ranks), keeps only this rank's shard, and returns `None` to autograd for the parameters, so
no `.grad` is ever filled. At most one layer's gradient is alive at a time, in a transient bucket.

On the wire it is ZeRO-1 exactly: a reduce-scatter of every gradient, an all-gather of every updated
parameter, 2Ψ per step. What changes is *when* the gradient is reduced, and so what stays resident.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from zero_core import memory
from zero_core.partition import unflatten
from zero_core.stages.base import Layer
from zero_core.stages.sharding import InFlightReduceScatter, LayerShard, swap_module
from zero_core.stages.zero1 import Zero1


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
        y, mean, rstd = torch.ops.aten.native_layer_norm(x, list(weight.shape), weight, bias, eps)
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


class FunctionLayer(nn.Module):
    """A parameter layer whose forward is a stage's autograd Function: `function(x, *params, shard, *extra)`."""

    def __init__(
        self, function: type[torch.autograd.Function], params: list[nn.Parameter], shard: LayerShard, *extra: object
    ) -> None:
        super().__init__()
        self.function = function
        self.params = nn.ParameterList(params)
        self.param_tuple = tuple(params)
        """The same parameters as a plain tuple: unpacking a ParameterList costs ~3 us a call, this ~0.1 us."""
        self.shard = shard
        self.extra = extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function.apply(x, *self.param_tuple, self.shard, *self.extra)


class Zero2(Zero1):
    stage = 2
    FUNCTIONS = {
        nn.Linear: ReduceScatterLinear,
        nn.Embedding: ReduceScatterEmbedding,
        nn.LayerNorm: ReduceScatterLayerNorm,
    }

    overlap_reduce_scatter = True
    """Let each layer's gradient reduce-scatter run on while backward goes on (see `InFlightReduceScatter`)."""

    def setup(self, model: nn.Module, initial: dict[str, torch.Tensor]) -> None:
        self.params: dict[str, torch.Tensor] = {}
        self.shards: dict[str, LayerShard] = {}
        self.in_flight = InFlightReduceScatter(self.tracker, overlap=self.overlap_reduce_scatter)
        for layer in self.layers:
            flat_param = self.new_buffer(initial[layer.name], memory.PARAM, layer)
            shard = LayerShard(layer, self.rank, self.tracker, self.dtype, self.in_flight)
            params = [nn.Parameter(view) for view in unflatten(flat_param, layer.shapes)]
            function = self.functions[layer.kind]
            swap_module(model, layer.name, FunctionLayer(function, params, shard, *layer.extra))
            self.params[layer.name], self.shards[layer.name] = flat_param, shard

    def sync_gradients(self) -> None:
        """Only the wait for the last layer's reduce-scatter: backward started every layer's."""
        self.in_flight.wait()

    def owned_gradients(self) -> list[torch.Tensor]:
        return [self.owned_grad(layer) for layer in self.layers]

    def owned_grad(self, layer: Layer) -> torch.Tensor:
        return self.shards[layer.name].grad[: layer.partition.owned_numel(self.rank)]

    def zero_gradients(self) -> None:
        torch._foreach_zero_([shard.grad for shard in self.shards.values()])
