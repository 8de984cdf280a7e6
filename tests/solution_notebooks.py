"""A submission written by hand: the course's solution notebook with one solution cell replaced."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def solution_notebook(assignment: str) -> Path:
    return ROOT / "solutions" / assignment / f"{assignment}.ipynb"


def _the_cell(notebook: dict, assignment: str, grade_id: str) -> dict:
    cells = [c for c in notebook["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id") == grade_id]
    assert len(cells) == 1, f"no solution cell {grade_id!r} in {assignment}"
    return cells[0]


def solution_cell(assignment: str, grade_id: str) -> str:
    """The source of the solution's cell `grade_id`."""
    return "".join(_the_cell(json.loads(solution_notebook(assignment).read_text()), assignment, grade_id)["source"])


def with_cell(assignment: str, grade_id: str, source: str, path: Path) -> Path:
    """The solution notebook with `source` in place of its cell `grade_id`, written to `path` (folders made)."""
    notebook = json.loads(solution_notebook(assignment).read_text())
    _the_cell(notebook, assignment, grade_id)["source"] = source
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(notebook))
    return path
