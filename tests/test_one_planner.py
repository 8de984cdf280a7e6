"""One planner: `ranked_plan`, `plan --nodes` and lesson 05's calculator give one answer.

`zero_core.cli.ranked.ranked_plan` is a function of plain values; `python -m zero_core plan --nodes` parses its
options and calls it, and so does lesson 05's calculator with its widgets' values. Each answer names the command
line that gives it (`RankedPlan.command`): run in-process, that command must print the same text.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest
from test_cli_table import run_cli

from zero_core.cli.model_choice import planned_model
from zero_core.cli.ranked import nodes_for, ranked_plan
from zero_core.units import GiB

LESSON_05 = Path(__file__).resolve().parent.parent / "lessons" / "05_at_scale.ipynb"

SETTINGS = [
    ({"model": "llama-2-13b"}, dict(gpu_memory="40GiB", nodes=4, machine="dgx-a100", configs="zero0,zero1,zero2,zero3",
                                    checkpointing="full")),
    ({"params": 7_500_000_000}, dict(gpu_memory="32GB", nodes=4, machine="dgx2-v100", checkpointing="selective",
                                     micro_batch=2, tokens_per_gpu=8192, allowance="3GiB")),
    ({"layers": 24, "hidden": 2048, "seq_len": 1024}, dict(gpu_memory="16GB", nodes=1, gpus_per_node=4,
                                                           machine="a100-400g", checkpointing="none")),
    ({"model": "llama-3-8b", "seq_len": 2048}, dict(gpu_memory="80GB", nodes=2, machine="dgx-h100")),
]


def cli_args(command: str) -> list[str]:
    prefix = "python -m zero_core "
    assert command.startswith(prefix), command
    return shlex.split(command[len(prefix):])


@pytest.mark.parametrize(("model", "values"), SETTINGS, ids=[str(m) for m, _ in SETTINGS])
def test_the_answer_of_ranked_plan_is_what_its_command_prints(model: dict, values: dict, capsys) -> None:
    answer = ranked_plan(planned_model(**model), **values)
    code, out, err = run_cli(cli_args(answer.command()), capsys)
    assert (code, err) == (0, "")
    assert out == answer.text() + "\n"


def test_llama2_13b_on_32_a100_40gb_with_zero2_and_full_checkpointing_is_the_commands_total(tmp_path, capsys) -> None:
    path = tmp_path / "plan.json"
    argv = ["plan", "--model", "llama-2-13b", "--gpu-memory", "40GiB", "--nodes", "4", "--machine", "dgx-a100",
            "--configs", "zero2", "--checkpointing", "full", "--json", str(path)]
    assert run_cli(argv, capsys)[0] == 0
    written = json.loads(path.read_text())["configurations"][0]
    nodes, gpus_per_node = nodes_for(32, "dgx-a100")
    answer = ranked_plan(planned_model(model="llama-2-13b"), "40GiB", nodes, "dgx-a100", gpus_per_node,
                         configs="zero2", checkpointing="full")
    assert answer.row("zero2")["total_gpu_bytes"] == written["total_gpu_bytes"]
    assert f"{written['total_gpu_bytes'] / GiB:.2f}" == "38.30"
    assert answer.row("zero2")["fits"] and answer.row("zero2")["step"] == written["step"]


def test_n_gpus_become_nodes_of_the_machine_or_one_node() -> None:
    assert nodes_for(32, "dgx-a100") == (4, 8)
    assert nodes_for(4, "dgx-a100") == (1, 4)
    assert nodes_for(32, "dgx2-v100") == (2, 16)


def lesson_calculator() -> Callable[..., None]:
    """The function lesson 05's widgets call, defined as the lesson defines it: the imports of its first code
    cell, then the definitions of the cell that defines the function (not its calls)."""
    code = ["".join(c["source"]) for c in json.loads(LESSON_05.read_text())["cells"] if c["cell_type"] == "code"]
    trees = [ast.parse(source.replace("%matplotlib inline", "")) for source in code]
    interact = next(node for tree in trees for node in ast.walk(tree)
                    if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "interact")
    name = interact.args[0].id
    defining = next(tree for tree in trees
                    if any(isinstance(s, ast.FunctionDef) and s.name == name for s in tree.body))
    imports = [s for s in trees[0].body if isinstance(s, ast.Import | ast.ImportFrom)]
    definitions = [s for s in defining.body if isinstance(s, ast.FunctionDef | ast.Assign)]
    namespace: dict = {}
    exec(compile(ast.Module(imports + definitions, type_ignores=[]), str(LESSON_05), "exec"), namespace)
    return namespace[name]


CALCULATOR_SETTINGS = [
    dict(model="llama-2-13b", params_billions=7.5, n_gpus=32, gpu_memory_gib=40, machine="dgx-a100",
         checkpointing="full", micro_batch=1),
    dict(model="custom Ψ", params_billions=7.5, n_gpus=64, gpu_memory_gib=32, machine="dgx2-v100",
         checkpointing="selective", micro_batch=2),
    dict(model="llama-3-8b", params_billions=7.5, n_gpus=4, gpu_memory_gib=80, machine="dgx-h100",
         checkpointing="none", micro_batch=1),
    dict(model="gpt-3-175b", params_billions=7.5, n_gpus=1024, gpu_memory_gib=80, machine="a100-400g",
         checkpointing="full", micro_batch=4),
]


def calculator_output(values: dict) -> tuple[str, str]:
    """(the command the calculator names, the answer it prints)."""
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        lesson_calculator()(**values)
    said, command, blank, *answer = printed.getvalue().split("\n")
    assert (said, blank) == ("The same answer from the command line:", ""), printed.getvalue()[:300]
    return command, "\n".join(answer)


@pytest.mark.parametrize("values", CALCULATOR_SETTINGS, ids=[v["model"] for v in CALCULATOR_SETTINGS])
def test_lesson_05s_calculator_prints_what_the_command_it_names_prints(values: dict, capsys) -> None:
    command, answer = calculator_output(values)
    code, out, err = run_cli(cli_args(command), capsys)
    assert (code, err) == (0, "")
    assert out == answer


def test_lesson_05s_calculator_gives_the_commands_total_for_llama2_13b_on_32_a100_40gb_with_zero2(
    tmp_path, capsys
) -> None:
    command, answer = calculator_output(CALCULATOR_SETTINGS[0])
    path = tmp_path / "plan.json"
    assert run_cli(cli_args(command) + ["--json", str(path)], capsys)[0] == 0
    zero2 = next(r for r in json.loads(path.read_text())["configurations"] if r["config"] == "zero2")
    states = f"{zero2['memory']['model_states'] / GiB:.2f}"
    memory_row = next(line.split() for line in answer.splitlines() if line.split()[1:3] == ["ZeRO-2", states])
    assert memory_row[8] == f"{zero2['total_gpu_bytes'] / GiB:.2f}" == "38.30"
    assert zero2["fits"] and "--checkpointing full" in command and "--gpu-memory 40GiB --nodes 4" in command
