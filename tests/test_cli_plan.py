"""`python -m zero_core plan --nodes M`: the configurations that fit, ranked by predicted step time."""

from __future__ import annotations

import json
import re

import pytest
from test_cli_table import run_cli

from zero_core.configurations import CONFIGURATIONS
from zero_core.planner.configuration_time import predict, shape_layers
from zero_core.planner.models import PRESETS
from zero_core.planner.time_model import DGX_H100

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
    assert "ZeRO-3 + offload" in listed and "HSDP, S = 32" in listed
    said = " ".join(out.split())
    assert "ZeRO-2 (159.93 GB per GPU)" in said and "HSDP, S = 16 (89.60 GB per GPU)" in said
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


def test_a_model_preset_gives_psi_from_its_shape_and_prints_the_shape(capsys) -> None:
    code, out, err = run_cli(["plan", "--model", "llama-2-13b", "--gpu-memory", "80GB"], capsys)
    assert code == 0 and err == ""
    assert "Ψ = 13.02B parameters fit?" in out and "llama-2-13b, Ψ = 13.02B from its shape (published as 13B" in out
    assert "40 layers, hidden 5,120, 40 heads, FFN 13,824, vocabulary 32,000" in " ".join(out.split())


def test_the_step_time_uses_the_models_own_shape(tmp_path, capsys) -> None:
    path = tmp_path / "plan.json"
    argv = ["plan", "--model", "llama-3-70b", "--gpu-memory", "80GB", "--nodes", "32", "--machine", "dgx-h100"]
    assert run_cli([*argv, "--configs", "zero3", "--checkpointing", "none", "--json", str(path)], capsys)[0] == 0
    data = json.loads(path.read_text())
    expected = predict(CONFIGURATIONS["zero3"], shape_layers(PRESETS["llama-3-70b"], 4096), DGX_H100, 256, 8)
    assert data["configurations"][0]["step_s"] == pytest.approx(expected.step_s)
    assert data["model"]["shape"]["vocabulary"] == 128256 and data["psi"] == PRESETS["llama-3-70b"].psi


def test_a_step_time_answer_prints_every_assumption_it_used(tmp_path, capsys) -> None:
    path = tmp_path / "plan.json"
    code, out, _ = run_cli([*ASK_70B, "--machine", "dgx-h100", "--json", str(path)], capsys)
    said = " ".join(out[: out.index("Ranked:")].split())
    for part in ("80 layers (assumed)", "derived from Ψ", "vocabulary 32,000 (assumed)", "4,096 tokens per GPU",
                 "reaches 0.4 of its 989 TFLOP/s peak (the course's assumption)",
                 "full activation checkpointing (--checkpointing), its recomputation timed"):
        assert part in said, part
    assumptions = json.loads(path.read_text())["assumptions"]
    assert assumptions["layers"] == 80 and assumptions["achieved_fraction_assumed"] is True
    assert assumptions["activations_counted"] is True and "hidden" in assumptions["assumed"]


def test_explicit_layers_and_hidden_make_a_gpt_of_that_shape(capsys) -> None:
    code, out, err = run_cli(["plan", "--layers", "96", "--hidden", "12288", "--vocab", "50257", "--seq-len", "2048",
                              "--gpu-memory", "80GB"], capsys)
    assert code == 0 and "a GPT of Ψ = 174.6B from --layers and --hidden" in out


def test_the_sequence_is_cut_to_the_tokens_per_gpu_and_says_so(capsys) -> None:
    argv = ["plan", "--model", "llama-3.1-405b", "--gpu-memory", "80GB", "--nodes", "64", "--machine", "dgx-h100"]
    _, out, _ = run_cli([*argv, "--configs", "zero3"], capsys)
    assert "sequences of 4,096 tokens (the model's 131,072, cut to the tokens per GPU)" in " ".join(out.split())


def test_model_list_names_each_preset_its_psi_and_a_source_for_every_number_in_100_columns(capsys) -> None:
    code, out, err = run_cli(["table", "--model", "list"], capsys)
    assert code == 0 and err == ""
    blocks = out.strip().split("\n\n")
    assert [block.split(":")[0] for block in blocks] == [
        "llama-2-7b", "llama-2-13b", "llama-2-70b", "llama-3-8b", "llama-3-70b", "llama-3.1-405b", "gpt-3-175b"
    ]
    assert "gpt-3-175b: Ψ = 174.6B from its shape (published as 175B)" in out
    said = " ".join(out.split())
    assert "NVIDIA/Megatron-LM, examples/gpt3/train_gpt3_175b_distributed.sh @ d98e8a64ddf3" in said
    assert max(len(line) for line in out.splitlines()) <= 100


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "llama-9"], "no preset 'llama-9'; choose one of llama-2-7b"),
        (["--model", "llama-2-70b", "--params", "13B"], "--params 13B disagrees with --model llama-2-70b"),
        (["--model", "llama-2-70b", "--layers", "40"], "--model llama-2-70b fixes its shape: drop --layers"),
        (["--hidden", "4096"], "--hidden needs --layers"),
        (["--layers", "32", "--hidden", "4096", "--params", "70B"], "disagrees with --layers 32 --hidden 4096"),
        ([], "give --params PSI, --model NAME"),
        (["--model", "llama-2-7b", "--seq-len", "0"], "--seq-len"),
    ],
)
def test_unknown_or_contradictory_models_get_one_line_and_exit_2(argv: list[str], message: str, capsys) -> None:
    code, out, err = run_cli(["plan", "--gpu-memory", "80GB", *argv], capsys)
    assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1


def test_params_that_agree_with_the_model_are_accepted(capsys) -> None:
    code, out, _ = run_cli(["plan", "--model", "llama-2-7b", "--params", "7B", "--gpu-memory", "80GB"], capsys)
    assert code == 0 and "Ψ = 6.738B parameters fit?" in out


@pytest.mark.parametrize("model", [["--params", "70B"], ["--model", "gpt-3-175b"]], ids=["params", "preset"])
def test_the_ranked_answer_fits_100_columns_and_wide_prints_each_table_whole(model: list[str], capsys) -> None:
    argv = ["plan", *model, "--gpu-memory", "80GB", "--nodes", "32", "--machine", "dgx-h100"]
    code, out, _ = run_cli(argv, capsys)
    assert code == 0 and max(len(line) for line in out.splitlines()) <= 100
    assert len(re.findall(r"^#\s+configuration", out, re.M)) > 1, "each part repeats # and configuration"
    _, wide, _ = run_cli([*argv, "--wide"], capsys)
    assert len(re.findall(r"^#\s+configuration", wide, re.M)) == 3, "ranking, memory and time: one table each"
    assert max(len(line) for line in wide.splitlines()) > 100


QUESTION = ["plan", "--model", "llama-2-13b", "--gpu-memory", "40GiB", "--nodes", "4", "--machine", "dgx-a100",
            "--configs", "zero2", "--seq-len", "4096", "--tokens-per-gpu", "4096"]


def test_llama2_13b_on_32_a100_40gb_with_zero2_is_answered_with_every_term(tmp_path, capsys) -> None:
    """The issue's question: will it fit, and how fast is a step? Each memory and time term is printed."""
    path = tmp_path / "plan.json"
    code, out, err = run_cli([*QUESTION, "--json", str(path)], capsys)
    assert code == 0 and err == "" and max(len(line) for line in out.splitlines()) <= 100
    for header in ("states", "activations", "bucket", "gathered", "persistent", "allowance", "total", "fits",
                   "compute", "of it recompute", "exposed comm", "exposed PCIe", "optimizer", "MFU", "tokens/s/GPU",
                   "bound by"):
        assert header in out, header
    row = json.loads(path.read_text())["configurations"][0]
    memory = row["memory"]
    parts = ("model_states", "activations", "gradient_bucket", "gathered_parameters", "persistent_parameters",
             "allowance")
    assert memory["total"] == pytest.approx(sum(memory[p] for p in parts))
    assert row["fits"] and memory["total"] <= 40 * 2**30
    assert not any(row["total_by_checkpointing"][mode] <= 40 * 2**30 for mode in ("none", "selective"))
    assert row["step"]["recompute_s"] > 0 and 0 < row["step"]["mfu"] < 0.5
    assert "Answer: ZeRO-2" in out and "bound by compute" in out


def test_fit_is_judged_on_the_total_not_on_model_states(tmp_path, capsys) -> None:
    path = tmp_path / "plan.json"
    run_cli([*QUESTION, "--checkpointing", "none", "--json", str(path)], capsys)
    row = json.loads(path.read_text())["configurations"][0]
    assert row["model_states_fit"] and not row["fits"]


def test_a_larger_allowance_can_make_a_configuration_not_fit(tmp_path, capsys) -> None:
    path = tmp_path / "plan.json"
    run_cli([*QUESTION, "--allowance", "8GiB", "--json", str(path)], capsys)
    row = json.loads(path.read_text())["configurations"][0]
    assert row["memory"]["allowance"] == 8 * 2**30 and not row["fits"]


def test_options_within_the_time_models_error_share_a_rank(tmp_path, capsys) -> None:
    path = tmp_path / "plan.json"
    run_cli([*ASK_70B, "--machine", "dgx-h100", "--json", str(path)], capsys)
    data = json.loads(path.read_text())
    times = {r["config"]: r["step_s"] for r in data["configurations"]}
    fastest = times[data["ranked"][0]]
    for name, rank in zip(data["ranked"], data["ranks"], strict=True):
        assert (rank == 1) == (times[name] <= fastest * (1 + data["time_model_error"]))
    assert data["ranks"].count(1) > 1


def test_each_ranked_option_says_what_it_changes(capsys) -> None:
    _, out, _ = run_cli([*ASK_70B, "--machine", "dgx-h100"], capsys)
    said = " ".join(out.split())
    assert "qwZ: quantises weights to int8" in said and "qgZ: quantises gradients to int4" in said
    assert "needs host memory" in said and "over PCIe" in said


def test_tokens_not_a_multiple_of_micro_batch_times_sequence_are_refused(capsys) -> None:
    code, _, err = run_cli([*QUESTION, "--micro-batch", "2"], capsys)
    assert code == 2 and "is not a multiple of --micro-batch 2" in err
