"""While the grading child runs the student's code, the parent makes what the judges will read that does not
depend on the student (`StageExercise.prepare`, called by `sandbox.grade_notebook`): every reference run and
oracle run the judges then ask for is one that was prepared, so judging makes none of its own. The solution it
grades under the hidden parameters of tests/test_hidden_parameters.py's first secret earns every point there, and
each hidden check names the world sizes it drew (that test's own check, made here for the stage exercises)."""

from __future__ import annotations

from pathlib import Path

import pytest

from autograder import harness, stage_checks
from autograder.checks import drawn
from autograder.sandbox import grade_submission
from autograder.submission import exercise_module, load
from tests.test_hidden_parameters import SECRETS, STAGE_EXERCISES, assert_every_point_naming_the_drawn_world_sizes

ROOT = Path(__file__).resolve().parents[1]


def reference_keys() -> set:
    return {key for key in harness._RUNS if isinstance(key, tuple) and key[1:2] == ("reference",)}


@pytest.mark.parametrize("assignment", [pytest.param(a, marks=getattr(pytest.mark, a[:4])) for a in STAGE_EXERCISES])
def test_judging_a_graded_notebook_makes_no_run_that_was_not_prepared(assignment: str) -> None:
    exercise = exercise_module(assignment)
    checks = drawn(exercise.CHECKS, assignment, SECRETS[0])
    harness.forget_runs()
    stage_checks.oracle_run.cache_clear()
    for check in checks:
        exercise.EXERCISE.prepare(check)
    prepared, oracle_runs = reference_keys(), stage_checks.oracle_run.cache_info().currsize
    assert prepared and oracle_runs  # the training checks' world sizes
    assert len(STAGE_EXERCISES) == 7
    # a term's grading parent keeps every assignment's references at once, else it remakes them for every student
    assert len(prepared) * len(STAGE_EXERCISES) <= harness.CACHED_RUNS, len(prepared)

    submission = load(ROOT / "solutions" / assignment / f"{assignment}.ipynb")
    results = list(grade_submission(submission, checks))
    assert_every_point_naming_the_drawn_world_sizes(checks, results)
    assert reference_keys() == prepared
    assert stage_checks.oracle_run.cache_info().currsize == oracle_runs
