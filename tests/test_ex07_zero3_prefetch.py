"""ex07's stage and checks: prefetching changes when parameters are gathered, never what training computes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from autograder import ex07
from autograder.checks import CheckFailed
from autograder.harness import CONFIG, GradedStage, graded_stage, train
from zero_core import memory
from zero_core.cluster import RankFailed
from zero_core.stages.zero3 import Zero3

pytestmark = pytest.mark.ex07


def windowed(window: int) -> GradedStage:
    return ex07.GRADED.with_setting(window)  # the window a check draws, as the grader hands it


@pytest.mark.parametrize("window", [0, 1, 3])
def test_prefetching_trains_bit_for_bit_like_zero3(window: int) -> None:
    reference, run = train(graded_stage(Zero3, "zero3"), 3), train(windowed(window), 3)
    assert [r.losses for r in run.ranks] == [r.losses for r in reference.ranks]
    got, want = run.master_weights(), reference.master_weights()
    assert all(torch.equal(got[layer], want[layer]) for layer in want)


@pytest.mark.parametrize("world_size", sorted(ex07.WINDOW))
def test_the_reference_gathers_exactly_the_largest_k_plus_1_layers_in_a_row(world_size: int) -> None:
    run = train(ex07.GRADED, world_size)
    peaks = {m.peak_bytes(memory.GATHER) for m in run.memory}
    assert peaks == {ex07.gathered_bytes_bound(run, ex07.WINDOW[world_size])}
    ex07.check_prefetch_schedule(run, f"{world_size} ranks", ex07.WINDOW[world_size])


def test_a_window_of_0_gathers_on_demand_and_fails_the_schedule() -> None:
    run = train(windowed(0), 2)
    with pytest.raises(CheckFailed, match="it was not prefetched"):
        ex07.check_prefetch_schedule(run, "2 ranks", ex07.WINDOW[2])


def test_a_window_of_k_judged_as_k_plus_1_is_too_late() -> None:
    run = train(windowed(1), 3)
    with pytest.raises(CheckFailed, match=r"started only 1 layer\(s\) ahead"):
        ex07.check_prefetch_schedule(run, "3 ranks", 2)


def test_the_prefetcher_gets_shards_without_the_reference_collectives() -> None:
    class Prefetcher:
        def __init__(self, shards: list, window: int) -> None:
            pass

        def gather(self, shard, backward: bool) -> list:
            return getattr(shard, "gather_" + "parameters")()

        def release(self, shard) -> None:
            pass

    stage, _ = ex07._build(Prefetcher)
    with pytest.raises(RankFailed, match="reference implementation"):
        train(stage, 2)


def test_the_stage_refuses_activation_checkpointing() -> None:
    config = dataclasses.replace(CONFIG, model=dataclasses.replace(CONFIG.model, activation_checkpointing=True))
    with pytest.raises(RankFailed, match="activation checkpointing"):
        train(windowed(1), 2, config=config)
