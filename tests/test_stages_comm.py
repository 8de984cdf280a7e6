"""What goes on the wire: 2Ψ for ZeRO-0/1/2, 3Ψ for ZeRO-3 (ring-exact), in the right collectives."""

from __future__ import annotations

import pytest

from zero_core import formulas
from zero_core.experiment import run_stage
from zero_core.model import build_model, parameter_layers, preset
from zero_core.partition import FlatPartition
from zero_core.stages import TrainConfig

MICRO = TrainConfig(model=preset("micro"))
LAYERS = len(parameter_layers(build_model(MICRO.model)))


def padded_psi(world_size: int) -> int:
    model = build_model(MICRO.model)
    return sum(
        FlatPartition(sum(p.numel() for p in m.parameters()), world_size).padded_numel
        for _, m in parameter_layers(model)
    )


@pytest.mark.parametrize("world_size", [2, 3, 7, 32])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_traffic_per_step_equals_the_ring_formula(stage: int, world_size: int) -> None:
    report = run_stage(stage, world_size, 2, MICRO)
    communicated = report.psi if stage == 0 else padded_psi(world_size)
    expected_elements = formulas.comm_elements(stage, communicated, world_size, exact=True)
    assert report.comm_elements_per_step_mean == pytest.approx(expected_elements, rel=1e-12)
    assert report.comm_psi_per_step == pytest.approx(report.comm_formula_psi_padded, rel=1e-12)


def test_zero1_all_reduce_variant_moves_three_psi() -> None:
    config = TrainConfig(model=preset("micro"), zero1_grad_sync="all_reduce")
    report = run_stage(1, 4, 1, config)
    expected = formulas.comm_elements(1, padded_psi(4), 4, exact=True, zero1_grad_sync="all_reduce")
    assert report.comm_elements_per_step_mean == pytest.approx(expected, rel=1e-12)
    assert report.collectives_by_op_per_step["all_reduce"] == LAYERS + 1


@pytest.mark.parametrize(
    ("stage", "expected"),
    [
        (0, {"all_reduce": LAYERS}),
        (1, {"reduce_scatter": LAYERS, "all_gather": LAYERS, "all_reduce": 1}),
        (2, {"reduce_scatter": LAYERS, "all_gather": LAYERS, "all_reduce": 1}),
        (3, {"reduce_scatter": LAYERS, "all_gather": 2 * LAYERS, "all_reduce": 1}),
    ],
)
def test_each_stage_calls_the_collectives_of_its_algorithm(stage: int, expected: dict[str, int]) -> None:
    report = run_stage(stage, 4, 1, MICRO)
    assert report.collectives_by_op_per_step == expected


def test_zero3_gathers_in_forward_and_again_in_backward() -> None:
    report = run_stage(3, 2, 1, MICRO)
    gathers = [e for e in report.ledger.entries(0) if e.op == "all_gather"]
    assert sum(e.phase == "forward" for e in gathers) == LAYERS
    assert sum(e.phase == "backward" for e in gathers) == LAYERS
    reduces = [e for e in report.ledger.entries(0) if e.op == "reduce_scatter"]
    assert all(e.phase == "backward" for e in reduces)


def test_zero2_reduces_gradients_during_backward_and_zero1_after_it() -> None:
    zero1 = run_stage(1, 2, 1, MICRO)
    zero2 = run_stage(2, 2, 1, MICRO)
    assert {e.phase for e in zero1.ledger.entries(0) if e.op == "reduce_scatter"} == {"grad_sync"}
    assert {e.phase for e in zero2.ledger.entries(0) if e.op == "reduce_scatter"} == {"backward"}
