"""The committed exercises/ are exactly what `nbgrader generate_assignment` makes of solutions/, and neither
hides a solution, a hidden test or the reference implementation where a student would see it."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import nbformat
import pytest

from autograder.submission import EXERCISES, exercise_module, is_setup_cell, is_solution_cell

ROOT = Path(__file__).resolve().parents[1]
PER_ASSIGNMENT = [pytest.param(a, marks=getattr(pytest.mark, a[:4])) for a in EXERCISES]
VOLATILE_METADATA: tuple[str, ...] = ()
"""nbgrader 0.9.6's generate_assignment is deterministic (cell checksums depend only on the source): none."""


def nbgrader_api(course: Path):
    """nbgrader's Python API on a course in `course`, configured by the repository's nbgrader_config.py."""
    from nbgrader.apps import NbGraderAPI
    from traitlets.config.loader import PyFileConfigLoader

    config = PyFileConfigLoader("nbgrader_config.py", path=str(ROOT)).load_config()
    config.CourseDirectory.root = str(course)
    config.CourseDirectory.db_url = f"sqlite:///{course / 'gradebook.db'}"
    return NbGraderAPI(config=config)


def comparable(path: Path) -> dict:
    notebook = json.loads(path.read_text())
    for cell in notebook["cells"]:
        for key in VOLATILE_METADATA:
            cell["metadata"].get("nbgrader", {}).pop(key, None)
    return notebook


@pytest.fixture(scope="module")
def alembic_on_path():
    """nbgrader runs the `alembic` script to create its database: it must be on PATH (the venv's bin)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PATH", os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
        yield


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory: pytest.TempPathFactory, alembic_on_path: None) -> Path:
    course = tmp_path_factory.mktemp("course")
    shutil.copytree(ROOT / "solutions", course / "solutions")
    api = nbgrader_api(course)
    for assignment in EXERCISES:
        result = api.generate_assignment(assignment, force=True)
        assert result["success"], result["error"] + result["log"]
    return course / "exercises"


@pytest.mark.parametrize("assignment", PER_ASSIGNMENT)
def test_the_committed_exercise_is_what_generate_assignment_makes(assignment: str, regenerated: Path) -> None:
    name = f"{assignment}/{assignment}.ipynb"
    assert comparable(regenerated / name) == comparable(ROOT / "exercises" / name), (
        f"exercises/{name} is out of date: run `nbgrader generate_assignment {assignment} --force` from the root"
    )


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


@pytest.mark.parametrize("assignment", PER_ASSIGNMENT)
def test_every_notebook_is_committed_without_outputs(assignment: str) -> None:
    for folder in ("solutions", "exercises"):
        for cell in _cells(ROOT / folder / assignment / f"{assignment}.ipynb"):
            if cell["cell_type"] == "code":
                assert cell["outputs"] == [] and cell["execution_count"] is None, f"{folder}/{assignment}"


@pytest.mark.parametrize("assignment", PER_ASSIGNMENT)
def test_each_test_cell_runs_its_check_for_the_points_the_autograder_gives(assignment: str) -> None:
    """nbgrader and `python -m autograder` must give the same points: one test cell per check, same call."""
    checks = {check.name: check for check in exercise_module(assignment).CHECKS}
    cells = {
        cell["metadata"]["nbgrader"]["grade_id"]: cell
        for cell in _cells(ROOT / "solutions" / assignment / f"{assignment}.ipynb")
        if cell["metadata"].get("nbgrader", {}).get("grade")
    }
    assert sorted(cells) == sorted(checks)
    for name, check in checks.items():
        source = "".join(cells[name]["source"])
        assert cells[name]["metadata"]["nbgrader"]["points"] == check.points, name
        assert check.call() in source, f"{name}: the cell should call {check.call()}"
        assert ("### BEGIN HIDDEN TESTS" in source) == check.hidden, name


@pytest.mark.parametrize("assignment", PER_ASSIGNMENT)
def test_the_release_holds_no_solution_no_hidden_test_and_no_reference_code(assignment: str) -> None:
    release = nbformat.read(ROOT / "exercises" / assignment / f"{assignment}.ipynb", as_version=4)
    text = "\n".join(cell.source for cell in release.cells if cell.cell_type == "code")
    for secret in ("BEGIN SOLUTION", "BEGIN HIDDEN TESTS", "zero_core.stages", "reduce_scatter_gradients(["):
        assert secret not in text, f"{assignment}: the release contains {secret!r}"
    for cell in release.cells:
        if is_solution_cell(cell):
            assert "raise NotImplementedError()" in cell.source
    assert sum(is_setup_cell(cell) for cell in release.cells) == 1
