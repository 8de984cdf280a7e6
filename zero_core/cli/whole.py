"""Whole memory and whole time per GPU for `plan --nodes` and `table --configs`: every term, and honest ties.

`--micro-batch`, `--checkpointing` and `--allowance` set what the configurations table adds to model states:
activations (`zero_core.planner.activations`), the stage's buffers and the allowance
(`zero_core.planner.gpu_memory`); a configuration fits when the total does. Its step is timed with the
recomputation its checkpointing costs and split into compute, recomputation, exposed communication, exposed PCIe
and the optimizer step, with MFU and tokens/s/GPU (`zero_core.planner.step_breakdown`). Ranked options whose
times differ by less than the time model's measured error share a rank, and each says what it changes.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from zero_core import configurations
from zero_core.cli.errors import UsageError
from zero_core.cli.render import table
from zero_core.planner import gpu_memory, step_breakdown
from zero_core.planner.activations import (
    CHECKPOINTING,
    DEFAULT_CHECKPOINTING,
    DEFAULT_HEAD_DIM,
    ActivationBytes,
    activation_bytes,
)
from zero_core.planner.models import custom_shape
from zero_core.planner.time_model import Layer, Machine, StepPrediction
from zero_core.units import GiB, format_seconds, parse_bytes

DEFAULT_MICRO_BATCH = 1
DEFAULT_ALLOWANCE = f"{gpu_memory.DEFAULT_ALLOWANCE_BYTES // GiB}GiB"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--micro-batch", type=int, default=DEFAULT_MICRO_BATCH,
        help=f"sequences per micro-step on each GPU, for activations (default {DEFAULT_MICRO_BATCH}); "
        "--tokens-per-gpu must be a multiple of micro-batch × sequence",
    )
    p.add_argument(
        "--checkpointing", choices=CHECKPOINTING, default=DEFAULT_CHECKPOINTING,
        help=f"activation checkpointing: what is stored and what is recomputed (default {DEFAULT_CHECKPOINTING})",
    )
    p.add_argument(
        "--allowance", default=DEFAULT_ALLOWANCE,
        help="room kept free per GPU for the CUDA context, workspaces and fragmentation (default "
        f"{gpu_memory.DEFAULT_ALLOWANCE_BYTES // GiB}GiB, an assumption)",
    )


@dataclass(frozen=True)
class Setup:
    """What the whole-memory and whole-time terms need beyond Ψ: the shape, micro-batch and checkpointing."""

    layers: int
    hidden: int
    heads: int
    heads_assumed: bool
    ffn: int
    vocabulary: int
    seq_len: int
    micro_batch: int
    micro_steps: int
    checkpointing: str
    allowance_bytes: int
    persistent_elements: int

    def activations(self, checkpointing: str | None = None) -> ActivationBytes:
        return activation_bytes(self.layers, self.hidden, self.heads, self.ffn, self.vocabulary, self.seq_len,
                                self.micro_batch, checkpointing or self.checkpointing)

    def to_dict(self) -> dict[str, Any]:
        return {"checkpointing": self.checkpointing, "micro_batch": self.micro_batch, "sequence": self.seq_len,
                "micro_steps": self.micro_steps, "heads": self.heads, "heads_assumed": self.heads_assumed,
                "ffn": self.ffn, "allowance_bytes": self.allowance_bytes,
                "persistent_elements": self.persistent_elements}


def setup(
    planned: Any,
    tokens: int,
    micro_batch: int = DEFAULT_MICRO_BATCH,
    checkpointing: str = DEFAULT_CHECKPOINTING,
    allowance: str = DEFAULT_ALLOWANCE,
) -> Setup:
    """The terms' inputs from the model and the values of `--tokens-per-gpu`, `--micro-batch`, `--checkpointing`
    and `--allowance`; inconsistent input is a UsageError."""
    if tokens < 1:
        raise UsageError(f"--tokens-per-gpu must be at least 1, got {tokens}")
    if micro_batch < 1:
        raise UsageError(f"--micro-batch must be at least 1, got {micro_batch}")
    if checkpointing not in CHECKPOINTING:
        raise UsageError(f"--checkpointing: {checkpointing!r} is none of {', '.join(CHECKPOINTING)}")
    try:
        allowance_bytes = parse_bytes(allowance)
    except ValueError as error:
        raise UsageError(f"argument --allowance: {error}") from None
    seq_len = min(planned.sequence, tokens)
    per_micro_step = micro_batch * seq_len
    if tokens % per_micro_step:
        raise UsageError(f"--tokens-per-gpu {tokens:,} is not a multiple of --micro-batch {micro_batch} × "
                         f"sequence {seq_len:,} = {per_micro_step:,}: change one of them")
    shape = planned.shape or custom_shape(planned.layers, planned.hidden, planned.vocabulary, planned.sequence)
    heads = shape.heads or max(1, round(planned.hidden / DEFAULT_HEAD_DIM))
    return Setup(planned.layers, planned.hidden, heads, shape.heads is None, shape.ffn, planned.vocabulary, seq_len,
                 micro_batch, tokens // per_micro_step, checkpointing, allowance_bytes,
                 gpu_memory.small_tensor_elements(shape))


def timed_layers(layers: list[Layer], s: Setup, tokens: int) -> list[Layer]:
    """The schedule with what checkpointing recomputes added to each block's backward."""
    return step_breakdown.with_recompute(layers, s.checkpointing, s.hidden, s.seq_len, tokens)


CHANGES = {
    0: "replicates all 16Ψ; all-reduces the fp16 gradients",
    1: "partitions the Adam states; gradients and weights stay whole on every GPU",
    2: "partitions Adam states and gradients, reduce-scattered during backward",
    3: "partitions the weights too: every layer is gathered in forward and again in backward (3Ψ sent)",
}


def changes(config: configurations.Configuration) -> str:
    """What a configuration changes, in one line: its stage, then each addition."""
    parts = [CHANGES[config.stage]]
    if config.offload:
        parts.append("fp32 states and Adam on the host: needs host memory (14Ψ/N per GPU) and moves 2Ψ/N each "
                     "way over PCIe")
    if config.hpz:
        parts.append("hpZ: a second fp16 copy of the weights per node (2Ψ/G), so backward gathers stay inside it")
    if config.qwz:
        parts.append("qwZ: quantises weights to int8 for the forward gather")
    if config.qgz:
        parts.append("qgZ: quantises gradients to int4 in an all-to-all")
    if config.hsdp:
        parts.append("HSDP: shards within a group of S GPUs, replicates across groups and all-reduces the "
                     "gradient shards between them")
    return "; ".join(parts)


def terms(
    config: configurations.Configuration,
    model_state_bytes: float,
    psi: int,
    n_gpus: int,
    gpu_memory_bytes: int,
    s: Setup,
    layers: list[Layer],
    prediction: StepPrediction | None,
    machine: Machine | None,
    tokens: int,
) -> dict[str, Any]:
    """The row's whole memory (each term, the total, the totals at every checkpointing mode) and, on a machine,
    its step in parts. `layers` is the schedule without recomputation."""
    largest = max(layer.params for layer in layers)

    def memory(mode: str) -> gpu_memory.GpuMemory:
        return gpu_memory.gpu_memory(config.stage, model_state_bytes, s.activations(mode), psi, largest,
                                     s.persistent_elements, n_gpus, s.allowance_bytes)

    chosen = memory(s.checkpointing)
    activations = s.activations()
    row: dict[str, Any] = {
        "memory": {**chosen.to_dict(), "activations_stored": activations.stored,
                   "activations_recomputing": activations.recomputing, "activations_output": activations.output},
        "total_gpu_bytes": chosen.total,
        "total_by_checkpointing": {mode: memory(mode).total for mode in CHECKPOINTING},
        "largest_layer_params": largest,
        "model_states_fit": model_state_bytes <= gpu_memory_bytes,
        "changes": changes(config),
    }
    if prediction is not None and machine is not None:
        recompute = sum(t.backward_flops for t in timed_layers(layers, s, tokens)) - sum(
            t.backward_flops for t in layers)
        row["step"] = step_breakdown.breakdown(prediction, layers, recompute, machine, tokens).to_dict()
    return row


def rank(fitting: list[dict[str, Any]], psi: int) -> tuple[float, str]:
    """Give each fitting row (sorted fastest first) its rank: times within the time model's error tie."""
    error, basis = step_breakdown.time_model_error(psi)
    timed = [r for r in fitting if r["step_s"] is not None]
    for r, position in zip(timed, step_breakdown.tie_groups([r["step_s"] for r in timed], error), strict=True):
        r["rank"] = position
    return error, basis


def render(found: list[dict[str, Any]], s: Setup, gpu_memory_bytes: int, tokens: int, width: int | None,
           numbered: bool = False, unit: str = "GiB") -> str:
    """The memory terms table (in `unit`, GB or GiB) and, when timed, the step table."""
    scale = GiB if unit == "GiB" else 1e9

    def _gib(n_bytes: float) -> str:
        return f"{n_bytes / scale:.2f}"

    mode = s.checkpointing
    title = (
        f"Memory per GPU at the step's peak, {unit}: {mode} checkpointing, micro-batch {s.micro_batch} × "
        f"{s.seq_len:,} tokens ({s.micro_steps} micro-step{'s' * (s.micro_steps > 1)} per step); fits "
        f"{gpu_memory_bytes / scale:g} {unit} on the total"
    )
    key = ["#"] * numbered
    memory_rows = []
    for r in found:
        m = r["memory"]
        totals = r["total_by_checkpointing"]
        memory_rows.append([str(r.get("rank", "-"))] * numbered + [
            r["label"], _gib(m["model_states"]), _gib(m["activations"]), _gib(m["gradient_bucket"]),
            _gib(m["gathered_parameters"]), _gib(m["persistent_parameters"]), _gib(m["allowance"]),
            _gib(m["total"]), "yes" if r["fits"] else "no",
            " / ".join(_gib(totals[c]) for c in CHECKPOINTING),
        ])
    headers = key + ["configuration", "states", "activations", "bucket", "gathered", "persistent", "allowance",
                     "total", "fits", "total: none / selective / full"]
    parts = [table(headers, memory_rows, title=title, width=width, keys=1 + numbered)]
    timed = [r for r in found if r.get("step")]
    if timed:
        step_rows = []
        for r in timed:
            t = r["step"]
            step_rows.append([str(r.get("rank", "-"))] * numbered + [
                r["label"], format_seconds(t["compute_s"]), format_seconds(t["recompute_s"]),
                format_seconds(t["exposed_comm_s"]), format_seconds(t["exposed_pcie_s"]),
                format_seconds(t["optimizer_s"]), format_seconds(t["step_s"]), f"{t['mfu']:.1%}",
                f"{t['tokens_per_s_per_gpu']:,.0f}", t["bound"],
            ])
        headers = key + ["configuration", "compute", "of it recompute", "exposed comm", "exposed PCIe", "optimizer",
                         "step", "MFU", "tokens/s/GPU", "bound by"]
        parts.append(table(headers, step_rows, title=f"Time per step, {tokens:,} tokens per GPU", width=width,
                           keys=1 + numbered))
    return "\n\n".join(parts)


def notes(found: list[dict[str, Any]], s: Setup) -> str:
    """What the terms are, and what each listed option changes."""
    heads = f"{s.heads} heads" + (f" (assumed: hidden / {DEFAULT_HEAD_DIM})" if s.heads_assumed else "")
    lines = [
        f"activations: Korthikanti et al. (arXiv:2205.05198), {heads}, {s.checkpointing}: stored layers, the layer "
        "being recomputed and the output logits (`zero_core/planner/activations.py`); bucket: DeepSpeed's "
        "reduce_bucket_size (5e8 elements, fp16); gathered: ZeRO-3's layer and the one prefetched, the largest "
        "layer each; persistent: ZeRO-3's tensors under stage3_param_persistence_threshold (1e5), whole on every "
        "GPU; allowance: CUDA context, workspaces and fragmentation (the course's assumption, --allowance).",
        "MFU: the model's FLOPs (6Ψ per token plus attention, no recomputation) / (step × peak). Exposed: time the "
        "GPU waited for a collective, or for PCIe alone.",
    ]
    seen = {}
    for r in found:
        seen.setdefault(r["label"], r["changes"])
    lines += [f"{label}: {text}." for label, text in seen.items()]
    return "\n".join(lines)
