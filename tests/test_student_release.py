"""What a class's students receive (`autograder.student_release`): the course without the assignment's answers,
solutions, tests or secret, in which `check` grades the visible checks from recorded references.

Each release is checked the way a student would check in it: a process whose only course is the release
(the instructor's editable install is taken off its import path, so an answer the release lacks cannot be
found anywhere), grading a notebook through `python -m autograder check`, in the walls where the machine
builds them. The releases cover a stage exercise (ex02), the formulas (ex05), an oracle of its own (ex08), a
stage whose runs carry links (ex09) and checkpoints resumed from recorded trajectories (ex10).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autograder import recorded, walls
from autograder.student_release import ReleaseError, build, execute_lesson
from autograder.submission import exercise_module
from tests.solution_notebooks import solution_notebook
from tests.test_grading_integrity import FIXTURES, ROOT, WrongSubmission

CHECK_IN_RELEASE = """
import sys
release, notebook = sys.argv[1], sys.argv[2]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
sys.path.insert(0, release)
from autograder.cli import main
sys.exit(main(["check", notebook]))
"""
"""`python -m autograder check` as run in the release, with nothing of the instructor's copy importable."""


def check_in_release(release: Path, notebook: Path, exit_code: int = 0) -> str:
    done = subprocess.run([sys.executable, "-I", "-c", CHECK_IN_RELEASE, str(release), str(notebook)],
                          capture_output=True, text=True, timeout=300, cwd=release)
    assert done.returncode == exit_code, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout


def visible_points(assignment: str) -> float:
    return sum(check.points for check in exercise_module(assignment).CHECKS if not check.hidden)


@pytest.fixture(scope="module")
def release_ex02(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("ex02_zero1_sharded_adam", tmp_path_factory.mktemp("release") / "ex02", run_lessons=False,
                 say=lambda line: None)


def test_the_release_holds_no_answer_solution_test_or_secret(release_ex02: Path) -> None:
    answers = walls.module_files(exercise_module("ex02_zero1_sharded_adam").ANSWER_MODULES)
    assert answers and not any((release_ex02 / path.relative_to(ROOT)).exists() for path in answers)
    for absent in ("solutions", "tests", "benchmarks", ".grading-secret", "nbgrader_config.py",
                   "exercises/ex03_zero2_reduce_scatter_backward"):
        assert not (release_ex02 / absent).exists(), absent
    assert (release_ex02 / "exercises/ex02_zero1_sharded_adam/ex02_zero1_sharded_adam.ipynb").exists()
    assert (release_ex02 / "zero_core/stages/base.py").exists() and (release_ex02 / "lessons").is_dir()
    record = json.loads((release_ex02 / recorded.RECORD_FILE.relative_to(ROOT)).read_text())
    assert record and all(key.split(":", 1)[0] in ("run", "oracle", "stage") for key in record)


def test_check_in_the_release_grades_the_visible_checks_from_the_record(release_ex02: Path, tmp_path: Path) -> None:
    notebook = tmp_path / "ex02_zero1_sharded_adam.ipynb"
    notebook.write_bytes(solution_notebook("ex02_zero1_sharded_adam").read_bytes())
    printed = check_in_release(release_ex02, notebook)
    assert "a student release: the visible checks only" in printed
    points = visible_points("ex02_zero1_sharded_adam")
    assert f"total: {points:g}/{points:g}" in printed
    assert "test_hidden" not in printed
    assert not (release_ex02 / ".grading-secret").exists(), "no secret is made where nothing hidden is drawn"


def test_a_wrong_answer_loses_its_visible_checks_in_the_release(release_ex02: Path, tmp_path: Path) -> None:
    wrong = WrongSubmission.read(FIXTURES / "ex02_floor_chunk.patch")
    printed = check_in_release(release_ex02, wrong.notebook(tmp_path), exit_code=1)
    lost = {line.split("] ", 1)[1].split(":", 1)[0] for line in printed.splitlines() if line.startswith("[0/")}
    assert lost == {name for name in wrong.loses if not name.startswith("test_hidden")}, printed


@pytest.mark.parametrize(
    "assignment",
    ["ex05_memory_planning", "ex08_clip_and_accumulate", "ex09_hierarchical_allgather", "ex10_sharded_checkpoints"],
)
def test_every_kind_of_recorded_reference_grades_the_solution(assignment: str, tmp_path: Path) -> None:
    release = build(assignment, tmp_path / "release", run_lessons=False, say=lambda line: None)
    notebook = tmp_path / f"{assignment}.ipynb"
    notebook.write_bytes(solution_notebook(assignment).read_bytes())
    printed = check_in_release(release, notebook)
    assert f"total: {visible_points(assignment):g}/{visible_points(assignment):g}" in printed, printed


def test_the_release_refuses_a_used_folder_one_inside_the_course_and_an_unknown_assignment(tmp_path: Path) -> None:
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    with pytest.raises(ReleaseError, match="not empty"):
        build("ex02_zero1_sharded_adam", used, run_lessons=False)
    with pytest.raises(ReleaseError, match="inside the course"):
        build("ex02_zero1_sharded_adam", ROOT / "out" / "release", run_lessons=False)
    with pytest.raises(ReleaseError, match="unknown assignment"):
        build("ex10_nothing", tmp_path / "new", run_lessons=False)


def test_a_lesson_ships_with_its_outputs(tmp_path: Path) -> None:
    """The release runs the lessons (the stages they train are answers it does not hold) and keeps their
    outputs; the smallest lesson shows the mechanism."""
    import nbformat

    source = ROOT / "lessons" / "00_virtual_cluster.ipynb"
    target = tmp_path / source.name
    execute_lesson(source, target)
    cells = nbformat.read(target, as_version=4).cells
    assert any(cell.get("outputs") for cell in cells if cell.cell_type == "code")
