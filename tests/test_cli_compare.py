"""`python -m zero_core compare`: the tables, the JSON, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zero_core.cli import main
from zero_core.configurations import CONFIGURATIONS, FORMULA_NOTES
from zero_core.planner.configuration_time import model_layers, predict
from zero_core.planner.time_model import DGX_A100, H100_800G


def test_compare_prints_the_four_tables_and_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "compare.json"
    code = main(
        ["compare", "--world-size", "3", "--steps", "2", "--preset", "micro", "--no-progress", "--json", str(out)]
    )
    text = capsys.readouterr().out
    assert code == 0
    for title in ("Model states per GPU", "Equivalence", "Compute per GPU", "Memory breakdown"):
        assert title in text
    assert text.count("1.0000") >= 4, "every stage's measured/formula ratio is printed as 1.0000"
    data = json.loads(out.read_text())
    assert data["schema"] == "zero-course/compare/1"
    assert [s["stage"] for s in data["stages"]] == [0, 1, 2, 3]
    assert all(e["bit_identical"] for e in data["equivalence"])
    assert data["stages"][3]["comm_psi_per_step"] > data["stages"][0]["comm_psi_per_step"]
    assert "inter-node" not in text, "the link columns show only when --gpus-per-node or --collectives asks"
    assert (data["gpus_per_node"], data["nodes"], data["collectives"]) == (3, 1, "ring")
    for stage in data["stages"]:
        assert stage["comm_inter_node_bytes_per_step_max"] == 0
        assert stage["comm_intra_node_psi_per_step"] == pytest.approx(stage["comm_psi_per_step"])



def test_compare_says_under_the_model_states_why_offload_is_not_tables_2_psi(capsys) -> None:
    argv = ["compare", "--world-size", "2", "--steps", "1", "--preset", "micro", "--stages", "2,offload"]
    assert main([*argv, "--no-progress"]) == 0
    text = capsys.readouterr().out
    states = text[text.index("Model states per GPU") : text.index("Equivalence")]
    assert "2Ψ + 2Ψ/N" in states
    assert states.rstrip().endswith(FORMULA_NOTES["zero2+offload"])

def compare_on_nodes(tmp_path, capsys, collectives: str) -> tuple[str, dict]:
    out = tmp_path / "nodes.json"
    argv = ["compare", "--world-size", "4", "--steps", "1", "--preset", "micro", "--gpus-per-node", "2"]
    code = main([*argv, "--collectives", collectives, "--no-progress", "--json", str(out)])
    assert code == 0
    return capsys.readouterr().out, json.loads(out.read_text())


def test_compare_splits_the_flat_rings_traffic_at_node_boundaries(tmp_path, capsys) -> None:
    text, data = compare_on_nodes(tmp_path, capsys, "ring")
    assert "2 nodes of 2 GPUs" in text and "inter-node, busiest GPU" in text
    assert (data["gpus_per_node"], data["nodes"], data["collectives"]) == (2, 2, "ring")
    for stage in data["stages"]:
        total = stage["comm_psi_per_step"]
        assert stage["comm_intra_node_psi_per_step"] + stage["comm_inter_node_psi_per_step"] == pytest.approx(total)
        assert stage["comm_inter_node_psi_per_step"] == pytest.approx(total / 2), "one rank in two sends across"
        assert stage["comm_inter_node_psi_per_step_max"] == pytest.approx(total), "and sends all its bytes there"
        senders = [r for r, link in enumerate(stage["link_bytes_per_step_by_rank"]) if link["inter_node_sent"]]
        assert senders == [1, 3]


def test_compare_hierarchical_sends_a_quarter_across_on_two_nodes_of_two(tmp_path, capsys) -> None:
    """N = 4, G = 2, M = 2: per pass (M-1)/M·Ψ/G = Ψ/4 across and (G-1)/G·Ψ = Ψ/2 inside, on every rank."""
    text, data = compare_on_nodes(tmp_path, capsys, "hierarchical")
    assert "collectives hierarchical" in text
    for stage in data["stages"]:
        passes = stage["comm_psi_per_step"] / (3 / 4)
        assert stage["comm_inter_node_psi_per_step"] == pytest.approx(passes / 4)
        assert stage["comm_inter_node_psi_per_step_max"] == pytest.approx(passes / 4)
        assert stage["comm_intra_node_psi_per_step"] == pytest.approx(passes / 2)


def test_compare_predicts_every_stages_step_time_on_the_machine(tmp_path, capsys) -> None:
    """The named stages sit in every table, the predicted times included; the times are the time model's for
    the stage's configuration, recomputed here: hpZ's network time is below ZeRO-3's, ZeRO++'s below hpZ's."""
    out = tmp_path / "named.json"
    argv = ["compare", "--world-size", "4", "--steps", "1", "--preset", "micro", "--gpus-per-node", "2"]
    argv += ["--stages", "0,3,offload,hsdp,hpz,zeropp", "--machine", "h100-800g", "--tokens-per-gpu", "2048"]
    assert main([*argv, "--no-progress", "--json", str(out)]) == 0
    text, data = capsys.readouterr().out, json.loads(out.read_text())
    assert "Predicted step time on H100 80GB" in text and "Ψ = 7.5B at 2,048 tokens per GPU" in text
    for label in ("ZeRO-Offload", "HSDP", "ZeRO++ hpZ", "ZeRO++ (ZeRO-3 + hpZ + qwZ + qgZ)"):
        assert label in text
    predicted = data["predicted"]
    assert (predicted["scaled_psi"], predicted["tokens_per_gpu"]) == (7_500_000_000, 2048)
    rows = {row["stage"]: row for row in predicted["stages"]}
    assert list(rows) == [0, 3, "offload", "hsdp", "hpz", "zeropp"]
    assert rows["offload"]["configuration"] == "zero2+offload"
    expected = predict(CONFIGURATIONS["zeropp"], model_layers(7.5e9, 2048), H100_800G, 4, 2)
    assert rows["zeropp"]["scaled_model"]["step_s"] == pytest.approx(expected.step_s)
    comm = {stage: row["scaled_model"]["comm_s"] for stage, row in rows.items()}
    assert comm["zeropp"] < comm["hpz"] < comm[3], "hpZ's backward gather runs on NVLink, ZeRO++ sends int8/int4"
    assert rows["offload"]["scaled_model"]["optimizer_s"] > 10 * rows[0]["scaled_model"]["optimizer_s"] / 4
    assert all(row["this_model"]["step_s"] > 0 for row in rows.values())


@pytest.mark.parametrize("world_size, nodes_of", [(16, 8), (12, 6), (3, 3)])
def test_without_gpus_per_node_the_prediction_uses_the_machines_nodes(tmp_path, capsys, world_size, nodes_of) -> None:
    """A run on one node still predicts for the machine's nodes (8 GPUs on a DGX A100; the largest divisor of N
    below that where N is no multiple of 8): 16 GPUs on one NVLink domain would hide the network."""
    out = tmp_path / "run.json"
    argv = ["compare", "--world-size", str(world_size), "--steps", "1", "--preset", "micro", "--stages", "0"]
    assert main([*argv, "--no-progress", "--json", str(out)]) == 0
    text, data = capsys.readouterr().out, json.loads(out.read_text())
    said = f"N = {world_size} in nodes of {nodes_of} (the machine's; --gpus-per-node sets them)"
    assert said in " ".join(text.split())
    assert data["gpus_per_node"] == world_size, "the run itself is on one node"
    assert data["predicted"]["gpus_per_node"] == nodes_of
    expected = predict(CONFIGURATIONS["zero0"], model_layers(7.5e9, 4096), DGX_A100, world_size, nodes_of)
    assert data["predicted"]["stages"][0]["scaled_model"]["step_s"] == pytest.approx(expected.step_s)


def test_named_stages_get_figures_and_trace_processes(tmp_path, capsys) -> None:
    trace = tmp_path / "step.json"
    argv = ["compare", "--world-size", "2", "--steps", "2", "--preset", "micro", "--stages", "0,offload,hpz"]
    assert main([*argv, "--no-progress", "--plots", str(tmp_path / "figures"), "--trace", str(trace)]) == 0
    names = sorted(path.name for path in (tmp_path / "figures").iterdir())
    assert {"memory_timeline_zero0.png", "memory_timeline_offload.png", "memory_timeline_hpz.png"} <= set(names)
    processes = {
        event["pid"]: event["args"]["name"]
        for event in json.loads(trace.read_text())["traceEvents"]
        if event["name"] == "process_name"
    }
    assert processes == {
        0: "ZeRO-0, 2 virtual GPUs, step 1",
        4: "ZeRO-Offload, 2 virtual GPUs, step 1",
        6: "ZeRO++ hpZ, 2 virtual GPUs, step 1",
    }


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--world-size", "0"], "--world-size"),
        (["--world-size", "100000"], "--world-size"),
        (["--steps", "0"], "--steps"),
        (["--stages", "0,5"], "--stages"),
        (["--stages", "one"], "--stages"),
        (["--preset", "huge"], "--preset"),
        (["--world-size", "two"], "--world-size"),
        (["--json", "/no/such/folder/x.json"], "--json"),
        (["--world-size", "4", "--gpus-per-node", "3"], "--gpus-per-node"),
        (["--world-size", "4", "--gpus-per-node", "0"], "--gpus-per-node"),
        (["--collectives", "tree"], "--collectives"),
        (["--machine", "laptop"], "--machine"),
        (["--tokens-per-gpu", "0"], "--tokens-per-gpu"),
        (["--predict-params", "7.5X"], "--predict-params"),
    ],
)
def test_bad_input_gets_one_line_and_exit_code_2(args: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        code = main(["compare", *args, "--no-progress"])
        raise SystemExit(code)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_the_module_runs_as_a_command() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "zero_core",
            "compare",
            "--world-size",
            "2",
            "--steps",
            "1",
            "--preset",
            "micro",
            "--stages",
            "0,3",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "ZeRO-3" in result.stdout and "ZeRO-1" not in result.stdout


def test_compare_fits_100_columns_and_wide_keeps_each_table_whole(capsys) -> None:
    argv = ["compare", "--world-size", "4", "--steps", "1", "--preset", "micro", "--gpus-per-node", "2"]
    argv += ["--stages", "0,3,offload,zeropp", "--no-progress", "--jobs", "1"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert max(len(line) for line in text.splitlines()) <= 100
    assert main([*argv, "--wide"]) == 0
    wide = capsys.readouterr().out
    header = next(line for line in wide.splitlines() if line.startswith("stage") and "measured/GPU" in line)
    assert header.split()[-1] == "GPU" and "inter-node, busiest GPU" in header and len(header) > 100
