"""`python -m autograder check` for a student and `python -m autograder grade` for an instructor.

ex05 (pure arithmetic, no training) keeps these tests fast; the training exercises go through the same
child-process path in tests/test_grading_integrity.py.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autograder.cli import build_parser, main
from autograder.grade_file import key_path, write_csv_atomically
from tests.solution_notebooks import solution_cell, with_cell

ROOT = Path(__file__).resolve().parents[1]
EX05 = "ex05_memory_planning"
pytestmark = pytest.mark.ex05


def run_autograder(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autograder", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=240)


def notebook(folder: str, assignment: str = EX05) -> Path:
    return ROOT / folder / assignment / f"{assignment}.ipynb"


def test_check_prints_every_check_and_the_total_last() -> None:
    done = run_autograder("check", str(notebook("solutions")))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(EX05)
    assert sum(line.startswith("[2/2] test_") for line in lines) == 5
    assert lines[-1] == "total: 10/10 points"


def test_check_exits_one_when_points_are_lost() -> None:
    done = run_autograder("check", str(notebook("exercises")))
    assert done.returncode == 1, done.stderr
    assert "[0/2] test_model_state_bytes: " in done.stdout
    assert "NotImplementedError" in done.stdout
    assert done.stdout.splitlines()[-1] == "total: 0/10 points"


@pytest.mark.parametrize("content", ["{ this is not json", "[1, 2, 3]", '{"cells": "none"}'])
def test_check_says_in_one_line_that_a_file_named_like_an_exercise_is_not_a_notebook(
    tmp_path: Path, content: str
) -> None:
    garbage = tmp_path / f"{EX05}.ipynb"
    garbage.write_text(content)
    done = run_autograder("check", str(garbage))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "is not a notebook" in done.stderr, done.stderr


def test_check_refuses_a_notebook_that_is_not_an_exercise(tmp_path: Path) -> None:
    other = tmp_path / "homework.ipynb"
    other.write_text(notebook("exercises").read_text())
    done = run_autograder("check", str(other))
    assert done.returncode == 2
    assert "not one of the course's notebooks" in done.stderr


def test_check_given_a_folder_says_it_takes_one_notebook_and_names_grade(tmp_path: Path) -> None:
    done = run_autograder("check", str(tmp_path))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert f"{tmp_path} is a folder: check takes one notebook" in done.stderr
    assert "python -m autograder grade DIR" in done.stderr
    done = run_autograder("check", "exercises")
    assert f"(like {Path('exercises', 'ex01_collectives', 'ex01_collectives.ipynb')})" in done.stderr, done.stderr


@pytest.fixture
def fake_class(tmp_path: Path) -> Path:
    """nbgrader's submitted/ layout: alice is right, bob has one formula wrong, carol's file is not a notebook."""
    submitted = tmp_path / "submitted"
    alice = submitted / "alice" / EX05 / f"{EX05}.ipynb"
    alice.parent.mkdir(parents=True)
    shutil.copy(notebook("solutions"), alice)
    wrong_stage_2 = notebook("solutions").read_text().replace("2: (2, 2 + k)", "2: (2, k)")
    (submitted / "bob" / EX05).mkdir(parents=True)
    (submitted / "bob" / EX05 / f"{EX05}.ipynb").write_text(wrong_stage_2)
    (submitted / "carol" / EX05).mkdir(parents=True)
    (submitted / "carol" / EX05 / f"{EX05}.ipynb").write_text("{ this is not json")
    return submitted


def read_grades(path: Path) -> dict[str, dict]:
    with path.open(newline="") as handle:
        return {row["student"]: row for row in csv.DictReader(handle)}


def without_timings(path: Path) -> list[list[str]]:
    """The CSV's cells, its `seconds` (wall time) and `signature` (which signs them, with a key per file) blank."""
    with path.open(newline="") as handle:
        table = list(csv.reader(handle))
    varying = [table[0].index("seconds"), table[0].index("signature")]
    return [[("" if index in varying else cell) for index, cell in enumerate(row)] for row in table]


def test_grade_writes_the_csv_and_feedback_the_same_at_any_jobs_and_survives_a_broken_notebook(
    fake_class: Path, tmp_path: Path
) -> None:
    """Two notebooks at a time, alice's two assignments possibly on two threads (carol's file, not a notebook, has
    no child; bob and carol handed in no ex01): the CSV, row for row, and every feedback file, byte for byte, as
    one at a time writes them, each student's row whole."""
    ex01 = "ex01_collectives"
    (fake_class / "alice" / ex01).mkdir()
    shutil.copy(ROOT / "solutions" / ex01 / f"{ex01}.ipynb", fake_class / "alice" / ex01 / f"{ex01}.ipynb")
    both = f"{EX05},{ex01}"
    out, feedback = tmp_path / "grades.csv", tmp_path / "feedback"
    done = run_autograder("grade", str(fake_class), "--out", str(out), "--feedback", str(feedback),
                          "--assignments", both, "--jobs", "2")
    assert done.returncode == 0, done.stderr
    assert "grading 3 students (6 notebooks), 2 notebooks at a time" in done.stderr, done.stderr
    assert "graded 3/3 students" in done.stderr
    one_out, one_feedback = tmp_path / "one" / "grades.csv", tmp_path / "one" / "feedback"
    alone = run_autograder("grade", str(fake_class), "--out", str(one_out), "--feedback", str(one_feedback),
                           "--assignments", both, "--jobs", "1", "--no-progress")
    assert alone.returncode == 0 and "graded" not in alone.stderr, alone.stderr
    assert without_timings(out) == without_timings(one_out)
    assert {p.name: p.read_bytes() for p in feedback.iterdir()} == {
        p.name: p.read_bytes() for p in one_feedback.iterdir()
    }
    grades = read_grades(out)
    assert {s: (g[EX05], g[ex01], g["total"], g["max_total"]) for s, g in grades.items()} == {
        "alice": ("10", "10", "20", "20"),
        "bob": ("2", "0", "2", "20"),
        "carol": ("0", "0", "0", "20"),
    }
    bob = (feedback / "bob.txt").read_text()
    assert "2Ψ + 14Ψ/N" in bob and bob.rstrip().endswith("total: 2/20 points")
    assert f"no {ex01}.ipynb submitted" in bob
    carol = (feedback / "carol.txt").read_text()
    assert "not graded: ex05_memory_planning.ipynb is not a notebook (not JSON" in carol


@pytest.mark.parametrize("jobs", ["0", "-2", "two"])
def test_grade_refuses_jobs_that_are_not_a_whole_number_from_one(jobs: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["grade", "submitted", "--out", "g.csv", "--feedback", "fb", "--jobs", jobs])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert f"--jobs: takes a whole number of students graded at once, 1 or more; got {jobs!r}" in error, error


def test_a_rerun_resumes_and_force_regrades(fake_class: Path, tmp_path: Path) -> None:
    out, feedback = tmp_path / "grades.csv", tmp_path / "feedback"
    args = ("grade", str(fake_class), "--out", str(out), "--feedback", str(feedback), "--assignments", EX05,
            "--no-progress")
    shutil.rmtree(fake_class / "carol")
    assert run_autograder(*args).returncode == 0
    first = out.read_text()
    dave = fake_class / "dave" / f"{EX05}.ipynb"
    dave.parent.mkdir()
    shutil.copy(notebook("exercises"), dave)
    done = run_autograder(*args)
    assert "graded 1 student(s), skipped 2" in done.stdout
    assert out.read_text().startswith(first.splitlines()[0])
    assert read_grades(out)["dave"][EX05] == "0"
    done = run_autograder(*args, "--force")
    assert "graded 3 student(s), skipped 0" in done.stdout


def test_a_rerun_trusts_only_the_rows_it_signed(fake_class: Path, tmp_path: Path) -> None:
    """Someone raises bob's points in the CSV and adds a row for eve: the rerun grades bob again and drops eve."""
    out, feedback = tmp_path / "grades.csv", tmp_path / "feedback"
    args = ("grade", str(fake_class), "--out", str(out), "--feedback", str(feedback), "--assignments", EX05,
            "--no-progress")
    assert run_autograder(*args).returncode == 0
    assert oct(key_path(out).stat().st_mode & 0o777) == "0o600"
    lines = out.read_text().splitlines()
    bob = next(i for i, line in enumerate(lines) if line.startswith("bob,"))
    signature = lines[bob].rsplit(",", 1)[1]
    lines[bob] = lines[bob].replace("bob,2,2,", "bob,10,10,")
    lines.append(f"eve,10,10,10,1.0,{signature}")
    out.write_text("\n".join(lines) + "\n")
    done = run_autograder(*args)
    assert "2 row(s) of" in done.stdout and "graded 1 student(s), skipped 2" in done.stdout
    assert {s: g["total"] for s, g in read_grades(out).items()} == {"alice": "10", "bob": "2", "carol": "0"}


def test_shards_graded_apart_merge_into_the_class_and_the_merge_refuses_what_does_not_verify(
    fake_class: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Two jobs grade alternate students with the course's key; merge joins them into the class's CSV and
    feedback, which a later `grade --key` resumes. A row raised by hand, and a student two shards graded,
    are refused and named (exit 1); a key other users may read is refused outright (exit 2)."""
    key = tmp_path / "course.key"
    assert main(["new-key", str(key)]) == 0
    assert oct(key.stat().st_mode & 0o777) == "0o600" and main(["new-key", str(key)]) == 2
    shards = [tmp_path / "shard1", tmp_path / "shard2"]
    for k, shard in enumerate(shards, 1):
        done = run_autograder("grade", str(fake_class), "--out", str(shard / "grades.csv"), "--feedback",
                              str(shard / "feedback"), "--assignments", EX05, "--shard", f"{k}/2", "--key", str(key),
                              "--no-progress")
        assert done.returncode == 0, done.stderr
    assert [sorted(read_grades(shard / "grades.csv")) for shard in shards] == [["alice", "carol"], ["bob"]]
    out, feedback = tmp_path / "class.csv", tmp_path / "feedback"
    options = ("--key", str(key), "--out", str(out), "--feedback", str(feedback))
    capsys.readouterr()
    assert main(["merge", *map(str, shards), *options]) == 0, capsys.readouterr().err
    assert "merged 3 student(s) from 2 shard(s)" in capsys.readouterr().out
    assert {s: g["total"] for s, g in read_grades(out).items()} == {"alice": "10", "bob": "2", "carol": "0"}
    assert {p.name: p.read_text() for p in feedback.iterdir()} == {
        p.name: p.read_text() for shard in shards for p in (shard / "feedback").iterdir()
    }
    resumed = run_autograder("grade", str(fake_class), "--out", str(out), "--feedback", str(feedback),
                             "--assignments", EX05, "--key", str(key), "--no-progress")
    assert "graded 0 student(s), skipped 3" in resumed.stdout, resumed.stdout + resumed.stderr

    bob = shards[1] / "grades.csv"
    bob.write_text(bob.read_text().replace("bob,2,2,", "bob,10,10,"))
    shutil.copytree(shards[0], tmp_path / "shard1-again")
    assert main(["merge", *map(str, shards), str(tmp_path / "shard1-again"), *options]) == 1
    refused = capsys.readouterr().err
    assert f"refused {shards[1]}: bob: its signature does not verify" in refused, refused
    assert "refused alice: graded by 2 shards" in refused and "refused carol: graded by 2" in refused, refused
    assert read_grades(out) == {} and list(feedback.iterdir()) == []  # nobody's earlier feedback stays either

    key.chmod(0o644)
    assert main(["merge", *map(str, shards), *options]) == 2 and f"chmod 600 {key}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["grade", str(fake_class), "--out", "g.csv", "--feedback", "f", "--shard", "3/2"])
    assert exited.value.code == 2 and "--shard: takes K/M with 1 <= K <= M" in capsys.readouterr().err


def test_a_missing_notebook_costs_its_points_with_a_message(tmp_path: Path) -> None:
    submitted = tmp_path / "submitted"
    (submitted / "erin").mkdir(parents=True)
    out, feedback = tmp_path / "grades.csv", tmp_path / "feedback"
    done = run_autograder("grade", str(submitted), "--out", str(out), "--feedback", str(feedback),
                          "--assignments", EX05, "--no-progress")
    assert done.returncode == 0, done.stderr
    assert read_grades(out)["erin"]["total"] == "0"
    assert f"no {EX05}.ipynb submitted" in (feedback / "erin.txt").read_text()


def test_the_csv_is_replaced_whole_or_not_at_all(tmp_path: Path) -> None:
    path = tmp_path / "grades.csv"
    write_csv_atomically(path, ["student", "total"], [{"student": "alice", "total": "10"}])
    before = path.read_text()
    with pytest.raises(ValueError):
        write_csv_atomically(path, ["student", "total"], [{"student": "bob", "total": "3", "oops": "x"}])
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["grades.csv"]


def test_a_batch_of_one_notebook_per_check_kind_matches_the_in_process_grade(tmp_path: Path) -> None:
    """The child process grades exactly as the checks do in process (same results, same order), the hidden
    checks drawn from the same secret."""
    from autograder.checks import drawn, grading_secret
    from autograder.sandbox import grade_notebook, grade_submission
    from autograder.submission import exercise_module, load

    path = with_cell(EX05, "answers", "q1_gb_per_gpu = 16.6\nq2_stage, q2_gpus, q3_gpus = 3, 32, 2\nq4_gb_sent = 1.0\n",
                     tmp_path / EX05 / f"{EX05}.ipynb")
    in_child = grade_notebook(path)
    in_process = list(grade_submission(load(path), drawn(exercise_module(EX05).CHECKS, EX05, grading_secret())))
    assert in_child == in_process
    assert [r.name for r in in_child if not r.passed] == ["test_hidden_answers"]
    assert "q4_gb_sent = 1.0 is not right" in in_child[-1].message


def test_no_submission_can_touch_the_grades_the_feedback_or_the_grader(tmp_path: Path) -> None:
    """mallory tries to kill the grader, with a cell the rules for graded cells refuse before it runs (the
    walls stop the same cell behind them: tests/fixtures/wrong/ex05_kills_its_parent.py); zed, graded last,
    through torch, which the rules allow, to rewrite alice's feedback and put a row of 10s at the top of the
    grades file, without losing a point of its own. The batch goes on, and only the grader writes."""
    out, feedback = tmp_path / "grades.csv", tmp_path / "feedback"
    submitted = tmp_path / "submitted"
    formulas = solution_cell(EX05, "formulas")
    targets = ((str(feedback / "alice.txt"), "alice: 0 points, see me"), (str(out), "mallory,10,10,10,0\n"))
    vandal = (
        "import torch\n"
        f"for path, text in {targets!r}:\n"
        "    try:\n"
        "        storage = torch.UntypedStorage.from_file(path, True, len(text))\n"
        "        torch.tensor([], dtype=torch.uint8).set_(storage)[:] = torch.tensor(list(text.encode()))\n"
        "    except RuntimeError:\n"
        "        pass\n"
    )
    (submitted / "alice").mkdir(parents=True)
    shutil.copy(notebook("solutions"), submitted / "alice" / f"{EX05}.ipynb")
    with_cell(EX05, "formulas", "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n" + formulas,
              submitted / "mallory" / f"{EX05}.ipynb")
    with_cell(EX05, "formulas", vandal + formulas, submitted / "zed" / f"{EX05}.ipynb")
    done = run_autograder("grade", str(submitted), "--out", str(out), "--feedback", str(feedback), "--assignments",
                          EX05, "--no-progress")
    assert done.returncode == 0, done.stderr
    grades = read_grades(out)
    assert {s: g["total"] for s, g in grades.items()} == {"alice": "10", "mallory": "0", "zed": "10"}
    assert "`import os` uses the module os" in (feedback / "mallory.txt").read_text()
    assert "see me" not in (feedback / "alice.txt").read_text()


def test_grade_refuses_a_secret_other_users_may_read_in_one_line(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("instructor\n")
    secret.chmod(0o644)
    done = subprocess.run(
        [sys.executable, "-m", "autograder", "grade", str(tmp_path), "--out", str(tmp_path / "g.csv"),
         "--feedback", str(tmp_path / "fb")],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
        env={**os.environ, "AUTOGRADER_SECRET_FILE": str(secret)},
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "may be read by other users" in done.stderr and "chmod 600" in done.stderr


def test_a_term_of_two_weeks_regrades_what_changed_and_lists_only_the_assignments_set(tmp_path: Path) -> None:
    """Week 1 sets ex05; week 2 adds ex01 (every student graded again, feedback naming those two only); a
    resubmission is graded again alone; a rerun with nothing new grades nobody."""
    ex01 = "ex01_collectives"
    submitted, out, feedback = tmp_path / "submitted", tmp_path / "grades.csv", tmp_path / "feedback"
    for student, folder in (("alice", "solutions"), ("bob", "exercises")):
        (submitted / student / EX05).mkdir(parents=True)
        shutil.copy(notebook(folder), submitted / student / EX05 / f"{EX05}.ipynb")

    def grade(assignments: str) -> str:
        done = run_autograder("grade", str(submitted), "--out", str(out), "--feedback", str(feedback),
                              "--assignments", assignments, "--no-progress")
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    assert "graded 2 student(s), skipped 0" in grade(EX05)
    assert {s: g[EX05] for s, g in read_grades(out).items()} == {"alice": "10", "bob": "0"}

    (submitted / "alice" / ex01).mkdir()
    shutil.copy(notebook("solutions", ex01), submitted / "alice" / ex01 / f"{ex01}.ipynb")
    week2 = grade(f"{EX05},{ex01}")
    assert "every student is graded again" in week2 and "graded 2 student(s), skipped 0" in week2
    grades = read_grades(out)
    assert {s: (g[EX05], g[ex01], g["total"], g["max_total"]) for s, g in grades.items()} == {
        "alice": ("10", "10", "20", "20"),
        "bob": ("0", "0", "0", "20"),
    }
    bob = (feedback / "bob.txt").read_text()
    sections = [line.split(":")[0] for line in bob.splitlines() if line.startswith("== ")]
    assert sections == [f"== {EX05}", f"== {ex01}"] and f"no {ex01}.ipynb submitted" in bob

    shutil.copy(notebook("solutions"), submitted / "bob" / EX05 / f"{EX05}.ipynb")
    assert "graded 1 student(s), skipped 1" in grade(f"{EX05},{ex01}")
    assert read_grades(out)["bob"][EX05] == "10" and read_grades(out)["alice"]["total"] == "20"
    assert "graded 0 student(s), skipped 2" in grade(f"{EX05},{ex01}")


def test_an_error_every_check_shares_is_said_once(tmp_path: Path) -> None:
    broken = with_cell(EX05, "formulas", "def model_state_bytes(stage, psi, n_gpus)\n    return 0\n",
                       tmp_path / EX05 / f"{EX05}.ipynb")
    done = run_autograder("check", str(broken))
    assert done.returncode == 1, done.stderr
    assert done.stdout.count("SyntaxError") == 1, done.stdout
    assert "every check that failed above also failed because:" in done.stdout
    assert sum(line.startswith("[0/2] test_") for line in done.stdout.splitlines()) == 5
