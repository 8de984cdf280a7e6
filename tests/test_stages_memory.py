"""Where the bytes live: per-rank model states equal the paper's formulas exactly; transients stay small."""

from __future__ import annotations

import pytest
import torch

from zero_core import formulas, memory
from zero_core.cluster import VirtualCluster
from zero_core.context import current
from zero_core.experiment import run_stage
from zero_core.model import build_model, parameter_layers, preset
from zero_core.partition import FlatPartition
from zero_core.stages import TrainConfig
from zero_core.stages.sharding import InFlightReduceScatter
from zero_core.stages.zero2 import Zero2
from zero_core.stages.zero3 import Zero3

MICRO = TrainConfig(model=preset("micro"))
ELEMENT_BYTES = 2


def layer_numels(config: TrainConfig) -> list[int]:
    model = build_model(config.model)
    return [sum(p.numel() for p in module.parameters()) for _, module in parameter_layers(model)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 7, 32])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_bytes_equal_the_formula_exactly(stage: int, world_size: int) -> None:
    report = run_stage(stage, world_size, 1, MICRO)
    assert report.model_state_bytes_mean == formulas.model_state_bytes(stage, report.psi, world_size)
    assert report.formula_ratio == 1.0
    expected = formulas.model_state_breakdown(stage, report.psi, world_size)
    for category, value in expected.items():
        assert report.model_state_bytes_by_category_mean[category] == pytest.approx(value, rel=1e-12)


def test_padding_is_reported_apart_when_n_does_not_divide_the_layers() -> None:
    report = run_stage(3, 7, 1, MICRO)
    expected_padding = sum(FlatPartition(n, 7).padding for n in layer_numels(MICRO)) * ELEMENT_BYTES * 2 / 7
    assert report.padding_bytes_mean == pytest.approx(expected_padding)
    assert report.padding_bytes_mean > 0


def test_zero2_never_materializes_a_full_gradient() -> None:
    world_size = 4
    report = run_stage(2, world_size, 2, MICRO)
    numels = layer_numels(MICRO)
    shard_bytes = sum(FlatPartition(n, world_size).chunk_numel for n in numels) * ELEMENT_BYTES
    largest_layer_bytes = max(FlatPartition(n, world_size).padded_numel for n in numels) * ELEMENT_BYTES
    full_gradient_bytes = sum(numels) * ELEMENT_BYTES
    grad_peak = report.peak_bytes_by_category_max[memory.GRAD]
    assert grad_peak <= shard_bytes < full_gradient_bytes
    assert report.peak_bytes_by_category_max[memory.GRAD_BUCKET] <= largest_layer_bytes


def test_zero1_keeps_the_full_gradient_resident() -> None:
    report = run_stage(1, 4, 1, MICRO)
    assert report.model_state_bytes_by_category_mean[memory.GRAD] == report.psi * ELEMENT_BYTES


def test_zero3_holds_at_most_one_layers_gathered_parameters() -> None:
    world_size = 4
    report = run_stage(3, world_size, 2, MICRO)
    largest = max(FlatPartition(n, world_size).padded_numel for n in layer_numels(MICRO)) * ELEMENT_BYTES
    assert 0 < report.peak_bytes_by_category_max[memory.GATHER] <= largest
    for tracker in report.trackers:
        assert tracker.current_bytes(memory.GATHER) == 0, "a gathered parameter outlived its layer"


def test_zero3_gathers_never_overlap_in_time() -> None:
    report = run_stage(3, 2, 1, MICRO)
    live = 0
    for event in report.trackers[1].timeline:
        if event.category == memory.GATHER:
            live += 1 if event.delta_bytes > 0 else -1
            assert live <= 1, f"two layers' parameters were gathered at once (at {event.label})"
    assert live == 0


def test_zero3_frees_the_memory_of_released_parameters() -> None:
    """Release frees the gathered buffer itself, not only its count; a second gather before release fails."""

    def train_then_gather_twice() -> tuple[list[int], str]:
        trainer = Zero3(MICRO)
        trainer.train_step(0)
        freed = [shard.gathered.untyped_storage().nbytes() for shard in trainer.shards.values()]
        shard = next(iter(trainer.shards.values()))
        shard.gather_parameters()
        try:
            shard.gather_parameters()
        except RuntimeError as error:
            return freed, str(error)
        finally:
            shard.release_parameters()
        return freed, ""

    for freed, error in VirtualCluster(2).run(train_then_gather_twice):
        assert freed == [0] * len(freed), "a released layer still holds its gathered parameters' memory"
        assert "gathered twice" in error


def backward_memory_events(stage_cls: type, world_size: int = 2) -> list[memory.MemoryEvent]:
    """Rank 0's tracker events of one training step from backward on (with `grad_sync`, where ZeRO-2/3 wait)."""

    def train_one_step() -> None:
        stage_cls(MICRO).train_step(0)

    cluster = VirtualCluster(world_size)
    cluster.run(train_one_step)
    return [e for e in cluster.trackers[0].timeline if e.phase in ("backward", "grad_sync")]


def without_overlap(stage_cls: type) -> type:
    return type(f"Blocking{stage_cls.__name__}", (stage_cls,), {"overlap_reduce_scatter": False})


@pytest.mark.parametrize(
    "stage_cls",
    [Zero2, Zero3, without_overlap(Zero2), without_overlap(Zero3)],
    ids=["zero2", "zero3", "zero2-blocking", "zero3-blocking"],
)
def test_reduce_scatters_stay_in_flight_one_bucket_at_a_time_unless_overlap_is_off(stage_cls: type) -> None:
    """With overlap each layer's bucket lives on into the next layer's backward (under ZeRO-3, through its
    gather) and the last one until `grad_sync`; without it each bucket is freed within its own layer."""
    overlap = stage_cls.overlap_reduce_scatter
    live_buckets, gathers_during_a_reduce_scatter, last_release_phase = 0, 0, ""
    for event in backward_memory_events(stage_cls):
        if event.category == memory.GRAD_BUCKET:
            live_buckets += 1 if event.delta_bytes > 0 else -1
            assert live_buckets <= 1, f"two gradient buckets alive at once (at {event.label})"
            if event.delta_bytes < 0:
                last_release_phase = event.phase
        elif event.category == memory.GATHER and event.delta_bytes > 0:
            gathers_during_a_reduce_scatter += live_buckets
    assert live_buckets == 0
    assert last_release_phase == ("grad_sync" if overlap else "backward")
    if stage_cls.stage == 3:
        assert (gathers_during_a_reduce_scatter > 0) == overlap


def test_a_second_reduce_scatter_cannot_start_while_one_is_in_flight() -> None:
    def start_twice() -> str:
        tracker = current().tracker
        in_flight = InFlightReduceScatter(tracker)
        first, second = (tracker.register(torch.ones(4), memory.GRAD_BUCKET) for _ in range(2))
        in_flight.start(torch.empty(2), first, "grad a")
        try:
            in_flight.start(torch.empty(2), second, "grad b")
        except RuntimeError as error:
            return str(error)
        finally:
            in_flight.wait()
        return ""

    for message in VirtualCluster(2).run(start_twice):
        assert "still in flight" in message
