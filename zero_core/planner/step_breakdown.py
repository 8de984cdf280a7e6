"""Whole time per step: compute with recomputation, exposed communication and PCIe, MFU, and what bounds the step.

`configuration_time.predict` schedules a step; this module says what that step is made of:

- recomputation: activation checkpointing reruns forward FLOPs in backward (`activations.recomputed_forward_flops`:
  selective, attention's scores, 4·h·s per token and block; full, the whole block's forward), so `with_recompute`
  adds them to each block's backward before the schedule is timed;
- model FLOPs: what the model needs without recomputation, forward and backward, 3 × forward = 6·Ψ' per token
  (Ψ' = the parameters that multiply: all but the embedding lookup) plus attention's 12·L·h·s (PaLM, App. B);
- MFU = model FLOPs / (step time × peak FLOP/s): exposed communication, PCIe waits and recomputation all lower it
  below the machine's achieved fraction;
- the step's parts: compute (forward and backward, recomputation included), the optimizer step, the time the
  compute stream waited while a collective ran (exposed communication) and while only PCIe did (exposed PCIe);
  the largest of them bounds the step;
- ties (`time_model_error`): two predicted times closer than the time model's measured error cannot be told
  apart. The error is per model size, from the validation of lesson 9 §6(b) against the PyTorch FSDP blog's
  published throughputs (Llama 2 34B and 70B, A100 and H100; 7B is the calibration), recomputed here from the
  facts file: for a model of Ψ, the worst |error| over both machines at the validated size nearest Ψ.

Part of the planner (`zero_core.planner`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cache

from zero_core.facts import fact
from zero_core.planner.activations import recomputed_forward_flops
from zero_core.planner.time_model import (
    A100_400G,
    H100_800G,
    Layer,
    Machine,
    StepPrediction,
    llama_block_params,
    predict_step,
    transformer_layers,
)

VALIDATED_SIZES = ("34b", "70b")


def with_recompute(layers: list[Layer], checkpointing: str, hidden: int, seq_len: int, tokens: int) -> list[Layer]:
    """The blocks' backward FLOPs plus what `checkpointing` reruns; the embedding and head are never recomputed."""
    out = []
    for layer in layers:
        if layer.name.startswith("block"):
            extra = recomputed_forward_flops(checkpointing, layer.forward_flops, hidden, seq_len, tokens)
            layer = replace(layer, backward_flops=layer.backward_flops + extra)
        out.append(layer)
    return out


def model_flops(layers: list[Layer]) -> float:
    """FLOPs the model needs per step without recomputation: forward and backward, 3 × each layer's forward."""
    return sum(3 * layer.forward_flops for layer in layers)


@dataclass(frozen=True)
class StepBreakdown:
    """One predicted step in parts (seconds), with MFU and what bounds it."""

    step_s: float
    compute_s: float
    recompute_s: float
    optimizer_s: float
    exposed_comm_s: float
    exposed_pcie_s: float
    model_flops: float
    mfu: float
    tokens_per_s_per_gpu: float

    @property
    def bound(self) -> str:
        """The largest part of the step: compute, exposed communication, PCIe or the optimizer step."""
        parts = {"compute": self.compute_s, "exposed communication": self.exposed_comm_s,
                 "PCIe": self.exposed_pcie_s, "optimizer": self.optimizer_s}
        return max(parts, key=parts.get)

    def to_dict(self) -> dict[str, float | str]:
        return {"step_s": self.step_s, "compute_s": self.compute_s, "recompute_s": self.recompute_s,
                "optimizer_s": self.optimizer_s, "exposed_comm_s": self.exposed_comm_s,
                "exposed_pcie_s": self.exposed_pcie_s, "model_flops": self.model_flops, "mfu": self.mfu,
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "bound": self.bound}


def exposed_by_stream(prediction: StepPrediction) -> dict[str, float]:
    """Seconds in which the compute stream was idle, split by what ran meanwhile: a collective ("comm", first), else
    a PCIe copy ("pcie"). Found by sweeping the step's interval boundaries."""
    spans = [iv for iv in prediction.intervals if iv.end_s > iv.start_s]
    busy = {stream: [(iv.start_s, iv.end_s) for iv in spans if iv.stream == stream]
            for stream in ("compute", "comm", "pcie")}
    edges = sorted({0.0, prediction.step_s, *(t for spans in busy.values() for span in spans for t in span)})
    exposed = {"comm": 0.0, "pcie": 0.0}
    for start, end in zip(edges, edges[1:], strict=False):
        middle = (start + end) / 2

        def active(stream: str, at: float = middle) -> bool:
            return any(a <= at < b for a, b in busy[stream])

        if active("compute"):
            continue
        for stream in ("comm", "pcie"):
            if active(stream):
                exposed[stream] += end - start
                break
    return exposed


def breakdown(
    prediction: StepPrediction, layers: list[Layer], recompute_flops: float, machine: Machine, tokens: int
) -> StepBreakdown:
    """`prediction` (timed on `layers` with recomputation added) in parts; `recompute_flops` is what recomputation
    added. MFU counts the model's own FLOPs (`model_flops`: forward is the same with or without recomputation)."""
    flops = model_flops(layers)
    exposed = exposed_by_stream(prediction)
    compute_s = prediction.compute_s - prediction.optimizer_s
    return StepBreakdown(
        step_s=prediction.step_s,
        compute_s=compute_s,
        recompute_s=recompute_flops / machine.flops_per_s,
        optimizer_s=prediction.optimizer_s,
        exposed_comm_s=exposed["comm"],
        exposed_pcie_s=exposed["pcie"],
        model_flops=flops,
        mfu=flops / (prediction.step_s * machine.peak_tflops * 1e12),
        tokens_per_s_per_gpu=tokens / prediction.step_s,
    )


@dataclass(frozen=True)
class ValidationRow:
    size: str
    machine: str
    psi: float
    published_tokens_per_s: float
    predicted_tokens_per_s: float

    @property
    def error(self) -> float:
        """(predicted - published) / published."""
        return (self.predicted_tokens_per_s - self.published_tokens_per_s) / self.published_tokens_per_s


@cache
def validation() -> tuple[ValidationRow, ...]:
    """Lesson 9 §6(b): the time model's ZeRO-3 step against the PyTorch FSDP blog's tokens/s/GPU (Llama 2 34B and
    70B, full activation checkpointing, 2 sequences of 4096 tokens per GPU, 128 A100 and 96 H100)."""
    hidden, heads, kv_heads = (int(fact(f"llama2_34b_70b_{k}").value) for k in ("hidden", "heads", "kv_heads"))
    seq_len = int(fact("fsdp_seq_length").value)
    tokens = int(fact("fsdp_batch_size").value) * seq_len
    vocab = int(fact("llama2_vocabulary").value)
    rows = []
    for size in VALIDATED_SIZES:
        n_layers, ffn = int(fact(f"llama2_{size}_layers").value), int(fact(f"llama2_{size}_ffn").value)
        block = llama_block_params(hidden, ffn, heads, kv_heads)
        layers = transformer_layers(n_layers, block, hidden, seq_len, vocab, tokens, recompute=True)
        psi = n_layers * block + 2 * vocab * hidden
        for gpu, machine in (("a100", A100_400G), ("h100", H100_800G)):
            n = int(fact(f"fsdp_{gpu}_cluster_gpus").value)
            predicted = tokens / predict_step(3, layers, machine, n).step_s
            published = fact(f"fsdp_{size}_tokens_per_gpu_{gpu}").value
            rows.append(ValidationRow(size.upper(), gpu.upper(), psi, published, predicted))
    return tuple(rows)


def time_model_error(psi: float) -> tuple[float, str]:
    """(relative error, which validation it is): the worst |error| over machines at the validated size nearest Ψ
    (in log Ψ)."""
    rows = validation()
    nearest = min(rows, key=lambda r: abs(math.log(r.psi / psi)))
    worst = max(abs(r.error) for r in rows if r.size == nearest.size)
    return worst, f"Llama 2 {nearest.size} against the PyTorch FSDP blog (lesson 9 §6(b))"


def tie_groups(step_times: list[float], error: float) -> list[int]:
    """A rank per time (sorted fastest first): a time within `error` of its group's fastest shares its rank."""
    ranks, rank, fastest = [], 0, None
    for position, seconds in enumerate(step_times, start=1):
        if fastest is None or seconds > fastest * (1 + error):
            rank, fastest = position, seconds
        ranks.append(rank)
    return ranks
