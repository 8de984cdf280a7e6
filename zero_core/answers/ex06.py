"""Exercise ex06's answer: ZeRO-2's gradients reduced in buckets of at most B bytes while backward goes on
(ZeRO §5.2, §7.1).

`BucketedZero2` (`zero_core.variants.bucketed`) names `GradientBuckets` through `zero_core.registry` and
imports it only when it runs it. Where a student's ex06 is graded, the grading sandbox leaves this module
out (`autograder.walls`): the grader trains the bucketed stage with the student's class in a process where
this module is never loaded, and cannot be.

One reduce-scatter per layer is many small collectives, each paying a latency; one for the whole model
would keep every gradient alive at once and start only when backward ends. Buckets sit between: layers
are grouped, in the order backward reaches them, into the fewest buckets of at most `bucket_bytes`, and
each bucket is reduce-scattered as soon as its last layer's gradients are in, while backward computes the
next layers (DeepSpeed's `reduce_bucket_size` with `overlap_comm`; PyTorch DDP's `bucket_cap_mb`).

Every rank keeps 1/N of every layer, so a bucket cannot simply be the layers' gradients end to end: a
reduce-scatter hands rank r the r-th N-th of its input. The bucket is laid out rank-major instead, row r
holding each of the bucket's layers' r-th chunk, and the reduce-scatter leaves rank r's row, in place, as
the averaged shards of all those layers.
"""

from __future__ import annotations

import torch

from zero_core import dist, memory


def plan_buckets(shards: list, bucket_bytes: int) -> list[list]:
    """The shards, in the order given, grouped into the fewest consecutive buckets of at most `bucket_bytes`
    (each layer counted padded, as it is sent). Filling each bucket before starting the next is optimal."""
    buckets: list[list] = []
    filled = 0
    for shard in shards:
        nbytes = shard.partition.padded_numel * shard.grad.element_size()
        if nbytes > bucket_bytes:
            raise ValueError(f"{shard.name}'s gradient takes {nbytes:,} bytes, more than a bucket of {bucket_bytes:,}")
        if buckets and filled + nbytes <= bucket_bytes:
            buckets[-1].append(shard)
            filled += nbytes
        else:
            buckets.append([shard])
            filled = nbytes
    return buckets


class GradientBuckets:
    """One rank's gradient buckets: filled layer by layer in backward, each reduce-scattered when full.

    At most one bucket exists at a time: the bucket in flight is completed, its shards copied out and its
    memory freed, right before the next bucket is made, so backward's computation of that next layer ran
    while the reduce-scatter was in flight.
    """

    def __init__(self, shards: list, bucket_bytes: int) -> None:
        """`shards`: every layer's shard, in the order backward reaches the layers."""
        self.buckets = plan_buckets(shards, bucket_bytes)
        self.bucket_of = {shard.name: i for i, bucket in enumerate(self.buckets) for shard in bucket}
        self.filling: torch.Tensor | None = None
        self.in_flight: tuple[dist.Work, torch.Tensor, int] | None = None
        """(the reduce-scatter, its bucket, the bucket's index) while one is in flight."""

    def add(self, shard, grads: list[torch.Tensor]) -> None:
        """Put a layer's local gradients (weight, bias) into its bucket; start the bucket when it is full."""
        index = self.bucket_of[shard.name]
        bucket = self.buckets[index]
        world_size = shard.partition.world_size
        if shard is bucket[0]:
            self.wait()
            self.filling = torch.empty(world_size * self.row_numel(bucket), dtype=shard.grad.dtype)
            padding = sum(s.partition.padding for s in bucket)
            shard.tracker.register(self.filling, memory.GRAD_BUCKET, padding_elements=padding, label=f"bucket {index}")
        rows = self.filling.view(world_size, -1)
        start = self.offset(bucket, shard)
        rows[:, start : start + shard.partition.chunk_numel].copy_(shard.partition.pack(grads).view(world_size, -1))
        if shard is bucket[-1]:
            mine = rows[shard.rank]
            work = dist.reduce_scatter_single(
                mine, self.filling, op=dist.ReduceOp.AVG, async_op=True, tag=f"grad bucket {index}"
            )
            self.in_flight, self.filling = (work, self.filling, index), None

    def finish(self) -> None:
        """After backward: complete the last bucket. Every shard then holds its averaged gradient."""
        self.wait()

    def wait(self) -> None:
        """Complete the bucket in flight, copy each of its layers' shard out of its row, free it."""
        if self.in_flight is None:
            return
        work, flat, index = self.in_flight
        work.wait()
        bucket = self.buckets[index]
        mine = flat.view(bucket[0].partition.world_size, -1)[bucket[0].rank]
        for shard in bucket:
            start = self.offset(bucket, shard)
            shard.grad.copy_(mine[start : start + shard.partition.chunk_numel])
        bucket[0].tracker.release(flat)
        self.in_flight = None

    @staticmethod
    def row_numel(bucket: list) -> int:
        """Elements of one rank's row of the bucket: one chunk of each of its layers."""
        return sum(shard.partition.chunk_numel for shard in bucket)

    @staticmethod
    def offset(bucket: list, shard) -> int:
        """Where `shard`'s chunk starts within a row of `bucket`."""
        start = 0
        for other in bucket:
            if other is shard:
                return start
            start += other.partition.chunk_numel
        raise ValueError(f"{shard.name} is not in this bucket")
