"""The single-device oracle: what data-parallel training must equal, computed without any parallelism.

Plain `torch.nn` and `torch.optim.Adam` on one device, in fp32, on the global batch (the ranks'
micro-batches concatenated in rank order). Averaging N equal micro-batch gradients is the gradient of
the global batch's mean loss, so every ZeRO stage at every N should train like this, up to rounding.
"""

from __future__ import annotations

import torch

from zero_core.model import build_model, global_batch, loss_fn, parameter_layers
from zero_core.partition import flatten
from zero_core.stages.base import TrainConfig


def train_single_device(
    config: TrainConfig, world_size: int, steps: int, gradients: dict[tuple[str, int], torch.Tensor] | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses per step and the final fp32 weights per layer (flattened weight then bias); with `gradients`,
    also each layer's gradient at each step, flattened the same way, keyed (layer, step)."""
    model = build_model(config.model, config.seed)
    adam = config.adam
    optimizer = torch.optim.Adam(model.parameters(), lr=adam.lr, betas=(adam.beta1, adam.beta2), eps=adam.eps)
    losses = []
    for step in range(steps):
        inputs, targets = global_batch(config.model, world_size, step, config.seed)
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        if gradients is not None:
            for name, module in parameter_layers(model):
                gradients[name, step] = flatten([p.grad.detach() for p in module.parameters()]).clone()
        optimizer.step()
        losses.append(loss.item())
    weights = {name: flatten([p.detach() for p in module.parameters()]) for name, module in parameter_layers(model)}
    return losses, weights
