"""The hidden checks' parameters come from the instructor's secret, not from the course's files: drawn the
same way from the same secret, otherwise from a fresh one, always within ranges that keep each check meaningful,
and the solutions earn every point whatever the secret."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from autograder import checks, ex01, ex05, ex06, ex07, ex08, ex09, stage_checks
from autograder.checks import (
    drawn,
    drawn_parameters,
    grading_secret,
    judge_check,
    observe_check,
    through_json,
    total,
    with_parameters,
)
from autograder.harness import STEPS
from autograder.sandbox import grade_submission
from autograder.stage_checks import StageExercise
from autograder.submission import EXERCISES, exercise_module, load

ROOT = Path(__file__).resolve().parents[1]
STAGE_EXERCISES = [a for a in EXERCISES if isinstance(getattr(exercise_module(a), "EXERCISE", None), StageExercise)]
"""The exercises whose checks train a stage (`autograder.stage_checks.StageExercise`)."""
SECRETS = [b"the instructor's secret", b"another term", b"a third"]
MANY_SECRETS = [f"secret {i}".encode() for i in range(300)]


def marker(assignment: str) -> pytest.MarkDecorator:
    return getattr(pytest.mark, assignment[:4])


def solution(assignment: str) -> dict:
    return load(ROOT / "solutions" / assignment / f"{assignment}.ipynb").namespace


def hidden_arguments(assignment: str, secret: bytes) -> dict[str, dict]:
    return drawn_parameters(drawn(exercise_module(assignment).CHECKS, assignment, secret))


# -- the secret ----------------------------------------------------------------------------------------------


@pytest.fixture
def secret_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / ".grading-secret"
    monkeypatch.setattr(checks, "SECRET_FILE", path)
    monkeypatch.delenv(checks.SECRET_FILE_VARIABLE, raising=False)
    return path


def test_the_instructors_grading_makes_the_secret_once_readable_by_them_only(secret_file: Path) -> None:
    secret = grading_secret(create=True)
    assert secret_file.stat().st_mode & 0o777 == 0o600
    assert grading_secret(create=True) == grading_secret() == secret and len(secret) == 64


def test_without_a_secret_every_grading_draws_other_parameters(secret_file: Path) -> None:
    secrets = {grading_secret() for _ in range(5)}
    assert len(secrets) == 5 and not secret_file.exists()
    assignment = "ex03_zero2_reduce_scatter_backward"
    assert len({json.dumps(hidden_arguments(assignment, s)) for s in secrets}) > 1


def test_a_secret_other_users_may_read_is_refused(secret_file: Path) -> None:
    grading_secret(create=True)
    secret_file.chmod(0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        grading_secret()


def test_a_secret_file_named_by_the_environment_is_read_and_must_exist(
    secret_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = tmp_path / "kept-elsewhere"
    monkeypatch.setenv(checks.SECRET_FILE_VARIABLE, str(elsewhere))
    with pytest.raises(FileNotFoundError, match=str(elsewhere)):
        grading_secret()
    elsewhere.write_text("my secret\n")
    os.chmod(elsewhere, 0o600)
    assert grading_secret() == b"my secret" and not secret_file.exists()


# -- drawing -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("assignment", list(EXERCISES))
def test_each_hidden_check_draws_its_arguments_and_only_hidden_checks_draw(assignment: str) -> None:
    graded = drawn(exercise_module(assignment).CHECKS, assignment, SECRETS[0])
    assert all(check.hidden for check in graded if check.draw)
    assert all(check.draw for check in graded if check.hidden and check.kwargs)
    assert hidden_arguments(assignment, SECRETS[0]) == hidden_arguments(assignment, SECRETS[0])
    assert len({json.dumps(hidden_arguments(assignment, s)) for s in MANY_SECRETS[:20]}) > 1


@pytest.mark.parametrize("assignment", list(EXERCISES))
def test_the_child_receives_exactly_the_arguments_the_parent_drew(assignment: str) -> None:
    """What `autograder.sandbox` passes: the parent's drawn arguments as JSON, read back by the child."""
    checks_of = exercise_module(assignment).CHECKS
    parent = drawn(checks_of, assignment, SECRETS[1])
    child = with_parameters(checks_of, json.loads(json.dumps(drawn_parameters(parent))))
    assert [c.kwargs for c in child] == [c.kwargs for c in parent]
    with pytest.raises(ValueError, match="grader bug"):
        with_parameters(checks_of, {"test_no_such_check": {}})


def test_checks_that_share_a_draw_share_their_arguments() -> None:
    for assignment in EXERCISES:
        graded = [c for c in drawn(exercise_module(assignment).CHECKS, assignment, SECRETS[0]) if c.draw]
        by_draw: dict[str, list[dict]] = {}
        for check in graded:
            by_draw.setdefault(check.draw.__qualname__, []).append(check.kwargs)
        assert all(all(kwargs == same[0] for kwargs in same) for same in by_draw.values()), assignment


def _drawn(assignment: str, name: str) -> list[dict]:
    return [hidden_arguments(assignment, secret)[name] for secret in MANY_SECRETS]


def test_ex01_draws_as_many_world_sizes_of_the_same_magnitudes() -> None:
    for arguments in _drawn("ex01_collectives", "test_hidden_all_reduce"):
        sizes = arguments["world_sizes"]
        assert len(set(sizes)) == 3 and sizes == sorted(sizes) and set(sizes) <= set(range(3, 9))
    for arguments in _drawn("ex01_collectives", "test_hidden_ring_bytes"):
        one, *small, large = arguments["world_sizes"]
        assert one == 1 and len(set(small)) == 3 and set(small) <= set(range(3, 17)) and 17 <= large <= 128


def test_ex05_draws_four_models_four_gpu_counts_and_counts_out_of_order() -> None:
    for arguments in _drawn("ex05_memory_planning", "test_hidden_formulas"):
        psis, sizes, counts = arguments["psis"], arguments["world_sizes"], arguments["gpu_counts"]
        assert [len(psis), len(sizes)] == [4, 4] and all(1e8 <= psi <= 2e12 for psi in psis)
        ranges = [(1, 1), (2, 8), (9, 64), (65, 2048)]
        assert all(low <= n <= high for n, (low, high) in zip(sizes, ranges, strict=True))
        assert counts[0] == max(counts) and counts != sorted(counts) and len(set(counts)) < len(counts)


STAGE_HIDDEN = [
    "ex02_zero1_sharded_adam",
    "ex03_zero2_reduce_scatter_backward",
    "ex04_zero3_gather_linear",
    "ex06_bucketed_overlap",
    "ex07_zero3_prefetch",
    "ex08_clip_and_accumulate",
]


@pytest.mark.parametrize("assignment", STAGE_HIDDEN)
def test_stage_exercises_draw_two_world_sizes_of_4_to_8_one_of_which_pads(assignment: str) -> None:
    for arguments in _drawn(assignment, "test_hidden_training"):
        sizes = arguments["world_sizes"]
        assert len(set(sizes)) == 2 and set(sizes) <= set(stage_checks.HIDDEN_WORLD_SIZE_RANGE)
        assert any(n & (n - 1) for n in sizes)


def test_ex06_draws_buckets_that_hold_every_layer_and_make_at_least_two() -> None:
    for arguments in _drawn("ex06_bucketed_overlap", "test_hidden_training"):
        for n, limit in zip(arguments["world_sizes"], arguments["bucket_bytes"], strict=True):
            low, high = ex06.bucket_bounds(n)
            assert low <= limit <= high and limit % 2 == 0


def test_ex07_and_ex08_draw_windows_and_accumulations_within_their_ranges() -> None:
    for arguments in _drawn("ex07_zero3_prefetch", "test_hidden_training"):
        assert set(arguments["windows"]) <= set(ex07.HIDDEN_WINDOWS)
    for arguments in _drawn("ex08_clip_and_accumulate", "test_hidden_training"):
        for k, max_norm in arguments["accumulation"]:
            assert k in ex08.HIDDEN_MICRO_STEPS and ex08.HIDDEN_MAX_NORMS[0] <= max_norm <= ex08.HIDDEN_MAX_NORMS[1]


def test_ex09_draws_nodes_that_divide_the_ranks_in_two_levels() -> None:
    for arguments in _drawn("ex09_hierarchical_allgather", "test_hidden_training"):
        sizes = arguments["world_sizes"]
        assert len(set(sizes)) == 2 and set(sizes) <= set(ex09.HIDDEN_WORLD_SIZES)
        for n, g in zip(sizes, arguments["gpus_per_node"], strict=True):
            assert n % g == 0 and 2 <= g <= n // 2


@pytest.mark.ex08
@pytest.mark.parametrize("world_size", list(stage_checks.HIDDEN_WORLD_SIZE_RANGE))
def test_every_accumulation_ex08_may_draw_clips_every_step(world_size: int) -> None:
    """The largest max_norm is below the gradient norm of every graded step, for every k and N it may meet."""
    for k in ex08.HIDDEN_MICRO_STEPS:
        for max_norm in ex08.HIDDEN_MAX_NORMS:
            accumulation = ex08.Accumulation(k, max_norm)
            assert ex08.clipped_steps(world_size, accumulation) == STEPS, (k, max_norm)


# -- the solutions, whatever is drawn ------------------------------------------------------------------------


def assert_every_point_naming_the_drawn_world_sizes(graded: list[checks.Check], results: list) -> None:
    """The solution's results under the drawn checks `graded`: every point, and each hidden check's message
    names the world sizes it drew."""
    assert [r.message for r in results if not r.passed] == [] and total(results) == (10, 10)
    for check, result in zip(graded, results, strict=True):
        if check.draw:
            sizes = check.kwargs["world_sizes"]
            named = ", ".join(map(str, sizes)) in result.message
            assert named or all(f"{n} ranks" in result.message for n in sizes), result.message


@pytest.mark.parametrize(
    ("assignment", "secrets"),
    [
        pytest.param(a, SECRETS if a in ("ex01_collectives", "ex05_memory_planning") else SECRETS[:1], marks=marker(a))
        for a in EXERCISES
        if a not in STAGE_EXERCISES
    ],
)
def test_the_solution_earns_every_point_whatever_the_secret(assignment: str, secrets: list[bytes]) -> None:
    """The stage exercises' solutions are graded under `SECRETS[0]` in tests/test_prepared_judges.py, which holds
    them to the same while it checks that judging makes no run of its own."""
    submission = load(ROOT / "solutions" / assignment / f"{assignment}.ipynb")
    for secret in secrets:
        graded = drawn(exercise_module(assignment).CHECKS, assignment, secret)
        assert_every_point_naming_the_drawn_world_sizes(graded, list(grade_submission(submission, graded)))


def _judged(assignment: str, name: str, **kwargs) -> str:
    check = next(c for c in exercise_module(assignment).CHECKS if c.name == name)
    check = replace(check, kwargs=kwargs)
    observed = observe_check(check, solution(assignment))
    assert observed.failure is None, observed.failure
    result = judge_check(check, through_json(observed.observation))
    assert result.passed, result.message
    return result.message


@pytest.mark.ex06
@pytest.mark.parametrize("end", [0, 1], ids=["smallest-B", "largest-B"])
def test_ex06_the_solution_passes_at_either_end_of_the_bucket_range(end: int) -> None:
    sizes = list(stage_checks.HIDDEN_WORLD_SIZE_RANGE)
    limits = [ex06.bucket_bounds(n)[end] // 2 * 2 for n in sizes]
    message = _judged(
        ex06.ASSIGNMENT, "test_hidden_memory_communication_overlap", world_sizes=sizes, bucket_bytes=limits
    )
    assert f"B = {limits[0]:,} bytes" in message


@pytest.mark.ex07
@pytest.mark.parametrize("window", [min(ex07.HIDDEN_WINDOWS), max(ex07.HIDDEN_WINDOWS)])
def test_ex07_the_solution_passes_with_the_narrowest_and_widest_window(window: int) -> None:
    sizes = list(stage_checks.HIDDEN_WORLD_SIZE_RANGE)
    _judged(
        ex07.ASSIGNMENT,
        "test_hidden_memory_communication_schedule",
        world_sizes=sizes,
        windows=[window] * len(sizes),
    )


@pytest.mark.ex09
@pytest.mark.parametrize("shape", ["smallest", "largest"])
def test_ex09_the_solution_passes_on_every_node_shape(shape: str) -> None:
    sizes = list(ex09.HIDDEN_WORLD_SIZES)
    pick = min if shape == "smallest" else max
    _judged(
        ex09.ASSIGNMENT,
        "test_hidden_memory_communication",
        world_sizes=sizes,
        gpus_per_node=[pick(ex09.node_shapes(n)) for n in sizes],
    )


def test_the_notebooks_hidden_cells_keep_their_own_arguments() -> None:
    """A hidden check's `kwargs` stay the call of the solution notebook's hidden test cell (an instructor's
    kernel); only a grade draws."""
    assert ex01.CHECKS[2].kwargs == {"world_sizes": ex01.HIDDEN_CELL_WORLD_SIZES}
    assert ex05.CHECKS[3].kwargs == ex05.HIDDEN_CELL
    graded = drawn(ex05.CHECKS, ex05.ASSIGNMENT, SECRETS[0])
    assert graded[3].kwargs != ex05.HIDDEN_CELL and ex05.CHECKS[3].kwargs == ex05.HIDDEN_CELL
