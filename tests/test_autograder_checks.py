"""The checks as a notebook's test cells call them, and the nets that keep the reference implementation out."""

from __future__ import annotations

import sys
import warnings
from types import SimpleNamespace

import pytest

from autograder import ex05
from autograder.integrity import REFERENCE_MODULES, ReferenceUsed, StudentShard, scan_objects, scan_source
from autograder.submission import without_magics


def model_state_bytes(stage: int, psi: float, n_gpus: int) -> float:
    replicated, partitioned = {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)}[stage]
    return replicated * psi + partitioned * psi / n_gpus


def noisy_model_state_bytes(stage: int, psi: float, n_gpus: int) -> float:
    if stage == 3 and n_gpus == 64 and psi == 7.5e9:
        warnings.warn("a warning from the student's code", UserWarning, stacklevel=1)
        print("and a line on stderr", file=sys.stderr)
    return model_state_bytes(stage, psi, n_gpus)


@pytest.mark.ex05
def test_a_passing_test_cell_prints_on_stdout_and_writes_nothing_to_stderr(capsys: pytest.CaptureFixture) -> None:
    ex05.check_model_state_bytes(noisy_model_state_bytes, **ex05.VISIBLE)
    out, err = capsys.readouterr()
    assert err == ""
    assert "passed: " in out
    assert "a warning from the student's code" in out and "and a line on stderr" in out


@pytest.mark.ex05
def test_a_failing_test_cell_raises_assertion_error_with_the_message(capsys: pytest.CaptureFixture) -> None:
    def zero_2_without_gradients(stage: int, psi: float, n_gpus: int) -> float:
        return model_state_bytes(stage, psi, n_gpus) - (2 * psi / n_gpus if stage == 2 else 0)

    with pytest.raises(AssertionError, match=r"model_state_bytes\(stage=2, .*2Ψ \+ 14Ψ/N"):
        ex05.check_model_state_bytes(zero_2_without_gradients, **ex05.VISIBLE)
    assert capsys.readouterr().err == ""


@pytest.mark.ex04
def test_a_subclass_of_the_reference_scores_zero_in_a_test_cell_too() -> None:
    from autograder import ex04
    from zero_core.stages import zero3_gather as zero3

    class GatherLinear(zero3.GatherLinear):
        pass

    with pytest.raises(AssertionError, match="subclasses zero_core.stages.zero3_gather.GatherLinear"):
        ex04.check_training(GatherLinear, zero3.GatherEmbedding, world_sizes=[2])


def test_scan_source_finds_imports_import_calls_and_reference_methods_but_not_mentions() -> None:
    source = '''
"""Unlike zero_core.stages, this is mine."""
import importlib
import sys
from zero_core.stages.zero2_linear import ReduceScatterLinear
from zero_core import dist
stages = importlib.import_module("zero_core.stages.zero3")
def backward(ctx, grad):
    ctx.shard.reduce_scatter_gradients([grad])
cached = sys.modules["zero_core.stages.zero2"]
NOTE = "zero_core.stages"  # where I read about buckets
print("compare with zero_core.stages.zero2")
'''
    problems = scan_source(source, REFERENCE_MODULES)
    assert sorted(int(p.split(":")[0].removeprefix("line ")) for p in problems) == [5, 7, 9, 10]


def test_scan_objects_follows_helpers_to_a_reference_they_use() -> None:
    namespace: dict = {}
    exec(
        "from zero_core.stages import zero2_linear as zero2\n"
        "def helper():\n    return zero2.ReduceScatterLinear\n"
        "def my_function():\n    return helper()\n",
        namespace,
    )
    problems = scan_objects({"my_function": namespace["my_function"]}, REFERENCE_MODULES)
    assert problems == ["`helper` uses `zero2` from zero_core.stages.zero2_linear"]


def test_the_students_shard_has_the_data_but_not_the_reference_collectives() -> None:
    real = SimpleNamespace(name="blocks.0.mlp.fc", grad="shard", reduce_scatter_gradients=lambda grads: None)
    shard = StudentShard(real, "ex03")
    assert shard.name == "blocks.0.mlp.fc" and shard.grad == "shard"
    shard.grad = "written"
    assert real.grad == "written"
    with pytest.raises(ReferenceUsed, match="write the collective yourself"):
        shard.reduce_scatter_gradients([])


def test_magics_in_a_solution_cell_do_not_stop_it_from_loading() -> None:
    source = "%timeit 1 + 1\nfor i in range(2):\n    !ls\nx = 1"
    namespace: dict = {}
    exec(compile(without_magics(source), "<cell>", "exec"), namespace)
    assert namespace["x"] == 1
