"""Activation bytes one GPU holds during a step, by activation-checkpointing mode.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (arXiv:2205.05198,
§4.1, Table 2), count what one transformer layer keeps from its forward for its backward, in bytes, for a
micro-batch of b sequences of s tokens, hidden size h, a attention heads, FFN width f, 16-bit activations:

    none       s·b·h·(18 + 4·f/h) + 5·a·s²·b      = s·b·h·(34 + 5·a·s/h) at f = 4h
    selective  s·b·h·(18 + 4·f/h)                 (attention's scores are recomputed in backward)
    full       2·s·b·h                            (only the layer's input; the layer reruns in backward)

18 + 4·f/h is Megatron-LM's form of the paper's 34 (`theoretical_memory_usage.py`, which cites Table 2): 11
for attention, 4 for the two norms' inputs, 3 for the MLP's input and dropout mask, and 4·f/h for the f-wide
GeLU input and second linear input; 5·a·s² is the softmax's input and output (2 bytes each) and its dropout
mask (1 byte) per score. Every coefficient is an entry of `zero_core/data/facts.toml`.

What the formula approximates. It is the GPT-3 block (multi-head attention, a GeLU MLP, dropout), applied here
to every model with that model's h, a, f. A Llama block differs: its SwiGLU MLP keeps three f-wide tensors
(gate, up and their product: 6·f/h, where GeLU keeps two: 4·f/h; at Llama's f ≈ 8h/3 the two MLPs' totals,
16.0 and 16.2 bytes per s·b·h, nearly agree, so the formula's 4·f/h undercounts Llama by about 2·f/h),
grouped-query attention keeps smaller keys and values (less), and Llama trains without dropout (no masks: 2·s·b·h
and a·s²·b less per layer). A kernel that never stores the scores (FlashAttention) removes the 5·a·s²·b term
altogether: read "none" and "selective" as the paper's unfused attention.

Beyond the stored layers, a step holds at its peak what the layer being recomputed needs (selective: one
layer's scores; full: one whole layer without recomputation), and the output layer's input and fp32 logits
for the loss, 4·s·b·(h + V) bytes (Megatron-LM, the same file). Per GPU, with data parallelism alone: each
GPU runs its own micro-batch, nothing of it is partitioned (ZeRO-R's partitioned activation checkpoints
need model parallelism, ZeRO §6.1).

Part of the planner (`zero_core.planner`): it reads only the facts file.
"""

from __future__ import annotations

from dataclasses import dataclass

from zero_core.facts import fact

CHECKPOINTING = ("none", "selective", "full")
DEFAULT_CHECKPOINTING = "full"
"""What `plan` and `table` assume without `--checkpointing`: full recomputation, as the PyTorch FSDP blog's
34B and 70B runs the time model is validated against (lesson 9, §6)."""
BYTES_PER_SBH = fact("megatron_activation_bytes_per_sbh").value
BYTES_PER_SBF = fact("megatron_activation_bytes_per_sbf").value
SCORE_BYTES = fact("korthikanti_attention_score_bytes").value
OUTPUT_BYTES = fact("megatron_output_layer_activation_bytes").value
INPUT_BYTES = 2
"""A layer's input under full recomputation: one 16-bit s·b·h tensor (the course trains in bf16)."""
DEFAULT_HEAD_DIM = int(fact("planner_default_head_dim").value)


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes of activations one GPU holds at the peak of a step (the start of backward), in three parts."""

    checkpointing: str
    stored: float
    """What every layer keeps from forward to backward: all layers' activations, or their inputs."""
    recomputing: float
    """What the one layer being recomputed in backward holds on top (0 without recomputation)."""
    output: float
    """The output layer's input and the fp32 logits the loss reads."""

    @property
    def total(self) -> float:
        return self.stored + self.recomputing + self.output


def layer_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, ffn: int) -> tuple[float, float]:
    """(the layer's activations but attention's scores, the scores) in bytes: s·b·h·(18 + 4·f/h) and 5·a·s²·b."""
    sbh = seq_len * micro_batch * hidden
    return sbh * (BYTES_PER_SBH + BYTES_PER_SBF * ffn / hidden), SCORE_BYTES * heads * seq_len**2 * micro_batch


def activation_bytes(
    layers: int,
    hidden: int,
    heads: int,
    ffn: int,
    vocabulary: int,
    seq_len: int,
    micro_batch: int,
    checkpointing: str = DEFAULT_CHECKPOINTING,
) -> ActivationBytes:
    """The activations of one micro-batch on one GPU (see the module docstring for each mode's formula)."""
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing must be one of {', '.join(CHECKPOINTING)}, got {checkpointing!r}")
    if min(layers, hidden, heads, ffn, vocabulary, seq_len, micro_batch) < 1:
        raise ValueError("layers, hidden, heads, ffn, vocabulary, sequence and micro-batch must each be at least 1")
    rest, scores = layer_bytes(seq_len, micro_batch, hidden, heads, ffn)
    if checkpointing == "none":
        stored, recomputing = layers * (rest + scores), 0.0
    elif checkpointing == "selective":
        stored, recomputing = layers * rest, scores
    else:
        stored, recomputing = layers * INPUT_BYTES * seq_len * micro_batch * hidden, rest + scores
    output = OUTPUT_BYTES * seq_len * micro_batch * (hidden + vocabulary)
    return ActivationBytes(checkpointing, stored, recomputing, output)


def recomputed_forward_flops(checkpointing: str, block_forward_flops: float, hidden: int, seq_len: int,
                             tokens: int) -> float:
    """Forward FLOPs one block reruns in backward: none, attention's scores (QKᵀ and the weighted sum of V:
    4·h·s per token, the attention term of `time_model.transformer_layers`), or the whole block's forward."""
    if checkpointing == "none":
        return 0.0
    if checkpointing == "selective":
        return 4 * hidden * seq_len * tokens
    return block_forward_flops
