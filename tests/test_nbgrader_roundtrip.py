"""The instructor's round trip with nbgrader itself, on a fake class in a temporary course:
generate_assignment, collect (copying into out/submitted/), autograde, generate_feedback.

alice hands in the solutions, carol the untouched release, and the others one fixture each from tests/fixtures
(`CLASS`, tests/round_trip_class.py): bob an honest mistake; mallory, oscar, peggy, trent, victor and walter an
attack on a grader judging beside their code (patched comparisons, a patched grader, forged results, the reference
loaded by a built name or called past the shard, reading the solutions, a process left behind, a signal to the
parent; most of them break a rule for graded cells, and lose every check before anything runs); xavier, yvonne and
zach an attack on the walls and the evidence (a file written into the grader's venv, the solutions read through
torch, a ledger rewritten, every gathered layer kept outside torch, where only the kernel's count of memory sees
it); ursula a correct notebook written unusually. The gradebook must give each of them, check by check, exactly
what the fixture's header says: the points `check` and `grade` give for the same cell, which
tests/test_grading_integrity.py holds the other fixtures to, so the gradebook and the batch grader agree check by
check without grading the class twice (tests/test_readme_instructor.py compares the two end to end); and the first
check each loses says why, in the phrase the header names. For a fixture that breaks no rule for graded cells that
is its whole header, and the round trip is where it is graded: the integrity test grades it no second time.
alice's graded test cells must not have written a byte to stderr (nbgrader scores such a cell 0), and everyone
gets HTML feedback.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest
from nbgrader.api import Gradebook
from nbgrader.apps import NbGraderAPI
from traitlets.config.loader import PyFileConfigLoader

from autograder.submission import exercise_module, is_solution_cell
from tests.fixture_text import FIXTURES, read_fixture, with_paths
from tests.round_trip_class import ASSIGNMENTS, CLASS

ROOT = Path(__file__).resolve().parents[1]
STUDENTS = (
    "alice", "bob", "carol", "mallory", "oscar", "peggy", "trent", "ursula", "victor", "walter", "xavier", "yvonne",
    "zach",
)
PER_ASSIGNMENT = {a: pytest.param(a, marks=getattr(pytest.mark, a[:4])) for a in ASSIGNMENTS}
EACH_ASSIGNMENT = pytest.mark.parametrize("assignment", list(PER_ASSIGNMENT.values()), scope="module")
"""Every test runs once per assignment, on that assignment's course (`course`, graded once per assignment)."""
pytestmark = pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SAWarning")  # nbgrader's own session noise


def fixture_cell(name: str) -> tuple[str, str, set[str] | None, str]:
    """(cell id, cell source, checks lost, phrase of the first lost check's message) of a submission in
    tests/fixtures; None for the checks lost by a cell that breaks a rule for graded cells: it loses every check
    (its `LOSES` and `MESSAGE` are what the nets behind the rules make of it, see tests/fixtures/wrong/README.md)."""
    meta, source = read_fixture(FIXTURES / name)
    return meta["CELL"], source, None if "RULES" in meta else set(meta["LOSES"]), meta["MESSAGE"]


def handed_in(assignment: str) -> dict[str, set[str]]:
    """{student: the checks that student's notebook loses} for everyone who handed `assignment` in."""
    every_check = {check.name for check in exercise_module(assignment).CHECKS}
    lost = {"alice": set(), "carol": every_check}
    for student, name in CLASS[assignment].items():
        loses = fixture_cell(name)[2]
        lost[student] = every_check if loses is None else loses
    return lost


def submission(release: Path, solution: Path, replace: dict[str, str]) -> nbformat.NotebookNode:
    """The release notebook as a student hands it in: solution cells filled from `replace` (by grade id)."""
    notebook = nbformat.read(release, as_version=4)
    for cell in notebook.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if is_solution_cell(cell) and grade_id in replace:
            cell.source = replace[grade_id]
    return notebook


@pytest.fixture(scope="module")
def course(tmp_path_factory: pytest.TempPathFactory, assignment: str) -> Iterator[Path]:
    """A temporary course in which the class has handed `assignment` in, graded by nbgrader's API with the
    repository's nbgrader_config.py. One course per assignment: the test workers grade them side by side
    (tests/conftest.py keeps each assignment's tests in one worker, so each class is graded once)."""
    course = tmp_path_factory.mktemp(f"course-{assignment[:4]}")
    shutil.copytree(ROOT / "solutions" / assignment, course / "solutions" / assignment)
    config = PyFileConfigLoader("nbgrader_config.py", path=str(ROOT)).load_config()
    config.CourseDirectory.root = str(course)
    config.CourseDirectory.db_url = f"sqlite:///{course / 'gradebook.db'}"
    with pytest.MonkeyPatch.context() as patch:
        bin_dir = str(Path(sys.executable).parent)
        patch.setenv("PATH", os.pathsep.join([bin_dir, os.environ.get("PATH", "")]))
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        api = NbGraderAPI(config=config)
        warnings, collected = logging.getLogger("traitlets"), _Collected()
        warnings.addHandler(collected)
        with Gradebook(config.CourseDirectory.db_url) as gradebook:
            for student in STUDENTS:
                gradebook.update_or_create_student(student)
        result = api.generate_assignment(assignment, force=True)
        assert result["success"], result["log"]
        release = course / "exercises" / assignment / f"{assignment}.ipynb"
        solution = course / "solutions" / assignment / f"{assignment}.ipynb"
        solutions = {
            cell.metadata["nbgrader"]["grade_id"]: cell.source
            for cell in nbformat.read(solution, as_version=4).cells
            if is_solution_cell(cell)
        }
        notebooks = {"alice": submission(release, solution, solutions), "carol": submission(release, solution, {})}
        for student, name in CLASS[assignment].items():
            cell, source, _, _ = fixture_cell(name)
            notebooks[student] = submission(release, solution, {**solutions, cell: source})
        for student, notebook in notebooks.items():
            path = course / "out" / "submitted" / student / assignment / f"{assignment}.ipynb"
            path.parent.mkdir(parents=True)
            nbformat.write(notebook, path)
            result = api.autograde(assignment, student)
            assert result["success"], result["log"]
            result = api.generate_feedback(assignment, student)
            assert result["success"], result["log"]
        warnings.removeHandler(collected)
        WARNINGS[assignment] = collected.messages
        yield course


class _Collected(logging.Handler):
    """The warnings nbgrader logs while `course` grades the class."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


WARNINGS: dict[str, list[str]] = {}
"""What nbgrader warned of while grading each assignment's class."""


@EACH_ASSIGNMENT
def test_nobody_who_left_the_locked_cells_alone_gets_a_checksum_warning(course: Path, assignment: str) -> None:
    """Every fixture edits solution cells only, so nbgrader has nothing to report: its warning about test
    cells whose hidden tests the release stripped (jupyter/nbgrader#1961) is a false alarm."""
    assert [m for m in WARNINGS[assignment] if "has changed" in m] == []


def expected_points(assignment: str, lost: set[str]) -> float:
    return sum(check.points for check in exercise_module(assignment).CHECKS if check.name not in lost)


@EACH_ASSIGNMENT
def test_autograde_gives_every_student_exactly_the_checks_their_notebook_earns(course: Path, assignment: str) -> None:
    """Check by check in the gradebook: what each fixture's header says it loses (the same checks
    tests/test_grading_integrity.py sees `check` and `grade` take), and the rest in full."""
    notebook = assignment
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        for student, lost in handed_in(assignment).items():
            grades = gradebook.find_submission_notebook(notebook, assignment, student).grades
            got = {g.name: g.score for g in grades if g.max_score}
            expected = {c.name: 0.0 if c.name in lost else float(c.points) for c in exercise_module(assignment).CHECKS}
            assert got == expected, student
            assert gradebook.find_submission(assignment, student).score == expected_points(assignment, lost)


def verdicts(course: Path, assignment: str, student: str) -> dict[str, str]:
    """What autograde wrote in each test cell of the student's notebook, by check: the grader's message."""
    graded = nbformat.read(course / "out" / "autograded" / student / assignment / f"{assignment}.ipynb", 4)
    return {
        cell.metadata.nbgrader.grade_id: "".join(o.get("evalue", "") + o.get("text", "") for o in cell.outputs)
        for cell in graded.cells
        if cell.metadata.get("nbgrader", {}).get("grade") and not cell.metadata.nbgrader.get("solution")
    }


@EACH_ASSIGNMENT
def test_the_first_check_a_student_loses_says_why_and_the_untouched_release_says_it_is_not_done(
    course: Path, assignment: str
) -> None:
    """The first lost check's message holds the phrase the fixture's header names (`MESSAGE`), as
    tests/test_grading_integrity.py holds the fixtures it grades: with the points above, the round trip is the
    one place that grades the fixtures it hands in without breaking a rule for graded cells
    (`round_trip_class.held_by_the_round_trip`). carol's every check says the exercise is not done."""
    checks = [check.name for check in exercise_module(assignment).CHECKS]
    said = verdicts(course, assignment, "carol")
    assert all("NotImplementedError" in said[name] for name in checks), said
    for student, name in CLASS[assignment].items():
        _, _, loses, message = fixture_cell(name)
        if loses:
            said = verdicts(course, assignment, student)
            first_lost = next(check for check in checks if check in loses)
            assert message in said[first_lost], f"{student} ({name}), {first_lost}: {said[first_lost]}"


@EACH_ASSIGNMENT
def test_a_correct_solution_writes_nothing_to_stderr(course: Path, assignment: str) -> None:
    graded = nbformat.read(course / "out" / "autograded" / "alice" / assignment / f"{assignment}.ipynb", 4)
    for cell in graded.cells:
        if cell.metadata.get("nbgrader", {}).get("grade"):
            bad = [o for o in cell.outputs if o.output_type == "error" or o.get("name") == "stderr"]
            assert bad == [], f"{cell.metadata.nbgrader.grade_id}: {bad}"


@EACH_ASSIGNMENT
def test_generate_feedback_writes_html_for_every_student(course: Path, assignment: str) -> None:
    for student in handed_in(assignment):
        html = course / "out" / "feedback" / student / assignment / f"{assignment}.html"
        assert html.exists() and "<html" in html.read_text()[:2000].lower()


@pytest.mark.parametrize("assignment", [PER_ASSIGNMENT["ex05_memory_planning"]], scope="module")
def test_autograde_leaves_no_file_in_the_venv_and_no_solution_in_the_feedback(course: Path, assignment: str) -> None:
    """xavier's file in the grader's site-packages was never written, and yvonne's feedback carries none of
    the solution she read through torch: inside the walls neither the venv nor `solutions/` was hers."""
    planted = Path(with_paths("{SITE_PACKAGES}/zz_written_by_a_submission.pth"))
    written = planted.exists()
    planted.unlink(missing_ok=True)
    assert not written
    html = (course / "out" / "feedback" / "yvonne" / assignment / f"{assignment}.html").read_text()
    assert "No such file" in html and "### BEGIN SOLUTION\\n" not in html
