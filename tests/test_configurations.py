"""Configurations beyond the paper's stages: closed forms for memory and traffic, and their step times."""

from __future__ import annotations

import pytest

from zero_core import configurations as cf
from zero_core import formulas, registry, report
from zero_core.planner import configuration_time as ct
from zero_core.planner import time_model as tm
from zero_core.planner.deepspeed_estimators import estimate_zero2_model_states_mem_needs
from zero_core.quantized_bytes import INT4_BYTES, INT8_BYTES
from zero_core.topology import HIERARCHICAL, RING

PSI, N, G = 70e9, 256, 8
C = cf.CONFIGURATIONS


def sent(name: str, algorithm: str = RING, n: int = N, g: int = G) -> cf.Cost:
    return cf.cost(C[name] if name in C else cf.parse_configurations(name)[0], PSI, n, g, algorithm)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_paper_stages_keep_the_papers_memory_and_ring_traffic(stage: int) -> None:
    cost = sent(f"zero{stage}")
    assert cost.gpu_bytes == formulas.model_state_bytes(stage, PSI, N)
    assert cost.network_bytes == pytest.approx(formulas.comm_bytes(stage, PSI, N))


def test_hpz_adds_a_secondary_fp16_partition_of_2psi_over_g() -> None:
    assert sent("zero3+hpz").gpu_bytes - sent("zero3").gpu_bytes == pytest.approx(2 * PSI / G)


def test_hpz_keeps_the_backward_all_gather_inside_the_node() -> None:
    one_pass_across = 2 * PSI * (N - 1) / N / G
    assert sent("zero3").inter_node_bytes - sent("zero3+hpz").inter_node_bytes == pytest.approx(one_pass_across)


def test_qwz_sends_each_weight_all_gather_in_int8_plus_one_scale_per_block() -> None:
    ratio = sent("zero3+qwz").network_bytes / sent("zero3").network_bytes
    assert ratio == pytest.approx((2 * (1 + 4 / 2048) + 2) / 6)
    assert sent("zero3+qwz").gpu_bytes == sent("zero3").gpu_bytes


def test_zeropp_cuts_zero3s_inter_node_bytes_to_a_quarter_up_to_scales() -> None:
    zero3, zeropp = sent("zero3", HIERARCHICAL), sent("zeropp", HIERARCHICAL)
    assert zeropp.inter_node_bytes / zero3.inter_node_bytes == pytest.approx((INT8_BYTES + INT4_BYTES) / 6)
    assert zeropp.inter_node_bytes / zero3.inter_node_bytes == pytest.approx(0.25, rel=0.01)


def test_offload_moves_the_gradient_partition_and_optimizer_states_to_the_host() -> None:
    zero2, offload = sent("zero2"), sent("zero2+offload")
    assert offload.gpu_bytes == 2 * PSI
    assert offload.host_bytes == pytest.approx(zero2.gpu_bytes - offload.gpu_bytes) == pytest.approx(14 * PSI / N)
    deepspeed = estimate_zero2_model_states_mem_needs(int(PSI), num_gpus_per_node=G, num_nodes=N // G)
    assert offload.gpu_bytes == deepspeed.gpu_bytes
    assert offload.pcie_down_bytes == offload.pcie_up_bytes == pytest.approx(2 * PSI / N)
    assert sent("zero3+offload").gpu_bytes == pytest.approx(2 * PSI / N)


@pytest.mark.parametrize("shard", [8, 32, 256])
def test_hsdp_holds_16psi_over_its_shard_group(shard: int) -> None:
    assert sent(f"hsdp:{shard}").gpu_bytes == pytest.approx(16 * PSI / shard)


def test_hsdp_over_all_gpus_is_zero3() -> None:
    hsdp, zero3 = sent(f"hsdp:{N}"), sent("zero3")
    assert (hsdp.intra_node_bytes, hsdp.inter_node_bytes) == pytest.approx(
        (zero3.intra_node_bytes, zero3.inter_node_bytes)
    )


def test_hsdp_over_one_node_sends_only_the_replica_all_reduce_across() -> None:
    m = N // G
    assert sent("hsdp").inter_node_bytes == pytest.approx(2 * (m - 1) / m * 2 * PSI / G)


@pytest.mark.parametrize("text", ["zero4", "hsdp:7", "hsdp:0", ""])
def test_an_unknown_configuration_or_shard_group_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        cf.cost(cf.parse_configurations(text)[0], PSI, N, G)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("n_gpus", [8, 64])
def test_the_configuration_schedule_is_predict_step_for_the_papers_stages(stage: int, n_gpus: int) -> None:
    layers = tm.transformer_layers(8, tm.gpt_block_params(2048), 2048, 1024, 50257, 4096)
    expected = tm.predict_step(stage, layers, tm.DGX_A100, n_gpus)
    got = ct.predict(C[f"zero{stage}"], layers, tm.DGX_A100, n_gpus)
    assert got.step_s == pytest.approx(expected.step_s, rel=1e-12)
    assert got.comm_s == pytest.approx(expected.comm_s, rel=1e-12)


def test_model_layers_sum_to_psi() -> None:
    assert sum(layer.params for layer in ct.model_layers(PSI, 4096)) == pytest.approx(PSI)


def test_on_a_slow_network_with_few_tokens_zeropp_beats_qwz_beats_zero3() -> None:
    slow = tm.DGX_H100.with_(inter_node_bandwidth=tm.DGX_H100.inter_node_bandwidth / 8)
    layers = ct.model_layers(PSI, 512)
    steps = {name: ct.predict(C[name], layers, slow, N).step_s for name in ("zero3", "zero3+qwz", "zeropp")}
    assert steps["zeropp"] < steps["zero3+qwz"] < steps["zero3"]


def test_offload_pays_for_pcie_and_the_host_step() -> None:
    layers = ct.model_layers(PSI, 4096)
    zero3 = ct.predict(C["zero3"], layers, tm.DGX_H100, N)
    offload = ct.predict(C["zero3+offload"], layers, tm.DGX_H100, N)
    host_adam = tm.ADAM_BYTES_PER_PARAM * PSI / N * G / tm.DGX_H100.host_memory_bandwidth
    assert offload.optimizer_s == pytest.approx(host_adam)
    assert offload.step_s > zero3.step_s
    assert any(iv.stream == "pcie" for iv in offload.intervals)


def test_offload_needs_a_machine_with_host_figures() -> None:
    bare = tm.DGX_H100.with_(pcie_bandwidth=0.0)
    with pytest.raises(ValueError, match="PCIe"):
        ct.predict(C["zero2+offload"], ct.model_layers(PSI, 512), bare, N)


def test_every_stage_runs_a_configuration_whose_two_counts_differ_only_where_a_note_says_why() -> None:
    """`compare` sets a stage beside `simulated_gpu_bytes`, `table` prints `gpu_bytes`: one home, two counts."""
    for stage in (*registry.PAPER_STAGES, *registry.NAMED_STAGE_NAMES):
        config = report.stage_configuration(stage)
        same = cf.simulated_gpu_bytes(config, PSI, N, G) == cf.gpu_bytes(config, PSI, N, G)
        assert same == (config.name not in cf.FORMULA_NOTES), config.name
    assert cf.simulated_gpu_bytes(C["zero2+offload"], PSI, N, G) - cf.gpu_bytes(C["zero2+offload"], PSI, N, G) == (
        pytest.approx(2 * PSI / N)
    )
    assert cf.gpu_bytes(C["zeropp"], PSI, N, G) - cf.simulated_gpu_bytes(C["zeropp"], PSI, N, G) == pytest.approx(
        cf.secondary_bytes(C["zeropp"], PSI, G)
    )
