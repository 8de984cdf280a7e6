"""ZeRO-3 whose parameter all-gathers run in two levels, across nodes on 1/G of a layer, then inside the node.

The same stage as `Zero3` (ZeRO §5.3): the same shards, the same layer Functions, the same bytes per rank,
(N-1)/N of each layer per gather, and the same values bit for bit (gathers copy). What changes is which
links the gathers take. N ranks sit in M = N/G nodes of G consecutive ranks (`zero_core.topology`); a flat
ring all-gather sends the whole (N-1)/N·Ψ of a layer across nodes from one rank per node. A hierarchical
all-gather first gathers across nodes among the M ranks with the same local index, on 1/G of the layer,
then inside the node: every rank sends (M-1)/M·Ψ/G across, and the busiest rank's inter-node bytes fall
by (N-1)/(M-1) per gather (`topology.pass_split`). The gradient reduce-scatter stays ZeRO-3's flat ring.

This is the gather of MiCS (Zhang et al., arXiv:2205.00119, its hierarchical communication; DeepSpeed's
`mics_hierarchical_params_gather`) and the inter-node half of ZeRO++'s hpZ question (arXiv:2306.10209 §3.2):
hpZ removes the backward gather's inter-node bytes with a second copy of the weights; this removes part of
every gather's, with no extra copy, only a staging buffer of Ψ_layer/G while it runs.

The two-level gather is exercise ex09's answer (`zero_core/answers/ex09.py`), named through
`zero_core.registry` and imported only when the stage runs it. Each shard measures, from the rank's memory
audit, what a gather allocates beyond the gathered layer and what outlives it (`GatherCall`), for runs that
ask (`GATHER_CALLS`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
import torch.nn as nn

from zero_core import dist, registry
from zero_core.context import current
from zero_core.stages.base import TrainConfig
from zero_core.stages.sharding import LayerShard
from zero_core.stages.zero3 import Zero3
from zero_core.variants.nodes import this_ranks_groups

GATHER_CALLS = "hierarchical gather calls"
"""The key, in `RankContext.extra`, of a list the shards append a `GatherCall` to per gather, when present."""


class GatherCall(NamedTuple):
    """One gather of a layer as the rank's memory audit saw it, from the moment the gathered buffer existed.

    `transient_bytes`: the most the rank held beyond that moment while the gather ran (its staging);
    `left_bytes`: what the rank held beyond it once the gather returned (0 when every buffer was freed).
    """

    layer: str
    step: int
    phase: str
    transient_bytes: int
    left_bytes: int


class HierarchicalShard(LayerShard):
    """A layer's shard whose parameters are gathered by the stage's two-level all-gather."""

    all_gather: Callable[..., Any]
    node_group: dist.ProcessGroup
    cross_group: dist.ProcessGroup

    def gather_parameters(self) -> list[torch.Tensor]:
        self.allocate_gathered(self.gathered, self.gathered_bytes, self.partition.padding)
        calls = current().extra.get(GATHER_CALLS)
        before, first_event = self.tracker.current_bytes(), len(self.tracker.timeline)
        self.all_gather(self.gathered, self.param, self.node_group, self.cross_group)
        if calls is not None:
            events = self.tracker.timeline[first_event:]
            peak = max((event.total_bytes for event in events), default=before)
            ctx = current()
            calls.append(
                GatherCall(self.name, ctx.step, ctx.phase, peak - before, self.tracker.current_bytes() - before)
            )
        return self.gathered_views


class HierarchicalZero3(Zero3):
    """ZeRO-3 whose layers' parameters are all-gathered across nodes on 1/G, then inside each node of G."""

    shard_class = HierarchicalShard
    ALL_GATHER: Callable[..., Any] | registry.Answer = registry.answer("ex09", "hierarchical_all_gather")
    """all_gather(output, shard, node_group, cross_group): exercise ex09's answer, named here."""

    def __init__(
        self,
        config: TrainConfig,
        functions: dict[type[nn.Module], type[torch.autograd.Function]] | None = None,
        *,
        gpus_per_node: int | None = None,
        all_gather: Callable[..., Any] | None = None,
    ) -> None:
        """`all_gather` replaces exercise ex09's answer (a student's two-level gather)."""
        self.gpus_per_node, self.node_group, self.cross_group = this_ranks_groups(gpus_per_node)
        self.all_gather = all_gather or registry.resolve(type(self).ALL_GATHER)
        super().__init__(config, functions)

    def setup(self, model: nn.Module, initial: Mapping[str, torch.Tensor]) -> None:
        super().setup(model, initial)
        for shard in self.shards.values():
            shard.all_gather, shard.node_group, shard.cross_group = self.all_gather, self.node_group, self.cross_group
