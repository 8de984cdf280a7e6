"""ZeRO-0: plain data parallelism, the 16Ψ baseline (ZeRO §3.1, §5).

Every rank holds everything: fp16 parameters (2Ψ) and gradients (2Ψ), fp32 master weights, Adam
momentum and variance (12Ψ). After backward each layer's gradient is all-reduced (mean), 2Ψ on the
wire per step, and every rank runs the same full Adam step: N identical copies of all model states.

The layers are the model's own `nn.Linear`/`nn.Embedding`/`nn.LayerNorm`, trained by plain autograd:
their parameters are views into one flat fp16 buffer per layer, and their `.grad`s are views into one
flat fp16 gradient buffer per layer, so autograd accumulates straight into the buffer we all-reduce.
"""

from __future__ import annotations

import torch

from zero_core import dist
from zero_core.optim import has_overflow
from zero_core.stages.base import ReplicatedStage, layer_tag


class Zero0(ReplicatedStage):
    stage = 0
    label = "ZeRO-0"
    partitioned = "nothing"
    configuration = "zero0"
    partitions_optimizer_states = False
    pads_buffers = False

    def sync_gradients(self) -> None:
        for layer in self.layers:
            dist.all_reduce(self.grads[layer.name], op=dist.ReduceOp.AVG, tag=layer_tag("grad", layer.name))

    def owned_gradients(self) -> list[torch.Tensor]:
        return [self.grads[layer.name] for layer in self.layers]

    def found_overflow(self, grad: torch.Tensor) -> bool:
        """Every rank holds the whole averaged gradient, so each decides alone, and all decide alike."""
        return has_overflow(grad)

    def owned_parameters(self) -> list[torch.Tensor]:
        return [self.params[layer.name] for layer in self.layers]
