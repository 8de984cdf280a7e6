"""`python -m zero_core plan --nodes M`: the configurations that fit, ranked by predicted step time."""

from __future__ import annotations

import json

from test_cli_table import run_cli

ASK_70B = ["plan", "--params", "70B", "--gpu-memory", "80GB", "--nodes", "32", "--gpus-per-node", "8"]


def ranked_lines(out: str) -> list[str]:
    block = out[out.index("Ranked:") :].split("\n\n")[0].splitlines()
    return [line for line in block[3:] if line[:1].isdigit()]


def test_70b_on_32_nodes_of_8_h100_gets_a_ranked_answer(capsys) -> None:
    code, out, err = run_cli([*ASK_70B, "--machine", "dgx-h100"], capsys)
    assert code == 0 and err == ""
    lines = ranked_lines(out)
    assert lines[0].split()[:2] == ["1", "ZeRO++"]
    assert "Answer: ZeRO++" in out
    listed = " ".join(lines)
    assert "ZeRO-3 + offload" in listed and "HSDP, S = 16" in listed
    assert "ZeRO-2 (143.83 GB per GPU)" in out and "HSDP, S = 8 (140.00 GB per GPU)" in out
    assert "ZeRO-1 " not in listed and "ZeRO-2 " not in listed


def test_the_ranking_is_by_step_time_then_memory(tmp_path, capsys) -> None:
    path = tmp_path / "plan.json"
    run_cli([*ASK_70B, "--machine", "dgx-h100", "--tokens-per-gpu", "1024", "--json", str(path)], capsys)
    data = json.loads(path.read_text())
    rows = {r["config"]: r for r in data["configurations"]}
    keys = [(round(rows[name]["step_s"], 6), rows[name]["gpu_bytes"]) for name in data["ranked"]]
    assert keys == sorted(keys) and len(keys) >= 5
    assert all(rows[name]["fits"] for name in data["ranked"])
    assert data["n_gpus"] == 256 and data["schema"] == "zero-course/plan/2"
    assert rows["zeropp"]["comm_bytes_inter_node"] < rows["zero3"]["comm_bytes_inter_node"] / 3


def test_nodes_without_a_machine_is_a_usage_error(capsys) -> None:
    code, out, err = run_cli(ASK_70B, capsys)
    assert code == 2 and "--machine" in err and out == ""


def test_the_default_plan_is_unchanged_by_the_new_options(capsys) -> None:
    _, out, _ = run_cli(["plan", "--params", "13B", "--gpu-memory", "80GB"], capsys)
    assert "Ranked" not in out and "Smallest data-parallel degree per stage" in out


def test_machine_list_describes_every_preset_with_a_source_for_each_figure_in_100_columns(capsys) -> None:
    """`--machine list` answers before any other argument is needed, on every command that takes --machine."""
    code, out, err = run_cli(["plan", "--machine", "list"], capsys)
    assert code == 0 and err == ""
    blocks = out.strip().split("\n\n")
    assert [block.split(":")[0] for block in blocks] == ["a100-400g", "dgx-a100", "dgx-h100", "dgx2-v100", "h100-800g"]
    for block in blocks:
        for figure in ("peak tflops:", "achieved fraction:", "intra node bandwidth:", "inter node bandwidth:"):
            assert figure in block, block
        assert "TFLOP/s peak x" in block and ("@ " in block or "http" in block or "an assumption" in block), block
    assert "an assumption of the course" in blocks[1]  # the DGX A100's achieved fraction, 0.5
    assert max(len(line) for line in out.splitlines()) <= 100
    assert run_cli(["compare", "--machine", "list"], capsys)[1] == out


def test_an_unknown_machine_names_the_presets_and_the_list(capsys) -> None:
    code, out, err = run_cli([*ASK_70B, "--machine", "dgx-b200"], capsys)
    assert code == 2 and out == ""
    assert "no preset 'dgx-b200'; choose one of a100-400g, dgx-a100, dgx-h100, dgx2-v100, h100-800g" in err
    assert "--machine list describes them" in err


def test_the_top_level_help_is_for_users_and_fits_100_columns(capsys) -> None:
    code, out, _ = run_cli(["--help"], capsys)
    assert code == 0 and "plan --machine list" in out and "Sizes take their unit" in out
    assert "add_parser" not in out and max(len(line) for line in out.splitlines()) <= 100
