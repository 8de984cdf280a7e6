"""`python -m zero_core table` and `plan`: the paper's numbers at real scale, human units, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from zero_core.cli import main
from zero_core.configurations import FORMULA_NOTES

REPO = Path(__file__).resolve().parents[1]


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """Run the CLI in-process; argparse's own errors exit through SystemExit, ours return the code."""
    try:
        code = main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def stage_line(text: str, stage: int, after: str = "") -> str:
    """The first line of the table titled `after` (or of any table) that starts with ZeRO-`stage`."""
    text = text[text.index(after) :] if after else text
    return next(line for line in text.splitlines() if line.startswith(f"ZeRO-{stage} "))


def test_table_prints_figure1_memory_for_7_5b_on_64_gpus(capsys) -> None:
    code, out, err = run_cli(["table", "--params", "7.5B", "--gpus", "64"], capsys)
    assert code == 0 and err == ""
    expected = {0: "120.00 GB", 1: "31.41 GB", 2: "16.64 GB", 3: "1.88 GB"}
    for stage, memory in expected.items():
        assert memory in stage_line(out, stage, "Memory per GPU")
    assert "Model states only" in out


def test_table_says_which_stages_fit_a_32gb_gpu(capsys) -> None:
    _, out, _ = run_cli(["table", "--params", "7.5B", "--gpus", "64"], capsys)
    fits = {stage: stage_line(out, stage, "Memory per GPU").split()[-1] for stage in range(4)}
    assert fits == {0: "no", 1: "yes", 2: "yes", 3: "yes"}


def test_table_gives_ring_and_paper_traffic_and_its_time_at_50gb_per_s(capsys) -> None:
    _, out, _ = run_cli(["table", "--params", "7.5B", "--gpus", "64", "--bandwidth", "50GB/s"], capsys)
    zero0 = stage_line(out, 0, "Communication")
    zero3 = stage_line(out, 3, "Communication")
    assert all(part in zero0 for part in ("1.9688Ψ", "14.77B", "29.53 GB", "2Ψ", "30.00 GB", "600.0 ms"))
    assert all(part in zero3 for part in ("2.9531Ψ", "22.15B", "44.30 GB", "3Ψ", "45.00 GB", "900.0 ms"))


def test_table_sets_deepspeeds_estimates_beside_the_papers(capsys) -> None:
    _, out, _ = run_cli(["table", "--params", "7.5B", "--gpus", "64", "--largest-layer", "100M"], capsys)
    zero2 = stage_line(out, 2, "DeepSpeed's estimators")
    zero3 = stage_line(out, 3, "DeepSpeed's estimators")
    assert "2P + 18P/N" in zero2 and "17.11 GB" in zero2 and "fp32 copy" in stage_line(out, 2, "why they differ")
    assert "4L + 18P/N" in zero3 and "2.51 GB" in zero3 and "largest layer" in stage_line(out, 3, "why they differ")


def test_table_labels_gib_when_the_gpu_memory_is_given_in_gib(capsys) -> None:
    _, out, _ = run_cli(["table", "--params", "7.5B", "--gpus", "64", "--gpu-memory", "40GiB"], capsys)
    assert "fits 40 GiB" in out
    assert "111.76 GiB" in stage_line(out, 0, "Memory per GPU")


def test_table_writes_json_in_bytes(tmp_path, capsys) -> None:
    path = tmp_path / "table.json"
    code, _, _ = run_cli(["table", "--params", "7.5B", "--gpus", "64", "--json", str(path)], capsys)
    data = json.loads(path.read_text())
    assert code == 0 and data["schema"] == "zero-course/table/1" and data["model_states_only"]
    assert [row["model_state_bytes"] for row in data["stages"]] == pytest.approx(
        [120e9, 31.40625e9, 16.640625e9, 1.875e9]
    )
    assert [row["comm_psi_paper"] for row in data["stages"]] == [2, 2, 2, 3]


def test_table_adds_link_columns_only_when_asked(capsys) -> None:
    _, out, _ = run_cli(["table", "--params", "7.5B", "--gpus", "64"], capsys)
    assert "inter-node" not in out
    _, out, _ = run_cli(["table", "--params", "7.5B", "--gpus", "64", "--gpus-per-node", "8"], capsys)
    assert "8 nodes of 8 GPUs, collectives one flat ring" in out
    zero0 = stage_line(out, 0, "inter-node, busiest GPU")
    assert zero0.split()[-3:] == ["1.7227Ψ", "0.2461Ψ", "1.9688Ψ"], "63/64·2Ψ: 7/8 inside, 1/8 across, all on one GPU"


def test_table_hierarchical_sends_2_m_minus_1_over_m_of_psi_over_g_across(capsys) -> None:
    argv = ["table", "--params", "7.5B", "--gpus", "64", "--gpus-per-node", "8", "--collectives", "hierarchical"]
    _, out, _ = run_cli(argv, capsys)
    assert stage_line(out, 0, "inter-node, busiest GPU").split()[-3:] == ["1.7500Ψ", "0.2188Ψ", "0.2188Ψ"]
    assert stage_line(out, 3, "inter-node, busiest GPU").split()[-3:] == ["2.6250Ψ", "0.3281Ψ", "0.3281Ψ"]


@pytest.mark.parametrize("collectives", ["ring", "hierarchical"])
def test_table_json_splits_each_stages_traffic_by_link(tmp_path, capsys, collectives) -> None:
    path = tmp_path / "links.json"
    argv = ["table", "--params", "7.5B", "--gpus", "64", "--gpus-per-node", "8", "--collectives", collectives]
    code, _, _ = run_cli([*argv, "--json", str(path)], capsys)
    data = json.loads(path.read_text())
    assert code == 0 and (data["gpus_per_node"], data["nodes"], data["collectives"]) == (8, 8, collectives)
    for row in data["stages"]:
        assert row["comm_psi_intra_node"] + row["comm_psi_inter_node"] == pytest.approx(row["comm_psi_ring"])
        assert row["comm_bytes_inter_node"] == pytest.approx(2 * row["comm_elements_inter_node"])
    zero0 = data["stages"][0]
    if collectives == "ring":
        assert zero0["comm_bytes_inter_node_max"] == pytest.approx(zero0["comm_bytes_ring"])
        assert zero0["comm_psi_inter_node"] == pytest.approx(2 * 63 / 64 / 8)
    else:
        assert zero0["comm_psi_inter_node"] == zero0["comm_psi_inter_node_max"] == pytest.approx(2 * 7 / 8 / 8)


def test_plan_finds_the_smallest_gpu_count_per_stage_for_13b_on_80gb(capsys) -> None:
    code, out, err = run_cli(["plan", "--params", "13B", "--gpu-memory", "80GB"], capsys)
    assert code == 0 and err == ""
    smallest = {stage: stage_line(out, stage).split()[-4 if stage else -2] for stage in range(4)}
    assert smallest == {0: "never", 1: "6", 2: "4", 3: "3"}
    assert "78.00 GB" in stage_line(out, 1) and "69.33 GB" in stage_line(out, 3)
    assert "Model states only" in out
    assert "ZeRO-0 never fits" in out


def test_plan_writes_json(tmp_path, capsys) -> None:
    path = tmp_path / "plan.json"
    run_cli(["plan", "--params", "7.5B", "--gpu-memory", "32GB", "--json", str(path)], capsys)
    data = json.loads(path.read_text())
    assert [row["smallest_n_gpus"] for row in data["stages"]] == [None, 45, 7, 4]
    assert [row["smallest_power_of_two"] for row in data["stages"]] == [None, 64, 8, 4]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["table", "--params", "7.5X", "--gpus", "64"], "--params"),
        (["table", "--params=-7.5B", "--gpus", "64"], "negative"),
        (["table", "--params", "7.5B", "--gpus", "0"], "--gpus"),
        (["table", "--params", "7.5B", "--gpus", "-4"], "--gpus"),
        (["table", "--params", "7.5B", "--gpus", "6.5"], "--gpus"),
        (["table", "--params", "7.5B", "--gpus", "64", "--gpu-memory=-32GB"], "negative"),
        (["table", "--params", "7.5B", "--gpus", "64", "--gpu-memory", "0GB"], "--gpu-memory"),
        (["table", "--params", "7.5B", "--gpus", "64", "--bandwidth", "50GB"], "--bandwidth"),
        (["table", "--params", "7.5B", "--gpus", "64", "--bandwidth=-5GB/s"], "negative"),
        (["table", "--params", "7.5B", "--gpus", "64", "--latency=-1us"], "--latency"),
        (["table", "--params", "7.5B", "--gpus", "64", "--json", "/no/such/folder/t.json"], "--json"),
        (["table", "--params", "7.5B", "--gpus", "64", "--gpus-per-node", "7"], "--gpus-per-node"),
        (["table", "--params", "7.5B", "--gpus", "64", "--gpus-per-node=-8"], "--gpus-per-node"),
        (["table", "--params", "7.5B", "--gpus", "64", "--gpus-per-node", "eight"], "--gpus-per-node"),
        (["table", "--params", "7.5B", "--gpus", "64", "--collectives", "tree"], "--collectives"),
        (["table", "--gpus", "64"], "--params"),
        (["plan", "--params", "13B", "--gpu-memory", "lots"], "--gpu-memory"),
        (["plan", "--params", "0", "--gpu-memory", "80GB"], "--params"),
        (["plan", "--params", "13B"], "--gpu-memory"),
        (["plan", "--params", "-13B", "--gpu-memory", "80GB"], "cannot be negative"),
        (["plan", "--params", "13B", "--gpu-memory", "-1GB"], "cannot be negative"),
        (["table", "--params", "7.5B", "--gpus", "64", "--bandwidth", "-.5GB/s"], "cannot be negative"),
        (["plan", "--params", "13B", "--gpu-memory", "40"], "'40' has no unit: write a memory size"),
        (["table", "--params", "13B", "--gpus", "32", "--gpu-memory", "40"], "'40' has no unit"),
        (["table", "--params", "7.5B", "--gpus", "64", "--bandwidth", "50"], "'50' has no unit"),
        (["table", "--params", "7.5B", "--gpus", "64", "--latency", "5"], "'5' has no unit"),
    ],
)
def test_bad_input_gets_one_line_and_exit_code_2(argv: list[str], message: str, capsys) -> None:
    code, out, err = run_cli(argv, capsys)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err and out == ""


def test_the_table_runs_as_a_command() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "zero_core", "table", "--params", "7.5B", "--gpus", "64"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "120.00 GB" in result.stdout and "1.88 GB" in result.stdout


def test_table_adds_configurations_only_when_asked(capsys) -> None:
    _, out, _ = run_cli(["table", "--params", "7.5B", "--gpus", "64"], capsys)
    assert "Configurations" not in out
    argv = ["table", "--params", "70B", "--gpus", "256", "--gpu-memory", "80GB", "--configs", "zero3,zeropp,hsdp:64"]
    _, out, _ = run_cli([*argv, "--machine", "dgx-h100"], capsys)
    block = out[out.index("Configurations") :]
    assert "32 nodes of 8 GPUs" in block
    zeropp = [line for line in block.splitlines() if line.startswith("ZeRO++")]
    assert "16Ψ/N + 2Ψ/G" in zeropp[0] and "21.88 GB" in zeropp[0] and any(" s " in f"{line} " for line in zeropp)
    assert "17.50 GB" in next(line for line in block.splitlines() if line.startswith("HSDP, S = 64"))



def test_table_says_under_the_configurations_why_compare_counts_offload_and_hpz_otherwise(capsys) -> None:
    argv = ["table", "--params", "7.5B", "--gpus", "64", "--configs"]
    _, out, _ = run_cli([*argv, "zero3,zero2+offload,zero3+hpz,zeropp"], capsys)
    notes = [line for line in out.splitlines() if line in FORMULA_NOTES.values()]
    assert notes == [FORMULA_NOTES["zero2+offload"], FORMULA_NOTES["zero3+hpz"]]
    _, out, _ = run_cli([*argv, "zero3,zero3+offload,hsdp"], capsys)
    assert not set(out.splitlines()) & set(FORMULA_NOTES.values())

def test_table_json_carries_the_configurations(tmp_path, capsys) -> None:
    path = tmp_path / "configs.json"
    argv = ["table", "--params", "70B", "--gpus", "256", "--gpus-per-node", "8", "--configs", "zero2+offload"]
    code, _, _ = run_cli([*argv, "--json", str(path)], capsys)
    (row,) = json.loads(path.read_text())["configurations"]
    assert code == 0 and row["step_s"] is None
    assert row["gpu_bytes"] == 140e9 and row["host_bytes_per_gpu"] == pytest.approx(14 * 70e9 / 256)
    assert row["pcie_bytes_to_host"] == pytest.approx(2 * 70e9 / 256)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--configs", "zero9"], "--configs"),
        (["--configs", "hsdp:3"], "--configs"),
        (["--machine", "dgx-z100"], "--machine"),
        (["--machine", "dgx-h100", "--tokens-per-gpu", "0"], "--tokens-per-gpu"),
    ],
)
def test_bad_configurations_get_one_line(argv: list[str], message: str, capsys) -> None:
    code, out, err = run_cli(["table", "--params", "70B", "--gpus", "256", *argv], capsys)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and out == ""


def test_table_for_a_model_preset_prints_its_shape_and_the_step_times_assumptions(tmp_path, capsys) -> None:
    path = tmp_path / "model.json"
    argv = ["table", "--model", "gpt-3-175b", "--gpus", "1024", "--gpu-memory", "80GB", "--machine", "dgx-a100"]
    code, out, err = run_cli([*argv, "--json", str(path)], capsys)
    said = " ".join(out.split())
    assert code == 0 and err == "" and "Ψ = 174.6B parameters on N = 1024 GPUs" in said
    assert "96 layers, hidden 12,288, 96 heads, FFN 49,152, vocabulary 50,257, sequences up to 2,048" in said
    assert "Step time assumes: 96 layers; hidden 12,288; vocabulary 50,257; sequences of 2,048 tokens;" in said
    data = json.loads(path.read_text())
    assert data["model"]["preset"] == "gpt-3-175b" and data["assumptions"]["sequence"] == 2048
    assert data["stages"][3]["model_state_bytes"] == pytest.approx(16 * data["model"]["psi"] / 1024)


def widest(out: str) -> int:
    return max(len(line) for line in out.splitlines())


@pytest.mark.parametrize(
    "argv",
    [
        ["table", "--params", "7.5B", "--gpus", "64"],
        ["table", "--model", "llama-2-70b", "--gpus", "256", "--gpu-memory", "80GB", "--gpus-per-node", "8",
         "--machine", "dgx-h100", "--configs", "zero3,zeropp,hsdp:64,zero2+offload,zero3+hpz"],
        ["plan", "--params", "13B", "--gpu-memory", "80GB"],
        ["plan", "--model", "llama-3.1-405b", "--gpu-memory", "80GB"],
    ],
    ids=["table", "table-links-configs-machine", "plan", "plan-model"],
)
def test_every_line_fits_100_columns(argv: list[str], capsys) -> None:
    code, out, _ = run_cli(argv, capsys)
    assert code == 0 and widest(out) <= 100


def test_wide_prints_each_table_whole(capsys) -> None:
    argv = ["table", "--params", "7.5B", "--gpus", "64", "--gpus-per-node", "8"]
    _, out, _ = run_cli([*argv, "--wide"], capsys)
    assert widest(out) > 100
    zero0 = stage_line(out, 0, "Communication")
    assert zero0.split()[1] == "1.9688Ψ" and zero0.split()[-3:] == ["1.7227Ψ", "0.2461Ψ", "1.9688Ψ"]
