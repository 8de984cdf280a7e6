"""Symmetric blockwise quantization to int8 or int4: what ZeRO++ puts on the wire instead of fp16.

ZeRO++ (Wang et al., arXiv:2306.10209) sends weights as int8 (qwZ, §3.1) and gradients as int4 (qgZ, §3.3),
each with one fp32 scale per block of consecutive elements: a block's scale follows its own largest value,
so one outlier costs precision in its block only, not in the whole tensor (the paper's "block-based
quantization"). For a block x of B elements and b bits, with q_max = 2^(b-1) - 1 (127 for int8, 7 for int4):

    scale = max|x| / q_max        codes = round(x / scale), in -q_max..q_max        x' = codes · scale

so every element comes back within scale/2 of where it was (`error_bound`), and a block of zeros stays
zeros exactly (its scale is 0). int4 codes travel two to a byte: code + 8 (1..15) in the low nibble for
even positions, the high nibble for odd ones.

Blocks run along the last dimension of the input, and a row's last block may be shorter: a rank's shard or
a slice bound for one peer is quantized on its own, so the receiver can dequantize each sender's piece with
that sender's scales. `codes` has the input's leading shape and `ceil(n·b/8)` bytes per row of n elements;
`scales` one fp32 per block. This is what DeepSpeed's `CUDAQuantizer` (weights, `zero_quantized_weights`)
and `all_to_all_quant_reduce` (gradients, `zero_quantized_gradients`) produce, symmetric mode.

The bytes those blocks take on the wire live here too (`INT8_BYTES`, `INT4_BYTES`, `quantized_row_bytes` and
the collectives' counts built on it), read by the ZeRO++ stages and by `zero_core.configurations`. The
functions that move tensors import torch when called, so the planner reads these counts without loading it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zero_core.facts import fact

if TYPE_CHECKING:
    import torch

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


def quantize(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of `x` in blocks of `block` elements along its last dimension.

    codes: int8 for 8 bits, uint8 (two codes per byte) for 4 bits; scales: fp32, one per block.
    """
    import torch

    q_max = max_code(bits)
    rows, n = x.shape[:-1], x.shape[-1]
    blocks, width = blocks_per_row(n, block), min(block, n)
    padded = torch.zeros(*rows, blocks * width, dtype=torch.float32, device=x.device)
    padded[..., :n] = x
    grouped = padded.view(*rows, blocks, width)
    scales = grouped.abs().amax(dim=-1) / q_max
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(-1)
    codes = grouped.div_(divisor).round_().clamp_(-q_max, q_max).view(*rows, blocks * width)[..., :n]
    if bits == 8:
        return codes.to(torch.int8).contiguous(), scales
    return pack_int4(codes), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int, block: int, numel: int) -> torch.Tensor:
    """fp32 values of `codes` (rows of `numel` elements) and their per-block `scales`: codes · scale."""
    import torch

    max_code(bits)
    values = codes.to(torch.float32) if bits == 8 else unpack_int4(codes, numel).to(torch.float32)
    rows = values.shape[:-1]
    blocks, width = blocks_per_row(numel, block), min(block, numel)
    if blocks * width == numel:
        return values.reshape(*rows, blocks, width).mul_(scales.unsqueeze(-1)).view(*rows, numel)
    padded = torch.zeros(*rows, blocks * width, dtype=torch.float32, device=codes.device)
    padded[..., :numel] = values
    return padded.view(*rows, blocks, width).mul_(scales.unsqueeze(-1)).view(*rows, blocks * width)[..., :numel]


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes in -7..7 (integers, of any dtype), two per uint8 along the last dimension: even ones low, odd high."""
    import torch

    n = codes.shape[-1]
    shifted = (codes + 8).to(torch.uint8)
    if n % 2:
        shifted = torch.cat([shifted, torch.full_like(shifted[..., :1], 8)], dim=-1)
    return (shifted[..., 0::2] | (shifted[..., 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The int8 codes of `pack_int4`'s bytes: `numel` per row."""
    import torch

    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=-1).flatten(-2)[..., :numel]


def error_bound(scales: torch.Tensor, block: int, numel: int) -> torch.Tensor:
    """Per element, the largest |x - x'| rounding can cause: half its block's scale (rows of `numel`)."""
    return (scales / 2).repeat_interleave(block, dim=-1)[..., :numel]
