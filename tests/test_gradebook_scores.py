"""`python -m autograder scores`: nbgrader's gradebook read through nbgrader's API, a row per student.

The points of a graded class are checked in tests/test_readme_instructor.py (`make autograde` ends with this
table); here, what a gradebook without a submission, a misspelt assignment and a missing gradebook give.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from nbgrader.api import Gradebook

from autograder.cli import CANNOT_GRADE, main


def test_a_student_who_handed_nothing_in_shows_a_dash_and_bad_names_are_one_line_errors(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    monkeypatch.setenv("PATH", os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))  # alembic
    db = tmp_path / "gradebook.db"
    with Gradebook(f"sqlite:///{db}") as gradebook:
        gradebook.add_assignment("ex01_collectives")
        gradebook.add_student("amy")
    assert main(["scores", "--db", str(db)]) == 0  # by default, the assignments anyone handed in: none
    assert ["student", "total"] in [line.split() for line in capsys.readouterr().out.splitlines()]
    assert main(["scores", "--db", str(db), "--assignments", "ex01_collectives"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["student", "ex01_collectives", "total"] in rows
    assert ["amy", "-", "0/0"] in rows
    assert main(["scores", "--db", str(db), "--assignments", "ex1_collectives"]) == CANNOT_GRADE
    assert "not in the gradebook: ex1_collectives (it holds ex01_collectives)" in capsys.readouterr().err
    assert main(["scores", "--db", str(tmp_path / "none.db")]) == CANNOT_GRADE
    assert "run `make release` and `make autograde` first" in capsys.readouterr().err
