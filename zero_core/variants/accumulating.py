"""ZeRO-2 with k micro-batches per optimizer step and the gradient clipped to a global norm before Adam.

Gradient accumulation trains on a batch k times larger than fits at once: k forward and backward passes,
one optimizer step. Data parallelism (DDP) can skip communication on the first k-1 micro-batches
(`no_sync`) because every rank keeps a full gradient anyway; ZeRO-2 keeps only a 1/N shard, so it must
reduce-scatter every micro-batch's gradient as backward produces it and add the result into the shard:
k·Ψ of gradient traffic per step instead of Ψ, the price of never holding a full gradient (2Ψ + 14Ψ/N
stays true for any k). DeepSpeed does the same (DeepSpeed#2252).

Clipping by the global norm (`torch.nn.utils.clip_grad_norm_`) needs the norm of the whole gradient, which
no rank holds: each rank sums the squares of the elements it owns and one all-reduce of a single fp32
number gives every rank the same norm. Both pieces are exercise ex08's answer, in `zero_core/answers/ex08.py`,
named through `zero_core.registry` and imported only when the stage runs them.

Each micro-batch's loss is divided by k before backward (as DeepSpeed's engine does), so that the
accumulated, rank-averaged gradient is the gradient of the mean loss over all N·k micro-batches: what one
device computes on their concatenation (`zero_core.oracle`, `micro_steps=k`). Micro-batch j of optimizer
step s is the data of step `accumulation_data_step(s, j, k)`; with k = 1 the data is ZeRO-2's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn as nn

from zero_core import memory, registry, schedule
from zero_core.context import current, phase
from zero_core.model import loss_fn, micro_batch
from zero_core.stages.base import TrainConfig, _unmeasured
from zero_core.stages.sharding import LayerShard
from zero_core.stages.zero2 import Zero2

NORM_TAG = "grad norm"
"""The ledger tag of the reference's all-reduce of the squared gradient norm: a few bytes per step."""


def accumulation_data_step(step: int, micro_step: int, micro_steps: int) -> int:
    """The data step (`model.micro_batch`'s `step`) of micro-batch `micro_step` of optimizer step `step`."""
    return step * micro_steps + micro_step


class AccumulatingLayerShard(LayerShard):
    """A layer's shard whose gradients are added into `grad` by the stage's `accumulate(shard, grads)`.

    `micro_step` (0 to `micro_steps` - 1) says which micro-batch of the optimizer step backward is in.
    """

    accumulate: Callable[[Any, list[torch.Tensor]], None]
    handed: Any = None
    """What `accumulate` is given as the shard (the shard itself, unless the stage was given a `hand`)."""
    micro_step: int = 0
    micro_steps: int = 1

    def reduce_scatter_gradients(self, grads: list[torch.Tensor]) -> None:
        schedule.mark(schedule.GRADIENTS_READY, self.name)
        self.accumulate(self.handed, grads)


class AccumulatingZero2(Zero2):
    """ZeRO-2 with `micro_steps` micro-batches per optimizer step, then clipping to `max_norm`, then Adam.

    `max_norm=None`: no clipping (and no norm all-reduce). `accumulate` and `clip` replace exercise ex08's
    two answers (a student's), and `hand(shard)` says what `accumulate` is given as each layer's shard.
    """

    ACCUMULATE: Callable | registry.Answer = registry.answer("ex08", "accumulate_gradient")
    CLIP: Callable | registry.Answer = registry.answer("ex08", "clip_global_norm")
    shard_class = AccumulatingLayerShard

    def __init__(
        self,
        config: TrainConfig,
        functions: dict[type[nn.Module], type[torch.autograd.Function]] | None = None,
        *,
        micro_steps: int = 2,
        max_norm: float | None = 1.0,
        accumulate: Callable | None = None,
        clip: Callable | None = None,
        hand: Callable[[LayerShard], Any] | None = None,
    ) -> None:
        if micro_steps < 1:
            raise ValueError(f"micro_steps counts micro-batches per optimizer step, 1 or more; got {micro_steps}")
        self.micro_steps, self.max_norm = micro_steps, max_norm
        self.accumulate = accumulate or registry.resolve(type(self).ACCUMULATE)
        self.clip = clip or registry.resolve(type(self).CLIP)
        self.hand = hand or (lambda shard: shard)
        super().__init__(config, functions)

    def setup(self, model: nn.Module, initial: Mapping[str, torch.Tensor]) -> None:
        super().setup(model, initial)
        for shard in self.shards.values():
            shard.accumulate, shard.handed, shard.micro_steps = self.accumulate, self.hand(shard), self.micro_steps
        self.grad_norms: list[float] = []
        """The global gradient norm before clipping, per optimizer step (as `clip_global_norm` returned it)."""

    def train_step(
        self,
        step: int,
        measure: Callable[[str], AbstractContextManager] = _unmeasured,
        count_activations: bool = True,
    ) -> float:
        """One optimizer step over `micro_steps` micro-batches; returns this rank's mean micro-batch loss."""
        ctx = current()
        ctx.step = self.tracker.step = step
        losses = []
        for micro_step in range(self.micro_steps):
            for shard in self.shards.values():
                shard.micro_step = micro_step
            data_step = accumulation_data_step(step, micro_step, self.micro_steps)
            inputs, targets = (
                t.to(self.device) for t in micro_batch(self.config.model, self.rank, data_step, self.config.seed)
            )
            with self.tracker.count_activations() if count_activations else nullcontext():
                with phase("forward"), measure("forward"):
                    loss = self.tracker.register(loss_fn(self.model(inputs), targets), memory.ACTIVATIONS, label="loss")
                with phase("backward"), measure("backward"):
                    (loss * (self.scaler.scale / self.micro_steps)).backward()
            losses.append(loss.item())
        with phase("grad_sync"), measure("grad_sync"):
            self.sync_gradients()
        with phase("optimizer"), measure("optimizer"), torch.no_grad():
            self.optimizer_step()
        return sum(losses) / len(losses)

    def update_masters(self, grad: torch.Tensor) -> None:
        """Clip the unscaled fp32 gradient to the global `max_norm`, then Adam."""
        if self.max_norm is not None:
            self.clip_gradients(list(self.master_gradients(grad).values()))
        super().update_masters(grad)

    def clip_gradients(self, grads: list[torch.Tensor]) -> None:
        """`clip(grads, max_norm)` on the rank's owned slices, one per layer, in place."""
        norm = self.clip(grads, self.max_norm)
        readable = isinstance(norm, float | int) or (isinstance(norm, torch.Tensor) and norm.numel() == 1)
        self.grad_norms.append(float(norm) if readable else float("nan"))
