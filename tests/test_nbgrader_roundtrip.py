"""The instructor's round trip with nbgrader itself, on a fake class of four students in a temporary course:
generate_assignment, collect (copying into out/submitted/), autograde, generate_feedback.

alice hands in the solutions, bob a partly wrong notebook (one fixture from tests/fixtures/wrong per
assignment), carol the untouched release, and mallory a wrong notebook that also attacks a grader judging
beside it (patches `torch.equal`, forges the results file). The gradebook must give alice full marks, bob
and mallory exactly the points of the checks their mistakes do not cost, and carol nothing, the same
points as the batch grader gives; alice's graded test cells must not have written a byte to stderr
(nbgrader scores such a cell 0), and everyone gets HTML feedback.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

import nbformat
import pytest
from nbgrader.api import Gradebook
from nbgrader.apps import NbGraderAPI
from traitlets.config.loader import PyFileConfigLoader

from autograder.checks import total
from autograder.sandbox import grade_notebook
from autograder.submission import exercise_module, is_solution_cell

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "wrong"
ASSIGNMENTS = {
    "ex03_zero2_reduce_scatter_backward": "ex03_all_reduce_instead_of_reduce_scatter.py",
    "ex05_memory_planning": "ex05_wrong_formula.py",
}
ATTACKS = {
    "ex03_zero2_reduce_scatter_backward": "ex03_patches_torch_equal.py",
    "ex05_memory_planning": "ex05_forges_the_results_file.py",
}
STUDENTS = ("alice", "bob", "carol", "mallory")
PER_ASSIGNMENT = [pytest.param(a, marks=getattr(pytest.mark, a[:4])) for a in ASSIGNMENTS]
pytestmark = pytest.mark.filterwarnings("ignore::sqlalchemy.exc.SAWarning")  # nbgrader's own session noise


def fixture_cell(name: str) -> tuple[str, str, set[str]]:
    """(cell id, cell source, checks lost) of a wrong submission in tests/fixtures/wrong."""
    header, source = (FIXTURES / name).read_text().split("# --- cell ---\n", 1)
    meta: dict = {}
    exec(header, meta)
    return meta["CELL"], source, set(meta["LOSES"])


def submission(release: Path, solution: Path, replace: dict[str, str]) -> nbformat.NotebookNode:
    """The release notebook as a student hands it in: solution cells filled from `replace` (by grade id)."""
    notebook = nbformat.read(release, as_version=4)
    for cell in notebook.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if is_solution_cell(cell) and grade_id in replace:
            cell.source = replace[grade_id]
    return notebook


@pytest.fixture(scope="module")
def course(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A temporary course, graded by nbgrader's API with the repository's nbgrader_config.py."""
    course = tmp_path_factory.mktemp("course")
    shutil.copytree(ROOT / "solutions", course / "solutions", ignore=lambda d, names: [
        n for n in names if d.endswith("solutions") and n not in ASSIGNMENTS
    ])
    config = PyFileConfigLoader("nbgrader_config.py", path=str(ROOT)).load_config()
    config.CourseDirectory.root = str(course)
    config.CourseDirectory.db_url = f"sqlite:///{course / 'gradebook.db'}"
    with pytest.MonkeyPatch.context() as patch:
        bin_dir = str(Path(sys.executable).parent)
        patch.setenv("PATH", os.pathsep.join([bin_dir, os.environ.get("PATH", "")]))
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        api = NbGraderAPI(config=config)
        warnings = logging.getLogger("traitlets")
        warnings.addHandler(_WARNINGS)
        with Gradebook(config.CourseDirectory.db_url) as gradebook:
            for student in STUDENTS:
                gradebook.update_or_create_student(student)
        for assignment, wrong in ASSIGNMENTS.items():
            result = api.generate_assignment(assignment, force=True)
            assert result["success"], result["log"]
            release = course / "exercises" / assignment / f"{assignment}.ipynb"
            solution = course / "solutions" / assignment / f"{assignment}.ipynb"
            solutions = {
                cell.metadata["nbgrader"]["grade_id"]: cell.source
                for cell in nbformat.read(solution, as_version=4).cells
                if is_solution_cell(cell)
            }
            cell, source, _ = fixture_cell(wrong)
            attack_cell, attack_source, _ = fixture_cell(ATTACKS[assignment])
            handed_in = {
                "alice": submission(release, solution, solutions),
                "bob": submission(release, solution, {**solutions, cell: source}),
                "carol": submission(release, solution, {}),
                "mallory": submission(release, solution, {**solutions, attack_cell: attack_source}),
            }
            for student, notebook in handed_in.items():
                path = course / "out" / "submitted" / student / assignment / f"{assignment}.ipynb"
                path.parent.mkdir(parents=True)
                nbformat.write(notebook, path)
            for student in STUDENTS:
                result = api.autograde(assignment, student)
                assert result["success"], result["log"]
                result = api.generate_feedback(assignment, student)
                assert result["success"], result["log"]
        warnings.removeHandler(_WARNINGS)
        yield course


class _Collected(logging.Handler):
    """The warnings nbgrader logs while the fixture grades the class."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


_WARNINGS = _Collected()


def test_nobody_who_left_the_locked_cells_alone_gets_a_checksum_warning(course: Path) -> None:
    """Every fixture edits solution cells only, so nbgrader has nothing to report: its warning about test
    cells whose hidden tests the release stripped (jupyter/nbgrader#1961) is a false alarm."""
    assert [m for m in _WARNINGS.messages if "has changed" in m] == []


def expected_points(assignment: str, lost: set[str]) -> float:
    return sum(check.points for check in exercise_module(assignment).CHECKS if check.name not in lost)


@pytest.mark.parametrize("assignment", PER_ASSIGNMENT)
def test_autograde_gives_full_partial_and_zero_marks(course: Path, assignment: str) -> None:
    _, _, bob_loses = fixture_cell(ASSIGNMENTS[assignment])
    _, _, mallory_loses = fixture_cell(ATTACKS[assignment])
    expected = {
        "alice": 10.0,
        "bob": expected_points(assignment, bob_loses),
        "carol": 0.0,
        "mallory": expected_points(assignment, mallory_loses),
    }
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        scores = {s: gradebook.find_submission(assignment, s).score for s in STUDENTS}
        assert gradebook.find_submission(assignment, "alice").max_score == 10.0
    assert scores == expected
    assert 0 < expected["bob"] < 10 and expected["mallory"] < 10


@pytest.mark.parametrize("assignment", PER_ASSIGNMENT)
def test_the_gradebook_and_the_batch_grader_give_the_same_points(course: Path, assignment: str) -> None:
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}") as gradebook:
        scores = {s: gradebook.find_submission(assignment, s).score for s in STUDENTS}
    for student in STUDENTS:
        path = course / "out" / "submitted" / student / assignment / f"{assignment}.ipynb"
        assert total(grade_notebook(path))[0] == scores[student], student


@pytest.mark.parametrize("assignment", PER_ASSIGNMENT)
def test_a_correct_solution_writes_nothing_to_stderr(course: Path, assignment: str) -> None:
    graded = nbformat.read(course / "out" / "autograded" / "alice" / assignment / f"{assignment}.ipynb", 4)
    for cell in graded.cells:
        if cell.metadata.get("nbgrader", {}).get("grade"):
            bad = [o for o in cell.outputs if o.output_type == "error" or o.get("name") == "stderr"]
            assert bad == [], f"{cell.metadata.nbgrader.grade_id}: {bad}"


@pytest.mark.parametrize("assignment", PER_ASSIGNMENT)
def test_generate_feedback_writes_html_for_every_student(course: Path, assignment: str) -> None:
    for student in STUDENTS:
        html = course / "out" / "feedback" / student / assignment / f"{assignment}.html"
        assert html.exists() and "<html" in html.read_text()[:2000].lower()
