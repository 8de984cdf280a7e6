"""`python -m zero_core compare`: the tables, the JSON, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zero_core.cli import main


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
