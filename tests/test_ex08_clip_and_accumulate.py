"""ex08's stage and oracle: accumulation and global-norm clipping on ZeRO-2's shards, as specified."""

from __future__ import annotations

import pytest
import torch

from autograder import ex08
from autograder.harness import STEPS, TRAINING_CONFIG
from zero_core import comm
from zero_core.cluster import VirtualCluster
from zero_core.model import count_parameters, global_batch, preset
from zero_core.oracle import accumulated_batch, train_single_device
from zero_core.stages import TrainConfig, Zero2
from zero_core.stages.base import OVERFLOW_TAG
from zero_core.variants.accumulating import NORM_TAG, AccumulatingZero2

pytestmark = pytest.mark.ex08
MICRO = TrainConfig(model=preset("micro"), precision="fp32")


def train(stage: type, world_size: int, steps: int = STEPS, **options) -> tuple[list, VirtualCluster]:
    """(per rank: losses, master shards, grad norms) and the cluster, for `stage` constructed with `options`."""
    cluster = VirtualCluster(world_size)

    def on_rank() -> tuple:
        trainer = stage(MICRO, **options)
        losses = [trainer.train_step(step) for step in range(steps)]
        return losses, trainer.master_shards(), getattr(trainer, "grad_norms", [])

    return cluster.run(on_rank), cluster


def test_one_micro_step_without_clipping_trains_bit_identically_to_zero2() -> None:
    plain, _ = train(Zero2, 3)
    accumulating, _ = train(AccumulatingZero2, 3, micro_steps=1, max_norm=None)
    for (losses, masters, _), (want_losses, want_masters, _) in zip(accumulating, plain, strict=True):
        assert losses == want_losses
        assert all(torch.equal(masters[name][1], want_masters[name][1]) for name in want_masters)


def test_the_oracle_defaults_are_plain_training_and_accumulation_reads_the_micro_steps_data() -> None:
    model = MICRO.model
    plain = zip(accumulated_batch(MICRO, 2, 1, 1), global_batch(model, 2, 1), strict=True)
    assert all(torch.equal(a, b) for a, b in plain)
    inputs, _ = accumulated_batch(MICRO, 2, 1, 3)
    assert torch.equal(inputs, torch.cat([global_batch(model, 2, step)[0] for step in (3, 4, 5)]))


@pytest.mark.parametrize("world_size", sorted(ex08.ACCUMULATION))
def test_the_graded_steps_clip_exactly_where_the_grader_says(world_size: int) -> None:
    """Clipped gradients have norm max_norm; the unclipped world size's stay below it."""
    setting = ex08.ACCUMULATION[world_size]
    gradients: dict = {}
    train_single_device(
        TRAINING_CONFIG, world_size, STEPS, gradients, micro_steps=setting.micro_steps, max_norm=setting.max_norm
    )
    for step in range(STEPS):
        norm = torch.cat([g for (_, s), g in gradients.items() if s == step]).norm().item()
        if world_size in ex08.UNCLIPPED_WORLD_SIZES:
            assert norm < 0.5 * setting.max_norm, (world_size, step, norm)
        else:
            assert norm == pytest.approx(setting.max_norm, rel=1e-5), (world_size, step, norm)


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_reference_trains_like_the_oracle_that_accumulates_and_clips(world_size: int) -> None:
    ranks, _ = train(AccumulatingZero2, world_size, micro_steps=3, max_norm=1.0)
    oracle_losses, oracle_weights = train_single_device(MICRO, world_size, STEPS, micro_steps=3, max_norm=1.0)
    for step, want in enumerate(oracle_losses):
        assert sum(losses[step] for losses, _, _ in ranks) / world_size == pytest.approx(want, abs=1e-5)
    for name, want in oracle_weights.items():
        got = torch.cat([masters[name][1] for _, masters, _ in ranks])
        assert torch.allclose(got, want, atol=1e-5), name
    norms = {tuple(norms) for _, _, norms in ranks}
    assert len(norms) == 1 and all(norm > 1.0 for norm in norms.pop()), "every rank sees the same, clipped norm"


@pytest.mark.parametrize("micro_steps", [1, 2, 4])
def test_gradient_traffic_grows_with_k_and_the_norm_costs_one_fp32_element(micro_steps: int) -> None:
    world_size = 4
    _, cluster = train(AccumulatingZero2, world_size, steps=1, micro_steps=micro_steps, max_norm=1.0)
    psi = count_parameters(MICRO.model)
    for rank in range(world_size):
        entries = cluster.ledger.entries(rank, exclude_tags=(OVERFLOW_TAG,))
        norm = [e for e in entries if e.tag == NORM_TAG]
        assert [(e.op, e.elements) for e in norm] == [(comm.ALL_REDUCE, 1)]
        reduce_scatters = [e for e in entries if e.op == comm.REDUCE_SCATTER]
        all_gathers = [e for e in entries if e.op == comm.ALL_GATHER]
        assert len(reduce_scatters) == micro_steps * len(all_gathers)
        padded = sum(e.elements for e in all_gathers)
        assert psi <= padded < psi + world_size * len(all_gathers)
        assert sum(e.elements for e in reduce_scatters) == micro_steps * padded
