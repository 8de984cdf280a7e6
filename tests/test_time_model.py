"""The time model: collective times in closed form, overlap bounds, and the stages' schedules."""

from __future__ import annotations

import json

import pytest

from zero_core.planner import time_model as tm

MACHINE = tm.DGX_A100


def layers(tokens: int = 4096, n_layers: int = 8) -> list[tm.Layer]:
    return tm.transformer_layers(n_layers, tm.gpt_block_params(2048), 2048, 1024, 50257, tokens)


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather"])
@pytest.mark.parametrize("n_gpus", [4, 8, 64])
def test_a_ring_collective_takes_alpha_per_step_plus_bytes_times_factor_over_beta(op: str, n_gpus: int) -> None:
    size = 3e8
    steps = (2 if op == "all_reduce" else 1) * (n_gpus - 1)
    factor = (2 if op == "all_reduce" else 1) * (n_gpus - 1) / n_gpus
    network = min(MACHINE.intra_node_bandwidth, 8 * MACHINE.inter_node_bandwidth)
    beta = MACHINE.intra_node_bandwidth if n_gpus <= 8 else network
    expected = steps * MACHINE.latency_s(n_gpus) + size * factor / beta
    assert tm.collective_seconds(MACHINE, op, size, n_gpus) == pytest.approx(expected, rel=1e-12)


def test_a_tree_all_reduce_pays_two_log2_n_latencies() -> None:
    tree = MACHINE.with_(algorithm="tree")
    bandwidth_term = 2 * 1023 / 1024 * 1e6 / tree.bus_bandwidth(1024)
    expected = 20 * tree.inter_node_latency_s + bandwidth_term
    assert tm.collective_seconds(tree, "all_reduce", 1e6, 1024) == pytest.approx(expected)
    ring = tm.collective_seconds(MACHINE, "all_gather", 1e6, 1024)
    assert tm.collective_seconds(tree, "all_gather", 1e6, 1024) == ring


def test_across_nodes_the_ring_runs_at_the_nodes_network_bandwidth() -> None:
    assert MACHINE.bus_bandwidth(8) == MACHINE.intra_node_bandwidth
    assert MACHINE.bus_bandwidth(16) == 8 * MACHINE.inter_node_bandwidth


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("tokens", [256, 4096, 65536])
def test_overlap_never_beats_the_busier_stream_nor_loses_to_running_both_in_turn(stage: int, tokens: int) -> None:
    p = tm.predict_step(stage, layers(tokens), MACHINE, 64)
    assert max(p.compute_s, p.comm_s) <= p.step_s * (1 + 1e-12)
    assert p.step_s <= (p.compute_s + p.comm_s) * (1 + 1e-12)


@pytest.mark.parametrize("tokens", [256, 4096, 65536])
def test_zero2_exposes_no_more_communication_than_zero1(tokens: int) -> None:
    zero1 = tm.predict_step(1, layers(tokens), MACHINE, 64)
    zero2 = tm.predict_step(2, layers(tokens), MACHINE, 64)
    assert zero2.comm_s == pytest.approx(zero1.comm_s)
    assert zero2.exposed_comm_s <= zero1.exposed_comm_s


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_optimizer_step_overlaps_no_collective(stage: int) -> None:
    p = tm.predict_step(stage, layers(), MACHINE, 64)
    (opt,) = [iv for iv in p.intervals if iv.kind == "optimizer"]
    assert opt.end_s > opt.start_s
    for iv in p.intervals:
        if iv.stream == "comm":
            assert iv.end_s <= opt.start_s or iv.start_s >= opt.end_s, iv


def test_zero0_and_zero1_hide_nothing_so_their_step_is_compute_plus_communication() -> None:
    for stage in (0, 1):
        p = tm.predict_step(stage, layers(), MACHINE, 64)
        assert p.step_s == pytest.approx(p.compute_s + p.comm_s)


def test_zero3_without_prefetch_waits_for_every_gather() -> None:
    none = tm.predict_step(3, layers(), MACHINE, 64, prefetch_depth=0)
    one = tm.predict_step(3, layers(), MACHINE, 64, prefetch_depth=1)
    assert one.step_s < none.step_s


def test_more_tokens_per_gpu_never_expose_a_larger_share_of_the_step() -> None:
    predictions = [tm.predict_step(3, layers(t), MACHINE, 64) for t in (128, 1024, 8192, 65536)]
    shares = [p.exposed_comm_s / p.step_s for p in predictions]
    assert shares == sorted(shares, reverse=True)


def test_break_even_tokens_grow_as_the_network_gets_slower() -> None:
    fast = tm.break_even_tokens(3, layers, MACHINE, 64)
    slow = tm.break_even_tokens(3, layers, MACHINE.with_(inter_node_bandwidth=MACHINE.inter_node_bandwidth / 4), 64)
    assert fast < slow
    p = tm.predict_step(3, layers(fast), MACHINE, 64)
    assert p.exposed_comm_s <= 0.05 * p.step_s
    q = tm.predict_step(3, layers(fast - 1), MACHINE, 64)
    assert q.exposed_comm_s > 0.05 * q.step_s


def test_zero3_becomes_communication_bound_earlier_with_fewer_tokens() -> None:
    few = tm.zero3_comm_bound_gpus(layers(256), MACHINE)
    many = tm.zero3_comm_bound_gpus(layers(8192), MACHINE)
    assert few is not None and many is not None and few < many


def test_the_trace_has_a_compute_and_a_comm_lane_per_stage(tmp_path) -> None:
    predictions = [tm.predict_step(s, layers(), MACHINE, 64) for s in (0, 3)]
    path = tm.write_chrome_trace(predictions, tmp_path / "t.json")
    events = json.loads(path.read_text())["traceEvents"]
    lanes = {(e["pid"], e["tid"]) for e in events if e["ph"] == "X"}
    assert lanes == {(0, 0), (0, 1), (3, 0), (3, 1)}
    assert all(e["dur"] > 0 for e in events if e["ph"] == "X")


def test_a_real_runs_ledger_gives_the_layers_and_their_bytes() -> None:
    from zero_core.experiment import run_stage
    from zero_core.model import preset
    from zero_core.stages import TrainConfig

    report = run_stage(3, 4, 1, TrainConfig(model=preset("micro")))
    found = tm.layers_from_report(report)
    assert sum(layer.params for layer in found) == report.psi
    assert sum(layer.forward_flops for layer in found) == pytest.approx(report.flops_per_step_mean["forward"])
