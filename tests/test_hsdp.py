"""HSDP (ZeRO-3 inside a node, replicas across nodes) and ZeRO++ hpZ, against ZeRO-0 and ZeRO-3.

8 ranks in 2 nodes of 4 (N = 8, G = 4, M = 2), the micro model, 3 steps. Each test states what it
measures against a closed form: memory per rank, bytes per collective, bytes across nodes.
"""

from __future__ import annotations

import pytest

from zero_core import configurations
from zero_core.comm import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER
from zero_core.experiment import equivalence, run_stage
from zero_core.model import preset
from zero_core.partition import FlatPartition
from zero_core.report import StageReport
from zero_core.stages import TrainConfig
from zero_core.stages.base import OVERFLOW_TAG
from zero_core.topology import Topology
from zero_core.variants.hsdp import REPLICA_TAG

N, G = 8, 4
M = N // G
STEPS = 3
TOPOLOGY = Topology(N, G)


def run(stage: int | str, precision: str = "bf16", gpus_per_node: int = G) -> StageReport:
    config = TrainConfig(model=preset("micro"), precision=precision)
    return run_stage(stage, N, STEPS, config, gpus_per_node=gpus_per_node)


@pytest.fixture(scope="module")
def reports() -> dict:
    return {stage: run(stage) for stage in (0, 3, "hsdp", "hpz")}


def inter_node_elements(report: StageReport) -> list[float]:
    """Per rank, elements sent across nodes in the last step (flat ring over each collective's ranks)."""
    links = report.ledger.link_traffic(TOPOLOGY, step=STEPS - 1, exclude_tags=(OVERFLOW_TAG,), in_elements=True)
    return [link.inter_node_sent for link in links]


def node_of(rank: int) -> int:
    return rank // G


def test_hsdp_trains_like_zero0_within_fp32_rounding():
    """fp32: the two-hop mean ((Σ node)/G, then the mean of M of those) rounds differently from Σ/N."""
    zero0, hsdp = run(0, "fp32"), run("hsdp", "fp32")
    assert hsdp.losses[0] == zero0.losses[0], "gathering is exact: the first forward is ZeRO-0's, bit for bit"
    delta = equivalence(zero0, hsdp)
    assert delta.max_loss_delta < 1e-6
    assert 0 < delta.max_master_delta < 1e-5


def test_hsdp_in_bf16_stays_within_a_bf16_gradient_rounding(reports):
    """Adam divides by √v, so a last-bit change of a near-zero gradient can move a weight by up to ~lr."""
    delta = equivalence(reports[0], reports["hsdp"])
    assert reports["hsdp"].losses[0] == reports[0].losses[0]
    assert delta.max_loss_delta < 1e-3
    assert delta.max_master_delta < 2 * STEPS * TrainConfig().adam.lr


def test_hsdp_on_one_node_is_zero3_bit_for_bit():
    assert equivalence(run(0), run("hsdp", gpus_per_node=N)).bit_identical


def test_hsdp_holds_16_psi_over_g_per_rank(reports):
    hsdp = reports["hsdp"]
    assert hsdp.formula_bytes == 16 * hsdp.psi / G
    assert hsdp.model_state_bytes_mean == hsdp.formula_bytes, "padding is reported apart, never as model state"
    assert hsdp.model_state_bytes_mean == reports[3].model_state_bytes_mean * N / G


def test_hsdp_parameter_gathers_and_gradient_reduce_scatters_never_leave_the_node(reports):
    for rank, ledger in enumerate(reports["hsdp"].ledger.ranks):
        for entry in ledger.entries:
            if entry.op in (ALL_GATHER, REDUCE_SCATTER):
                assert len(entry.group) == G and {node_of(r) for r in entry.group} == {node_of(rank)}


def test_hsdp_replica_all_reduce_bytes_are_the_closed_form(reports):
    """Per layer: the rank's 1/G shard (chunk of the G-way partition, 2 bytes an element) all-reduced among
    the M ranks with its local index: 2(M-1)/M of it sent, all across nodes."""
    hsdp = reports["hsdp"]
    psi_padded = sum(FlatPartition(numel, G).padded_numel for numel in layer_numels(hsdp))
    expected = 2 * (M - 1) / M * psi_padded / G * 2
    for rank, ledger in enumerate(hsdp.ledger.ranks):
        replica = [e for e in ledger.entries if e.step == STEPS - 1 and e.tag.endswith(REPLICA_TAG)]
        assert {e.op for e in replica} == {ALL_REDUCE}
        assert all(e.group == tuple(range(rank % G, N, G)) for e in replica)
        assert sum(e.bytes_sent for e in replica) == expected
    assert inter_node_elements(hsdp) == [expected / 2] * N, "the replica all-reduce is the only inter-node traffic"


def layer_numels(report: StageReport) -> list[int]:
    return [values.numel() for values in report.master_weights.values()]


def test_hsdp_sends_fewer_bytes_across_nodes_than_zero3(reports):
    """ZeRO-3's flat ring: each node's boundary rank sends its 3(N-1)/N·Ψ across; HSDP: 2(M-1)/M·Ψ/G a rank."""
    zero3, hsdp = inter_node_elements(reports[3]), inter_node_elements(reports["hsdp"])
    psi = reports[3].psi
    assert max(zero3) == pytest.approx(3 * (N - 1) / N * psi, rel=0.01)
    assert max(hsdp) == pytest.approx(2 * (M - 1) / M * psi / G, rel=0.01)
    assert sum(hsdp) < sum(zero3) / 2


def test_hsdp_traffic_matches_its_formula(reports):
    hsdp = reports["hsdp"]
    assert hsdp.comm_psi_per_step == pytest.approx(hsdp.comm_formula_psi_padded, rel=1e-12)
    assert hsdp.comm_formula_psi == pytest.approx(3 * (G - 1) / G + 2 * (M - 1) / M / G)


def test_hpz_trains_to_zero3s_weights_bit_for_bit(reports):
    assert equivalence(reports[0], reports["hpz"]).bit_identical


def test_hpz_backward_gathers_stay_in_the_node_and_forward_gathers_span_every_rank(reports):
    for rank, ledger in enumerate(reports["hpz"].ledger.ranks):
        gathers = [e for e in ledger.entries if e.op == ALL_GATHER]
        forward = [e for e in gathers if e.phase == "forward"]
        backward = [e for e in gathers if e.phase == "backward"]
        assert len(forward) == len(backward) > 0
        assert all(e.group == () for e in forward)
        assert all({node_of(r) for r in e.group} == {node_of(rank)} and len(e.group) == G for e in backward)


def test_hpz_sends_two_thirds_of_zero3s_bytes_across_nodes(reports):
    """The backward gather, one of ZeRO-3's three passes over every rank, moves into the node."""
    zero3, hpz = inter_node_elements(reports[3]), inter_node_elements(reports["hpz"])
    assert sum(hpz) / sum(zero3) == pytest.approx(2 / 3, rel=1e-3)
    assert reports["hpz"].comm_psi_per_step == pytest.approx(reports["hpz"].comm_formula_psi_padded, rel=1e-3)


def test_hpz_keeps_zero3s_model_states_and_adds_the_secondary_partition_at_its_peak(reports):
    zero3, hpz = reports[3], reports["hpz"]
    assert hpz.model_state_bytes_mean == zero3.model_state_bytes_mean == 16 * hpz.psi / N
    secondary = configurations.secondary_bytes(configurations.CONFIGURATIONS["zero3+hpz"], hpz.psi, G)
    extra = hpz.peak_bytes_by_category_max["gather.fp16"] - zero3.peak_bytes_by_category_max["gather.fp16"]
    assert secondary * 0.75 < extra <= secondary + sum(FlatPartition(n, G).padding for n in layer_numels(hpz)) * 2
