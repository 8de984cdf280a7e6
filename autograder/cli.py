"""`python -m autograder check NOTEBOOK` (a student) and `python -m autograder grade DIR` (an instructor).

check: grades one notebook (any of the course's `exNN_*.ipynb`) in a child process and prints every
check's points and message (what every failed check shares, such as a cell that raised, once at the end);
the last line is `total: X/Y points`. Exit codes: 0 every point, 1 graded with points lost, 2 the
notebook could not be graded (no such file, not a course notebook, not a notebook).

grade: grades a class. DIR holds one folder per student, named by the student id, with the notebooks
anywhere below it, found by file name (nbgrader's `submitted/<student>/<assignment>/<assignment>.ipynb`
layout works as is). Every notebook is graded in its own child process with a time and a memory limit, so a
notebook that loops, crashes or exits costs its own points and never stops the batch. `--jobs J` grades J
notebooks at a time (`autograder.batch`; default one per core), with the same grades as one at a time. Writes
`--out` (CSV: one row per student, points per assignment, total) atomically after every student, and
`--feedback DIR/<student>.txt` (every check's message), each atomically. A rerun skips students whose
notebooks have not changed since their row (a fingerprint of the notebooks' bytes, column `submitted`),
unless `--force`; a run on another set of assignments grades everyone again; and it trusts only rows this
grader wrote: every row carries an HMAC-SHA256 signature with a key kept beside the CSV (`.<name>.key`, mode
0600, out of every submission's reach), and a row whose signature does not verify (edited, forged, from an
older grader) is graded again (`autograder.grade_file`). For a class too large for one machine, `--shard K/M`
grades one shard of it with the instructor's key (`--key FILE`, made by `new-key`), and `merge` joins the
shards' folders, refusing every row that does not verify (`autograder.shards`).

Walls: every child runs inside the operating system's walls (`autograder.walls`). `grade` refuses, in one
line naming the fix, where they cannot be built, unless `--no-walls`, and then the CSV's `walls` column and
every feedback file say so. `check` (a learner's own machine: macOS, WSL, a container) uses them where it
can, runs without them where it cannot, and says which on its first line. `grade` runs as `python -I` (it
starts itself again so when it was not): nothing from `PYTHONPATH` or a user site reaches the process that
holds the signing key; and it refuses a venv or course folder that any user may write.

student-release: the folder a class's students receive for one assignment (`autograder.student_release`).

workspace: a learner's own copy of the lessons and exercises in `work/` (`make lab` makes it;
`autograder.workspace`).

scores: nbgrader's gradebook (`make autograde` fills it) as one table, a row per student, a column per
assignment (`autograder.gradebook_scores`).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import sys
from pathlib import Path

from autograder import recorded, walls
from autograder.batch import Batch, Finished, progress_line
from autograder.checks import CheckResult, format_points, grading_secret, print_results, results_text, total
from autograder.grade_file import (
    SIGNATURE,
    grading_key,
    key_path,
    new_key,
    read_key,
    read_rows,
    sign,
    signed_rows,
    write_csv_atomically,
    write_text_atomically,
)
from autograder.sandbox import ROOT, Limits, grade_notebook
from autograder.shards import merge, parse_shard, shard_of
from autograder.submission import EXERCISES, assignment_of, exercise_module, load_graders, unreadable
from zero_core.cpu_turns import machine_cores

MiB = 2**20


class UsageError(Exception):
    """Input the command cannot use; shown as one line, exit code 2."""


def _limits(args: argparse.Namespace, walled: bool) -> Limits:
    return Limits(
        time_s=args.time_limit, memory_bytes=args.memory_limit_mb * MiB, check_time_s=args.check_time_limit,
        walls=walled,
    )


UNWALLED = "off (--no-walls): graded without walls"
"""What the CSV's `walls` column and the feedback say of a grade made without walls."""


def walls_for_grading(no_walls: bool) -> bool:
    """Whether `grade` runs its children in walls: yes, or `UsageError` naming the fix; no only if asked.
    Refuses, either way, a venv or course folder that any user may write."""
    open_folders = walls.writable_by_others([Path(sys.prefix), ROOT])
    if open_folders:
        raise UsageError(
            f"{open_folders[0]} may be written by any user, so a submission could leave code there that the "
            "grader runs: chmod o-w it"
        )
    if no_walls:
        return False
    try:
        walls.require()
    except walls.WallsUnavailable as error:
        raise UsageError(str(error)) from None
    return True


def _add_limits(parser: argparse.ArgumentParser) -> None:
    defaults = Limits()
    parser.add_argument(
        "--time-limit", type=float, default=defaults.time_s, help=f"seconds per notebook (default {defaults.time_s:g})"
    )
    parser.add_argument(
        "--check-time-limit",
        type=float,
        default=defaults.check_time_s,
        help=f"CPU seconds per check (default {defaults.check_time_s:g})",
    )
    parser.add_argument(
        "--memory-limit-mb",
        type=int,
        default=defaults.memory_bytes // MiB,
        help=f"address space per notebook, MiB (default {defaults.memory_bytes // MiB})",
    )


def run_check_command(args: argparse.Namespace) -> int:
    path = Path(args.notebook)
    if path.is_dir():
        inside = sorted([*path.glob("ex0*.ipynb"), *path.glob("*/ex0*.ipynb")])  # two levels: never a long walk
        example = f" (like {inside[0]})" if inside else ""
        raise UsageError(
            f"{path} is a folder: check takes one notebook{example}; "
            "`python -m autograder grade DIR` grades a class, one folder per student"
        )
    if not path.is_file():
        raise UsageError(f"no notebook at {path}")
    try:
        assignment = assignment_of(path)
    except ValueError as error:
        raise UsageError(str(error)) from None
    problem = unreadable(path)
    if problem:
        raise UsageError(problem)
    built = walls.available()
    if isinstance(built, walls.Walls):
        print(f"{assignment}: {path} ({built.describe()})")
    else:
        print(f"{assignment}: {path} (walls off: {built}; your own code runs as you)")
    if recorded.replaying():
        print("a student release: the visible checks only (the hidden ones run when your instructor grades)")
    load_graders([assignment])
    results = grade_notebook(path, assignment, _limits(args, isinstance(built, walls.Walls)))
    print_results(results)
    points, max_points = total(results)
    print(f"total: {format_points(points)}/{format_points(max_points)} points")
    return FULL_MARKS if points == max_points else BELOW_FULL_MARKS


FULL_MARKS, BELOW_FULL_MARKS, CANNOT_GRADE = 0, 1, 2
"""`check`'s exit codes: every point; graded, some points lost; the notebook could not be graded at all."""


def find_notebooks(student_dir: Path, assignments: list[str]) -> dict[str, Path]:
    """{assignment: notebook} for the assignments found below `student_dir` (checkpoint copies ignored)."""
    found: dict[str, Path] = {}
    for path in sorted(student_dir.rglob("*.ipynb")):
        if ".ipynb_checkpoints" not in path.parts and path.stem in assignments:
            found.setdefault(path.stem, path)
    return found


SUBMITTED = "submitted"
"""The column that fingerprints what a row graded: a student whose notebooks changed since is graded again."""


def submission_fingerprint(student_dir: Path, assignments: list[str]) -> str:
    """SHA-256 over each assignment's notebook bytes (or its absence), in the order of `assignments`."""
    notebooks = find_notebooks(student_dir, assignments)
    digest = hashlib.sha256()
    for assignment in assignments:
        path = notebooks.get(assignment)
        digest.update(f"{assignment}\0".encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest() if path else b"absent")
    return digest.hexdigest()[:32]


def feedback_text(student: str, graded: dict[str, list[CheckResult]], walled: bool = True) -> str:
    lines = [f"Feedback for {student}", ""]
    if not walled:
        lines[1:1] = [f"walls: {UNWALLED}"]
    for assignment, results in graded.items():
        points, max_points = total(results)
        lines.append(f"== {assignment}: {format_points(points)}/{format_points(max_points)} points")
        lines.append(results_text(results))
    points, max_points = total([r for results in graded.values() for r in results])
    lines.append(f"total: {format_points(points)}/{format_points(max_points)} points")
    return "\n".join(lines) + "\n"


def grade_assignment(
    student_dir: Path,
    assignment: str,
    limits: Limits,
    protected: tuple[Path, ...] = (),
    secret: bytes | None = None,
) -> list[CheckResult]:
    """One assignment of one student, the hidden checks drawn from `secret`; `protected` (the grades file,
    the feedback folder) is out of the submission's reach. 0 points everywhere if no notebook was handed in."""
    notebook = find_notebooks(student_dir, [assignment]).get(assignment)
    if notebook is None:
        missing = f"no {assignment}.ipynb submitted"
        return [CheckResult(c.name, 0, c.points, missing) for c in exercise_module(assignment).CHECKS]
    return grade_notebook(notebook, assignment, limits, protected, secret)


def student_row(done: Finished, submitted: str, walled: bool, key: bytes, fieldnames: list[str]) -> dict:
    """The CSV row of a student graded: points per assignment, total, seconds, walls, fingerprint, signature."""
    row = {"student": done.student, "seconds": f"{done.seconds:.1f}", "walls": "on" if walled else UNWALLED,
           SUBMITTED: submitted}
    for assignment, results in done.graded.items():
        row[assignment] = format_points(total(results)[0])
    points, max_points = total([r for results in done.graded.values() for r in results])
    row.update(total=format_points(points), max_total=format_points(max_points))
    row[SIGNATURE] = sign(key, row, fieldnames)
    return row


def run_grade_command(args: argparse.Namespace) -> int:
    submissions = Path(args.directory)
    if not submissions.is_dir():
        raise UsageError(f"no directory at {submissions}")
    assignments = args.assignments.split(",") if args.assignments else list(EXERCISES)
    unknown = [a for a in assignments if a not in EXERCISES]
    if unknown:
        raise UsageError(f"unknown assignment(s) {unknown}; the course has {', '.join(EXERCISES)}")
    out, feedback_dir = Path(args.out), Path(args.feedback)
    walled = walls_for_grading(args.no_walls)
    try:
        secret = grading_secret(create=True)
    except (PermissionError, FileNotFoundError) as error:
        raise UsageError(f"the grading secret: {error}") from None
    fieldnames = ["student", *assignments, "total", "max_total", "seconds", "walls", SUBMITTED, SIGNATURE]
    try:
        key = read_key(Path(args.key)) if args.key else grading_key(out)
    except ValueError as error:
        raise UsageError(str(error)) from None
    rows, forged = signed_rows([] if args.force else read_rows(out, fieldnames), key, fieldnames)
    if forged:
        print(f"{forged} row(s) of {out} were not written by this grader (no valid signature): dropped, and graded "
              "again if their student has a folder")
        write_csv_atomically(out, fieldnames, rows)
    graded_before = {row["student"]: row[SUBMITTED] for row in rows}
    students = sorted(p for p in submissions.iterdir() if p.is_dir() and not p.name.startswith("."))
    if args.shard is not None:
        students = shard_of(students, args.shard)
    fingerprints = {s.name: submission_fingerprint(s, assignments) for s in students}
    pending = [s for s in students if graded_before.get(s.name) != fingerprints[s.name]]
    limits = _limits(args, walled)
    feedback_dir.mkdir(parents=True, exist_ok=True)
    if pending and not args.no_progress:
        notebooks = len(pending) * len(assignments)
        print(f"grading {len(pending)} students ({notebooks} notebooks), {min(args.jobs, notebooks)} notebooks at a "
              "time (--jobs)", file=sys.stderr)
    protected = (out, Path(args.key) if args.key else key_path(out), feedback_dir)
    load_graders(assignments)
    grade = functools.partial(grade_assignment, limits=limits, protected=protected, secret=secret)
    batch = Batch(pending, assignments, args.jobs, grade)
    for count, done in enumerate(batch.finished(), 1):
        row = student_row(done, fingerprints[done.student], walled, key, fieldnames)
        write_text_atomically(feedback_dir / f"{done.student}.txt", feedback_text(done.student, done.graded, walled))
        rows = [r for r in rows if r["student"] != done.student] + [row]
        write_csv_atomically(out, fieldnames, sorted(rows, key=lambda r: r["student"]))
        if not args.no_progress:
            print(progress_line(count, len(pending), batch.slowest_running()), file=sys.stderr)
    print(
        f"graded {len(pending)} student(s), skipped {len(students) - len(pending)} whose notebooks {out} has "
        f"graded; grades in {out}, feedback in {feedback_dir}/"
    )
    return 0


def run_new_key_command(args: argparse.Namespace) -> int:
    try:
        new_key(Path(args.file))
    except ValueError as error:
        raise UsageError(str(error)) from None
    print(f"made {args.file} (mode 0600): give it to every grading job (grade --key) and to merge, and no one else")
    return 0


def run_merge_command(args: argparse.Namespace) -> int:
    """The class's CSV and feedback from the shards'; exit 1 when a row was refused (named on stderr)."""
    try:
        merged = merge([Path(folder) for folder in args.shards], read_key(Path(args.key)), Path(args.out),
                       Path(args.feedback))
    except ValueError as error:
        raise UsageError(str(error)) from None
    for shard, student in merged.unsigned:
        print(f"refused {shard}: {student}: its signature does not verify with {args.key} (edited, or signed with "
              "another key); grade that student again", file=sys.stderr)
    for student, shards in merged.twice.items():
        print(f"refused {student}: graded by {len(shards)} shards ({', '.join(map(str, shards))}); merge one",
              file=sys.stderr)
    print(f"merged {len(merged.rows)} student(s) from {len(args.shards)} shard(s) into {args.out}, feedback in "
          f"{args.feedback}/; refused {len(merged.unsigned) + len(merged.twice)}")
    return 1 if merged.unsigned or merged.twice else 0


def shard_argument(text: str) -> tuple[int, int]:
    """`--shard K/M`, refused by argparse (exit code 2) with the form it takes."""
    try:
        return parse_shard(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--shard ")) from None


def jobs_count(text: str) -> int:
    """`--jobs J`: a whole number of students graded at once, 1 or more; anything else is refused by argparse
    (exit code 2) with a message naming what it takes."""
    try:
        jobs = int(text)
    except ValueError:
        jobs = 0
    if jobs < 1:
        raise argparse.ArgumentTypeError(f"takes a whole number of students graded at once, 1 or more; got {text!r}")
    return jobs


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line and exit 2, as the course's other refusals print
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.exit(CANNOT_GRADE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m autograder", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    check = commands.add_parser("check", help="grade one notebook and print every check's points and message")
    check.add_argument("notebook", help="an exNN_*.ipynb notebook")
    _add_limits(check)
    check.set_defaults(run=run_check_command)
    grade = commands.add_parser("grade", help="grade a class: one folder per student; CSV and feedback out")
    grade.add_argument("directory", help="one folder per student (e.g. nbgrader's submitted/)")
    grade.add_argument("--out", required=True, help="the grades CSV (written atomically, resumed on rerun)")
    grade.add_argument("--feedback", required=True, help="folder for one feedback file per student")
    grade.add_argument("--assignments", help="comma-separated assignments to grade (default: all)")
    grade.add_argument("--force", action="store_true", help="regrade students already in the CSV")
    grade.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    cores = len(machine_cores())
    grade.add_argument(
        "--jobs",
        type=jobs_count,
        default=cores,
        help=f"notebooks graded at once, each still in its own child with the same limits (default: one per "
        f"core this process may use, {cores} here); the grades are the same for any J",
    )
    grade.add_argument(
        "--no-walls",
        action="store_true",
        help="grade without the operating system's walls where they cannot be built (every such grade is marked)",
    )
    grade.add_argument(
        "--shard",
        metavar="K/M",
        type=shard_argument,
        help="grade only the K-th of M shards of the students, for one job of many (merge)",
    )
    grade.add_argument(
        "--key", metavar="FILE", help="sign the rows with this key (new-key makes one), not the one beside --out"
    )
    _add_limits(grade)
    grade.set_defaults(run=run_grade_command)
    key = commands.add_parser("new-key", help="make the key every grading job of a course signs its rows with")
    key.add_argument("file", help="where the key goes (mode 0600; never overwritten)")
    key.set_defaults(run=run_new_key_command)
    joined = commands.add_parser("merge", help="join the shards' grades into the class's, refusing unsigned rows")
    joined.add_argument("shards", nargs="+", help="each job's folder: its grades.csv and feedback/")
    joined.add_argument("--key", required=True, metavar="FILE", help="the key the jobs signed with")
    joined.add_argument("--out", required=True, help="the class's grades CSV")
    joined.add_argument("--feedback", required=True, help="folder for the class's feedback files")
    joined.set_defaults(run=run_merge_command)
    release = commands.add_parser(
        "student-release", help="the folder a class's students receive for one assignment: no answers, no solutions"
    )
    release.add_argument("assignment", help="the assignment released (e.g. ex02_zero1_sharded_adam)")
    release.add_argument("out", help="a new folder outside the course")
    release.add_argument(
        "--lessons",
        choices=("run", "copy"),
        default="run",
        help="run: save the lessons with their outputs (default; minutes); copy: as they are, without outputs",
    )
    release.set_defaults(run=run_student_release_command)
    scores = commands.add_parser("scores", help="nbgrader's gradebook: points per student and assignment")
    scores.add_argument("--db", default=str(ROOT / "gradebook.db"), help="the gradebook (default: gradebook.db)")
    scores.add_argument("--assignments", help="comma-separated assignments to show (default: those anyone handed in)")
    scores.set_defaults(run=run_scores_command)
    workspace = commands.add_parser("workspace", help="copy the lessons and exercises into a folder of your own")
    workspace.add_argument("folder", nargs="?", default="work", help="where the copies go (default: work)")
    workspace.set_defaults(run=lambda args: _workspace(Path(args.folder)))
    return parser


def _workspace(folder: Path) -> int:
    from autograder.workspace import main as make_workspace

    return make_workspace(ROOT, folder if folder.is_absolute() else Path.cwd() / folder)


def run_scores_command(args: argparse.Namespace) -> int:
    from autograder.gradebook_scores import scores_text

    assignments = [a for a in (args.assignments or "").split(",") if a] or None
    try:
        print(scores_text(Path(args.db), assignments))
    except (FileNotFoundError, KeyError) as error:
        raise UsageError(str(error).strip("'\"")) from None
    return 0


def run_student_release_command(args: argparse.Namespace) -> int:
    from autograder.student_release import ReleaseError, build

    try:
        build(args.assignment, Path(args.out), run_lessons=args.lessons == "run")
    except ReleaseError as error:
        raise UsageError(str(error)) from None
    return 0


ISOLATED_BOOT = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from autograder.cli import main; sys.exit(main())"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "grade" and argv is None and not sys.flags.isolated:
        os.execv(sys.executable, [sys.executable, "-I", "-c", ISOLATED_BOOT, *sys.argv[1:]])
    try:
        return args.run(args)
    except UsageError as error:
        sys.stderr.write(f"python -m autograder {args.command}: error: {error}\n")
        return CANNOT_GRADE
