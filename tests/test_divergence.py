"""Each way of breaking the bit-identical training makes a run diverge, and switching it off gives exactly 0.0.

`zero_core.divergence` breaks one contract at a time on the virtual cluster: the order and dtype of the
gradient sum, division before the sum, the accumulation boundary, clipping on a local norm, and a loss-scale
verdict taken by one rank alone. Each run here is a few steps of the micro GPT on 4 or 6 virtual GPUs.
"""

from __future__ import annotations

import pytest
import torch

from zero_core.backends.base import ReduceOp, reduce_in_rank_order
from zero_core.cluster import ClusterError
from zero_core.divergence import Switches, Trajectory, divergence, reduce_copies, summation_order, train
from zero_core.experiment import run_stage
from zero_core.model import preset
from zero_core.stages import TrainConfig

CONFIG = TrainConfig(model=preset("micro"))
FP16 = TrainConfig(model=preset("micro"), precision="fp16", init_loss_scale=2.0**17)
"""At this initial scale the first step's overflowing gradient elements all lie in rank 3's chunks (on 4 ranks)."""
N, STEPS = 4, 3


def gap(switches: Switches, config: TrainConfig = CONFIG, world_size: int = N, **options) -> float:
    """max |Δ master weight| over the steps of a run with `switches` against the same run with none."""
    reference = train(Switches(), config, world_size, STEPS, **options)
    return divergence(reference, train(switches, config, world_size, STEPS, **options)).max_master_delta


def test_with_every_switch_off_the_run_is_zero0s_and_zero2s_bit_for_bit() -> None:
    run = train(Switches(), CONFIG, N, STEPS)
    for stage in (0, 2):
        report = run_stage(stage, N, STEPS, CONFIG)
        assert run.losses == report.losses
        assert all(torch.equal(run.masters[-1][name], w) for name, w in report.master_weights.items())


def test_the_ring_adds_each_chunk_from_the_next_rank_round_to_its_owner() -> None:
    assert summation_order("ring", 1, 4) == [2, 3, 0, 1]
    assert summation_order("rank", 1, 4) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="order"):
        summation_order("tree", 0, 4)


def test_bf16_partial_sums_lose_what_fp32_partial_sums_keep() -> None:
    """1 + 2⁻⁸ rounds back to 1 in bf16 (8 significant bits), twice; in fp32 the two halves add up to 2⁻⁷."""
    copies = [torch.tensor([value], dtype=torch.bfloat16) for value in (1.0, 2.0**-8, 2.0**-8)]
    in_fp32 = reduce_copies(copies, [0, 1, 2], sum_in_fp32=True, divide=False)
    in_bf16 = reduce_copies(copies, [0, 1, 2], sum_in_fp32=False, divide=False)
    assert in_fp32.item() == 1.0 + 2.0**-7 and in_bf16.item() == 1.0
    assert reduce_copies(copies, [1, 2, 0], sum_in_fp32=False, divide=False).item() == 1.0 + 2.0**-7
    assert torch.equal(reduce_copies(copies, [0, 1, 2], True, divide=True), reduce_in_rank_order(copies, ReduceOp.AVG))


def test_summing_in_bf16_diverges_in_either_order_and_fp32_sums_restore_bit_identity() -> None:
    assert gap(Switches(sum_in_fp32=False)) > 0.0
    assert gap(Switches(order="ring", sum_in_fp32=False)) > 0.0
    assert gap(Switches()) == 0.0


def test_in_bf16_the_ring_order_and_the_rank_order_train_apart() -> None:
    rank_order = train(Switches(sum_in_fp32=False), CONFIG, N, STEPS)
    ring_order = train(Switches(order="ring", sum_in_fp32=False), CONFIG, N, STEPS)
    assert divergence(rank_order, ring_order).max_master_delta > 0.0


def test_dividing_before_the_sum_is_exact_on_4_ranks_and_diverges_on_6() -> None:
    assert gap(Switches(predivide=True), world_size=4) == 0.0
    assert gap(Switches(predivide=True), world_size=6) > 0.0


def test_treating_every_backward_as_the_boundary_keeps_only_the_last_micro_batch() -> None:
    assert gap(Switches(every_backward_a_boundary=True), micro_steps=2) > 0.0
    assert gap(Switches(every_backward_a_boundary=True), micro_steps=1) == 0.0
    assert gap(Switches(), micro_steps=2) == 0.0


def test_clipping_on_a_local_norm_diverges_and_every_rank_clips_by_a_different_norm() -> None:
    local = train(Switches(clip_on_local_norm=True), CONFIG, N, STEPS, max_norm=1.0)
    assert len({norms[0] for norms in local.grad_norms}) == N
    assert gap(Switches(clip_on_local_norm=True), max_norm=1.0) > 0.0
    assert gap(Switches(), max_norm=1.0) == 0.0


def test_a_rank_that_skips_alone_parts_its_loss_scale_from_the_others_and_the_run_diverges() -> None:
    reference = train(Switches(), FP16, N, STEPS)
    alone = train(Switches(overflow_verdict_alone=True), FP16, N, STEPS)
    assert reference.skipped == [[0]] * N
    assert alone.skipped == [[], [], [], [0]]
    assert alone.loss_scales[3] == alone.loss_scales[0] / 2
    assert divergence(reference, alone).max_master_delta > 0.0


def test_a_rank_that_skips_alone_and_leaves_the_all_gather_stops_the_run() -> None:
    with pytest.raises(ClusterError, match="all_gather"):
        train(Switches(overflow_verdict_alone=True, join_all_gather=False), FP16, N, STEPS)


def test_the_overflow_verdict_is_broken_alone() -> None:
    with pytest.raises(ValueError, match="no other switch"):
        Switches(overflow_verdict_alone=True, sum_in_fp32=False).make_stage(CONFIG)


def test_divergence_finds_the_first_step_whose_weights_differ() -> None:
    masters = [{"w": torch.zeros(3)} for _ in range(3)]
    changed = [{"w": torch.zeros(3)}, {"w": torch.tensor([0.0, 2.0**-20, 0.0])}, {"w": torch.zeros(3)}]
    empty: list[list] = [[]]
    reference = Trajectory([1.0, 1.0, 1.0], masters, empty, [1.0], empty)
    run = Trajectory([1.0, 1.0, 1.5], changed, empty, [1.0], empty)
    found = divergence(reference, run)
    assert found.first_step == 1 and found.master_deltas == [0.0, 2.0**-20, 0.0] and found.max_loss_delta == 0.5
    assert not found.bit_identical and divergence(reference, reference).bit_identical
