"""Activation bytes by checkpointing mode (`zero_core.planner.activations`), recomputation in the step, MFU and ties
(`zero_core.planner.step_breakdown`), the stage's buffers (`zero_core.planner.gpu_memory`)."""

from __future__ import annotations

import pytest

from zero_core.configurations import CONFIGURATIONS
from zero_core.planner import activations, gpu_memory, step_breakdown
from zero_core.planner.configuration_time import predict, shape_layers
from zero_core.planner.models import PRESETS
from zero_core.planner.time_model import DGX_A100

LLAMA_13B = PRESETS["llama-2-13b"]
SHAPE = dict(layers=40, hidden=5120, heads=40, ffn=13824, vocabulary=32000, seq_len=4096, micro_batch=1)


def test_full_checkpointing_holds_less_than_selective_which_holds_less_than_none() -> None:
    totals = [activations.activation_bytes(**SHAPE, checkpointing=mode).total for mode in ("none", "selective", "full")]
    assert totals[0] > totals[1] > totals[2]


def test_at_an_ffn_of_4h_a_layer_holds_the_papers_34_plus_5as_over_h_bytes_per_sbh() -> None:
    s, b, h, a = 2048, 1, 12288, 96
    rest, scores = activations.layer_bytes(s, b, h, a, 4 * h)
    assert rest + scores == pytest.approx(s * b * h * (34 + 5 * a * s / h))


def test_full_checkpointing_stores_each_layers_16_bit_input_and_recomputes_one_whole_layer() -> None:
    full = activations.activation_bytes(**SHAPE, checkpointing="full")
    rest, scores = activations.layer_bytes(4096, 1, 5120, 40, 13824)
    assert full.stored == 40 * 2 * 4096 * 5120 and full.recomputing == rest + scores


def test_activations_grow_linearly_with_the_micro_batch() -> None:
    one = activations.activation_bytes(**SHAPE, checkpointing="selective").total
    two = activations.activation_bytes(**{**SHAPE, "micro_batch": 2}, checkpointing="selective").total
    assert two == pytest.approx(2 * one)


def test_an_unknown_checkpointing_mode_is_refused_naming_the_modes() -> None:
    with pytest.raises(ValueError, match="none, selective, full"):
        activations.activation_bytes(**SHAPE, checkpointing="some")


def test_recomputation_adds_forward_flops_selective_less_than_full() -> None:
    layers = shape_layers(LLAMA_13B, 4096)
    extra = {mode: sum(x.backward_flops for x in step_breakdown.with_recompute(layers, mode, 5120, 4096, 4096))
             - sum(x.backward_flops for x in layers) for mode in ("none", "selective", "full")}
    block_forward = sum(x.forward_flops for x in layers if x.name.startswith("block"))
    assert extra["none"] == 0 < extra["selective"] < extra["full"] == pytest.approx(block_forward)


def test_mfu_falls_when_communication_is_exposed() -> None:
    layers = shape_layers(LLAMA_13B, 4096)
    slow_network = DGX_A100.with_(inter_node_bandwidth=DGX_A100.inter_node_bandwidth / 50)
    mfus = []
    for machine in (DGX_A100, slow_network):
        p = predict(CONFIGURATIONS["zero2"], layers, machine, 32)
        mfus.append((step_breakdown.breakdown(p, layers, 0.0, machine, 4096), p))
    (fast, p_fast), (slow, p_slow) = mfus
    assert slow.exposed_comm_s > fast.exposed_comm_s and slow.mfu < fast.mfu
    assert fast.mfu <= DGX_A100.achieved_fraction


def test_recomputation_lowers_mfu_but_not_the_models_flops() -> None:
    layers = shape_layers(LLAMA_13B, 4096)
    timed = step_breakdown.with_recompute(layers, "full", 5120, 4096, 4096)
    plain = step_breakdown.breakdown(predict(CONFIGURATIONS["zero2"], layers, DGX_A100, 32), layers, 0, DGX_A100, 4096)
    redo = step_breakdown.breakdown(predict(CONFIGURATIONS["zero2"], timed, DGX_A100, 32), layers, 1, DGX_A100, 4096)
    assert redo.model_flops == plain.model_flops and redo.mfu < plain.mfu


def test_offload_waits_on_pcie_and_says_so() -> None:
    layers = shape_layers(LLAMA_13B, 4096)
    p = predict(CONFIGURATIONS["zero2+offload"], layers, DGX_A100, 32)
    assert step_breakdown.breakdown(p, layers, 0.0, DGX_A100, 4096).exposed_pcie_s > 0


def test_times_within_the_error_share_a_rank_and_a_slower_one_starts_a_new_rank() -> None:
    assert step_breakdown.tie_groups([1.0, 1.15, 1.25, 1.4], 0.2) == [1, 1, 3, 3]


def test_the_time_models_error_is_its_validation_against_published_throughput() -> None:
    rows = step_breakdown.validation()
    assert {r.size for r in rows} == {"34B", "70B"} and all(-0.3 < r.error < 0 for r in rows)
    error, basis = step_breakdown.time_model_error(LLAMA_13B.psi)
    assert error == max(abs(r.error) for r in rows if r.size == "34B") and "34B" in basis


def test_zero3_gathers_two_largest_layers_and_zero2_none() -> None:
    act = activations.activation_bytes(**SHAPE)
    z3 = gpu_memory.gpu_memory(3, 0, act, 13e9, 3e8, 0, 32)
    z2 = gpu_memory.gpu_memory(2, 0, act, 13e9, 3e8, 0, 32)
    assert z3.gathered_parameters == 2 * 2 * 3e8 and z2.gathered_parameters == 0
    assert z2.gradient_bucket == 2 * gpu_memory.REDUCE_BUCKET_ELEMENTS


def test_llamas_persistent_tensors_are_its_norms() -> None:
    assert gpu_memory.small_tensor_elements(LLAMA_13B) == (2 * 40 + 1) * 5120
