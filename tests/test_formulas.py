"""Specification of zero_core.formulas and zero_core.planner.deepspeed_estimators: the paper's numbers, recomputed."""

import math

import pytest

from zero_core.formulas import (
    MODEL_STATE_CATEGORIES,
    activation_bytes_checkpointed_per_block,
    activation_bytes_estimate,
    activation_bytes_per_layer,
    busbw_factor,
    comm_bytes,
    comm_elements,
    comm_seconds,
    fits,
    largest_model_params,
    model_state_breakdown,
    model_state_bytes,
    plan,
    printed_reading,
    ring_bytes_sent,
    table1,
    table2,
)
from zero_core.planner.deepspeed_estimators import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs,
)
from zero_core.units import parse_count

PSI = 7.5e9
GB = 1e9
N_VALUES = (1, 2, 4, 16, 64, 1024)


@pytest.mark.parametrize("n", N_VALUES)
def test_stage0_replicates_16_bytes_per_parameter(n):
    assert model_state_bytes(0, PSI, n) == 16 * PSI


@pytest.mark.parametrize("n", N_VALUES)
def test_stage1_holds_4psi_plus_12psi_over_n(n):
    assert model_state_bytes(1, PSI, n) == pytest.approx(4 * PSI + 12 * PSI / n)


@pytest.mark.parametrize("n", N_VALUES)
def test_stage2_holds_2psi_plus_14psi_over_n(n):
    assert model_state_bytes(2, PSI, n) == pytest.approx(2 * PSI + 14 * PSI / n)


@pytest.mark.parametrize("n", N_VALUES)
def test_stage3_holds_16psi_over_n(n):
    assert model_state_bytes(3, PSI, n) == pytest.approx(16 * PSI / n)


def test_figure1_example_7_5b_parameters_on_64_gpus():
    per_gpu_gb = [round(model_state_bytes(stage, PSI, 64) / GB, 2) for stage in (0, 1, 2, 3)]
    assert per_gpu_gb == [120.0, 31.41, 16.64, 1.88]
    assert [round(model_state_bytes(stage, PSI, 64) / GB, 1) for stage in (1, 2)] == [31.4, 16.6]


def test_model_state_bytes_follows_k_and_the_training_precisions():
    # fp32 training with a K = 8 optimizer: (4 + 4 + 8)Ψ replicated at stage 0, 4Ψ + (4 + 8)Ψ/N at stage 2.
    assert model_state_bytes(0, 1e9, 8, k=8, param_bytes=4, grad_bytes=4) == 16e9
    assert model_state_bytes(2, 1e9, 8, k=8, param_bytes=4, grad_bytes=4) == pytest.approx(4e9 + 12e9 / 8)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_breakdown_sums_to_model_state_bytes(stage):
    breakdown = model_state_breakdown(stage, PSI, 16)
    assert sum(breakdown.values()) == pytest.approx(model_state_bytes(stage, PSI, 16))


def test_breakdown_partitions_optimizer_then_gradients_then_parameters():
    assert model_state_breakdown(1, 8.0, 4) == {
        "param.fp16": 16.0, "grad.fp16": 16.0, "master.fp32": 8.0, "adam.m": 8.0, "adam.v": 8.0
    }
    assert model_state_breakdown(2, 8.0, 4)["grad.fp16"] == 4.0
    assert model_state_breakdown(3, 8.0, 4)["param.fp16"] == 4.0


def test_breakdown_uses_the_memory_trackers_category_names():
    memory = pytest.importorskip("zero_core.memory")
    assert MODEL_STATE_CATEGORIES == memory.MODEL_STATES
    assert tuple(model_state_breakdown(0, 1.0, 1)) == MODEL_STATE_CATEGORIES


def test_breakdown_refuses_an_optimizer_other_than_mixed_precision_adam():
    with pytest.raises(ValueError, match="K = 12"):
        model_state_breakdown(1, PSI, 4, k=16)


@pytest.mark.parametrize(("stage", "n_gpus"), [(4, 8), (-1, 8), (2, 0)])
def test_model_state_bytes_refuses_unknown_stages_and_empty_clusters(stage, n_gpus):
    with pytest.raises(ValueError, match="stage|GPU"):
        model_state_bytes(stage, PSI, n_gpus)


# ZeRO Table 1 as printed: per model, per N_d, the columns P_os, P_os+g, P_os+g+p in GB (1e9 bytes).
PAPER_TABLE1 = {
    7.5e9: {
        1: ("120", "120", "120"), 4: ("52.5", "41.3", "30"), 16: ("35.6", "21.6", "7.5"),
        64: ("31.4", "16.6", "1.88"), 256: ("30.4", "15.4", "0.47"), 1024: ("30.1", "15.1", "0.12"),
    },
    128e9: {
        1: ("2048", "2048", "2048"), 4: ("896", "704", "512"), 16: ("608", "368", "128"),
        64: ("536", "284", "32"), 256: ("518", "263", "8"), 1024: ("513", "257", "2"),
    },
    1e12: {
        1: ("16000", "16000", "16000"), 4: ("7000", "5500", "4000"), 16: ("4750", "2875", "1000"),
        64: ("4187", "2218", "250"), 256: ("4046", "2054", "62.5"), 1024: ("4011", "2013", "15.6"),
    },
}


def _within_printed_precision(exact: float, printed: str) -> bool:
    """Rounded half up, or truncated, to the printed number of decimals."""
    decimals = len(printed.partition(".")[2])
    scale = 10**decimals
    rounded = math.floor(exact * scale + 0.5 + 1e-9) / scale
    truncated = math.floor(exact * scale + 1e-9) / scale
    return float(printed) in (rounded, truncated)


def test_table1_matches_every_printed_cell():
    cells = 0
    for psi, rows in PAPER_TABLE1.items():
        for n_gpus, printed_row in rows.items():
            assert model_state_bytes(0, psi, n_gpus) / GB == 16 * psi / GB
            for stage, printed in zip((1, 2, 3), printed_row, strict=True):
                exact_gb = model_state_bytes(stage, psi, n_gpus) / GB
                assert _within_printed_precision(exact_gb, printed), (psi, n_gpus, stage, exact_gb, printed)
                cells += 1
    assert cells == 54


def test_table1_function_returns_the_exact_value_beside_the_printed_text():
    rows = table1()
    assert len(rows) == 18
    for row in rows:
        assert tuple(cell.printed for cell in row.cells) == PAPER_TABLE1[row.psi][row.n_gpus]
        assert row.baseline_gb == 16 * row.psi / GB
        for stage, cell in zip((1, 2, 3), row.cells, strict=True):
            assert cell.exact == model_state_bytes(stage, row.psi, row.n_gpus) / GB
            assert cell.reading != "disagrees"


def test_table1_cuts_the_128b_and_1t_fractions_and_rounds_the_7_5b_ones():
    readings = {(row.model, row.n_gpus): [cell.reading for cell in row.cells] for row in table1()}
    assert readings[("128B", 1024)] == ["truncated", "truncated", "exact"]
    assert readings[("1T", 64)] == ["truncated", "truncated", "exact"]
    assert readings[("7.5B", 4)] == ["exact", "rounded", "exact"]
    assert readings[("7.5B", 256)] == ["rounded", "rounded", "rounded"]


@pytest.mark.parametrize(
    ("exact", "printed", "reading"),
    [
        (120.0, "120", "exact"),
        (41.25, "41.3", "rounded"),
        (30.3516, "30.4", "rounded"),
        (513.5, "513", "truncated"),
        (2218.75, "2218", "truncated"),
        (30.567e9, "30.4B", "disagrees"),
        (512e9, "0.5T", "rounded"),
        (7.642e9, "7.6B", "rounded"),
    ],
)
def test_printed_reading_tells_rounding_from_truncation(exact, printed, reading):
    assert printed_reading(exact, printed) == reading


def test_table2_largest_models_on_32gb_gpus_at_64_way_data_parallelism():
    largest = [largest_model_params(32 * GB, 64, stage) for stage in (0, 1, 2, 3)]
    assert largest[0] == pytest.approx(2e9)
    assert largest[1] == pytest.approx(32e9 / (4 + 12 / 64))  # 7.64B, printed 7.6B
    assert largest[2] == pytest.approx(32e9 / (2 + 14 / 64))  # 14.42B, printed 14.4B
    assert largest[3] == pytest.approx(128e9)


def test_table2_first_row_matches_the_paper():
    first = table2()[0]
    assert (first.model_parallel, first.total_gpus) == (1, 64)
    assert [cell.printed for cell in first.cells] == ["2B", "7.6B", "14.4B", "128B"]
    assert [cell.reading for cell in first.cells] == ["exact", "rounded", "rounded", "exact"]


def test_table2_later_rows_are_the_first_row_times_the_model_parallel_degree():
    # The paper scaled its rounded first row (7.6B × 4 = 30.4B; the formula gives 30.57B) and wrote
    # the P_os+g+p column in trillions from 512B on.
    rows = table2()
    first = rows[0]
    assert [row.model_parallel for row in rows] == [1, 2, 4, 8, 16]
    for row in rows:
        assert row.total_gpus == 64 * row.model_parallel
        for cell, first_cell in zip(row.cells, first.cells, strict=True):
            assert cell.exact == pytest.approx(row.model_parallel * first_cell.exact)
            if cell.printed.endswith("T"):
                assert cell.reading == "rounded"
            else:
                assert parse_count(cell.printed) == row.model_parallel * parse_count(first_cell.printed)


def test_fits_adds_activations_to_model_states():
    assert fits(3, PSI, 64, 32 * GB)
    assert not fits(3, PSI, 64, 32 * GB, activation_bytes=31 * GB)


def test_plan_finds_the_smallest_cluster_per_stage_for_7_5b_on_32gb():
    # 16Ψ = 120 GB never fits; 4Ψ + 12Ψ/N fits from N = 64; 2Ψ + 14Ψ/N from 8; 16Ψ/N from 4.
    assert plan(PSI, 32 * GB) == {0: None, 1: 64, 2: 8, 3: 4}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_exact_ring_communication_at_32_gpus_is_1_9375_psi_for_stages_0_to_2(stage):
    assert comm_elements(stage, PSI, 32) == pytest.approx(2 * 31 / 32 * PSI)
    assert comm_elements(stage, 1.0, 32) == pytest.approx(1.9375)


def test_stage3_and_deepspeed_style_zero1_send_three_ring_passes():
    assert comm_elements(3, PSI, 32) == pytest.approx(3 * 31 / 32 * PSI)
    assert comm_elements(1, PSI, 32, zero1_grad_sync="all_reduce") == pytest.approx(3 * 31 / 32 * PSI)


def test_asymptotic_communication_is_2psi_2psi_2psi_3psi():
    assert [comm_elements(stage, 1.0, 32, exact=False) for stage in (0, 1, 2, 3)] == [2, 2, 2, 3]
    assert comm_elements(1, 1.0, 32, exact=False, zero1_grad_sync="all_reduce") == 3


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_single_gpu_sends_nothing(stage):
    assert comm_elements(stage, PSI, 1) == 0


def test_comm_elements_refuses_an_unknown_zero1_gradient_sync():
    with pytest.raises(ValueError, match="zero1_grad_sync"):
        comm_elements(1, PSI, 8, zero1_grad_sync="broadcast")


def test_7_5b_over_50gbps_takes_0_6s_for_stages_0_to_2_and_0_9s_for_stage3():
    for stage in (0, 1, 2):
        sent = comm_bytes(stage, PSI, 32, exact=False)
        assert sent == pytest.approx(30 * GB)
        assert comm_seconds(sent, 50 * GB) == pytest.approx(0.6)
    sent = comm_bytes(3, PSI, 32, exact=False)
    assert sent == pytest.approx(45 * GB)
    assert comm_seconds(sent, 50 * GB) == pytest.approx(0.9)


def test_comm_seconds_pays_the_latency_once_per_message():
    assert comm_seconds(1e9, 1e10, latency_s=5e-6, n_messages=62) == pytest.approx(0.1 + 62 * 5e-6)


def test_comm_seconds_refuses_a_link_without_bandwidth():
    with pytest.raises(ValueError, match="bandwidth"):
        comm_seconds(1e9, 0)


def test_busbw_factors_are_those_of_nccl_tests():
    assert busbw_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert busbw_factor("reduce_scatter", 8) == pytest.approx(7 / 8)
    assert busbw_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert busbw_factor("broadcast", 8) == 1.0
    with pytest.raises(ValueError, match="unknown collective"):
        busbw_factor("all_to_all", 8)


def test_ring_bytes_sent_scales_the_buffer_by_the_busbw_factor():
    assert ring_bytes_sent("all_reduce", 800, 4) == 1200
    assert ring_bytes_sent("reduce_scatter", 800, 4) == 600
    assert ring_bytes_sent("all_gather", 800, 4) == 600
    assert ring_bytes_sent("broadcast", 800, 4) == 800
    assert ring_bytes_sent("broadcast", 800, 1) == 0


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather", "broadcast"])
def test_ring_bytes_sent_is_the_busiest_rank_of_the_interconnect_ledger(op):
    comm = pytest.importorskip("zero_core.comm")
    per_rank = [comm.ring_bytes(op, 4096, 2, 8, rank)[0] for rank in range(8)]
    assert max(per_rank) == ring_bytes_sent(op, 4096, 8)


def test_gpt2_1_5b_activations_are_about_60gb_and_about_8gb_with_checkpointing():
    full = activation_bytes_estimate(hidden=1600, batch=32, seq=1024, layers=48)
    checkpointed = activation_bytes_estimate(hidden=1600, batch=32, seq=1024, layers=48, checkpointing=True)
    assert full == 12 * 1600 * 32 * 1024 * 48 * 2
    assert full / GB == pytest.approx(60, rel=0.01)
    assert checkpointed == pytest.approx(full / math.sqrt(48))
    assert 8 <= checkpointed / GB < 9


# DeepSpeed's estimators, derived by hand from deepspeed/runtime/zero/stage_1_and_2.py and stage3.py.
def test_deepspeed_zero2_without_offload_on_4_nodes_of_8_gpus():
    # total_gpus = 32; gpu = 2P + int(18P/32) = 15e9 + 4.21875e9; cpu = P·4·8·1.5 = 360e9.
    estimate = estimate_zero2_model_states_mem_needs(7_500_000_000, 8, 4, cpu_offload=False)
    assert (estimate.gpu_bytes, estimate.cpu_bytes) == (19_218_750_000, 360_000_000_000)


def test_deepspeed_zero2_with_offload_keeps_only_fp16_parameters_on_the_gpu():
    # gpu = 2P = 2e9; cpu = P·max(4·8, 16)·1.5 = 1e9·32·1.5 = 48e9 (8 GPUs); with 2 GPUs max(8, 16) = 16: 24e9.
    estimate = estimate_zero2_model_states_mem_needs(10**9, num_gpus_per_node=8, cpu_offload=True)
    assert (estimate.gpu_bytes, estimate.cpu_bytes) == (2 * 10**9, 48 * 10**9)
    assert estimate_zero2_model_states_mem_needs(10**9, num_gpus_per_node=2).cpu_bytes == 24 * 10**9


def test_deepspeed_zero2_truncates_the_partitioned_term():
    # P = 7, N = 4: 2·7 + int(18·7/4) = 14 + int(31.5) = 45.
    assert estimate_zero2_model_states_mem_needs(7, 4, 1, cpu_offload=False).gpu_bytes == 45


def test_deepspeed_zero2_holds_4p_over_n_more_than_the_paper():
    estimate = estimate_zero2_model_states_mem_needs(6_400_000_000, 8, 8, cpu_offload=False)
    assert estimate.gpu_bytes - model_state_bytes(2, 6.4e9, 64) == pytest.approx(4 * 6.4e9 / 64)


def test_deepspeed_zero3_without_offload_on_8_nodes_of_8_gpus():
    # L = 0.5e9: gpu = 4L + int(18P/64) = 2e9 + 2.109375e9; zero_init cpu = L·4·8·1.5 = 24e9,
    # without zero_init every GPU's process builds the whole model first: P·4·8·1.5 = 360e9.
    kwargs = dict(num_gpus_per_node=8, num_nodes=8, cpu_offload=False, cpu_offload_params=False)
    with_init = estimate_zero3_model_states_mem_needs(7_500_000_000, 500_000_000, zero_init=True, **kwargs)
    without_init = estimate_zero3_model_states_mem_needs(7_500_000_000, 500_000_000, zero_init=False, **kwargs)
    assert (with_init.gpu_bytes, with_init.cpu_bytes) == (4_109_375_000, 24_000_000_000)
    assert (without_init.gpu_bytes, without_init.cpu_bytes) == (4_109_375_000, 360_000_000_000)
    assert with_init.largest_layer_bytes == 2_000_000_000


def test_deepspeed_zero3_offloading_parameters_leaves_only_the_largest_layer_on_the_gpu():
    # 2 nodes × 8 GPUs, P = 1e9, L = 1e8: gpu = 4L = 4e8.
    # zero_init: cpu = P·18·(1/2)·1.5 = 13.5e9; without: P·max(4·8, 18/2)·1.5 = 48e9.
    # Optimizer-only offload: gpu = 4L + int(2P/16) = 4e8 + 1.25e8; cpu = P·16·(1/2)·1.5 = 12e9.
    both = estimate_zero3_model_states_mem_needs(10**9, 10**8, 8, 2, zero_init=True)
    both_no_init = estimate_zero3_model_states_mem_needs(10**9, 10**8, 8, 2, zero_init=False)
    optimizer_only = estimate_zero3_model_states_mem_needs(10**9, 10**8, 8, 2, cpu_offload_params=False)
    assert (both.gpu_bytes, both.cpu_bytes) == (400_000_000, 13_500_000_000)
    assert both_no_init.cpu_bytes == 48_000_000_000
    assert (optimizer_only.gpu_bytes, optimizer_only.cpu_bytes) == (525_000_000, 12_000_000_000)


def test_deepspeed_zero3_reproduces_its_printout_for_t5_small():
    # estimate_zero3_model_states_mem_needs_all_live(t5-small) on 1 GPU, as printed in
    # https://blog.csdn.net/u012327567/article/details/132278598 (GiB labelled "GB"): t5-small has
    # 60,506,624 parameters; its largest layer is the shared 32128 × 512 embedding.
    total, largest = 60_506_624, 32_128 * 512
    printed = {  # (offload_optimizer, offload_param, zero_init): (per CPU, per GPU)
        (True, True, True): (1.52, 0.06), (True, True, False): (1.52, 0.06),
        (True, False, True): (1.35, 0.17), (True, False, False): (1.35, 0.17),
        (False, False, True): (0.09, 1.08), (False, False, False): (0.34, 1.08),
    }
    for (offload_optimizer, offload_param, zero_init), (cpu_gib, gpu_gib) in printed.items():
        estimate = estimate_zero3_model_states_mem_needs(
            total, largest, cpu_offload=offload_optimizer, cpu_offload_params=offload_param, zero_init=zero_init
        )
        assert round(estimate.cpu_bytes / 2**30, 2) == cpu_gib
        assert round(estimate.gpu_bytes / 2**30, 2) == gpu_gib


def test_the_fuller_activation_count_adds_attentions_quadratic_term() -> None:
    """GPT-2 1.5B (h = 1600, a = 25) at b = 32, s = 1024: s·b·h = 52,428,800, and 34 + 5·25·1024/1600 = 114."""
    per_layer = activation_bytes_per_layer(hidden=1600, heads=25, batch=32, seq=1024)
    assert per_layer == 52_428_800 * 114
    assert activation_bytes_per_layer(hidden=1600, heads=25, batch=32, seq=2048) > 2 * per_layer  # s² grows faster
    checkpointed = activation_bytes_checkpointed_per_block(hidden=1600, heads=25, batch=32, seq=1024, layers=48)
    assert checkpointed == 2 * 52_428_800 * 48 + per_layer
    assert 48 * per_layer / activation_bytes_estimate(hidden=1600, batch=32, seq=1024, layers=48) == 114 / 24
