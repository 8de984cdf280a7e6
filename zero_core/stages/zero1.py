"""ZeRO-1 (P_os): partition the optimizer states, 4Ψ + 12Ψ/N per rank (ZeRO §5.1).

Parameters and gradients stay replicated (2Ψ + 2Ψ), but rank r keeps fp32 master, momentum and
variance only for its 1/N slice of each layer (12Ψ/N) and updates only that slice. Two collectives per
layer per step:

1. gradient sync: a reduce-scatter (mean) gives rank r the averaged gradient of exactly its slice,
   (N-1)/N·Ψ on the wire (the paper's accounting), or, as DeepSpeed runs ZeRO-1/2 by default
   (`use_multi_rank_bucket_allreduce`; DeepSpeed#5758, and #6463 for the per-partition reduces with it
   off), an all-reduce of the whole gradient, 2(N-1)/N·Ψ, of which each rank then reads its slice;
2. after the update, an all-gather of the fp16 parameters, (N-1)/N·Ψ.

So 2Ψ per step like data parallelism (3Ψ with the all-reduce variant), and less memory.
"""

from __future__ import annotations

from zero_core import dist
from zero_core.stages.base import ReplicatedStage, layer_tag


class Zero1(ReplicatedStage):
    stage = 1
    label = "ZeRO-1"
    partitioned = "optimizer states"
    configuration = "zero1"

    def sync_gradients(self) -> None:
        for layer in self.layers:
            flat_grad = self.grads[layer.name]
            if self.config.zero1_grad_sync == "all_reduce":
                dist.all_reduce(flat_grad, op=dist.ReduceOp.AVG, tag=layer_tag("grad", layer.name))
            else:
                dist.reduce_scatter_single(
                    self.chunk(flat_grad, layer), flat_grad, op=dist.ReduceOp.AVG, tag=layer_tag("grad", layer.name)
                )

    def publish_parameters(self) -> None:
        for layer in self.layers:
            flat_param = self.params[layer.name]
            dist.all_gather_single(flat_param, self.chunk(flat_param, layer), tag=layer_tag("param", layer.name))
