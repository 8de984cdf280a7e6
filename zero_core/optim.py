"""Mixed-precision Adam, as the paper counts it: 16 bytes per parameter (ZeRO §3.1).

Training runs on a 2-byte copy of the parameters (fp16 as in the paper, or bf16) and produces 2-byte
gradients; the optimizer keeps fp32 master weights, momentum and variance (4 + 4 + 4 = K = 12 bytes).
`AdamShard` updates any contiguous slice of the flat parameters, which is what lets ZeRO-1/2/3 run the
same update on 1/N of the elements that ZeRO-0 runs on all of them.

Every update is made of elementwise IEEE operations (multiply, add, square root, divide), never fused
ones: an element then gets the same bits whether it is updated inside the whole tensor or inside a
rank's slice, and the four stages train to bit-identical weights.

`LossScaler` is fp16's dynamic loss scaling: multiply the loss so small gradients survive fp16, skip the
step and halve the scale when any gradient overflowed, grow the scale after a window without overflow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zero_core import memory

PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
ADAM_CHUNK = 1 << 16
"""Elements an Adam step updates at a time (256 KiB of fp32 per temporary)."""


def precision_dtype(name: str) -> torch.dtype:
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}; choose one of {', '.join(PRECISIONS)}")
    return PRECISIONS[name]


@dataclass(frozen=True)
class AdamConfig:
    lr: float = 3e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8


class AdamShard:
    """Adam on an fp32 master slice; registers master, m and v with the rank's memory tracker."""

    def __init__(self, master: torch.Tensor, config: AdamConfig, tracker: memory.MemoryTracker, label: str) -> None:
        if master.dtype != torch.float32 or master.dim() != 1:
            raise ValueError(f"master weights must be a 1-D fp32 tensor, got {master.dtype} {list(master.shape)}")
        self.config = config
        self.master = tracker.register(master, memory.MASTER, label=label)
        self.m = tracker.register(torch.zeros_like(master), memory.ADAM_M, label=label)
        self.v = tracker.register(torch.zeros_like(master), memory.ADAM_V, label=label)

    def view(self, start: int, end: int) -> AdamShard:
        """The update of elements [start, end) alone: master, m and v are views of this shard's (nothing new
        is allocated or counted). Updating the views updates this shard, bit for bit as a whole step would."""
        part = AdamShard.__new__(AdamShard)
        part.config = self.config
        part.master, part.m, part.v = self.master[start:end], self.m[start:end], self.v[start:end]
        return part

    def step(self, grad: torch.Tensor, step: int) -> None:
        """One Adam update with the unscaled fp32 gradient of this slice; `step` counts from 1.

        Long slices are updated `ADAM_CHUNK` elements at a time, which bounds the temporaries (and so the
        process's memory when 32 ranks run at once) and changes no bit: every operation is elementwise.
        """
        for start in range(0, grad.numel(), ADAM_CHUNK):
            end = start + ADAM_CHUNK
            _adam_update(
                self.master[start:end], self.m[start:end], self.v[start:end], grad[start:end], step, self.config
            )


def _adam_update(
    master: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, step: int, c: AdamConfig
) -> None:
    """Adam on equal-length fp32 tensors, in place, from unfused elementwise operations."""
    m.mul_(c.beta1).add_(grad * (1 - c.beta1))
    v.mul_(c.beta2).add_((grad * grad).mul_(1 - c.beta2))
    bias_correction1 = 1 - c.beta1**step
    bias_correction2_sqrt = (1 - c.beta2**step) ** 0.5
    denom = v.sqrt().div_(bias_correction2_sqrt).add_(c.eps)
    master.sub_(torch.div(m, denom, out=denom).mul_(c.lr / bias_correction1))


@dataclass
class LossScaler:
    """Dynamic loss scaling for fp16; a constant 1.0 (still skipping non-finite steps) otherwise."""

    scale: float = 2.0**16
    growth_interval: int = 1000
    dynamic: bool = True
    good_steps: int = 0
    skipped_steps: int = 0

    @classmethod
    def for_precision(cls, precision: str, init_scale: float = 2.0**16) -> LossScaler:
        if precision == "fp16":
            return cls(scale=init_scale)
        return cls(scale=1.0, dynamic=False)

    def update(self, found_overflow: bool) -> bool:
        """Record this step's verdict; True means take the optimizer step."""
        if found_overflow:
            self.skipped_steps += 1
            self.good_steps = 0
            if self.dynamic:
                self.scale /= 2.0
            return False
        self.good_steps += 1
        if self.dynamic and self.good_steps % self.growth_interval == 0:
            self.scale *= 2.0
        return True


def has_overflow(tensor: torch.Tensor) -> bool:
    """True if any element is inf or NaN.

    Read from the smallest and largest elements: a NaN anywhere makes both NaN and an inf makes one of them
    infinite, so two reductions answer for the whole tensor, where `isfinite(tensor).all()` first writes
    a flag per element (16x slower on a bf16 gradient here, and every rank checks its gradient every step).
    """
    if not tensor.numel():
        return False
    return not bool(torch.isfinite(torch.stack(torch.aminmax(tensor))).all())
