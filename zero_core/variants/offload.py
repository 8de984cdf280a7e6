"""ZeRO-Offload: ZeRO-2 whose fp32 master weights, Adam moments and Adam step live on the host.

ZeRO-Offload (Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training", arXiv:2101.06840, §4)
keeps the fp16 parameters and the forward and backward passes on the GPU and moves the optimizer to the
CPU: each GPU's gradient partition (ZeRO-2's reduce-scatter output, 2Ψ/N bytes) goes down to the host over
PCIe, the host runs Adam in fp32 on its 12Ψ/N of master weights, momentum and variance, and the updated
fp16 parameter partition (2Ψ/N) comes back up, after which ZeRO-2's all-gather publishes it. Per GPU and
step that is 2Ψ/N each way on PCIe; the network carries ZeRO-2's 2Ψ.

On the virtual cluster the host is a memory category (`memory.HOST_STATES`, outside the GPU's model
states) and the copies are `dist.copy_to_host` / `dist.copy_to_device`, "d2h" / "h2d" on the ledger.
The math is ZeRO-2's, element for element, so it trains bit-identically to ZeRO-0.

What this stage keeps on the GPU: 2Ψ of fp16 parameters and ZeRO-2's 2Ψ/N gradient shard. DeepSpeed
frees the GPU's gradient partition once it is on the host (the paper's "2Ψ on the GPU",
`configurations.gpu_bytes`); this stage keeps it resident so that backward's reduce-scatter is ZeRO-2's
unchanged, which costs 2Ψ/N more GPU memory than the paper's count and nothing else. Both counts, and why
they differ, are in `zero_core.configurations` (`simulated_gpu_bytes`, `FORMULA_NOTES`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn as nn

from zero_core import dist, memory
from zero_core.stages.base import TrainConfig
from zero_core.stages.zero2 import Zero2

GRAD_TO_HOST_TAG = "grad to host"
PARAM_TO_DEVICE_TAG = "param to device"


class OffloadZero2(Zero2):
    """ZeRO-2 with the optimizer states and step on the host (ZeRO-Offload §4)."""

    stage = "offload"
    label = "ZeRO-Offload"
    partitioned = "+ gradients; states on host"
    configuration = "zero2+offload"

    def __init__(
        self,
        config: TrainConfig,
        functions: dict[type[nn.Module], type[torch.autograd.Function]] | None = None,
        *,
        gpus_per_node: int | None = None,
    ) -> None:
        """`gpus_per_node` is accepted like the node stages' and unused: PCIe is per GPU."""
        super().__init__(config, functions)

    def setup(self, model: nn.Module, initial: Mapping[str, torch.Tensor]) -> None:
        super().setup(model, initial)
        for tensor, category in (
            (self.optimizer.master, memory.HOST_MASTER),
            (self.optimizer.m, memory.HOST_ADAM_M),
            (self.optimizer.v, memory.HOST_ADAM_V),
        ):
            self.tracker.move(tensor, category)
        self.host_grad = self.tracker.register(
            torch.zeros_like(self.optimizer.master, dtype=self.dtype), memory.HOST_GRAD, label="gradient partition"
        )
        self.host_grad_views = [self.host_grad[layer.master_slice] for layer in self.layers]

    def optimizer_step(self) -> bool:
        """Gradient partition down (d2h), overflow check and Adam on the host, fp16 partition up (h2d)."""
        dist.copy_to_host(self.host_grad_views, self.owned_gradients(), tag=GRAD_TO_HOST_TAG)
        scale = self.scaler.scale
        if not self.scaler.update(self.found_overflow(self.host_grad)):
            self.zero_gradients()
            return False
        self.adam_steps += 1
        self.update_masters(self.host_grad.float().div_(scale))
        updated = self.optimizer.master.to(self.dtype)  # rounded on the host, as the base step rounds on the GPU
        dist.copy_to_device(
            self.owned_parameters(), [updated[layer.master_slice] for layer in self.layers], tag=PARAM_TO_DEVICE_TAG
        )
        self.zero_gradients()
        self.publish_parameters()
        return True
