"""ZeRO-2 with its gradients reduced in buckets of at most `bucket_bytes` while backward goes on (ZeRO §5.2).

The same stage as `Zero2`, the same bytes on the wire, in fewer and larger collectives: each layer's
Function hands its gradients to the rank's `GradientBuckets` (exercise ex06's answer, in
`zero_core/answers/ex06.py`, named through `zero_core.registry` and imported only when the stage runs),
which groups layers into buckets and reduce-scatters each bucket when it is full, letting it run on while
backward computes the next layers. A layer's shard marks the moment
its gradients exist (`schedule.GRADIENTS_READY`), so a run's schedule shows which reduce-scatters were in
flight while backward computed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn as nn

from zero_core import registry, schedule
from zero_core.stages.base import TrainConfig
from zero_core.stages.sharding import LayerShard
from zero_core.stages.zero2 import Zero2


class BucketedLayerShard(LayerShard):
    """A layer's shard whose gradients go to the rank's buckets instead of a reduce-scatter of their own."""

    buckets: Any = None
    """The rank's `GradientBuckets` (set by the stage)."""
    handed: Any = None
    """What the buckets know this shard as (the shard itself, unless the stage was given a `hand`)."""

    def reduce_scatter_gradients(self, grads: list[torch.Tensor]) -> None:
        schedule.mark(schedule.GRADIENTS_READY, self.name)
        self.buckets.add(self.handed, grads)


BUCKET_BYTES = 25 * 2**20
"""PyTorch DDP's default `bucket_cap_mb`: 25 MiB."""


class BucketedZero2(Zero2):
    """ZeRO-2 whose gradients travel in buckets of at most `bucket_bytes` (padding counted).

    `buckets` replaces the class of the rank's buckets (a student's `GradientBuckets`; default: exercise
    ex06's answer), and `hand(shard)` says what it is given as each layer's shard (default: the shard).
    """

    BUCKETS: type | registry.Answer = registry.answer("ex06", "GradientBuckets")
    shard_class = BucketedLayerShard

    def __init__(
        self,
        config: TrainConfig,
        functions: dict[type[nn.Module], type[torch.autograd.Function]] | None = None,
        *,
        bucket_bytes: int = BUCKET_BYTES,
        buckets: type | None = None,
        hand: Callable[[LayerShard], Any] | None = None,
    ) -> None:
        self.bucket_bytes = bucket_bytes
        self.buckets_class = buckets or registry.resolve(type(self).BUCKETS)
        self.hand = hand or (lambda shard: shard)
        super().__init__(config, functions)

    def setup(self, model: nn.Module, initial: Mapping[str, torch.Tensor]) -> None:
        super().setup(model, initial)
        backward_order = [self.shards[layer.name] for layer in reversed(self.layers)]
        for shard in backward_order:
            shard.handed = self.hand(shard)
        self.buckets = self.buckets_class([shard.handed for shard in backward_order], self.bucket_bytes)
        for shard in backward_order:
            shard.buckets = self.buckets

    def sync_gradients(self) -> None:
        """Complete the last bucket: backward started every other one."""
        self.buckets.finish()
