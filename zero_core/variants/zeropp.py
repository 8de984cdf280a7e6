"""ZeRO++: ZeRO-3 with hpZ, qwZ and qgZ together (arXiv:2306.10209, §3).

Per layer and step, on N ranks in nodes of G (M = N/G nodes):
- forward all-gathers the layer over all N ranks in int8 blocks with fp32 scales (qwZ, §3.1,
  `zero_core.variants.qwz`); each rank keeps its 1/G slice of the dequantized layer, the secondary shard, in
  the training dtype (hpZ, §3.2, `zero_core.variants.hpz`);
- backward all-gathers the layer from the secondary shards over the node's G ranks only, also in int8
  (DeepSpeed quantizes every gather when `zero_quantized_weights` is on, the secondary one included; its
  secondary tensor itself is kept in the parameters' dtype, as here), then drops the secondary shard;
- the gradient goes through qgZ's hierarchical int4 all-to-all (§3.3, `zero_core.variants.qgz`).

Across nodes this leaves the forward gather, at about half of ZeRO-3's bytes, and qgZ's second all-to-all,
a quarter of the bytes of 1/G of the gradient: the paper's 3M → 0.75M counts the forward gather 0.5M, the
backward gather 0 and the gradients 0.25M, taking a node's gradient traffic across to be the whole of it
in int4. Measured on the virtual cluster (`compare`), the cut is larger at small M because qgZ's across
step carries only (M-1)/M of 1/G of the gradient, where a ring reduce-scatter's boundary ranks carry
(N-1)/N of all of it (`zero_core.configurations.cost`'s inter-node bytes).

Memory is hpZ's: ZeRO-3's 16Ψ/N after a step, plus the secondary shards' 2Ψ/G between forward and backward.
Training is within qwZ's and qgZ's tolerances of ZeRO-0, not bit-identical (`tests/test_zeropp.py`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn

from zero_core.stages.base import TrainConfig
from zero_core.stages.zero3 import Zero3
from zero_core.variants.hpz import SecondaryShard
from zero_core.variants.nodes import this_ranks_groups
from zero_core.variants.qgz import QgzZero3, use_quantized_gradients
from zero_core.variants.qwz import QuantizedGatherShard, quantized_all_gather


class QuantizedSecondaryShard(SecondaryShard, QuantizedGatherShard):
    """hpZ's shard whose forward gather (over every rank) and backward gather (in the node) are both qwZ's."""

    def gather_parameters(self) -> list[torch.Tensor]:
        if self.secondary is None:
            return super().gather_parameters()  # hpZ's forward, through QuantizedGatherShard's gather
        self.allocate_gathered(self.node_gathered, self.node_gathered_bytes, self.node_partition.padding)
        quantized_all_gather(
            self.node_gathered,
            self.secondary,
            group=self.node_group,
            tracker=self.tracker,
            tag=f"{self.param_tag} node",
            label=self.name,
            padding=(self.node_partition.padding_of(self.node_rank), self.node_partition.padding),
        )
        self.from_node = True
        return self.node_gathered_views


class ZeroppZero3(Zero3):
    """ZeRO-3 + hpZ + qwZ + qgZ in nodes of `gpus_per_node` ranks.

    It derives from `Zero3`, as hpZ, qwZ and qgZ each do, and composes them: hpZ's and qwZ's shard
    (`QuantizedSecondaryShard`) and qgZ's reduce-scatter (`use_quantized_gradients`)."""

    stage = "zeropp"
    label = "ZeRO++"
    partitioned = "all, + node copy; int8, int4"
    configuration = "zeropp"
    shard_class = QuantizedSecondaryShard

    def __init__(
        self,
        config: TrainConfig,
        functions: dict[type[nn.Module], type[torch.autograd.Function]] | None = None,
        *,
        gpus_per_node: int | None = None,
    ) -> None:
        self.gpus_per_node, self.node_group, self.replica_group = this_ranks_groups(gpus_per_node)
        super().__init__(config, functions)

    def setup(self, model: nn.Module, initial: Mapping[str, torch.Tensor]) -> None:
        super().setup(model, initial)
        for shard in self.shards.values():
            shard.attach_node(self.node_group)
        use_quantized_gradients(self, self.node_group, self.replica_group, QgzZero3.reduce_scatter_class)
