"""The README's instructor and self-study commands, run as written; and `make lab`.

The shell block of the README's "Instructors" section is read from the README itself and run line by line
in a fresh copy of the course (its virtual environment shared, nothing activated, the venv not on PATH),
with three students who handed in exercise 5: aaron a notebook whose first solution cell never ends, alice
the solution, bob one wrong formula. If a step drifts from the code, this test fails.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import sqlite3
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from course_copy import LEFT_OUT, PRINTED, ROOT, copy_course, started_lab
from readme_text import shell_commands

EX05 = "ex05_memory_planning"
pytestmark = pytest.mark.ex05


def test_the_self_study_check_command_grades_the_learner_s_copy_as_the_readme_says(tmp_path: Path) -> None:
    (command,) = shell_commands("### Self-study")
    assert command.startswith("python -m autograder check work/exercises/")
    course = copy_course(tmp_path / "course")
    # As `make lab` leaves it: the learner's copies made, and in a lab terminal the venv's bin first on PATH.
    made = subprocess.run([str(ROOT / ".venv" / "bin" / "python"), "-m", "autograder", "workspace", "work"],
                          cwd=course, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0 and "hand in work/exercises/" in made.stdout, made.stdout + made.stderr
    path = os.pathsep.join([str(ROOT / ".venv" / "bin"), os.environ["PATH"]])
    env = {**os.environ, "PATH": path}
    done = subprocess.run(command, shell=True, cwd=course, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr  # graded, points lost: as the README says
    assert done.stdout.splitlines()[-1] == "total: 0/10 points"


def test_a_copy_of_the_course_leaves_out_what_git_ignores_the_edge_torch_venvs_above_all() -> None:
    """A checkout that ran `CI=true make test` holds two venvs of the CUDA build of torch (11 GB each): copied
    into every course copy, they filled the disk."""
    names = [".venv", ".venv-oldest-torch", ".venv-newest-torch", "out", "work", ".grading-secret", "gradebook.db",
             "zero_course.egg-info", ".git", "zero_core", "README.md", "lessons"]
    left_out = shutil.ignore_patterns(*LEFT_OUT)(str(ROOT), names)
    assert sorted(set(names) - left_out) == ["README.md", "lessons", "zero_core"]


def hand_in(course: Path, student: str, notebook_text: str) -> None:
    path = course / "out" / "submitted" / student / EX05 / f"{EX05}.ipynb"
    path.parent.mkdir(parents=True)
    path.write_text(notebook_text)


def test_the_instructor_commands_grade_a_class_as_the_readme_says(tmp_path: Path) -> None:
    course = copy_course(tmp_path / "course")
    solution = (ROOT / "solutions" / EX05 / f"{EX05}.ipynb").read_text()
    hand_in(course, "alice", solution)
    hand_in(course, "bob", solution.replace("2: (2, 2 + k)", "2: (2, k)"))
    endless = "while True:\\n    pass\\n\\n\\ndef model_state_bytes("
    hand_in(course, "aaron", solution.replace("def model_state_bytes(", endless, 1))
    env = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if ".venv" not in p)
    env["JOBS"] = "2"  # `make grade` grades two notebooks at a time: aaron's loop beside the others
    env["CHECK_TIME_LIMIT"] = "2"  # aaron's loop costs 2 s of a core twice (autograde, grade), not 30 s twice

    commands = shell_commands("### Instructors")
    assert commands == ["make release", "make autograde", "make feedback", "make grade"]
    started = time.perf_counter()
    for command in commands:
        done = subprocess.run(command, shell=True, cwd=course, env=env, capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, f"{command}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        if command == "make autograde":  # nbgrader's log in a file, the gradebook's scores on the screen
            assert "generate_assignment" not in done.stdout, "autograde released again what release just released"
            assert "[AutogradeApp]" not in done.stdout + done.stderr
            assert "AutogradeApp" in (course / "out" / "autograde.log").read_text()
            shown = {line.split()[0]: line.split()[-1] for line in done.stdout.splitlines()
                     if line.split() and line.split()[0] in ("aaron", "alice", "bob")}
            assert shown == {"aaron": "0/10", "alice": "10/10", "bob": "2/10"}, done.stdout
        if command == "make grade":  # alice and bob were graded while aaron's notebook looped
            assert "graded 2/3 students (slowest still running: aaron, " in done.stderr, done.stderr
    seconds = time.perf_counter() - started

    with sqlite3.connect(course / "gradebook.db") as db:
        rows = db.execute(
            "SELECT student.id, SUM(grade.auto_score) FROM grade "
            "JOIN submitted_notebook ON grade.notebook_id = submitted_notebook.id "
            "JOIN submitted_assignment ON submitted_notebook.assignment_id = submitted_assignment.id "
            "JOIN student ON submitted_assignment.student_id = student.id GROUP BY student.id"
        ).fetchall()
    assert dict(rows) == {"aaron": 0.0, "alice": 10.0, "bob": 2.0}
    with (course / "out" / "grades.csv").open(newline="") as handle:
        grades = {row["student"]: row[EX05] for row in csv.DictReader(handle)}
    assert grades == {"aaron": "0", "alice": "10", "bob": "2"}
    for student in ("aaron", "alice", "bob"):
        assert (course / "out" / "feedback" / student / EX05 / f"{EX05}.html").exists()
        assert (course / "out" / "autograder-feedback" / f"{student}.txt").exists()
    assert "within 2 s of CPU time" in (course / "out" / "autograder-feedback" / "aaron.txt").read_text()
    html = (course / "out" / "feedback" / "aaron" / EX05 / f"{EX05}.html").read_text()
    assert "within 2 s of CPU time" in html, "nbgrader's TrustedGrade had the same bound as make grade"
    # The timeout, not a wall-clock bound on this shared machine, is what stops the looping student: its
    # feedback above says so. How long the class took is printed, not asserted (speed lives in benchmarks/).
    print(f"the class took {seconds:.0f} s")


def test_autograde_releases_first_only_an_assignment_not_released_as_it_now_is(tmp_path: Path) -> None:
    """`make autograde` runs `make release` first only where a stamp of the last release (out/released/) is
    missing, or older than the assignment's source, nbgrader's configuration or the gradebook, or where there is
    no gradebook: the question it asks make."""
    course = copy_course(tmp_path / "course")
    stamp, gradebook = course / "out" / "released" / EX05, course / "gradebook.db"
    source = course / "solutions" / EX05 / f"{EX05}.ipynb"

    def released() -> bool:
        asked = subprocess.run(["make", "--question", f"out/released/{EX05}"], cwd=course, capture_output=True)
        return asked.returncode == 0

    def dated(path: Path, seconds_ago: float) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
        os.utime(path, (time.time() - seconds_ago,) * 2)

    dated(course / "nbgrader_config.py", 30)
    dated(source, 30)
    assert not released(), "no stamp"
    dated(stamp, 10)
    assert not released(), "no gradebook"
    dated(gradebook, 20)
    assert released()
    for newer in (gradebook, source, course / "nbgrader_config.py"):
        dated(newer, 5)
        assert not released(), f"{newer.name} changed after the release"
        dated(newer, 20)
    assert released()


def contents(url: str, tries: int = 30) -> list[dict]:
    """A folder's entries from the Jupyter server at `url`, which may take a moment to accept connections."""
    for attempt in range(tries):
        try:
            with urllib.request.urlopen(url, timeout=30) as answer:
                return json.load(answer)["content"]
        except urllib.error.URLError:
            if attempt == tries - 1:
                raise
            time.sleep(1)
    return []


def test_make_lab_serves_the_learner_s_copies_and_the_course_and_prints_its_url(tmp_path: Path) -> None:
    """As a new user runs it (root included): `make lab` first copies the lessons and exercises into work/
    (git-ignored), and the URL it prints opens work/lessons/; every folder of the course is served."""
    course = copy_course(tmp_path / "course")
    with started_lab(course) as (base, token):
        for folder in ("work/lessons", "work/exercises", "lessons", "exercises", "solutions"):
            names = [item["name"] for item in contents(f"{base}/api/contents/{folder}?token={token}")]
            assert names, folder
        assert "ex05_memory_planning" in names
        assert PRINTED["path"] == "/lab/tree/work/lessons", "the URL it prints opens the learner's copies"
        terminal_path = PRINTED["PATH"]
    assert "/work/" in (ROOT / ".gitignore").read_text().splitlines()
    # A lab terminal inherits the server's PATH: the notebook's own tip runs there, on the learner's copy.
    mine = course / "work" / "exercises" / EX05
    tip = f"python -m autograder check {EX05}.ipynb"
    assert tip in (mine / f"{EX05}.ipynb").read_text()
    done = subprocess.run(tip, shell=True, cwd=mine, capture_output=True, text=True, timeout=300,
                          env={"PATH": terminal_path, "HOME": os.environ.get("HOME", "/tmp")})
    assert done.returncode == 1, done.stdout[-1000:] + done.stderr[-1000:]
    assert done.stdout.splitlines()[-1] == "total: 0/10 points"


def test_a_term_of_two_weeks_keeps_gradebook_csv_and_feedback_in_agreement(tmp_path: Path) -> None:
    """Week 1 sets ex05, week 2 adds ex01 (`ASSIGNMENTS=...` for every target, as the README says): after each
    week, the gradebook's scores (`make scores`, nbgrader's own numbers), the batch grader's CSV and the
    feedback agree, student by student and assignment by assignment."""
    ex01 = "ex01_collectives"
    course = copy_course(tmp_path / "course")
    hand_in(course, "alice", (ROOT / "solutions" / EX05 / f"{EX05}.ipynb").read_text())
    hand_in(course, "bob", (ROOT / "exercises" / EX05 / f"{EX05}.ipynb").read_text())
    env = {key: value for key, value in os.environ.items() if key not in ("VIRTUAL_ENV", "PYTHONPATH")}

    def week(assignments: list[str]) -> tuple[dict[str, dict[str, str]], dict[str, dict[str, str]]]:
        """(the gradebook's scores, the CSV's points), each {student: {assignment: points}}."""
        set_now = f"ASSIGNMENTS={' '.join(assignments)}"
        for target in ("release", "autograde", "grade", "scores"):
            done = subprocess.run(f'make {target} "{set_now}"', shell=True, cwd=course, env=env, capture_output=True,
                                  text=True, timeout=400)
            assert done.returncode == 0, f"make {target}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        lines = [line.split() for line in done.stdout.splitlines()]
        header = next(line for line in lines if line and line[0] == "student")
        gradebook = {line[0]: {a: p.split("/")[0].replace("-", "0") for a, p in zip(header[1:-1], line[1:-1],
                                                                                 strict=True)}
                     for line in lines if line and line[0] in ("alice", "bob")}
        with (course / "out" / "grades.csv").open(newline="") as handle:
            table = {row["student"]: {a: row[a] for a in assignments} for row in csv.DictReader(handle)}
        assert header[1:-1] == assignments, "the scores show the assignments set, in order"
        return gradebook, table

    gradebook, table = week([EX05])
    assert gradebook == table == {"alice": {EX05: "10"}, "bob": {EX05: "0"}}

    (course / "out" / "submitted" / "alice" / ex01).mkdir()
    (course / "out" / "submitted" / "alice" / ex01 / f"{ex01}.ipynb").write_text(
        (ROOT / "solutions" / ex01 / f"{ex01}.ipynb").read_text()
    )
    gradebook, table = week([EX05, ex01])
    assert gradebook == table == {"alice": {EX05: "10", ex01: "10"}, "bob": {EX05: "0", ex01: "0"}}
    bob = (course / "out" / "autograder-feedback" / "bob.txt").read_text()
    assert [line.split(":")[0] for line in bob.splitlines() if line.startswith("== ")] == [f"== {EX05}", f"== {ex01}"]
