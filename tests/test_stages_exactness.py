"""All four stages are one algorithm: bit-identical losses and fp32 master weights (torch.equal)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from zero_core import dist
from zero_core.answers.ex03 import ReduceScatterLinear
from zero_core.experiment import equivalence, run_stage
from zero_core.model import preset
from zero_core.stages import TrainConfig

STEPS = 5
MICRO = TrainConfig(model=preset("micro"))


def assert_bit_identical(reference, report) -> None:
    assert report.losses == reference.losses, f"ZeRO-{report.stage} losses differ from ZeRO-{reference.stage}"
    assert report.master_weights.keys() == reference.master_weights.keys()
    for name, values in report.master_weights.items():
        assert torch.equal(values, reference.master_weights[name]), (
            f"ZeRO-{report.stage} master weights of {name} differ by "
            f"{(values - reference.master_weights[name]).abs().max().item():.3e}"
        )


@pytest.mark.parametrize("world_size", [1, 2, 4, 8, 32])
def test_all_stages_train_bit_identically(world_size: int) -> None:
    reports = [run_stage(stage, world_size, STEPS, MICRO) for stage in range(4)]
    assert all(r.skipped_steps == 0 for r in reports)
    for report in reports[1:]:
        assert_bit_identical(reports[0], report)
    assert reports[0].losses[-1] < reports[0].losses[0], "the loss should fall"


def test_default_model_trains_bit_identically_on_eight_gpus() -> None:
    config = TrainConfig(model=preset("tiny"))
    reports = [run_stage(stage, 8, STEPS, config) for stage in range(4)]
    for report in reports[1:]:
        assert_bit_identical(reports[0], report)


def test_zero1_all_reduce_sync_trains_like_reduce_scatter() -> None:
    reference = run_stage(1, 3, STEPS, MICRO)
    variant = run_stage(1, 3, STEPS, TrainConfig(model=preset("micro"), zero1_grad_sync="all_reduce"))
    assert_bit_identical(reference, variant)


def test_fp16_overflow_skips_the_same_steps_in_every_stage() -> None:
    config = TrainConfig(model=preset("micro"), precision="fp16", init_loss_scale=2.0**40)
    reports = [run_stage(stage, 3, STEPS, config) for stage in range(4)]
    assert reports[0].skipped_steps > 0, "a 2^40 loss scale must overflow fp16 gradients"
    assert len({r.skipped_steps for r in reports}) == 1
    for report in reports[1:]:
        assert_bit_identical(reports[0], report)


class SummingReduceScatterLinear(ReduceScatterLinear):
    """A wrong ZeRO-2 Linear: sums the gradients over ranks instead of averaging them."""

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        g2d, x2d = grad_out.reshape(-1, grad_out.size(-1)), x.reshape(-1, x.size(-1))
        shard = ctx.shard
        bucket = shard.partition.pack([g2d.T @ x2d, g2d.sum(0)])
        dist.reduce_scatter_single(shard.grad, bucket, op=dist.ReduceOp.SUM)
        return grad_out @ weight, None, None, None


def test_the_equivalence_check_catches_a_summing_reduce_scatter() -> None:
    reference = run_stage(0, 4, 2, MICRO)
    wrong = run_stage(2, 4, 2, MICRO, functions={nn.Linear: SummingReduceScatterLinear})
    result = equivalence(reference, wrong)
    assert not result.bit_identical
    assert result.max_master_delta > 0
