"""The single-device oracle: what data-parallel training must equal, computed without any parallelism.

Plain `torch.nn` and PyTorch's own Adam on one device, in fp32, on the global batch (the ranks'
micro-batches concatenated in rank order). Averaging N equal micro-batch gradients is the gradient of
the global batch's mean loss, so every ZeRO stage at every N should train like this, up to rounding.

With gradient accumulation (`micro_steps` k) an optimizer step's batch is its k micro-steps' global
batches concatenated, and with `max_norm` the gradient is clipped by `torch.nn.utils.clip_grad_norm_`
before Adam: what `AccumulatingZero2` must equal.

`resume_single_device` starts the same training from a consolidated checkpoint instead of the initial weights
(fp32 masters, Adam's m and v and step, per layer: what `zero_core.answers.ex10.consolidate` returns): what a
run resumed from that checkpoint on any number of ranks must equal.
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam as torch_adam

from zero_core.model import build_model, global_batch, loss_fn, parameter_layers
from zero_core.optim import AdamConfig
from zero_core.partition import flatten, unflatten
from zero_core.stages.base import TrainConfig
from zero_core.variants.accumulating import accumulation_data_step


class TorchAdam:
    """`torch.optim.Adam`'s update, through the function its `step` calls (`torch.optim.adam.adam`, with the
    class's defaults): the same arithmetic, bit for bit, on moments and step counts kept here (`moments`: m and v
    per parameter, in the order of `params`; zeros by default). Not the class itself: the first `torch.optim.Adam`
    a process constructs imports torch's compiler stack (`torch._dynamo`), about 1.3 s of CPU in every process
    that makes an oracle run. A student's `python -m autograder check` of ex08's solution took 8.2-8.9 CPU
    seconds with the class, 7.1-7.4 with this."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        adam: AdamConfig,
        moments: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        step: int = 0,
    ) -> None:
        self.params, self.adam = params, adam
        moments = moments or [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
        self.exp_avgs = [m.clone() for m, _ in moments]
        self.exp_avg_sqs = [v.clone() for _, v in moments]
        self.steps = [torch.tensor(float(step)) for _ in params]

    @torch.no_grad()
    def step(self) -> None:
        adam = self.adam
        torch_adam(
            self.params, [p.grad for p in self.params], self.exp_avgs, self.exp_avg_sqs, [], self.steps,
            amsgrad=False, beta1=adam.beta1, beta2=adam.beta2, lr=adam.lr, weight_decay=0.0, eps=adam.eps,
            maximize=False,
        )


def train_single_device(
    config: TrainConfig,
    world_size: int,
    steps: int,
    gradients: dict[tuple[str, int], torch.Tensor] | None = None,
    *,
    micro_steps: int = 1,
    max_norm: float | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses per step and the final fp32 weights per layer (flattened weight then bias); with `gradients`,
    also each layer's gradient at each step, flattened the same way, keyed (layer, step): the gradient Adam
    is given, clipped if `max_norm` is set. Step s trains on the data of steps s·k to s·k + k - 1
    (`accumulation_data_step`); the defaults (k = 1, no clipping) are plain training."""
    model = build_model(config.model, config.seed)
    optimizer = TorchAdam(list(model.parameters()), config.adam)
    losses = []
    for step in range(steps):
        inputs, targets = accumulated_batch(config, world_size, step, micro_steps)
        model.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if gradients is not None:
            for name, module in parameter_layers(model):
                gradients[name, step] = flatten([p.grad.detach() for p in module.parameters()]).clone()
        optimizer.step()
        losses.append(loss.item())
    weights = {name: flatten([p.detach() for p in module.parameters()]) for name, module in parameter_layers(model)}
    return losses, weights


def accumulated_batch(
    config: TrainConfig, world_size: int, step: int, micro_steps: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batches of optimizer step `step`'s micro-steps, concatenated (the global batch for k = 1)."""
    if micro_steps == 1:
        return global_batch(config.model, world_size, step, config.seed)
    pairs = [
        global_batch(config.model, world_size, accumulation_data_step(step, j, micro_steps), config.seed)
        for j in range(micro_steps)
    ]
    return torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])


def resume_single_device(
    config: TrainConfig, state: dict, world_size: int, start_step: int, steps: int
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Losses and final fp32 weights per layer of `steps` steps from a consolidated `state`, on the global
    batches of steps `start_step`... for `world_size` ranks: PyTorch's Adam given the saved moments and step."""
    model = build_model(config.model, config.seed)
    params, moments = [], []
    with torch.no_grad():
        for name, module in parameter_layers(model):
            layer = list(module.parameters())
            shapes = [p.shape for p in layer]
            moments += zip(unflatten(state["m"][name], shapes), unflatten(state["v"][name], shapes), strict=True)
            for param, value in zip(layer, unflatten(state["master"][name], shapes), strict=True):
                param.copy_(value)
            params += layer
    optimizer = TorchAdam(params, config.adam, moments, state["step"])
    losses = []
    for step in range(start_step, start_step + steps):
        inputs, targets = global_batch(config.model, world_size, step, config.seed)
        model.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    weights = {name: flatten([p.detach() for p in module.parameters()]) for name, module in parameter_layers(model)}
    return losses, weights
