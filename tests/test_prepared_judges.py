"""While the grading child runs the student's code, the parent makes what the judges will read that does not
depend on the student (`StageExercise.prepare`, called by `sandbox.grade_notebook`): every reference run and
oracle run the judges then ask for is one that was prepared, so judging makes none of its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from autograder import harness, stage_checks
from autograder.checks import drawn
from autograder.sandbox import grade_submission
from autograder.stage_checks import StageExercise
from autograder.submission import EXERCISES, exercise_module, load

ROOT = Path(__file__).resolve().parents[1]


def reference_keys() -> set:
    return {key for key in harness._RUNS if isinstance(key, tuple) and key[1:2] == ("reference",)}


STAGE_EXERCISES = [a for a in EXERCISES if isinstance(getattr(exercise_module(a), "EXERCISE", None), StageExercise)]


@pytest.mark.parametrize("assignment", [pytest.param(a, marks=getattr(pytest.mark, a[:4])) for a in STAGE_EXERCISES])
def test_judging_a_graded_notebook_makes_no_run_that_was_not_prepared(assignment: str) -> None:
    exercise = exercise_module(assignment)
    checks = drawn(exercise.CHECKS, assignment, b"a secret of this test")
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
    assert all(result.points == result.max_points for result in results), results
    assert reference_keys() == prepared
    assert stage_checks.oracle_run.cache_info().currsize == oracle_runs
