"""ZeRO-Offload (zero_core/variants/offload.py): ZeRO-2's training, optimizer states and step on the host."""

import pytest

from zero_core import configurations, memory
from zero_core.experiment import equivalence, run_stage
from zero_core.model import preset
from zero_core.stages import TrainConfig, stage_class
from zero_core.variants.offload import OffloadZero2

WORLD_SIZE, STEPS = 4, 3
OFFLOAD = configurations.CONFIGURATIONS["zero2+offload"]


@pytest.fixture(scope="module")
def runs():
    config = TrainConfig(model=preset("micro"))
    return run_stage(0, WORLD_SIZE, STEPS, config), run_stage("offload", WORLD_SIZE, STEPS, config)


def test_offload_is_registered_by_name():
    assert stage_class("offload") is OffloadZero2


def test_offload_trains_bit_identically_to_zero0(runs):
    zero0, offload = runs
    assert equivalence(zero0, offload).bit_identical


def test_offload_keeps_no_optimizer_state_on_the_gpu(runs):
    _, offload = runs
    for category in (memory.MASTER, memory.ADAM_M, memory.ADAM_V):
        assert offload.model_state_bytes_by_category_max[category] == 0
    assert offload.model_state_bytes_mean == configurations.simulated_gpu_bytes(
        OFFLOAD, offload.psi, WORLD_SIZE, WORLD_SIZE
    )


def test_offload_host_holds_14_psi_over_n(runs):
    _, offload = runs
    host = sum(offload.peak_bytes_by_category_max[c] for c in memory.HOST_STATES)
    assert host == pytest.approx(configurations.host_bytes(OFFLOAD, offload.psi, WORLD_SIZE), rel=0.01)
    assert offload.peak_bytes_by_category_max[memory.HOST_MASTER] > 0


def test_offload_pcie_bytes_are_2_psi_over_n_each_way(runs):
    """The owned ranges partition the Ψ parameters, so the ranks' copies add up to 2Ψ bytes each way."""
    _, offload = runs
    for op in ("d2h", "h2d"):
        per_rank = [offload.ledger.pcie_bytes(r, op, step=STEPS - 1) for r in range(WORLD_SIZE)]
        assert sum(per_rank) == 2 * offload.psi
        assert sum(per_rank) / WORLD_SIZE == configurations.pcie_bytes(OFFLOAD, offload.psi, WORLD_SIZE)


def test_host_copies_put_no_bytes_on_the_network(runs):
    _, offload = runs
    zero2 = run_stage(2, WORLD_SIZE, 1, TrainConfig(model=preset("micro")))
    assert offload.comm_psi_per_step == zero2.comm_psi_per_step
    assert offload.collectives_per_step == zero2.collectives_per_step
