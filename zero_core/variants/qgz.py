"""ZeRO++ qgZ (quantized gradients): ZeRO-3 whose gradient reduce-scatter is two int4 all-to-alls.

ZeRO++ (Wang et al., arXiv:2306.10209, §3.3) replaces the ring reduce-scatter of each layer's gradient,
which would have to quantize and dequantize at every one of its N-1 hops, by a hierarchical all-to-all that
quantizes twice, once per level, and always reduces in full precision. For N ranks in M nodes of G, a
layer's padded gradient bucket of N chunks of c elements, on rank (node m, local index l):
1. slice reordering: chunks are grouped by the local index of their owner, group j = chunks j, G+j, 2G+j...
   (the paper's "tensor slice reordering", which puts every chunk on its owner at the end);
2. each group quantized to int4 in blocks (one fp32 scale each) and sent to local peer j: an all-to-all
   inside the node, (G-1)/G of the bucket at half a byte an element;
3. dequantized and summed in fp32: rank l now holds its node's sum of the M chunks its replicas own;
4. requantized to int4, row m sent to the rank with local index l on node m: an all-to-all among the M
   ranks of one local index, (M-1)/M of the node's sum (M chunks), every byte of it across nodes;
5. dequantized, summed in fp32, divided by N once, cast to the training dtype: rank r's averaged chunk r.
DeepSpeed's `all_to_all_quant_reduce` (`zero_quantized_gradients`, runtime/comm/coalesced_collectives.py)
is this algorithm: `swizzle_quant` (reorder + int4), an all-to-all of codes and one of scales in the node,
`quantized_reduction` (dequantize, reduce, requantize), the same two across nodes, dequantize and average.

Bytes a rank sends per layer (chunk c): (G-1)·(ceil(M·c/2) + 4·ceil(M·c/B)) inside the node and
(M-1)·(ceil(c/2) + 4·ceil(c/B)) across (`zero_core.quantized_bytes.all_to_all_bytes`), against ZeRO-3's ring
(N-1)·2c: a quarter of the bytes, all but the last 1/G of them inside the node.

Not bit-identical: each quantization moves a value by up to half its block's scale, so rank r's chunk
differs from the exact mean by at most (Σ over the N senders of their block's scale/2 + Σ over the M nodes
of their block's scale/2) / N (`tests/test_zeropp.py` checks this bound, and the training tolerance).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn

from zero_core import dist, memory
from zero_core.quantize import dequantize, quantize
from zero_core.quantized_bytes import GRADIENT_BITS, QUANT_BLOCK_ELEMENTS
from zero_core.stages.base import TrainConfig
from zero_core.stages.sharding import InFlightReduceScatter
from zero_core.stages.zero3 import Zero3
from zero_core.variants.nodes import this_ranks_groups

NODE_TAG = "int4 in node"
ACROSS_TAG = "int4 across nodes"
SCALES_TAG = "scales"
"""Suffixes of the tags of a layer's all-to-alls: "grad <layer> int4 in node", "grad <layer> int4 in node scales"."""


class QuantizedReduceScatter(InFlightReduceScatter):
    """qgZ in place of a gradient reduce-scatter: the in-node all-to-all starts with `start`, the rest (reduce,
    requantize, the across-node all-to-all, reduce) runs in `wait`, as HSDP's second hop does."""

    def __init__(
        self,
        tracker: memory.MemoryTracker,
        node_group: dist.ProcessGroup,
        replica_group: dist.ProcessGroup,
        *,
        overlap: bool = True,
    ) -> None:
        super().__init__(tracker, overlap=overlap)
        self.node_group, self.replica_group = node_group, replica_group
        self.output: torch.Tensor | None = None
        self.received: tuple[torch.Tensor, ...] = ()
        self.works: list[dist.Work] = []
        self.tag = ""

    def exchange(
        self, rows: torch.Tensor, group: dist.ProcessGroup, tag: str, async_op: bool
    ) -> tuple[torch.Tensor, torch.Tensor, list[dist.Work]]:
        """Row j of `rows` (one per rank of `group`) quantized to int4 and sent to the group's rank j: the
        received (codes, scales) rows, one per sender, and the works to wait for."""
        codes, scales = quantize(rows, GRADIENT_BITS, QUANT_BLOCK_ELEMENTS)
        received = (torch.empty_like(codes), torch.empty_like(scales))
        for buffer in (codes, scales, *received):
            self.tracker.register(buffer, memory.GRAD_BUCKET, label=f"{tag} {buffer.dtype}")
        if group.size == 1:
            received[0].copy_(codes)
            received[1].copy_(scales)
            return (*received, [])
        works = [
            dist.all_to_all_single(out, sent, group=group, async_op=async_op, tag=name)
            for out, sent, name in ((received[0], codes, tag), (received[1], scales, f"{tag} {SCALES_TAG}"))
        ]
        return (*received, [w for w in works if w is not None])

    def start(self, output: torch.Tensor, bucket: torch.Tensor, tag: str) -> None:
        if self.output is not None:
            raise RuntimeError("a reduce-scatter is still in flight: wait() for it before starting the next")
        g, m, chunk = self.node_group.size, self.replica_group.size, output.numel()
        by_local_index = bucket.view(m, g, chunk).transpose(0, 1).reshape(g, m * chunk)
        codes, scales, self.works = self.exchange(by_local_index, self.node_group, f"{tag} {NODE_TAG}", True)
        self.tracker.release(bucket)  # quantized: the bucket is no longer read
        self.output, self.received, self.tag = output, (codes, scales), tag
        self.work = self.works[-1] if self.works else None
        if not self.overlap or not self.works:
            self.wait()

    @staticmethod
    def reduce(codes: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
        """The fp32 sum of the senders' rows of `numel` elements: each dequantized with its own scales first
        (int4 codes of different senders have different scales: their sum means nothing)."""
        return dequantize(codes, scales, GRADIENT_BITS, QUANT_BLOCK_ELEMENTS, numel).sum(0)

    def wait(self) -> None:
        """Finish the in-node all-to-all, reduce the node's sum, exchange it across nodes, reduce and average."""
        if self.output is None:
            return
        for work in self.works:
            work.wait()
        g, m = self.node_group.size, self.replica_group.size
        output, (codes, scales) = self.output, self.received
        chunk = output.numel()
        node_sum = self.reduce(codes, scales, m * chunk)
        codes, scales, _ = self.exchange(node_sum.view(m, chunk), self.replica_group, f"{self.tag} {ACROSS_TAG}", False)
        output.copy_(self.reduce(codes, scales, chunk).div_(g * m))
        self.output, self.received, self.works, self.work = None, (), [], None


def use_quantized_gradients(
    stage: Zero3,
    node_group: dist.ProcessGroup,
    replica_group: dist.ProcessGroup,
    reduce_scatter: type[QuantizedReduceScatter] = QuantizedReduceScatter,
) -> None:
    """Give every layer of a set-up ZeRO-3 stage qgZ's reduce-scatter (`reduce_scatter`) in place of its own."""
    stage.in_flight = reduce_scatter(stage.tracker, node_group, replica_group, overlap=stage.overlap_reduce_scatter)
    for shard in stage.shards.values():
        shard.in_flight = stage.in_flight


class QgzZero3(Zero3):
    """ZeRO-3 with ZeRO++'s hierarchical int4 all-to-all for gradients (qgZ, §3.3), nodes of `gpus_per_node`."""

    stage = "qgz"
    label = "ZeRO++ qgZ"
    partitioned = "+ parameters (int4 gradients)"
    configuration = "zero3+qgz"
    reduce_scatter_class = QuantizedReduceScatter
    """What averages each layer's gradient; a variant (or a wrong one, in the tests) swaps in a subclass."""

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
        use_quantized_gradients(self, self.node_group, self.replica_group, self.reduce_scatter_class)
