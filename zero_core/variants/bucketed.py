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

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from zero_core import registry, schedule
from zero_core.stages.sharding import LayerShard
from zero_core.stages.zero2 import Zero2


class BucketedLayerShard(LayerShard):
    """A layer's shard whose gradients go to the rank's buckets instead of a reduce-scatter of their own."""

    buckets: Any = None
    """The rank's `GradientBuckets` (set by the stage)."""
    handed: Any = None
    """What the buckets know this shard as (`BucketedZero2.handed_shard`)."""

    def reduce_scatter_gradients(self, grads: list[torch.Tensor]) -> None:
        schedule.mark(schedule.GRADIENTS_READY, self.name)
        self.buckets.add(self.handed, grads)


class BucketedZero2(Zero2):
    """ZeRO-2 whose gradients travel in buckets of at most `bucket_bytes` (padding counted)."""

    BUCKETS: type | registry.Answer = registry.answer("ex06", "GradientBuckets")
    bucket_bytes: int = 25 * 2**20
    """PyTorch DDP's default `bucket_cap_mb`: 25 MiB."""
    shard_class = BucketedLayerShard

    def setup(self, model: nn.Module, initial: Mapping[str, torch.Tensor]) -> None:
        super().setup(model, initial)
        backward_order = [self.shards[layer.name] for layer in reversed(self.layers)]
        for shard in backward_order:
            shard.handed = self.handed_shard(shard)
        self.buckets = registry.resolve(self.BUCKETS)([shard.handed for shard in backward_order], self.bucket_bytes)
        for shard in backward_order:
            shard.buckets = self.buckets

    def handed_shard(self, shard: LayerShard) -> Any:
        """The shard as the buckets see it: itself (the grader hands a student's class a guarded view)."""
        return shard

    def sync_gradients(self) -> None:
        """Complete the last bucket: backward started every other one."""
        self.buckets.finish()
