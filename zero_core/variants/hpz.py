"""ZeRO++ hpZ (hierarchical partitioning): ZeRO-3 whose backward gathers stay inside the node.

ZeRO++ (Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant Model Training",
arXiv:2306.10209, §3.2) keeps ZeRO-3's *primary* partition, 1/N of every model state per rank, and adds
a *secondary* partition of the fp16 parameters inside each node of G ranks. Per layer and step:
- forward all-gathers the layer from the primary shards over all N ranks, as ZeRO-3 does, (N-1)/N·Ψ; from
  the gathered parameters each rank keeps its 1/G slice (its local index's chunk), the secondary shard;
- backward all-gathers the layer from the secondary shards over the node's G ranks only, (G-1)/G·Ψ, all of
  it intra-node, and then drops the secondary shard;
- the gradient is reduce-scattered over all N ranks into the primary partition, as in ZeRO-3.
So the inter-node traffic is that of two passes over all ranks instead of ZeRO-3's three: the paper's
"hpZ eliminates inter-node backward parameter all-gather communication" (the DeepSpeed ZeRO++ tutorial),
a 1.5x cut on its own; the paper's 4x is hpZ together with qwZ (int8 weights) and qgZ (int4 gradients).

The memory it trades (the abstract's "data remapping that trades-off communication for more memory"):
the secondary shards, 2Ψ/G bytes per rank when all layers' are alive, from the end of forward until
backward reaches each layer. They are transient, so the model states after a step are ZeRO-3's 16Ψ/N; the
peak adds 2Ψ/G (+ padding to a multiple of G), reported under `gather.fp16` with the gathered layer
(`zero_core.configurations.secondary_bytes`; `table` counts it resident, `FORMULA_NOTES`).

Every value is ZeRO-3's bit for bit: gathers copy, and the gradient path is ZeRO-3's reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn

from zero_core import dist, memory
from zero_core.partition import FlatPartition, unflatten
from zero_core.stages.base import TrainConfig
from zero_core.stages.sharding import LayerShard
from zero_core.stages.zero3 import Zero3
from zero_core.variants.nodes import this_ranks_groups


class SecondaryShard(LayerShard):
    """A rank's ZeRO-3 shard of a layer (1/N) plus, between forward and backward, its node's copy (1/G)."""

    node_group: dist.ProcessGroup

    def attach_node(self, node_group: dist.ProcessGroup) -> None:
        """Set up the secondary partition over `node_group` (the rank's node): its buffer and views."""
        self.node_group = node_group
        self.node_partition = FlatPartition(self.partition.numel, node_group.size)
        self.node_rank = dist.get_rank(node_group)
        self.secondary: torch.Tensor | None = None
        self.node_gathered = torch.empty(self.node_partition.padded_numel, dtype=self.dtype, device=self.grad.device)
        self.node_gathered_views = unflatten(self.node_gathered, self.shapes)
        self.node_gathered_bytes = self.node_gathered.untyped_storage().nbytes()
        self.node_gathered.untyped_storage().resize_(0)
        self.from_node = False

    def gather_parameters(self) -> list[torch.Tensor]:
        """Forward: ZeRO-3's gather over every rank, keeping the secondary shard. Backward: a gather in the node."""
        if self.secondary is None:
            views = super().gather_parameters()
            secondary = self.node_partition.shard(self.gathered[: self.partition.numel], self.node_rank)
            self.secondary = self.tracker.register(
                secondary,
                memory.GATHER,
                padding_elements=self.node_partition.padding_of(self.node_rank),
                label=f"{self.name} secondary",
            )
            return views
        self.allocate_gathered(self.node_gathered, self.node_gathered_bytes, self.node_partition.padding)
        dist.all_gather_single(self.node_gathered, self.secondary, group=self.node_group, tag=f"{self.param_tag} node")
        self.from_node = True
        return self.node_gathered_views

    def release_parameters(self) -> None:
        """After forward, as ZeRO-3; after backward's gather from the node, the secondary shard goes too."""
        if not self.from_node:
            super().release_parameters()
            return
        self.node_gathered.untyped_storage().resize_(0)
        self.tracker.release(self.node_gathered)
        self.tracker.release(self.secondary)
        self.secondary, self.from_node = None, False


class HpzZero3(Zero3):
    """ZeRO-3 with ZeRO++'s secondary parameter partition in each node of `gpus_per_node` ranks."""

    stage = "hpz"
    label = "ZeRO++ hpZ"
    partitioned = "all, + node copy of params"
    configuration = "zero3+hpz"
    shard_class = SecondaryShard

    def __init__(
        self,
        config: TrainConfig,
        functions: dict[type[nn.Module], type[torch.autograd.Function]] | None = None,
        *,
        gpus_per_node: int | None = None,
    ) -> None:
        self.gpus_per_node, self.node_group, _ = this_ranks_groups(gpus_per_node)
        super().__init__(config, functions)

    def setup(self, model: nn.Module, initial: Mapping[str, torch.Tensor]) -> None:
        super().setup(model, initial)
        for shard in self.shards.values():
            shard.attach_node(self.node_group)
