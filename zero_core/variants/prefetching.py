"""ZeRO-3 whose all-gathers run k layers ahead of the computation (ZeRO §5.3, "prefetch").

The same stage as `Zero3`, the same bytes on the wire (3Ψ), the same layer Functions: each layer's
Function still asks its shard for the full parameters right before it computes and releases them right
after. Here the shard hands both requests to the rank's `Prefetcher` (exercise ex07's answer, in
`zero_core/answers/ex07.py`, named through `zero_core.registry` and imported only when the stage runs),
which starts the all-gathers of the next `window` layers of the pass whenever a layer asks, so that by the
time a layer needs its parameters they are, ideally, already on their way. A layer's shard marks the
moment it needs them (`schedule.NEEDS_PARAMETERS`), so a run's schedule shows how far ahead each gather
started.

The prefetcher is told the layers in forward order and, at each request, whether backward asks: the
micro GPT's backward reaches its layers in exactly the reverse order. Activation checkpointing would
recompute forward inside backward, an order no fixed window follows, so this stage refuses it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn

from zero_core import registry, schedule
from zero_core.context import current
from zero_core.stages.base import TrainConfig
from zero_core.stages.sharding import LayerShard
from zero_core.stages.zero3 import Zero3


class PrefetchingLayerShard(LayerShard):
    """A layer's shard whose parameters are gathered by the rank's prefetcher, not by a collective of its own."""

    prefetcher: Any = None
    """The rank's `Prefetcher` (set by the stage)."""
    handed: Any = None
    """What the prefetcher knows this shard as (the shard itself, unless the stage was given a `hand`)."""

    def gather_parameters(self) -> list[torch.Tensor]:
        schedule.mark(schedule.NEEDS_PARAMETERS, self.name)
        return self.prefetcher.gather(self.handed, backward=current().phase == "backward")

    def release_parameters(self) -> None:
        self.prefetcher.release(self.handed)


class PrefetchingZero3(Zero3):
    """ZeRO-3 whose layers' parameters are all-gathered up to `window` layers before they are needed.

    `window` is k, how many layers ahead of the one computing the gathers run (0: on demand, as `Zero3`).
    `prefetcher` replaces the class of the rank's prefetcher (a student's `Prefetcher`; default: exercise
    ex07's answer), and `hand(shard)` says what it is given as each layer's shard (default: the shard).
    """

    PREFETCHER: type | registry.Answer = registry.answer("ex07", "Prefetcher")
    shard_class = PrefetchingLayerShard

    def __init__(
        self,
        config: TrainConfig,
        functions: dict[type[nn.Module], type[torch.autograd.Function]] | None = None,
        *,
        window: int = 1,
        prefetcher: type | None = None,
        hand: Callable[[LayerShard], Any] | None = None,
    ) -> None:
        if window < 0:
            raise ValueError(f"a prefetch window is a number of layers, 0 or more; got {window}")
        if config.model.activation_checkpointing:
            raise ValueError(
                "PrefetchingZero3 prefetches in forward order, then in reverse: activation checkpointing "
                "recomputes forward inside backward, an order no window follows. Train without it."
            )
        self.window = window
        self.prefetcher_class = prefetcher or registry.resolve(type(self).PREFETCHER)
        self.hand = hand or (lambda shard: shard)
        super().__init__(config, functions)

    def setup(self, model: nn.Module, initial: Mapping[str, torch.Tensor]) -> None:
        super().setup(model, initial)
        forward_order = [self.shards[layer.name] for layer in self.layers]
        for shard in forward_order:
            shard.handed = self.hand(shard)
        self.prefetcher = self.prefetcher_class([shard.handed for shard in forward_order], self.window)
        for shard in forward_order:
            shard.prefetcher = self.prefetcher
