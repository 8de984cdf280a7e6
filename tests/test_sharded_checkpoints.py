"""Sharded checkpoints (ex10's reference, `zero_core.answers.ex10`): each rank saves its shards, a consolidation
gives ZeRO-0's full state bit for bit, and a run resumed on the same or another number of ranks trains on.

Each check is shown to fail on a wrong checkpoint, written here as a small function: padding kept, moments
from the neighbour rank, the step lost, files out of order, a save that builds the full state first.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zero_core.answers import ex10
from zero_core.cluster import VirtualCluster
from zero_core.context import current
from zero_core.model import build_model, parameter_layers, preset
from zero_core.oracle import resume_single_device
from zero_core.partition import FlatPartition
from zero_core.registry import stage_class
from zero_core.stages import TrainConfig

WORLD_SIZE = 4
STEPS = 2
MICRO = TrainConfig(model=preset("micro"))
FP32 = TrainConfig(model=preset("micro"), precision="fp32")
ORACLE_TOLERANCE = (1e-5, 1e-4)
"""tests/test_oracle.py's fp32 tolerances across world sizes: |Δ loss| and relative weight error."""
METADATA_BYTES = 4096
"""What a rank file may hold beyond its shards: names, shapes, ranges, step, and torch.save's zip records."""


def train_on_rank(stage_number, config, steps, *, start=0, state=None, save_to=None, save=ex10.save_shards):
    """Train `steps` steps from data step `start` (from `state` if given), then save to `save_to` if given.
    Returns (losses, bytes the rank's ledger grew by while saving)."""
    stage = ex10.resume(stage_number, config, state) if state else stage_class(stage_number)(config)
    losses = [stage.train_step(step, count_activations=False) for step in range(start, start + steps)]
    growth = 0
    if save_to is not None:
        tracker = current().tracker
        tracker.reset_peaks()
        held = tracker.current_bytes()
        with tracker.audit():
            save(stage, stage.rank, save_to)
        growth = tracker.peak_bytes() - held
    return losses, growth


def run(stage_number, world_size, steps, config=MICRO, **kwargs) -> list[tuple[list[float], int]]:
    return VirtualCluster(world_size).run(train_on_rank, stage_number, config, steps, **kwargs)


def zero0_states(world_size: int, steps: int, config=MICRO) -> dict:
    """ZeRO-0's full fp32 masters and moments after `steps` steps, read from the stage on rank 0, which keeps
    every element."""

    def states(stage_number, config, steps):
        stage = stage_class(stage_number)(config)
        for step in range(steps):
            stage.train_step(step, count_activations=False)
        return {name: {layer.name: values(layer).clone() for layer in stage.layers} for name, values in (
            ("master", lambda layer: layer.master.master), ("m", lambda layer: layer.master.m),
            ("v", lambda layer: layer.master.v))} | {"step": stage.adam_steps}

    return VirtualCluster(world_size).run(states, 0, config, steps)[0]


def differences(state: dict, reference: dict) -> list[str]:
    """Which of master, m, v (per layer) and the step differ between two full states, bit for bit."""
    found = [f"step {state['step']} != {reference['step']}"] if state["step"] != reference["step"] else []
    for name in ex10.STATES:
        found += [f"{name} of {layer}" for layer, values in reference[name].items()
                  if not torch.equal(state[name][layer], values)]
    return found


# -- wrong checkpoints, to show the checks can fail ---------------------------------------------------------


def save_with_padding(stage, rank, directory):
    """Wrong: each layer's piece padded to the partition's chunk, as the buffers the collectives use are."""
    path = ex10.save_shards(stage, rank, directory)
    checkpoint = torch.load(path, weights_only=True)
    padded = {name: [] for name in checkpoint["shards"]}
    offset = 0
    for layer in stage.layers:
        owned, chunk = layer.partition.owned_numel(rank), layer.partition.chunk_numel
        for name, values in checkpoint["shards"].items():
            padded[name] += [values[offset : offset + owned], values.new_zeros(chunk - owned)]
        offset += owned
    checkpoint["shards"] = {name: torch.cat(pieces) for name, pieces in padded.items()}
    torch.save(checkpoint, path)
    return path


def save_through_the_full_state(stage, rank, directory):
    """Wrong: builds every layer's full fp32 master, m and v on the rank before writing its own part."""
    full = [torch.zeros(3, layer.numel) for layer in stage.layers]
    for buffer, layer in zip(full, stage.layers, strict=True):
        start, end = layer.partition.owned_range(rank)
        buffer[:, start:end] = torch.stack([layer.master.master, layer.master.m, layer.master.v])
    return ex10.save_shards(stage, rank, directory)


def swap_moments_with_the_next_rank(directory: Path, world_size: int) -> None:
    """Wrong: rank r's file holds the m and v of rank r + 1 (equal shard sizes, so nothing breaks loudly)."""
    checkpoints = [torch.load(ex10.rank_file(directory, r), weights_only=True) for r in range(world_size)]
    for rank, checkpoint in enumerate(checkpoints):
        neighbour = checkpoints[(rank + 1) % world_size]
        checkpoint["shards"] = checkpoint["shards"] | {k: neighbour["shards"][k].clone() for k in ("m", "v")}
    for rank, checkpoint in enumerate(checkpoints):
        torch.save(checkpoint, ex10.rank_file(directory, rank))


def lose_the_step(directory: Path, world_size: int) -> None:
    """Wrong: the files say step 0, as a checkpoint that keeps tensors but not the optimizer's counter."""
    for rank in range(world_size):
        checkpoint = torch.load(ex10.rank_file(directory, rank), weights_only=True)
        torch.save(checkpoint | {"step": 0}, ex10.rank_file(directory, rank))


# -- the checks ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage_number", [1, 2, 3])
def test_consolidated_state_is_zero0s_masters_and_moments_bit_for_bit(stage_number: int, tmp_path: Path) -> None:
    run(stage_number, WORLD_SIZE, STEPS, save_to=tmp_path)
    assert differences(ex10.consolidate(tmp_path), zero0_states(WORLD_SIZE, STEPS)) == []


def test_moments_from_the_neighbour_rank_fail_the_bit_for_bit_check(tmp_path: Path) -> None:
    run(3, WORLD_SIZE, STEPS, save_to=tmp_path)
    swap_moments_with_the_next_rank(tmp_path, WORLD_SIZE)
    found = differences(ex10.consolidate(tmp_path), zero0_states(WORLD_SIZE, STEPS))
    assert found and all(name.startswith(("m ", "v ")) for name in found)


@pytest.mark.parametrize("stage_number", [1, 2, 3])
def test_resuming_on_the_same_ranks_continues_bit_for_bit(stage_number: int, tmp_path: Path) -> None:
    whole = run(stage_number, WORLD_SIZE, 2 * STEPS, save_to=tmp_path / "whole")
    run(stage_number, WORLD_SIZE, STEPS, save_to=tmp_path / "first")
    state = ex10.consolidate(tmp_path / "first")
    resumed = run(stage_number, WORLD_SIZE, STEPS, start=ex10.next_step(state), state=state, save_to=tmp_path / "on")
    assert [losses for losses, _ in resumed] == [losses[STEPS:] for losses, _ in whole]
    assert differences(ex10.consolidate(tmp_path / "on"), ex10.consolidate(tmp_path / "whole")) == []


def test_a_lost_step_fails_the_resume_check(tmp_path: Path) -> None:
    whole = run(3, WORLD_SIZE, 2 * STEPS)
    run(3, WORLD_SIZE, STEPS, save_to=tmp_path)
    lose_the_step(tmp_path, WORLD_SIZE)
    state = ex10.consolidate(tmp_path)
    resumed = run(3, WORLD_SIZE, STEPS, start=STEPS, state=state)
    assert [losses for losses, _ in resumed] != [losses[STEPS:] for losses, _ in whole]


def relative_weight_error(state: dict, oracle_weights: dict) -> float:
    return max(((oracle_weights[n] - w).norm() / oracle_weights[n].norm()).item() for n, w in state["master"].items())


@pytest.mark.parametrize("new_world_size", [2, 3])
@pytest.mark.parametrize("stage_number", [1, 3])
def test_resuming_on_fewer_ranks_trains_like_the_single_device_oracle(
    stage_number: int, new_world_size: int, tmp_path: Path
) -> None:
    run(3, WORLD_SIZE, STEPS, FP32, save_to=tmp_path / "n4")
    state = ex10.consolidate(tmp_path / "n4")
    start = ex10.next_step(state)
    resumed = run(stage_number, new_world_size, STEPS, FP32, start=start, state=state, save_to=tmp_path / "m")
    oracle_losses, oracle_weights = resume_single_device(FP32, state, new_world_size, start, STEPS)
    loss_tolerance, weight_tolerance = ORACLE_TOLERANCE
    mean_losses = [sum(step) / new_world_size for step in zip(*(losses for losses, _ in resumed), strict=True)]
    assert max(abs(a - b) for a, b in zip(mean_losses, oracle_losses, strict=True)) < loss_tolerance
    assert relative_weight_error(ex10.consolidate(tmp_path / "m"), oracle_weights) < weight_tolerance


def test_the_oracle_check_catches_a_resume_without_the_moments(tmp_path: Path) -> None:
    run(3, WORLD_SIZE, STEPS, FP32, save_to=tmp_path / "n4")
    state = ex10.consolidate(tmp_path / "n4")
    without_moments = state | {name: {k: torch.zeros_like(v) for k, v in state[name].items()} for name in ("m", "v")}
    run(3, 3, STEPS, FP32, start=STEPS, state=without_moments, save_to=tmp_path / "m")
    _, oracle_weights = resume_single_device(FP32, state, 3, STEPS, STEPS)
    assert relative_weight_error(ex10.consolidate(tmp_path / "m"), oracle_weights) > 1e-4


def shard_bytes(path: Path) -> tuple[int, bool]:
    """(bytes of the tensors the file holds, whether each tensor's storage is exactly its elements)."""
    shards = torch.load(path, weights_only=True)["shards"]
    exact = all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in shards.values())
    return sum(t.numel() * t.element_size() for t in shards.values()), exact


@pytest.mark.parametrize("stage_number", [1, 2, 3])
def test_each_rank_file_holds_its_unpadded_shard_and_little_else(stage_number: int, tmp_path: Path) -> None:
    run(stage_number, 3, 1, save_to=tmp_path)
    element_bytes = 4 + 4 + 4 + (2 if stage_number == 3 else 0)
    for rank, owned in enumerate(owned_numels(3)):
        path = ex10.rank_file(tmp_path, rank)
        written, exact = shard_bytes(path)
        assert exact and written == owned * element_bytes, f"rank {rank} wrote {written} bytes, owns {owned} elements"
        assert path.stat().st_size - written < METADATA_BYTES


def layer_numels() -> list[int]:
    return [sum(p.numel() for p in module.parameters()) for _, module in parameter_layers(build_model(MICRO.model))]


def owned_numels(world_size: int) -> list[int]:
    """Per rank, the elements it owns over every layer: what its file must hold, per state."""
    numels = layer_numels()
    return [sum(FlatPartition(n, world_size).owned_numel(r) for n in numels) for r in range(world_size)]


def test_a_padded_shard_fails_the_file_check_and_the_consolidation(tmp_path: Path) -> None:
    run(3, 3, 1, save_to=tmp_path, save=save_with_padding)
    written, _ = shard_bytes(ex10.rank_file(tmp_path, 2))
    assert written > owned_numels(3)[2] * 14
    with pytest.raises(ValueError, match="padding"):
        ex10.consolidate(tmp_path)


def test_files_out_of_rank_order_fail_the_consolidation(tmp_path: Path) -> None:
    run(2, WORLD_SIZE, 1, save_to=tmp_path)
    first, second = ex10.rank_file(tmp_path, 1), ex10.rank_file(tmp_path, 2)
    first.rename(tmp_path / "swap")
    second.rename(first)
    (tmp_path / "swap").rename(second)
    with pytest.raises(ValueError, match="file of rank 1"):
        ex10.consolidate(tmp_path)


def consolidate_in_file_name_order(directory: Path) -> dict[str, torch.Tensor]:
    """Wrong: the rank files in the order a plain sort of their names gives (rank 10 before rank 2), each file's
    pieces of a layer put one after another, the ranges the files record ignored. Returns the masters."""
    checkpoints = [torch.load(path, weights_only=True) for path in sorted(directory.glob("zero_pp_rank_*"))]
    masters = {}
    for index, (name, *_) in enumerate(checkpoints[0]["layers"]):
        pieces = []
        for checkpoint in checkpoints:
            offset = sum(end - start for _, _, start, end in checkpoint["layers"][:index])
            _, _, start, end = checkpoint["layers"][index]
            pieces.append(checkpoint["shards"]["master"][offset : offset + end - start])
        masters[name] = torch.cat(pieces)
    return masters


def test_twelve_rank_files_read_in_name_order_scramble_the_masters(tmp_path: Path) -> None:
    run(1, 12, 1, save_to=tmp_path)
    reference = zero0_states(12, 1)
    assert differences(ex10.consolidate(tmp_path), reference) == []
    scrambled = consolidate_in_file_name_order(tmp_path)
    assert any(not torch.equal(scrambled[name], values) for name, values in reference["master"].items())


def largest_layer_fp32_bytes() -> int:
    return 4 * max(layer_numels())


@pytest.mark.parametrize("stage_number", [1, 2, 3])
def test_saving_holds_no_more_than_the_shards_plus_one_layer(stage_number: int, tmp_path: Path) -> None:
    element_bytes = 4 + 4 + 4 + (2 if stage_number == 3 else 0)
    bounds = [owned * element_bytes + largest_layer_fp32_bytes() for owned in owned_numels(WORLD_SIZE)]
    growths = [growth for _, growth in run(stage_number, WORLD_SIZE, 1, save_to=tmp_path)]
    assert all(growth <= bound for growth, bound in zip(growths, bounds, strict=True)), (growths, bounds)


def test_a_save_through_the_full_state_fails_the_memory_check(tmp_path: Path) -> None:
    bound = max(owned_numels(WORLD_SIZE)) * 14 + largest_layer_fp32_bytes()
    growths = [growth for _, growth in run(3, WORLD_SIZE, 1, save_to=tmp_path, save=save_through_the_full_state)]
    assert min(growths) > bound
