"""Exercise ex07's answer: ZeRO-3's parameter prefetch, a layer's all-gather started k layers before the
layer needs it (ZeRO §5.3).

`PrefetchingZero3` (`zero_core.variants.prefetching`) names `Prefetcher` through `zero_core.registry` and
imports it only when it runs it. Where a student's ex07 is graded, the grading sandbox leaves this module
out (`autograder.walls`): the grader trains the prefetching stage with the student's class in a process
where this module is never loaded, and cannot be.

Gathering on demand (exercise 4) makes every layer wait for its own all-gather: the rank is idle for a
collective's latency twice per layer and step. A window of k layers hides it: when a layer asks for its
parameters, the all-gathers of the next k layers of the pass (forward order in forward, the reverse in
backward) start too, with `async_op=True`, and a layer's own gather is waited for only when that layer
asks. While layer i computes, the gathers of layers i+1 ... i+k are on the wire. The price is memory: up
to k+1 layers' full parameters alive at once instead of one (DeepSpeed's `stage3_prefetch_bucket_size`,
FSDP's `forward_prefetch` and `backward_prefetch`, a window of one layer).
"""

from __future__ import annotations

import torch

from zero_core import dist, memory
from zero_core.partition import unflatten


class Prefetcher:
    """One rank's gathers for its layers: each layer's parameters gathered up to `window` layers ahead."""

    def __init__(self, shards: list, window: int) -> None:
        """`shards`: this rank's shard of every parameter layer, in forward order; `window`: k >= 0."""
        self.forward_order = list(shards)
        self.backward_order = self.forward_order[::-1]
        self.window = window
        self.in_flight: dict[str, tuple[dist.Work, torch.Tensor]] = {}
        """Per layer whose gather has started and is not released yet: its Work and its flat buffer."""

    def gather(self, shard, backward: bool) -> list[torch.Tensor]:
        """The layer's full weight (and bias), once its gather completes; the next k layers' gathers started."""
        order = self.backward_order if backward else self.forward_order
        position = order.index(shard)
        for layer in order[position : position + self.window + 1]:
            if layer.name not in self.in_flight:
                self.in_flight[layer.name] = self._start(layer)
        work, flat = self.in_flight[shard.name]
        work.wait()
        return unflatten(flat, shard.shapes)

    def release(self, shard) -> None:
        """The layer is done with its parameters: forget the buffer, so its memory goes."""
        _, flat = self.in_flight.pop(shard.name)
        shard.tracker.release(flat)

    def _start(self, shard) -> tuple[dist.Work, torch.Tensor]:
        flat = torch.empty(shard.partition.padded_numel, dtype=shard.param.dtype, device=shard.param.device)
        shard.tracker.register(flat, memory.GATHER, padding_elements=shard.partition.padding, label=shard.name)
        work = dist.all_gather_single(flat, shard.param, async_op=True, tag=f"param {shard.name}")
        return work, flat
