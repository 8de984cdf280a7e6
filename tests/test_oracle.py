"""Every stage trains like a single device running plain torch.nn + torch.optim.Adam on the global batch.

Tolerances, measured and explained: in fp32 the only differences are rounding order (per-rank mean
losses averaged vs one global mean; our Adam's unfused arithmetic vs torch's addcdiv), so losses agree
to ~1e-6 and weights to ~1e-5 relative after 5 steps. In bf16 the stages round parameters, activations
and gradients to 8 significant bits while the oracle stays fp32: ~1e-2 relative, loss within ~1e-2.
"""

from __future__ import annotations

import pytest
import torch

from zero_core.experiment import run_stage
from zero_core.model import build_model, global_batch, loss_fn, preset
from zero_core.optim import AdamConfig
from zero_core.oracle import TorchAdam, train_single_device
from zero_core.stages import TrainConfig

STEPS = 5
TOLERANCES = {"fp32": (1e-5, 1e-4), "bf16": (1e-2, 5e-2)}


def relative_weight_error(oracle: dict, report) -> float:
    return max(
        ((oracle[name] - values).norm() / oracle[name].norm()).item() for name, values in report.master_weights.items()
    )


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_matches_the_single_device_oracle(stage: int, precision: str) -> None:
    config = TrainConfig(model=preset("micro"), precision=precision)
    world_size = 3
    oracle_losses, oracle_weights = train_single_device(config, world_size, STEPS)
    report = run_stage(stage, world_size, STEPS, config)
    loss_tol, weight_tol = TOLERANCES[precision]
    assert max(abs(a - b) for a, b in zip(oracle_losses, report.losses, strict=True)) < loss_tol
    assert relative_weight_error(oracle_weights, report) < weight_tol


def test_the_oracle_comparison_notices_a_different_batch() -> None:
    config = TrainConfig(model=preset("micro"), precision="fp32")
    oracle_losses, oracle_weights = train_single_device(config, 2, STEPS)
    report = run_stage(0, 3, STEPS, config)
    assert relative_weight_error(oracle_weights, report) > TOLERANCES["fp32"][1]


@pytest.mark.parametrize("start_step", [0, 5])
def test_the_oracle_s_adam_is_torch_optim_adam_bit_for_bit(start_step: int) -> None:
    """`TorchAdam` steps through the function `torch.optim.Adam.step` calls: from fresh moments, and from moments
    and a step count given (a resumed run), three steps of each on the same model and data give the same bits."""
    config, adam = preset("micro"), AdamConfig()
    models = [build_model(config), build_model(config)]
    generator = torch.Generator().manual_seed(1)
    moments = [(torch.rand(p.shape, generator=generator), torch.rand(p.shape, generator=generator) / 100)
               for p in models[0].parameters()] if start_step else None
    theirs = torch.optim.Adam(models[0].parameters(), lr=adam.lr, betas=(adam.beta1, adam.beta2), eps=adam.eps)
    if moments:  # as `resume_single_device` gave them to torch.optim.Adam before it used `TorchAdam`
        for param, (m, v) in zip(models[0].parameters(), moments, strict=True):
            count = torch.tensor(float(start_step))
            theirs.state[param] = {"step": count, "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    ours = TorchAdam(list(models[1].parameters()), adam, moments, start_step)
    for step in range(3):
        inputs, targets = global_batch(config, 2, step, 0)
        for model, optimizer in zip(models, (theirs, ours), strict=True):
            model.zero_grad()
            loss_fn(model(inputs), targets).backward()
            optimizer.step()
    for mine, reference in zip(models[1].parameters(), models[0].parameters(), strict=True):
        assert torch.equal(mine, reference)
