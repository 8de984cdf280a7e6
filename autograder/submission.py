"""Load what a student wrote in a notebook: the solution cells, run after the course's own setup cells.

A graded notebook has three kinds of code cells (nbgrader cell metadata): setup cells (locked, grade id
`setup...`: imports), solution cells (`solution: true`: the student's code) and test cells (`grade: true`).
Only the first two are run, in the order of the course's release notebook, and the setup cells are taken
from that release copy (`exercises/<assignment>/<assignment>.ipynb`), never from the student's: a student
can edit any cell of their copy, tests included, so nothing but their solutions is read from it. This is
what nbgrader's autograde does too (it restores locked and test cells from its own copy).

Each cell runs on its own: a cell that fails to compile or raises costs only the checks that need what
it defines, and the failure is reported with the cell's grade id.
"""

from __future__ import annotations

import json
import linecache
import sys
import types
from dataclasses import dataclass, field
from importlib import import_module
from pathlib import Path
from typing import Any

from autograder.checks import describe_exception
from autograder.graded_cells import GradedCells
from autograder.integrity import REFERENCE_MODULES
from zero_core.long_lived import freeze_what_is_loaded

ROOT = Path(__file__).resolve().parents[1]
RELEASE_DIR = ROOT / "exercises"
EXERCISES = {
    "ex01_collectives": "autograder.ex01",
    "ex02_zero1_sharded_adam": "autograder.ex02",
    "ex03_zero2_reduce_scatter_backward": "autograder.ex03",
    "ex04_zero3_gather_linear": "autograder.ex04",
    "ex05_memory_planning": "autograder.ex05",
    "ex06_bucketed_overlap": "autograder.ex06",
    "ex07_zero3_prefetch": "autograder.ex07",
    "ex08_clip_and_accumulate": "autograder.ex08",
    "ex09_hierarchical_allgather": "autograder.ex09",
    "ex10_sharded_checkpoints": "autograder.ex10",
}


def exercise_module(assignment: str) -> types.ModuleType:
    """The autograder module of an assignment (its `CHECKS`, `ASSIGNMENT`, ...)."""
    if assignment not in EXERCISES:
        raise ValueError(f"unknown assignment {assignment!r}; the course has {', '.join(EXERCISES)}")
    return import_module(EXERCISES[assignment])


def load_graders(assignments: list[str]) -> None:
    """Import the assignments' graders (with torch, for a stage exercise; a formula exercise's grader never
    loads it), then keep the cycle collector off everything loaded (`zero_core.long_lived`): what a grading
    program does once, after its imports and before it grades."""
    for assignment in assignments:
        exercise_module(assignment)
    freeze_what_is_loaded()


def assignment_of(path: Path) -> str:
    """The assignment a notebook belongs to, from its file name (`ex03_zero2_reduce_scatter_backward.ipynb`)."""
    if path.stem in EXERCISES:
        return path.stem
    raise ValueError(f"{path.name} is not one of the course's notebooks ({', '.join(f'{a}.ipynb' for a in EXERCISES)})")


@dataclass
class Submission:
    """The namespace the solution cells built, and what went wrong on the way."""

    assignment: str
    namespace: dict[str, Any]
    cell_errors: list[str] = field(default_factory=list)
    integrity_problems: list[str] = field(default_factory=list)


def _nbgrader(cell: dict) -> dict:
    return cell.get("metadata", {}).get("nbgrader", {})


def unreadable(path: Path) -> str | None:
    """Why the file at `path` is not a notebook the grader can read, in one line; None if it is one."""
    advice = "hand in the .ipynb file JupyterLab saves"
    try:
        notebook = json.loads(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        return f"{path.name} is not a notebook (not UTF-8 text): {advice}"
    except json.JSONDecodeError as error:
        where = f"{error.msg} at line {error.lineno} column {error.colno}"
        return f"{path.name} is not a notebook (not JSON: {where}): {advice}"
    except OSError as error:
        return f"{path.name} is not a notebook the grader can read ({error.strerror}): {advice}"
    cells = notebook.get("cells") if isinstance(notebook, dict) else None
    if not isinstance(cells, list) or not all(isinstance(c, dict) and "cell_type" in c for c in cells):
        return f"{path.name} is not a notebook (JSON, but without a list of cells): {advice}"
    return None


def read_cells(path: Path) -> list[dict]:
    """A notebook's cells, each source as one string (plain JSON: nbformat's schema checks cost seconds)."""
    cells = json.loads(Path(path).read_text(encoding="utf-8"))["cells"]
    for cell in cells:
        if isinstance(cell.get("source"), list):
            cell["source"] = "".join(cell["source"])
    return cells


def is_setup_cell(cell: dict) -> bool:
    meta = _nbgrader(cell)
    return (
        cell["cell_type"] == "code"
        and meta.get("locked", False)
        and not meta.get("grade", False)
        and not meta.get("solution", False)
        and str(meta.get("grade_id", "")).startswith("setup")
    )


def is_solution_cell(cell: dict) -> bool:
    return cell["cell_type"] == "code" and _nbgrader(cell).get("solution", False)


def without_magics(source: str) -> str:
    """IPython magics and shell escapes (`%timeit`, `!pip`) are not Python: each becomes `pass`."""
    lines = []
    for line in source.splitlines():
        stripped = line.lstrip()
        lines.append(line[: len(line) - len(stripped)] + "pass" if stripped.startswith(("%", "!")) else line)
    return "\n".join(lines) + "\n"


def _run_cell(source: str, filename: str, namespace: dict[str, Any]) -> None:
    source = without_magics(source)
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
    exec(compile(source, filename, "exec"), namespace)


def _trusted_cells(path: Path, assignment: str) -> tuple[list[dict], dict[str, str]]:
    """(the release notebook's cells, the student's solution sources by grade id) for the notebook at `path`."""
    student = read_cells(path)
    release = RELEASE_DIR / assignment / f"{assignment}.ipynb"
    trusted = read_cells(release) if release.exists() else student
    return trusted, {_nbgrader(c).get("grade_id"): c["source"] for c in student if is_solution_cell(c)}


def reference_uses(path: Path, assignment: str) -> list[str]:
    """The rules for graded cells (`autograder.policy`) that the solution cells the grader runs break, found
    by parsing them (nothing runs): what costs a submission every point."""
    return _reference_uses(*_trusted_cells(path, assignment), assignment)


def _reference_uses(trusted: list[dict], solutions: dict[str, str], assignment: str) -> list[str]:
    forbidden = getattr(exercise_module(assignment), "FORBIDDEN", REFERENCE_MODULES)
    rules = GradedCells(forbidden, setup=[cell["source"] for cell in trusted if is_setup_cell(cell)])
    return [
        f"cell `{grade_id}`, {problem}"
        for cell in trusted
        if is_solution_cell(cell) and (grade_id := _nbgrader(cell).get("grade_id", "")) in solutions
        for problem in rules.check(without_magics(solutions[grade_id]))
    ]


def _cells_to_run(trusted: list[dict], solutions: dict[str, str]) -> list[tuple[str, str | None]]:
    """(grade id, source) of every cell `load` runs, in the release's order: its setup cells, and the student's
    solution cells (source None for one missing from the student's notebook)."""
    cells: list[tuple[str, str | None]] = []
    for cell in trusted:
        grade_id = _nbgrader(cell).get("grade_id", "")
        if is_setup_cell(cell):
            cells.append((grade_id, cell["source"]))
        elif is_solution_cell(cell):
            cells.append((grade_id, solutions.get(grade_id)))
    return cells


NATIVE_NAMES = ("torch", "zero_core")
"""What a cell must name to use torch, whose import loads native libraries through `ctypes`: torch, or a module
of the course (each imports torch). Graded cells may import only what their text names (`autograder.policy`)."""


def cells_name_torch(path: Path, assignment: str) -> bool:
    """Whether a cell that `load` would run for the notebook at `path` names torch or the course's package
    (`NATIVE_NAMES`, anywhere in its text, comments included: a false alarm only costs the import).

    The grading child imports torch before its audit hook refuses `ctypes` (`autograder.child_guard`) only for
    such a notebook or a grader that needs torch: `python -m autograder check` of the ex05 solution then takes
    0.32-0.35 core-s instead of 1.31-1.38. A cell that reached torch without naming it would break the rules
    for graded cells, and there its import fails under the hook, as any other native library's."""
    return any(
        isinstance(source, str) and any(name in source for name in NATIVE_NAMES)
        for _, source in _cells_to_run(*_trusted_cells(path, assignment))
    )


def load(path: Path, assignment: str | None = None, rules: bool = True) -> Submission:
    """Run the setup and solution cells of the notebook at `path`; never raises for the student's code.
    `rules=False` skips the rules for graded cells: the grading child's parent held the cells to them before
    it started the child (and checking them imports the modules they name, torch included)."""
    assignment = assignment or assignment_of(path)
    trusted, solutions = _trusted_cells(path, assignment)

    namespace_module = types.ModuleType("submission")
    sys.modules["submission"] = namespace_module
    problems = _reference_uses(trusted, solutions, assignment) if rules else []
    submission = Submission(assignment, namespace_module.__dict__, integrity_problems=problems)
    for grade_id, source in _cells_to_run(trusted, solutions):
        if source is None:
            submission.cell_errors.append(f"cell `{grade_id}` is missing from the notebook")
            continue
        try:
            _run_cell(source, f"<cell {grade_id}>", submission.namespace)
        except (Exception, SystemExit) as error:
            submission.cell_errors.append(f"cell `{grade_id}` raised {describe_exception(error)}")
    return submission
