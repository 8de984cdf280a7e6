"""The bytes of ZeRO++'s quantized blocks on the wire: how many codes and scales a row, a gather, an all-to-all take.

`zero_core.quantize` turns tensors into int8 or int4 codes with one fp32 scale per block of B elements; this
module is its arithmetic alone (no torch), which the ZeRO++ stages, `zero_core.configurations` and the
planner read: an int8 element costs 1 + 4/B bytes with its scale's share, an int4 one 1/2 + 4/B.
"""

from __future__ import annotations

from zero_core.facts import fact

BITS = (8, 4)
WEIGHT_BITS = 8
"""qwZ all-gathers weights as int8 (ZeRO++ §3.1)."""
GRADIENT_BITS = 4
"""qgZ sends gradients as int4 (ZeRO++ §3.3)."""
SCALE_BYTES = 4
"""One fp32 scale per block."""
QUANT_BLOCK_ELEMENTS = int(fact("quantization_block_elements").value)
"""Elements per quantization block, each with one fp32 scale: the course's choice, also the block the ZeRO++
stages quantize with (`zero_core.variants.qwz`, `qgz`). ZeRO++ quantizes blockwise (§3.1) and DeepSpeed sizes
blocks per tensor: weights in groups of at most 8000 elements that divide the shard (its `CUDAQuantizer`:
"the optimal size is 4k"; 4096 for power-of-two shards), gradients one group per row of the 2-D gradient
(`all_to_all_quant_reduce`). The scales add 4/2048 bytes per element, about 0.2% (0.1% at 4096)."""
INT8_BYTES = 1 + SCALE_BYTES / QUANT_BLOCK_ELEMENTS
"""Bytes per element of an int8 block on the wire, its scale included: 1 + 4/B."""
INT4_BYTES = 0.5 + SCALE_BYTES / QUANT_BLOCK_ELEMENTS
"""Bytes per element of an int4 block on the wire, its scale included: 1/2 + 4/B."""


def max_code(bits: int) -> int:
    """q_max: the largest code magnitude, 2^(bits-1) - 1 (the symmetric range leaves -2^(bits-1) unused)."""
    if bits not in BITS:
        raise ValueError(f"quantization to {bits} bits is not supported; use one of {BITS}")
    return 2 ** (bits - 1) - 1


def blocks_per_row(numel: int, block: int) -> int:
    """ceil(n / B): how many scales a row of n elements carries."""
    if block < 1:
        raise ValueError(f"a quantization block needs at least one element, got {block}")
    return -(-numel // block)


def code_bytes_per_row(numel: int, bits: int) -> int:
    """Bytes of codes for a row of n elements: n for int8, ceil(n/2) for int4."""
    return numel if max_code(bits) == 127 else -(-numel // 2)


def quantized_row_bytes(numel: int, bits: int, block: int = QUANT_BLOCK_ELEMENTS) -> int:
    """Bytes a row of n elements takes on the wire: its codes and one fp32 scale per block, code + 4·ceil(n/B)."""
    return code_bytes_per_row(numel, bits) + SCALE_BYTES * blocks_per_row(numel, block)


def all_gather_bytes(chunk_numel: int, group_size: int, bits: int = WEIGHT_BITS) -> int:
    """Bytes a rank sends in one quantized ring all-gather of shards of c elements over k ranks (qwZ's):
    (k-1)·(c + 4·ceil(c/B)) in int8, against fp16's (k-1)·2c."""
    return (group_size - 1) * quantized_row_bytes(chunk_numel, bits)


def all_to_all_bytes(chunk_numel: int, world_size: int, gpus_per_node: int) -> tuple[int, int]:
    """(in-node, across-node) bytes a rank sends for one layer's gradient in qgZ's two int4 all-to-alls, shards
    of c elements, N ranks in M nodes of G: (G-1)·bytes(M·c) inside the node, (M-1)·bytes(c) across."""
    g, m, c = gpus_per_node, world_size // gpus_per_node, chunk_numel
    return (g - 1) * quantized_row_bytes(m * c, GRADIENT_BITS), (m - 1) * quantized_row_bytes(c, GRADIENT_BITS)
