"""ZeRO++ qwZ (quantized weights): ZeRO-3 whose parameter all-gathers carry int8 blocks and fp32 scales.

ZeRO++ (Wang et al., arXiv:2306.10209, §3.1) halves ZeRO-3's parameter traffic: before each all-gather a
rank quantizes its fp16 shard to int8 in blocks, each block with one fp32 scale (`zero_core.quantize`);
the codes and the scales are all-gathered, and every rank dequantizes the whole layer back to fp16 and
computes with that. DeepSpeed (`zero_quantized_weights`, `partition_parameters.py`) does the same with
two all-gathers per gather, one of int8 codes and one of fp32 scales (`quant_scale_buffer`), and
quantizes every gather, in forward and in backward: so does `QuantizedGatherShard`, tagged
"param <layer> int8" and "param <layer> scales" on the ledger.

Bytes a rank sends per gather of a layer whose shard has c elements, over a group of k ranks (ring):
(k-1)·(c + 4·ceil(c/B)) with B = `QUANT_BLOCK_ELEMENTS`, against ZeRO-3's (k-1)·2c: half, plus the
scales, 4/B bytes per element (0.2% at B = 2048; on the micro model every shard is one block, so the
scales cost more there, `zero_core.quantized_bytes.all_gather_bytes`). Resident memory is ZeRO-3's 16Ψ/N:
the int8 codes and scales live only while the layer is gathered, under `gather.fp16` like the layer.

Not bit-identical to ZeRO-0: every forward and backward computes with weights moved by up to half a
block's scale (max|w| of the block / 254). The gradients are ZeRO-3's reduce-scatter of those, the
optimizer updates the exact fp32 masters, so the error does not accumulate in the weights; it shows as a
small change in the losses and, through Adam's normalisation, in the updates (`tests/test_zeropp.py`
states the bound).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from zero_core import dist, memory
from zero_core.quantize import dequantize, quantize
from zero_core.quantized_bytes import QUANT_BLOCK_ELEMENTS, WEIGHT_BITS
from zero_core.stages.base import TrainConfig
from zero_core.stages.sharding import LayerShard
from zero_core.stages.zero3 import Zero3

CODES_TAG = "int8"
SCALES_TAG = "scales"
"""Suffixes of the tags of a quantized gather's two all-gathers: "param <layer> int8", "param <layer> scales"."""


def quantized_all_gather(
    output: torch.Tensor,
    shard: torch.Tensor,
    *,
    group: dist.ProcessGroup | None,
    tracker: memory.MemoryTracker,
    tag: str,
    label: str,
    padding: tuple[int, int] = (0, 0),
) -> None:
    """qwZ's all-gather: `output` (k shards long, any float dtype) becomes the dequantized int8 blocks of the
    k ranks' `shard`s, in group order. Two collectives: the int8 codes, then the fp32 scales (DeepSpeed's).
    `padding`: the zero elements of `shard` and of `output`, reported as padding in the int8 codes too."""
    k, numel = dist.get_world_size(group), shard.numel()
    codes, scales = quantize(shard.detach(), WEIGHT_BITS, QUANT_BLOCK_ELEMENTS)
    all_codes = torch.empty(k * numel, dtype=codes.dtype, device=codes.device)
    all_scales = torch.empty(k * scales.numel(), dtype=scales.dtype, device=scales.device)
    buffers = (codes, all_codes, scales, all_scales)
    for buffer, padding_elements in zip(buffers, (*padding, 0, 0), strict=True):
        tracker.register(buffer, memory.GATHER, padding_elements=padding_elements, label=f"{label} {buffer.dtype}")
    dist.all_gather_single(all_codes, codes, group=group, tag=f"{tag} {CODES_TAG}")
    dist.all_gather_single(all_scales, scales, group=group, tag=f"{tag} {SCALES_TAG}")
    values = dequantize(all_codes.view(k, numel), all_scales.view(k, -1), WEIGHT_BITS, QUANT_BLOCK_ELEMENTS, numel)
    output.view(k, numel).copy_(values)
    for buffer in buffers:
        tracker.release(buffer)


class QuantizedGatherShard(LayerShard):
    """A rank's ZeRO-3 shard of a layer whose gathers go through `quantized_all_gather`."""

    def gather_parameters(self) -> list[torch.Tensor]:
        self.allocate_gathered(self.gathered, self.gathered_bytes, self.partition.padding)
        quantized_all_gather(
            self.gathered,
            self.param,
            group=None,
            tracker=self.tracker,
            tag=self.param_tag,
            label=self.name,
            padding=(self.partition.padding_of(self.rank), self.partition.padding),
        )
        return self.gathered_views


class QwzZero3(Zero3):
    """ZeRO-3 with ZeRO++'s int8 weight all-gathers (qwZ, §3.1)."""

    stage = "qwz"
    label = "ZeRO++ qwZ"
    partitioned = "+ parameters (int8 gathers)"
    configuration = "zero3+qwz"
    shard_class = QuantizedGatherShard

    def __init__(
        self,
        config: TrainConfig,
        functions: dict[type[nn.Module], type[torch.autograd.Function]] | None = None,
        *,
        gpus_per_node: int | None = None,
    ) -> None:
        """`gpus_per_node` is accepted like the node stages' and unused: qwZ changes what, not where."""
        super().__init__(config, functions)
