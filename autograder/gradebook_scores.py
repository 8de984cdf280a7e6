"""`python -m autograder scores`: nbgrader's gradebook as one table, a row per student, a column per assignment.

`make autograde` writes each submission's points into `gradebook.db` (nbgrader's gradebook); nbgrader shows
them in its web app, one assignment at a time. An instructor who graded from a terminal wants them at once:
this reads the gradebook through nbgrader's own API and prints `points/max` for every assignment handed in,
`-` for one that was not, and each student's total over the assignments shown.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from autograder.checks import format_points

Points = dict[str, dict[str, float | None]]


def scores(db: Path, assignments: list[str] | None = None) -> tuple[list[str], Points, dict[str, float]]:
    """(assignments, {student: {assignment: points or None}}, {assignment: max points}) from the gradebook at
    `db`; `assignments` limits and orders the columns (default: every assignment someone handed in)."""
    from nbgrader.api import Gradebook, MissingEntry

    if not db.is_file():
        raise FileNotFoundError(f"no gradebook at {db}: run `make release` and `make autograde` first")
    # nbgrader checks the gradebook's schema by running `alembic` from PATH: the one beside this interpreter.
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    with Gradebook(f"sqlite:///{db.resolve()}") as gradebook:
        known = [assignment.name for assignment in gradebook.assignments]
        shown = assignments or [name for name in known if gradebook.assignment_submissions(name)]
        unknown = sorted(set(shown) - set(known))
        if unknown:
            raise KeyError(f"not in the gradebook: {', '.join(unknown)} (it holds {', '.join(known) or 'none'})")
        maximum = {name: gradebook.find_assignment(name).max_score for name in shown}
        table = {}
        for student in sorted(s.id for s in gradebook.students):
            row = {}
            for name in shown:
                try:
                    row[name] = gradebook.find_submission(name, student).score
                except MissingEntry:
                    row[name] = None
            table[student] = row
    return shown, table, maximum


def scores_text(db: Path, assignments: list[str] | None = None) -> str:
    """The gradebook as a text table, one line per student, with the total of the assignments shown."""
    from zero_core.cli.render import table

    shown, points, maximum = scores(db, assignments)
    rows = []
    for student, row in points.items():
        cells = [
            "-" if row[name] is None else f"{format_points(row[name])}/{format_points(maximum[name])}" for name in shown
        ]
        total = sum(row[name] for name in shown if row[name] is not None)
        rows.append([student, *cells, f"{format_points(total)}/{format_points(sum(maximum.values()))}"])
    if not rows:
        return f"{db}: no students in the gradebook yet"
    return table(["student", *shown, "total"], rows, title=f"scores in {db} (nbgrader's gradebook; - = not handed in)")
