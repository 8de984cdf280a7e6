"""The plan as a DeepSpeed configuration: the chosen configuration written as DeepSpeed's JSON, each key explained.

`deepspeed_config` turns a configuration of `zero_core.configurations` (the one `plan --nodes` ranks first), a
batch (`zero_core.planner.batch`) and a precision into the dictionary DeepSpeed reads (`deepspeed.initialize(
config=...)`), and lists every key it sets with why, in the ledger's terms: which memory category
(`param.fp16`, `grad.fp16`, `master.fp32`, `adam.m`, `adam.v`, `gather.fp16`, `grad.bucket`) a key moves,
shrinks or bounds, and which collective it changes. The JSON stays valid DeepSpeed input: the explanations
are a separate text (`explain`), never `_comment` keys.

Key names and meanings are DeepSpeed's configuration reference (docs/_pages/config-json.md, "ZeRO
Optimizations for FP16 Training", "Batch Size Related Parameters", "BFLOAT16 training options") and its
pydantic models (`deepspeed/runtime/zero/config.py`, `DeepSpeedZeroConfig`, whose unknown keys are errors);
ZeRO++'s three keys are its tutorial's (docs/_tutorials/zeropp.md: `zero_hpz_partition_size`,
`zero_quantized_weights`, `zero_quantized_gradients`). HSDP has no DeepSpeed key: MiCS, its DeepSpeed
counterpart, is gone from 0.19 (`mics_shard_size` is refused), so HSDP is emitted for FSDP2 only. DeepSpeed's
default bucket sizes are figures of the facts file, written out so that a reader sees what they cost.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass
from typing import Any

from zero_core.configurations import Configuration
from zero_core.facts import fact
from zero_core.planner.batch import Batch

PRECISIONS = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes per element of the parameters and gradients the GPUs compute with, by precision."""

REDUCE_BUCKET_ELEMENTS = int(fact("deepspeed_reduce_bucket_size_default").value)
ALLGATHER_BUCKET_ELEMENTS = int(fact("deepspeed_allgather_bucket_size_default").value)
PREFETCH_BUCKET_ELEMENTS = int(fact("deepspeed_prefetch_bucket_size_default").value)
PERSISTENCE_THRESHOLD_ELEMENTS = int(fact("deepspeed_param_persistence_threshold_default").value)


@dataclass(frozen=True)
class Knob:
    """One key of the configuration: its dotted path, its value and why, in the ledger's terms."""

    key: str
    value: Any
    why: str


def _gb(n_bytes: float) -> str:
    return f"{n_bytes / 1e9:.2f} GB"


def knobs(config: Configuration, batch: Batch, precision: str, gpus_per_node: int, psi: int) -> list[Knob]:
    """Every key DeepSpeed needs for `config` trained on `batch` in `precision`, in the order they are written."""
    if config.hsdp:
        raise ValueError(
            f"{config.name}: DeepSpeed has no HSDP (its MiCS, `mics_shard_size`, was removed: DeepSpeed issue 8489); "
            "emit it for FSDP2 (--emit fsdp2), or choose a ZeRO configuration (--configs)"
        )
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    element = PRECISIONS[precision]
    n = batch.world_size
    found = [
        Knob("train_batch_size", batch.train_batch_size,
             f"sequences per optimizer step on all GPUs: micro-batch x accumulation x N = "
             f"{batch.micro_batch_per_gpu} x {batch.gradient_accumulation_steps} x {n}; DeepSpeed refuses any other"),
        Knob("train_micro_batch_size_per_gpu", batch.micro_batch_per_gpu,
             f"sequences each GPU runs forward and backward at once: its activations are this many sequences of "
             f"{batch.sequence:,} tokens"),
        Knob("gradient_accumulation_steps", batch.gradient_accumulation_steps,
             f"micro-steps per optimizer step: {batch.tokens_per_gpu:,} tokens per GPU per step, what the plan timed; "
             "ZeRO-2/3 reduce gradients every micro-step, so accumulation does not divide their traffic"),
    ]
    if precision == "bf16":
        found.append(Knob("bf16.enabled", True,
                          "param.fp16 and grad.fp16 are 2-byte bf16 (16 bytes per parameter with master.fp32, adam.m, "
                          "adam.v); bf16 needs no loss scaling"))
    elif precision == "fp16":
        found += [
            Knob("fp16.enabled", True, "param.fp16 and grad.fp16 are 2-byte fp16: 16 bytes per parameter in all"),
            Knob("fp16.loss_scale", 0, "0 means dynamic loss scaling: a step whose gradients overflow is skipped "
                 "and the scale halved, as the course's fp16 runs do"),
            Knob("fp16.initial_scale_power", 16, "the first scale is 2^16, the course's starting scale"),
        ]
    found.append(Knob("optimizer.type", "AdamW",
                      "Adam's master.fp32, adam.m and adam.v: the 12 bytes per parameter the plan counts (add "
                      "lr and betas under optimizer.params); with offload DeepSpeed runs it as its CPU Adam"))
    found.append(Knob("zero_optimization.stage", config.stage, _stage_why(config.stage, n)))
    if config.stage in (1, 2):
        found += [
            Knob("zero_optimization.reduce_scatter", True,
                 "gradients are reduced in buckets and each GPU keeps its 1/N slice (the paper's reduce-scatter); "
                 "DeepSpeed may still all-reduce whole buckets (use_multi_rank_bucket_allreduce), about 3Ψ instead "
                 "of 2Ψ per step"),
            Knob("zero_optimization.reduce_bucket_size", REDUCE_BUCKET_ELEMENTS,
                 f"elements per gradient bucket (DeepSpeed's default): grad.bucket holds up to "
                 f"{_gb(REDUCE_BUCKET_ELEMENTS * element)} per GPU on top of the plan's model states"),
            Knob("zero_optimization.allgather_bucket_size", ALLGATHER_BUCKET_ELEMENTS,
                 f"elements per all-gather of updated parameters after the step (DeepSpeed's default): up to "
                 f"{_gb(ALLGATHER_BUCKET_ELEMENTS * element)} of gather.fp16 at once"),
            Knob("zero_optimization.contiguous_gradients", True,
                 "each GPU copies its gradient slice into one flat buffer as backward produces it: grad.fp16 stays "
                 f"{_gb(element * psi / n)} (its 1/N) without fragments"),
        ]
    if config.stage >= 2:
        found.append(Knob("zero_optimization.overlap_comm", True,
                          "reduce gradient buckets while backward runs (the plan's step time overlaps them); "
                          "the price is more grad.bucket buffers live at once"))
    if config.stage == 3:
        found += [
            Knob("zero_optimization.reduce_bucket_size", REDUCE_BUCKET_ELEMENTS,
                 f"elements per gradient reduce-scatter (DeepSpeed's default): grad.bucket up to "
                 f"{_gb(REDUCE_BUCKET_ELEMENTS * element)} per GPU"),
            Knob("zero_optimization.stage3_prefetch_bucket_size", PREFETCH_BUCKET_ELEMENTS,
                 f"elements all-gathered ahead of the layer that needs them (DeepSpeed's default): up to "
                 f"{_gb(PREFETCH_BUCKET_ELEMENTS * element)} of gather.fp16 in flight, which hides the 3Ψ per "
                 "step behind compute"),
            Knob("zero_optimization.stage3_param_persistence_threshold", PERSISTENCE_THRESHOLD_ELEMENTS,
                 f"parameters under {PERSISTENCE_THRESHOLD_ELEMENTS:,} elements (norms, biases) stay whole in "
                 "param.fp16 on every GPU: a little memory against many latency-bound all-gathers"),
        ]
    if config.offload:
        found += [
            Knob("zero_optimization.offload_optimizer.device", "cpu",
                 f"master.fp32, adam.m, adam.v and the gradient slice live in host memory, "
                 f"{_gb((element + 12) * psi / n)} per GPU, and Adam runs on the CPU; "
                 f"each step copies {_gb(element * psi / n)} down and up over PCIe"),
            Knob("zero_optimization.offload_optimizer.pin_memory", True,
                 "page-locked host buffers, so the PCIe copies run at the link's speed"),
        ]
    if config.hpz:
        found.append(Knob("zero_optimization.zero_hpz_partition_size", gpus_per_node,
                          f"hpZ: a secondary copy of the weights split over the node's {gpus_per_node} GPUs "
                          f"({_gb(element * psi / gpus_per_node)} per GPU of param.fp16), so backward's all-gather "
                          "stays inside the node"))
    if config.qwz:
        found.append(Knob("zero_optimization.zero_quantized_weights", True,
                          "qwZ: parameters are all-gathered as int8 with blockwise scales, half the bytes of "
                          "gather.fp16 on the wire"))
    if config.qgz:
        found.append(Knob("zero_optimization.zero_quantized_gradients", True,
                          "qgZ: gradients travel as int4 in a hierarchical all-to-all instead of the reduce-scatter"))
    return found


def _stage_why(stage: int, n: int) -> str:
    return {
        0: "no partitioning: every GPU keeps all 16Ψ and all-reduces gradients (2Ψ per step)",
        1: f"master.fp32, adam.m and adam.v split over the N = {n} GPUs: 4Ψ + 12Ψ/N per GPU",
        2: f"gradients split too, reduce-scattered in backward: 2Ψ + 14Ψ/N per GPU (N = {n})",
        3: f"parameters split too, all-gathered layer by layer (gather.fp16): 16Ψ/N per GPU (N = {n}), 3Ψ per step",
    }[stage]


def as_dict(found: list[Knob]) -> dict[str, Any]:
    """The knobs as DeepSpeed's nested dictionary (`zero_optimization.stage` → {"zero_optimization": {"stage"}})."""
    config: dict[str, Any] = {}
    for knob in found:
        *sections, last = knob.key.split(".")
        node = config
        for section in sections:
            node = node.setdefault(section, {})
        node[last] = knob.value
    return config


def deepspeed_config(
    config: Configuration, batch: Batch, precision: str, gpus_per_node: int, psi: int
) -> tuple[dict[str, Any], list[Knob]]:
    """DeepSpeed's configuration for the plan, and the knobs it is made of (each with its reason)."""
    found = knobs(config, batch, precision, gpus_per_node, psi)
    return as_dict(found), found


def to_json(config: dict[str, Any]) -> str:
    return json.dumps(config, indent=2) + "\n"


def explain(found: list[Knob], label: str, width: int = 100) -> str:
    """One paragraph per key, `key = value: why`, wrapped to `width`, headed by the configuration it is for."""
    lines = textwrap.wrap(f"Every key of the DeepSpeed configuration for {label}, in the ledger's terms:", width)
    for k in found:
        lines += textwrap.wrap(f"- {k.key} = {json.dumps(k.value)}: {k.why}.", width, subsequent_indent="  ")
    return "\n".join(lines)
