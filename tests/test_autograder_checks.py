"""The checks as a notebook's test cells call them, and the nets that keep the reference implementation out
(the rules for graded cells have their own file, tests/test_graded_cell_policy.py)."""

from __future__ import annotations

import linecache
import sys
import warnings
from types import SimpleNamespace

import pytest

from autograder import ex05
from autograder.checks import CheckFailed
from autograder.integrity import REFERENCE_MODULES, StudentShard, require_own_code, scan_objects
from autograder.submission import without_magics
from tests.solution_notebooks import solution_notebook
from tests.test_grading_integrity import FIXTURES, UNUSUAL, WRONG, WrongSubmission


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
    from zero_core.answers import ex04 as zero3

    class GatherLinear(zero3.GatherLinear):
        pass

    with pytest.raises(AssertionError, match="subclasses zero_core.answers.ex04.GatherLinear"):
        ex04.check_training(GatherLinear, zero3.GatherEmbedding, world_sizes=[2])


def test_scan_objects_follows_helpers_to_a_reference_they_use() -> None:
    namespace: dict = {}
    exec(
        "from zero_core.answers import ex03 as zero2\n"
        "def helper():\n    return zero2.ReduceScatterLinear\n"
        "def my_function():\n    return helper()\n",
        namespace,
    )
    problems = scan_objects({"my_function": namespace["my_function"]}, REFERENCE_MODULES)
    assert problems == ["`helper` uses `zero2` from zero_core.answers.ex03"]


def test_the_students_shard_reads_and_writes_the_data_and_has_none_of_the_reference_collectives() -> None:
    real = SimpleNamespace(name="blocks.0.mlp.fc", grad="shard", reduce_scatter_gradients=lambda grads: None)
    shard = StudentShard(real, "ex03")
    assert shard.name == "blocks.0.mlp.fc" and shard.grad == "shard"
    shard.grad = "written"
    assert real.grad == "written"
    assert not hasattr(shard, "reduce_scatter_gradients")
    with pytest.raises(AttributeError, match="has no `reduce_scatter_gradients`: its collectives are the reference"):
        shard.reduce_scatter_gradients([])
    with pytest.raises(AttributeError):
        shard.name = "another layer"


def test_the_students_shard_keeps_the_stages_shard_in_no_attribute() -> None:
    real = SimpleNamespace(name="blocks.0.mlp.fc", grad="shard")
    shard = StudentShard(real, "ex03")
    shard.mine = "the student's own"
    reachable = [*vars(shard).values(), *vars(type(shard)).values(), *vars(StudentShard).values()]
    assert all(value is not real for value in reachable)


def test_the_run_time_net_judges_only_the_imports_of_the_defining_cell() -> None:
    """A cell that breaks another rule (here `vars`) is the grader's to judge on the notebook; at run time
    only a forbidden import costs the points."""
    namespace: dict = {}
    source = "def my_function(x):\n    return vars(x)\n"
    linecache.cache["<cell own>"] = (len(source), None, source.splitlines(keepends=True), "<cell own>")
    exec(compile(source, "<cell own>", "exec"), namespace)
    require_own_code({"my_function": namespace["my_function"]}, ("my_function",), REFERENCE_MODULES, "ex05")
    source = "def my_function(x):\n    from zero_core.stages import zero2\n    return x\n"
    linecache.cache["<cell reference>"] = (len(source), None, source.splitlines(keepends=True), "<cell reference>")
    exec(compile(source, "<cell reference>", "exec"), namespace)
    with pytest.raises(CheckFailed, match="line 2: `from zero_core.stages import zero2` uses zero_core.stages"):
        require_own_code({"my_function": namespace["my_function"]}, ("my_function",), REFERENCE_MODULES, "ex05")


def test_magics_in_a_solution_cell_do_not_stop_it_from_loading() -> None:
    source = "%timeit 1 + 1\nfor i in range(2):\n    !ls\nx = 1"
    namespace: dict = {}
    exec(compile(without_magics(source), "<cell>", "exec"), namespace)
    assert namespace["x"] == 1


# -- the likely cause a training check names, told from the values (never from the student's source) ----------

LIKELY_CAUSES = {
    "ex06_layers_end_to_end": "the bucket's elements are not where the reference puts them: ",
    "ex08_local_norm_without_all_reduce": "a norm computed from this rank's shard only (not all-reduced) clips by",
    "ex08_overwrites_instead_of_adding": "the shard equals the last micro-batch's gradient (up to the clip",
}
"""Each wrong fixture whose training check must name its mistake, and the phrase that names it."""


def _graded_by_the_training_check() -> list:
    """The submissions of the exercises above that the training check runs: the solution, the correct but
    unusual fixtures, and every wrong fixture that loses `test_training` by what it computes (not by a rule,
    nor only in a child process)."""
    exercises = sorted({WrongSubmission.read(FIXTURES / f"{name}.patch").exercise for name in LIKELY_CAUSES})
    params = [pytest.param(exercise, None, id=f"{exercise[:4]}_solution", marks=getattr(pytest.mark, exercise[:4]))
              for exercise in exercises]
    for submission in [*UNUSUAL, *WRONG]:
        computes = not submission.loses or ("test_training" in submission.loses and submission.rules is None)
        if submission.exercise in exercises and computes and not submission.child:
            mark = getattr(pytest.mark, submission.exercise[:4])
            params.append(pytest.param(submission.exercise, submission, id=submission.path.stem, marks=mark))
    return params


@pytest.mark.parametrize(("assignment", "submission"), _graded_by_the_training_check())
def test_the_training_check_names_a_likely_cause_exactly_where_it_is_that_mistake(
    assignment: str, submission: WrongSubmission | None, tmp_path
) -> None:
    """The fixture of each cause gets its phrase; the solution, the correct but unusual submissions and the
    other wrong ones (other mistakes that also train wrong values) get none of the exercise's phrases."""
    from autograder.sandbox import grade_submission
    from autograder.submission import exercise_module, load

    notebook = solution_notebook(assignment) if submission is None else submission.notebook(tmp_path)
    (check,) = [check for check in exercise_module(assignment).CHECKS if check.name == "test_training"]
    (result,) = grade_submission(load(notebook), (check,))
    name = submission.path.stem if submission else "the solution"
    for fixture, cause in LIKELY_CAUSES.items():
        if fixture.startswith(assignment[:4]):
            assert (cause in result.message) == (name == fixture), f"{name}, {fixture}'s cause: {result.message}"
    assert result.passed == (submission is None or not submission.loses), result.message


@pytest.mark.ex06
def test_ex06_layout_cause_needs_the_reference_values_in_other_places() -> None:
    """Right values in wrong places name the layout; wrong values (twice the average) do not."""
    import copy

    from autograder import ex06
    from autograder.harness import TRAINING_CONFIG
    from autograder.stage_checks import oracle_run
    from autograder.verdicts import tolerance_from_oracle

    reference = ex06.EXERCISE.reference_run(("test", "layout"), 2, ex06.BUCKET_BYTES[2], TRAINING_CONFIG)
    tolerance = tolerance_from_oracle(reference, *oracle_run(2))
    assert ex06.bucket_layout_cause(reference, reference, tolerance) is None

    doubled = copy.deepcopy(reference)
    grads = doubled.ranks[1].adam_grads
    grads["lm_head", 0] = grads["lm_head", 0] * 2
    assert ex06.bucket_layout_cause(doubled, reference, tolerance) is None

    moved = copy.deepcopy(reference)
    grads = moved.ranks[1].adam_grads
    numel = grads["lm_head", 0].numel()
    grads["lm_head", 0] = reference.averaged_gradient("wte", 0)[100 : 100 + numel].clone()
    cause = ex06.bucket_layout_cause(moved, reference, tolerance)
    assert cause is not None and f"elements [100, {100 + numel:,}) of wte" in cause, cause
    assert "check the bucket layout" in cause.lower()
