"""Every stage trains like a single device running plain torch.nn + torch.optim.Adam on the global batch.

Tolerances, measured and explained: in fp32 the only differences are rounding order (per-rank mean
losses averaged vs one global mean; our Adam's unfused arithmetic vs torch's addcdiv), so losses agree
to ~1e-6 and weights to ~1e-5 relative after 5 steps. In bf16 the stages round parameters, activations
and gradients to 8 significant bits while the oracle stays fp32: ~1e-2 relative, loss within ~1e-2.
"""

from __future__ import annotations

import pytest

from zero_core.experiment import run_stage
from zero_core.model import preset
from zero_core.oracle import train_single_device
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
