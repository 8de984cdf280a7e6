"""How long grading a class takes: one grader for the class, one student or J at a time, and a grader per student.

Builds a synthetic class in nbgrader's `submitted/<student>/<assignment>/<assignment>.ipynb` layout, correct
and wrong submissions mixed: in every four students, one hands in the untouched release, one the solution and
two a wrong answer from `tests/fixtures/wrong/` (those kept as patches of a correct cell, which run to the
end: not the answers that loop, exit or break the rules for graded cells, which the grader ends or refuses
early, and which would make the class faster or slower than a real one). Then grades it with
`python -m autograder grade` as an instructor would, every notebook in its own walled child:

- `--jobs 1`, then `--jobs J` (J = the cores this process may use): the speed-up, and that the grades are the
  same (every column but the seconds). Target: `--jobs 2` at least 1.8x faster than `--jobs 1`. Under each
  grading, the core-seconds the machine was busy (`/proc/stat`: run it alone); beside the target, the bound
  that sets: J jobs share J cores, and one job alone already keeps (busy / wall) of them busy, so J jobs can be
  at most J x wall / busy times as fast, less the start and the end of the batch.
- `--jobs 1` again, on a new output folder but with the reference store the first `--jobs 1` filled
  (`autograder.reference_store`), as an instructor's next grading on the same machine: what reading the judges'
  references back instead of making them saves. Every other grading here has a new, empty store of its own.
- where one notebook's time goes: a solution notebook of each assignment graded by this process from nothing
  (the judges' references made while its child runs) and again with them made, as every later notebook of a
  batch is: the difference is the references' share.
- nothing shared: the first `--unshared` students each graded by a grader process of its own (`--shard k/S`,
  one student a shard, as a job array with one job per student would), one after another. Such a grader makes
  the judges' reference runs, the oracle's trajectories and the kernel's reference figures again for its one
  student, where one grader for the class makes them once (`autograder.sandbox.prepare_judges`). Compared per
  notebook with `--jobs 1`: what sharing them saves.

First for one assignment (`--assignment`, `--students`), then for a term of every assignment
(`--term-students`; 0 leaves it out).

    python benchmarks/bench_class.py [--students 40] [--assignment ex03_zero2_reduce_scatter_backward]
                                     [--term-students 8] [--unshared 8]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autograder.grade_file import new_key  # noqa: E402
from autograder.reference_store import STORE_VARIABLE  # noqa: E402
from autograder.sandbox import grade_notebook  # noqa: E402
from autograder.student_release import forget_cached_references  # noqa: E402
from autograder.submission import EXERCISES  # noqa: E402
from tests.fixture_text import read_fixture, wrong_fixtures  # noqa: E402

TARGET_SPEEDUP = 1.8
"""`--jobs 2` against `--jobs 1` on a class, on two cores."""
TIMED_COLUMNS = {"seconds", "signature"}
"""The CSV's columns that differ between two gradings of the same class: the time, and the signature over it."""


def honest_mistakes(assignment: str) -> list[tuple[str, str]]:
    """(solution cell, its wrong source) of every wrong answer of `assignment` kept as a patch of a correct cell
    that breaks no rule for graded cells and writes no file."""
    mistakes = []
    for path in wrong_fixtures():
        meta, source = read_fixture(path)
        if path.suffix == ".patch" and meta["EXERCISE"] == assignment and not {"RULES", "WRITES"} & set(meta):
            mistakes.append((meta["CELL"], source))
    return mistakes


def notebook_text(assignment: str, folder: str, replace: tuple[str, str] | None = None) -> str:
    """The notebook of `folder` (solutions or exercises), with one solution cell replaced where asked."""
    notebook = json.loads((ROOT / folder / assignment / f"{assignment}.ipynb").read_text())
    if replace is not None:
        cell_id, source = replace
        (cell,) = [c for c in notebook["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id") == cell_id]
        cell["source"] = source
    return json.dumps(notebook)


@dataclass(frozen=True)
class Class:
    """A synthetic class handing in `assignments`: its folder and what it holds."""

    submitted: Path
    students: int
    assignments: list[str]
    kinds: dict[str, int]
    """How many notebooks of each kind: the release untouched, the solution, a wrong answer."""

    @property
    def notebooks(self) -> int:
        return self.students * len(self.assignments)

    @classmethod
    def make(cls, folder: Path, students: int, assignments: list[str]) -> Class:
        kinds = {"untouched": 0, "solution": 0, "wrong": 0}
        mistakes = {a: honest_mistakes(a) for a in assignments}
        for index in range(students):
            for assignment in assignments:
                kind = ("untouched", "solution", "wrong", "wrong")[index % 4]
                if kind == "wrong" and not mistakes[assignment]:
                    kind = "solution"
                if kind == "wrong":
                    choices = mistakes[assignment]
                    text = notebook_text(assignment, "solutions", choices[(index // 2) % len(choices)])
                else:
                    text = notebook_text(assignment, "exercises" if kind == "untouched" else "solutions")
                kinds[kind] += 1
                path = folder / f"student{index:03d}" / assignment / f"{assignment}.ipynb"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
        return cls(folder, students, assignments, kinds)

    def describe(self) -> str:
        kinds = ", ".join(f"{count} {kind}" for kind, count in self.kinds.items() if count)
        return f"{self.students} students x {len(self.assignments)} assignment(s): {self.notebooks} notebooks ({kinds})"


def grade(the_class: Class, out: Path, jobs: int, shard: tuple[int, int] | None = None, store: Path | None = None
          ) -> float:
    """Wall seconds of one `python -m autograder grade` of the class (or of one shard of it), with `store` as
    its reference store (`autograder.reference_store`): None, a new one, so the grading starts from nothing."""
    command = [sys.executable, "-m", "autograder", "grade", str(the_class.submitted), "--out", str(out / "grades.csv"),
               "--feedback", str(out / "feedback"), "--no-progress", "--jobs", str(jobs),
               "--assignments", ",".join(the_class.assignments)]
    if shard is not None:
        command += ["--shard", f"{shard[0]}/{shard[1]}", "--key", str(out.parent / "key")]
    folder = store or Path(tempfile.mkdtemp(prefix="references-", dir=out.parent))
    env = dict(os.environ, **{STORE_VARIABLE: str(folder)})
    started = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - started
    if done.returncode not in (0, 1):  # 1: graded, and some points lost
        sys.exit(f"bench_class: grading failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return seconds


def grades(out: Path) -> list[dict[str, str]]:
    """The CSV's rows without the columns a second grading changes."""
    with (out / "grades.csv").open(newline="") as handle:
        return [{k: v for k, v in row.items() if k not in TIMED_COLUMNS} for row in csv.DictReader(handle)]


def busy_core_seconds() -> float | None:
    """The machine's CPU time so far, all cores and every process (`/proc/stat`, in its clock ticks), or None
    where there is no /proc/stat: what shows how many cores a grading kept busy, so run the benchmark alone."""
    try:
        with open("/proc/stat") as stat:
            ticks = [int(field) for field in stat.readline().split()[1:]]
    except OSError:
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def timed_grade(the_class: Class, out: Path, jobs: int, store: Path | None = None) -> tuple[float, float | None]:
    """(wall seconds, core-seconds the machine was busy) of one `grade` of the class."""
    before = busy_core_seconds()
    seconds = grade(the_class, out, jobs, store=store)
    after = busy_core_seconds()
    return seconds, None if before is None or after is None else after - before


def row(label: str, seconds: float, notebooks: int, busy: float | None = None) -> str:
    """A grading's line: wall seconds, per notebook, and below it how many cores the machine kept busy."""
    line = f"  {label:<46} {seconds:7.1f} s {seconds / notebooks:6.2f} s per notebook"
    if busy is not None:
        line += f"\n    the machine busy {busy:,.0f} core-s: {busy / seconds:.2f} cores on average"
    return line


def breakdown(the_class: Class) -> None:
    """Per assignment: a solution notebook graded from nothing, then with its references made."""
    solution = the_class.submitted / "student001" if the_class.students > 1 else None
    if solution is None:
        return
    print(f"  one solution notebook, graded here: {'from nothing':>14} {'references made':>16} {'their share':>12}")
    for assignment in the_class.assignments:
        notebook = solution / assignment / f"{assignment}.ipynb"
        forget_cached_references()
        # nothing kept from an earlier grading: a reference store of its own, new
        os.environ[STORE_VARIABLE] = tempfile.mkdtemp(prefix="references-", dir=the_class.submitted.parent)
        seconds = []
        for _ in range(2):
            started = time.perf_counter()
            grade_notebook(notebook)
            seconds.append(time.perf_counter() - started)
        cold, warm = seconds
        print(f"    {assignment:<33} {cold:12.1f} s {warm:14.1f} s {(cold - warm) / cold:11.0%}")


def measure(the_class: Class, work: Path, jobs: int, unshared: int) -> None:
    """Grade the class with --jobs 1 and --jobs `jobs`, and its first `unshared` students a grader each."""
    print(the_class.describe())
    store = work / "references"
    store.mkdir(mode=0o700, parents=True)
    one, busy_one = timed_grade(the_class, work / "jobs1", 1, store)
    print(row("grade --jobs 1", one, the_class.notebooks, busy_one))
    again, busy_again = timed_grade(the_class, work / "again", 1, store)
    print(row("grade --jobs 1 again, references kept", again, the_class.notebooks, busy_again))
    saved = ""
    if busy_one and busy_again:  # on a class this small the machine's noise can outweigh what the store saves
        change = 1 - busy_again / busy_one
        saved = f", {abs(change):.0%} {'fewer' if change >= 0 else 'more'} core-seconds"
    print(f"    {one / again:.2f}x the speed of the first{saved}: the references read back from its store")
    if jobs > 1:
        many, busy = timed_grade(the_class, work / f"jobs{jobs}", jobs)
        same = "identical" if grades(work / "jobs1") == grades(work / f"jobs{jobs}") else "DIFFERENT"
        met = "met" if one / many >= TARGET_SPEEDUP else "NOT met"
        # the bound: J jobs share J cores, and one job alone already kept busy_one / one of them busy
        bound = f"; bound {jobs * one / busy_one:.2f}x" if busy_one else ""
        target = f" (target {TARGET_SPEEDUP:g}x: {met}{bound})"
        print(row(f"grade --jobs {jobs}", many, the_class.notebooks, busy))
        print(f"    {one / many:.2f}x the speed of --jobs 1{target if jobs == 2 else ''}; the grades {same}")
    breakdown(the_class)
    if unshared:
        unshared = min(unshared, the_class.students)
        alone = work / "alone"
        new_key(alone / "key")
        seconds = sum(grade(the_class, alone / f"shard{k}", 1, (k, the_class.students)) for k in range(1, unshared + 1))
        notebooks = unshared * len(the_class.assignments)
        print(row(f"nothing shared (a grader per student, first {unshared})", seconds, notebooks))
        print(f"    one grader for the class is {seconds / notebooks / (one / the_class.notebooks):.2f}x as fast "
              "per notebook")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--students", type=int, default=40, help="students handing in one assignment (default 40)")
    parser.add_argument("--assignment", default="ex03_zero2_reduce_scatter_backward",
                        help="the one assignment (default ex03_zero2_reduce_scatter_backward)")
    parser.add_argument("--term-students", type=int, default=8,
                        help="students handing in every assignment (default 8; 0: no term)")
    parser.add_argument("--unshared", type=int, default=8,
                        help="students graded a grader each, for the time without sharing (default 8; 0: none)")
    parser.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)),
                        help="notebooks at once for the parallel run (default: the cores this process may use)")
    args = parser.parse_args()
    if args.assignment not in EXERCISES:
        parser.error(f"unknown assignment {args.assignment!r}; the course has {', '.join(EXERCISES)}")
    if args.students < 1 or args.term_students < 0 or args.unshared < 0 or args.jobs < 1:
        parser.error("--students and --jobs take 1 or more, --term-students and --unshared 0 or more")

    print(f"grading a synthetic class with `python -m autograder grade`, walls on, on {args.jobs} core(s)")
    with tempfile.TemporaryDirectory(prefix="bench-class-") as tmp:
        one = Class.make(Path(tmp) / "one" / "submitted", args.students, [args.assignment])
        measure(one, Path(tmp) / "one", args.jobs, args.unshared)
        if args.term_students:
            term = Class.make(Path(tmp) / "term" / "submitted", args.term_students, list(EXERCISES))
            measure(term, Path(tmp) / "term", args.jobs, min(args.unshared, args.term_students))


if __name__ == "__main__":
    main()
