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

The block size and the bytes those blocks take on the wire are `zero_core.quantized_bytes`'s, arithmetic that
the planner reads without loading torch.
"""

from __future__ import annotations

import torch

from zero_core.quantized_bytes import blocks_per_row, max_code


def quantize(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of `x` in blocks of `block` elements along its last dimension.

    codes: int8 for 8 bits, uint8 (two codes per byte) for 4 bits; scales: fp32, one per block.
    """
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
    n = codes.shape[-1]
    shifted = (codes + 8).to(torch.uint8)
    if n % 2:
        shifted = torch.cat([shifted, torch.full_like(shifted[..., :1], 8)], dim=-1)
    return (shifted[..., 0::2] | (shifted[..., 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The int8 codes of `pack_int4`'s bytes: `numel` per row."""
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack([low, high], dim=-1).flatten(-2)[..., :numel]


def error_bound(scales: torch.Tensor, block: int, numel: int) -> torch.Tensor:
    """Per element, the largest |x - x'| rounding can cause: half its block's scale (rows of `numel`)."""
    return (scales / 2).repeat_interleave(block, dim=-1)[..., :numel]
