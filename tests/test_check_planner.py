"""`python -m zero_core check-planner`: the planner against DeepSpeed's package, Megatron-Core's table and a run.

Each reference must really be the one named: the DeepSpeed rows change when the installed package's estimator
does, the Megatron-Core rows when its facts entry does, the virtual-cluster rows come from `run_stage`, and a
wrong coefficient in the planner shows as an error rather than vanishing.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli_table import run_cli

from zero_core import planner_check
from zero_core.cli.check_planner import render_cluster, render_deepspeed, render_megatron
from zero_core.facts import fact
from zero_core.planner import activations
from zero_core.planner.models import PRESETS
from zero_core.units import GiB

ROOT = Path(__file__).resolve().parents[1]


def test_the_command_prints_three_tables_each_with_an_error_column_and_no_deepspeed_banner(tmp_path: Path) -> None:
    path = tmp_path / "check.json"
    result = subprocess.run(
        [sys.executable, "-m", "zero_core", "check-planner", "--presets", "micro", "--world-size", "2", "--json",
         str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    )
    lines = result.stdout.splitlines()
    assert lines[0].startswith("(a) Model states per GPU"), "DeepSpeed's accelerator line reached stdout"
    for part in ("(a)", "(b)", "(c)"):
        title = next(i for i, line in enumerate(lines) if line.startswith(part))
        header = next(line for line in lines[title:] if line.startswith(("model", "dtypes", "preset")))
        assert header.split()[-1] == "error" or "error" in header.split(), part
    assert max(len(line) for line in lines) <= 100
    data = json.loads(path.read_text())
    assert {len(data["deepspeed"]), len(data["megatron"]), len(data["cluster"])} >= {4}
    assert all("error" in row for row in data["deepspeed"] + data["megatron"])
    assert [row["stage"] for row in data["cluster"]] == [0, 1, 2, 3]


def test_the_deepspeed_rows_are_the_installed_packages_estimators(monkeypatch) -> None:
    zero2 = importlib.import_module("deepspeed.runtime.zero.stage_1_and_2")
    zero3 = importlib.import_module("deepspeed.runtime.zero.stage3")
    monkeypatch.setattr(zero2, "estimate_zero2_model_states_mem_needs", lambda **kw: (0, 7 * GiB))
    monkeypatch.setattr(zero3, "estimate_zero3_model_states_mem_needs", lambda **kw: (0, 3 * GiB, 0))
    rows = planner_check.deepspeed_rows(("llama-2-13b",), (32,), ("zero2", "zero3"))
    assert [r.deepspeed_bytes for r in rows] == [7 * GiB, 3 * GiB]
    printed = render_deepspeed(rows)
    assert "7.00" in printed and "3.00" in printed


def test_the_deepspeed_rows_pass_the_configuration_to_the_package() -> None:
    zero2, zero3 = planner_check.deepspeed_modules()
    (on_gpu, offloaded, zero3_row) = planner_check.deepspeed_rows(("llama-2-13b",), (32,),
                                                                   ("zero2", "zero2+offload", "zero3"))
    psi = PRESETS["llama-2-13b"].psi
    assert on_gpu.deepspeed_bytes == zero2.estimate_zero2_model_states_mem_needs(
        psi, num_gpus_per_node=8, num_nodes=4, cpu_offload=False)[1]
    assert offloaded.deepspeed_bytes == 2 * psi and offloaded.error == 0
    assert zero3_row.deepspeed_bytes == zero3.estimate_zero3_model_states_mem_needs(
        psi, zero3_row.largest_layer_params, num_gpus_per_node=8, num_nodes=4, cpu_offload=False)[1]
    assert zero3_row.largest_layer_params == 32000 * 5120  # Llama 2's embedding, V·h


def test_the_megatron_figures_are_the_facts_files(monkeypatch) -> None:
    rows = planner_check.megatron_rows((8,))
    fp16 = [r for r in rows if r.fact == "megatron_dist_optimizer_fp16_fp16"]
    assert [(r.data_parallel, r.megatron_bytes_per_param) for r in fp16] == [(None, 20.0), (8, 4 + 16 / 8)]
    assert [r.planner_bytes_per_param for r in fp16] == [16.0, 4 + 12 / 8]

    changed = dataclasses.replace(fact("megatron_dist_optimizer_fp16_fp16"), printed=("21", "5 + 17/d"))
    monkeypatch.setattr(planner_check, "fact", lambda name: changed if name == changed.name else fact(name))
    rows = planner_check.megatron_rows((8,))
    assert [r.megatron_bytes_per_param for r in rows[:2]] == [21.0, 5 + 17 / 8]
    assert "21.000" in render_megatron(rows)


def test_a_megatron_cell_not_of_the_form_a_plus_b_over_d_is_refused_naming_the_entry(monkeypatch) -> None:
    broken = dataclasses.replace(fact("megatron_dist_optimizer_fp32_fp32"), printed=("16", "8 + 8d"))
    monkeypatch.setattr(planner_check, "fact", lambda name: broken)
    with pytest.raises(ValueError, match=r"megatron_dist_optimizer_fp32_fp32.*'8 \+ 8d'"):
        planner_check.megatron_cells("megatron_dist_optimizer_fp32_fp32")


@pytest.fixture(scope="module")
def micro_rows() -> list[planner_check.ClusterRow]:
    return planner_check.cluster_rows(("micro",), 2)


def test_the_cluster_rows_are_measured_by_a_run(monkeypatch) -> None:
    reports = []
    run_stage = planner_check.run_stage

    def recording(*args, **kwargs):
        reports.append(run_stage(*args, **kwargs))
        return reports[-1]

    monkeypatch.setattr(planner_check, "run_stage", recording)
    rows = planner_check.cluster_rows(("micro",), 2)
    assert [r.stage for r in reports] == [0, 1, 2, 3]
    for row, report in zip(rows, reports, strict=True):
        assert (row.measured_states, row.measured_activations, row.measured_peak) == (
            report.model_state_bytes_max, report.activation_peak_bytes_max, report.peak_bytes_max)
        assert row.measured_psi == report.psi


def test_the_model_state_error_is_the_untied_head_the_planner_does_not_count(micro_rows) -> None:
    """The stages hold exactly the paper's bytes for their own Ψ; the planner's GPT ties its head (V·h + V fewer)."""
    for row in micro_rows:
        assert row.measured_psi - row.planner_psi == 64 * 32 + 64
        assert row.errors["states"] == pytest.approx((row.planner_psi - row.measured_psi) / row.measured_psi)


def test_a_wrong_activation_coefficient_shows_as_a_larger_error(micro_rows, monkeypatch) -> None:
    monkeypatch.setattr(activations, "BYTES_PER_SBH", 2 * activations.BYTES_PER_SBH)
    wrong = planner_check.cluster_rows(("micro",), 2)
    for right, doubled in zip(micro_rows, wrong, strict=True):
        assert doubled.errors["activations"] > right.errors["activations"] + 0.3
        assert doubled.measured_activations == right.measured_activations


@pytest.mark.parametrize(("argv", "said"), [
    (["--world-size", "0"], "--world-size must be between 1"),
    (["--presets", "huge"], "--presets: choose from micro, tiny, small"),
])
def test_bad_input_is_one_line_and_exit_code_2(argv: list[str], said: str, capsys) -> None:
    code, out, err = run_cli(["check-planner", *argv], capsys)
    assert code == 2 and out == "" and said in err and len(err.splitlines()) == 1


def test_the_docs_show_the_commands_real_output() -> None:
    """docs/cli.md's block is what the command prints: DeepSpeed's and Megatron-Core's tables whole, and the
    virtual cluster's micro rows (deterministic: one seeded step, audited byte for byte), compared word by word
    (a table's columns are as wide as its widest cell)."""
    shown = {" ".join(line.split()) for line in (ROOT / "docs" / "cli.md").read_text().splitlines()}
    printed = [*render_deepspeed(planner_check.deepspeed_rows()).splitlines(),
               *render_megatron(planner_check.megatron_rows()).splitlines(),
               *(line for line in render_cluster(planner_check.cluster_rows(("micro",))).splitlines()
                 if line.startswith("micro "))]
    assert [line for line in printed if " ".join(line.split()) not in shown] == []
