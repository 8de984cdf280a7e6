"""nbgrader's autograde, with each test cell's outcome decided by the course's grader, not in a kernel.

nbgrader runs a submission's test cells in the kernel its solution cells ran in, so one line of a
solution cell can patch whatever the tests call, and the cells' outputs (which nbgrader scores) are
the student's to shape. `TrustedGrade` takes the place of nbgrader's `Execute` preprocessor in
`Autograde.autograde_preprocessors` (see `nbgrader_config.py`): it grades the sanitized notebook (locked
and test cells already restored by nbgrader) with `autograder.sandbox.grade_notebook`, which runs the
student's code in a child process and judges in this one, and writes each check's outcome as the output
of its test cell: "passed: ..." on stdout, or an `AssertionError` with the grader's message. nbgrader's
`SaveAutoGrades` then scores the cells from those outputs as usual, so the gradebook, the feedback that
`generate_feedback` renders and `python -m autograder grade` give the same points. No cell of the
submission runs in a kernel.

The child runs inside the operating system's walls (`autograder.walls`); where they cannot be built,
autograde stops with one line naming the fix, unless `TrustedGrade.walls = False` in `nbgrader_config.py`,
and then every test cell's output says the grade was made without walls.
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

import nbformat
from nbconvert.preprocessors import Preprocessor
from nbgrader import utils
from nbgrader.api import MissingEntry
from nbgrader.preprocessors import ClearHiddenTests, OverwriteCells
from traitlets import Bool, Float

from autograder import walls as os_walls
from autograder.checks import CheckResult, grading_secret
from autograder.sandbox import Limits, grade_notebook
from autograder.submission import EXERCISES


class TrustedGrade(Preprocessor):
    """Write the course grader's verdict into every test cell of a notebook of the course."""

    enabled = True
    """On wherever nbgrader lists it (nbconvert's preprocessors are off unless enabled)."""

    time_limit_s = Float(Limits.time_s, help="Seconds the child process may take for one notebook.").tag(config=True)
    check_time_limit_s = Float(Limits.check_time_s, help="CPU seconds one check may take in the child.").tag(
        config=True
    )

    walls = Bool(True, help="Grade inside the operating system's walls (False: without, and say so).").tag(
        config=True
    )

    def preprocess(self, nb: nbformat.NotebookNode, resources: dict[str, Any]) -> tuple:
        assignment = resources["nbgrader"]["notebook"]
        if assignment not in EXERCISES:
            raise ValueError(f"{assignment}.ipynb is not a notebook of this course ({', '.join(EXERCISES)})")
        if self.walls:
            os_walls.require()
        limits = Limits(time_s=self.time_limit_s, check_time_s=self.check_time_limit_s, walls=self.walls)
        with tempfile.TemporaryDirectory(prefix="nbgrader-trusted-") as folder:
            path = Path(folder) / f"{assignment}.ipynb"
            nbformat.write(nb, path)
            secret = grading_secret(create=True)
            results = {result.name: result for result in grade_notebook(path, assignment, limits, secret=secret)}
        for cell in nb.cells:
            meta = cell.metadata.get("nbgrader", {})
            if cell.cell_type == "code" and meta.get("grade") and not meta.get("solution"):
                grade_id = meta.get("grade_id")
                missing = CheckResult(grade_id, 0, 0, f"the grader has no check {grade_id!r}: no points")
                cell.outputs = [_output(results.get(grade_id, missing), self.walls)]
                cell.execution_count = None
        return nb, resources


UNWALLED = "[graded without walls: TrustedGrade.walls = False] "


def _output(result: CheckResult, walled: bool = True) -> nbformat.NotebookNode:
    if not walled:
        result = CheckResult(result.name, result.points, result.max_points, UNWALLED + result.message)
    if result.passed and result.max_points:
        return nbformat.v4.new_output("stream", name="stdout", text=f"passed: {result.message}\n")
    return nbformat.v4.new_output(
        "error", ename="AssertionError", evalue=result.message, traceback=[f"AssertionError: {result.message}"]
    )


class OverwriteCellsKnowingHiddenTests(OverwriteCells):
    """nbgrader's `OverwriteCells` without its false alarm on test cells with hidden tests.

    nbgrader stores a test cell's checksum before `generate_assignment` strips its hidden tests, so a
    locked cell handed back exactly as released is reported as changed ("Attribute 'checksum' for cell
    test_hidden_... has changed!", jupyter/nbgrader#1961) for every student. A cell that is the source
    cell with its hidden tests stripped, to the character, is put back first, so only a cell a student
    really edited is reported; the restoring and checking are nbgrader's own.
    """

    def preprocess_cell(self, cell: nbformat.NotebookNode, resources: dict, cell_index: int) -> tuple:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if grade_id is not None and utils.is_locked(cell):
            try:
                source = self.gradebook.find_source_cell(grade_id, self.notebook_id, self.assignment_id).source
            except MissingEntry:
                source = None
            if source is not None and source != cell.source:
                released = copy.deepcopy(cell)
                released.source = source
                ClearHiddenTests()._remove_hidden_test_region(released)
                if released.source == cell.source:
                    cell.source = source
        return super().preprocess_cell(cell, resources, cell_index)
