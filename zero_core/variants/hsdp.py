"""Hybrid sharding (HSDP, MiCS): ZeRO-3 inside each node, plain data parallelism across nodes.

N ranks sit in M = N/G nodes of G consecutive ranks. Parameters, gradients and optimizer states are
sharded ZeRO-3 style over the G ranks of a node (the *shard group*), so a node holds one whole copy of
the model states and every rank 16Ψ/G of them (+ padding to a multiple of G); the M nodes are replicas of
each other. Per layer and step:
- forward and backward all-gather the layer's parameters inside the node: (G-1)/G·Ψ each, all intra-node;
- the gradient is reduce-scattered (mean) inside the node, (G-1)/G·Ψ intra-node, and the resulting 1/G
  shard all-reduced (mean) across the M ranks with the same local index (the *replica group*, one rank per
  node): 2(M-1)/M·Ψ/G per rank, every byte of it inter-node.
So the inter-node traffic per rank is 2(M-1)/M·Ψ/G a step, against ZeRO-3's flat ring, where the boundary
rank of each node sends all its 3(N-1)/N·Ψ across (mean over ranks 3(N-1)/N·Ψ/G). The price is memory:
16Ψ/G per rank instead of 16Ψ/N.

This is PyTorch FSDP2's HSDP, `fully_shard(module, mesh=init_device_mesh(..., (M, G)))`: with a 2-D mesh,
"parameters are sharded across the 1st dim and replicated across the 0th dim" (placements
`(Replicate(), Shard(0))`, the docstring of `torch.distributed.fsdp.fully_shard`, torch 2.13), gradients
reduce-scattered in the shard group and all-reduced across replicas. MiCS (Zhang et al., "MiCS: Near-linear
Scaling for Training Gigantic Model on Public Cloud", arXiv:2205.00119) partitions model states inside
"partition groups" and replicates across them, with the same two-hop gradient synchronisation, to keep
the parameter gathers off the slow links (its hierarchical all-gather and 2-hop gradient sync; DeepSpeed's
`mics_shard_size`).

Not bit-identical to ZeRO-0: the gradient is averaged in two hops, each rounding to the training dtype
(the node's mean of G, cast; then the mean of M such means, cast), where ZeRO-0 sums all N in fp32 and
rounds once. Gathering parameters is exact, so the first step's loss is bit-identical; weights agree to
within the dtype's rounding of the gradient (`tests/test_hsdp.py` states the bound).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn

from zero_core import dist, memory
from zero_core.stages.base import Layer, TrainConfig
from zero_core.stages.sharding import FunctionLayer, InFlightReduceScatter, LayerShard, swap_module
from zero_core.stages.zero3 import Zero3
from zero_core.variants.nodes import this_ranks_groups

REPLICA_TAG = "across replicas"
"""Suffix of the tag of a gradient shard's all-reduce across nodes: "grad <layer> across replicas"."""


class ShardGroupReduceScatter(InFlightReduceScatter):
    """A gradient reduce-scatter in the shard group, completed by an all-reduce of the shard across replicas."""

    def __init__(
        self,
        tracker: memory.MemoryTracker,
        shard_group: dist.ProcessGroup,
        replica_group: dist.ProcessGroup,
        *,
        overlap: bool = True,
    ) -> None:
        super().__init__(tracker, overlap=overlap)
        self.shard_group, self.replica_group = shard_group, replica_group
        self.output: torch.Tensor | None = None
        self.tag = ""

    def start(self, output: torch.Tensor, bucket: torch.Tensor, tag: str) -> None:
        if self.work is not None:
            raise RuntimeError("a reduce-scatter is still in flight: wait() for it before starting the next")
        self.output, self.tag, self.bucket = output, tag, bucket
        self.work = dist.reduce_scatter_single(
            output, bucket, op=dist.ReduceOp.AVG, group=self.shard_group, async_op=True, tag=tag
        )
        if not self.overlap:
            self.wait()

    def wait(self) -> None:
        """Complete the node's reduce-scatter, free its bucket, then average the shard over the replicas."""
        if self.work is None:
            return
        output, tag = self.output, self.tag
        super().wait()
        self.output = None
        if self.replica_group.size > 1:
            dist.all_reduce(output, op=dist.ReduceOp.AVG, group=self.replica_group, tag=f"{tag} {REPLICA_TAG}")


class NodeShard(LayerShard):
    """A rank's 1/G of a layer, its parameters gathered inside the node only."""

    shard_group: dist.ProcessGroup

    def gather_parameters(self) -> list[torch.Tensor]:
        self.allocate_gathered(self.gathered, self.gathered_bytes, self.partition.padding)
        dist.all_gather_single(self.gathered, self.param, group=self.shard_group, tag=self.param_tag)
        return self.gathered_views


class HybridZero3(Zero3):
    """ZeRO-3 over the G ranks of each node, replicated over the M nodes (HSDP / MiCS)."""

    stage = "hsdp"
    label = "HSDP"
    partitioned = "all, within a node"
    configuration = "hsdp"
    shard_class = NodeShard

    def __init__(
        self,
        config: TrainConfig,
        functions: dict[type[nn.Module], type[torch.autograd.Function]] | None = None,
        *,
        gpus_per_node: int | None = None,
    ) -> None:
        self.gpus_per_node, self.shard_group, self.replica_group = this_ranks_groups(gpus_per_node)
        self.shard_rank = dist.get_rank(self.shard_group)
        """This rank's index in its node: which 1/G of every layer it owns."""
        super().__init__(config, functions)

    def _build(self, config: TrainConfig, world_size: int) -> None:
        """Every layer partitioned over the node's G ranks, not over all N."""
        super()._build(config, self.gpus_per_node)

    def master_range(self, layer: Layer) -> tuple[int, int]:
        return layer.partition.owned_range(self.shard_rank)

    def setup(self, model: nn.Module, initial: Mapping[str, torch.Tensor]) -> None:
        self.shards: dict[str, LayerShard] = {}
        self.in_flight = ShardGroupReduceScatter(
            self.tracker, self.shard_group, self.replica_group, overlap=self.overlap_reduce_scatter
        )
        mine = self.shard_rank
        for layer in self.layers:
            shard = self.shard_class(layer, mine, self.tracker, self.dtype, self.in_flight, self.device)
            shard.shard_group = self.shard_group
            shard.param = nn.Parameter(layer.partition.shard(initial[layer.name], mine).to(self.device, self.dtype))
            padding = layer.partition.padding_of(mine)
            self.tracker.register(shard.param, memory.PARAM, padding_elements=padding, label=layer.name)
            function = self.functions[layer.kind]
            swap_module(model, layer.name, FunctionLayer(function, [shard.param], shard, *layer.extra))
            self.shards[layer.name] = shard
