"""Whole memory per GPU: model states, activations, the stage's own buffers and an allowance, each a term.

ZeRO §5 and `zero_core.configurations` count model states; a GPU also holds the step's activations
(`planner.activations`) and buffers its stage allocates beside them, sized by DeepSpeed's documented defaults
(`deepspeed/runtime/zero/config.py`, entries of `zero_core/data/facts.toml`):

- a gradient bucket (ZeRO-1, 2, 3): gradients are copied into a contiguous buffer of `reduce_bucket_size`
  elements (5e8) and reduced from there, 2 bytes each: min(5e8, Ψ)·2 bytes. ZeRO-0 all-reduces the gradients
  its 2Ψ already counts, in place.
- gathered parameters (ZeRO-3): the layer being computed and the layers prefetched ahead of it, whole in
  fp16: (1 + prefetch depth) × the largest layer × 2 bytes, with the time model's depth of one layer
  (`configuration_time.predict`), so that memory and time describe the same schedule. DeepSpeed's own prefetch
  is `stage3_prefetch_bucket_size` elements (5e7), less than one block of a large model.
- persistent parameters (ZeRO-3): tensors of at most `stage3_param_persistence_threshold` elements (1e5; norms,
  biases) stay whole on every GPU: their fp16 copy costs 2·(1 - 1/N) bytes per element beyond the 2/N counted.
- an allowance: the CUDA context, library workspaces and fragmentation, which no formula here counts
  (an assumption of the course, `--allowance`).

A configuration fits when the total does. Part of the planner (`zero_core.planner`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from zero_core.facts import fact
from zero_core.planner.activations import ActivationBytes
from zero_core.planner.models import GPT, ModelShape
from zero_core.units import GiB

FP16_BYTES = 2
REDUCE_BUCKET_ELEMENTS = fact("deepspeed_reduce_bucket_size_default").value
PREFETCH_BUCKET_ELEMENTS = fact("deepspeed_prefetch_bucket_size_default").value
PERSISTENCE_THRESHOLD = fact("deepspeed_param_persistence_threshold_default").value
DEFAULT_ALLOWANCE_BYTES = int(fact("gpu_memory_allowance").value * GiB)
PREFETCH_DEPTH = 1
"""Layers gathered ahead of the one computing: the time model's default (`configuration_time.predict`)."""


@dataclass(frozen=True)
class GpuMemory:
    """Bytes one GPU holds at the peak of a step, term by term; `total` is what must fit."""

    model_states: float
    activations: float
    gradient_bucket: float
    gathered_parameters: float
    persistent_parameters: float
    allowance: float

    @property
    def buffers(self) -> float:
        """The stage's own buffers: gradient bucket, gathered and persistent parameters."""
        return self.gradient_bucket + self.gathered_parameters + self.persistent_parameters

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.buffers + self.allowance

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "buffers": self.buffers, "total": self.total}


def small_tensor_elements(shape: ModelShape, threshold: float = PERSISTENCE_THRESHOLD) -> int:
    """Elements in the tensors of at most `threshold` elements: Llama's RMSNorm weights (two per block, one final);
    GPT's LayerNorm weights and biases and its linear biases (QKV 3h, projection h, FFN f and h)."""
    h, f = shape.hidden, shape.ffn
    if shape.family == GPT:
        block, final = [h, h, h, h, 3 * h, h, f, h], [h, h]
    else:
        block, final = [h, h], [h]
    small = sum(n for n in block if n <= threshold) * shape.layers + sum(n for n in final if n <= threshold)
    return int(small)


def gpu_memory(
    stage: int,
    model_state_bytes: float,
    activations: ActivationBytes,
    psi: float,
    largest_layer_params: float,
    persistent_elements: int,
    n_gpus: int,
    allowance_bytes: float = DEFAULT_ALLOWANCE_BYTES,
) -> GpuMemory:
    """The terms for a configuration of ZeRO-`stage` whose model states take `model_state_bytes` per GPU."""
    bucket = FP16_BYTES * min(REDUCE_BUCKET_ELEMENTS, psi) if stage >= 1 else 0.0
    gathered = FP16_BYTES * (1 + PREFETCH_DEPTH) * largest_layer_params if stage == 3 else 0.0
    persistent = FP16_BYTES * persistent_elements * (1 - 1 / n_gpus) if stage == 3 else 0.0
    return GpuMemory(model_state_bytes, activations.total, bucket, gathered, persistent, allowance_bytes)
