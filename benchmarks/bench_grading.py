"""How long grading takes: each exercise, one complete submission (every notebook), and a batch of them.

Builds a class of `--students` students, each handing in every solution notebook in nbgrader's
`submitted/<student>/<assignment>/<assignment>.ipynb` layout, and grades it with
`python -m autograder grade`, exactly as an instructor would: every notebook in its own child process,
with the default time and memory limits. First grades one submission notebook by notebook, each notebook
inside the walls (`autograder.walls`) and without them, one right after the other (in alternating order,
so that a machine's drift costs both alike, after one untimed grade that makes the parent's reference runs,
which a batch makes once), to show where the time goes and what the walls cost. The
targets: under 60 s per complete submission with the walls on 2 cores, and under 1.5x the time without.
Then what the kernel's count of memory costs (`autograder.kernel_memory`): per stage exercise, the sized
run (the reference stage trained on the sized model in this process, about what the grading child spends
on it) and the reference child a grading process starts once per exercise, with the figures it gives.

    python benchmarks/bench_grading.py [--students 3] [--assignments ex05_memory_planning,...]
"""

from __future__ import annotations

import argparse
import csv
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autograder import walls  # noqa: E402
from autograder.checks import total  # noqa: E402
from autograder.sandbox import Limits, grade_notebook  # noqa: E402
from autograder.submission import EXERCISES  # noqa: E402

TARGET_SECONDS = 60.0
TARGET_WALLS_RATIO = 1.5


def timed_grade(notebook: Path, walled: bool) -> tuple[float, str]:
    """(seconds, "points/max") of grading `notebook` in a child, inside the walls or not."""
    started = time.perf_counter()
    results = grade_notebook(notebook, limits=Limits(walls=walled))
    points, max_points = total(results)
    return time.perf_counter() - started, f"{points:g}/{max_points:g}"


def kernel_memory_costs(assignments: list[str]) -> None:
    """Seconds of the sized run and of the reference child, and the kernel's figure, per stage exercise."""
    from autograder import kernel_memory
    from autograder.submission import exercise_module

    print(f"\nthe kernel's count of memory: a {kernel_memory.parameter_count() / 1e6:.1f}M-parameter model on "
          f"{kernel_memory.SIZED_WORLD_SIZE} ranks, {kernel_memory.SIZED_STEPS} step")
    print(f"  {'exercise':<36} {'sized run':>9} {'reference child':>16} {'its peak':>10}")
    for assignment in assignments:
        exercise = getattr(exercise_module(assignment), "EXERCISE", None)
        if exercise is None:
            continue
        started = time.perf_counter()
        exercise.sized_run(exercise.reference_stage, None)
        sized = time.perf_counter() - started
        started = time.perf_counter()
        figures = kernel_memory.measure_reference(assignment)
        child = time.perf_counter() - started
        print(f"  {assignment:<36} {sized:8.1f}s {child:15.1f}s {figures.kernel_bytes / 2**20:6,.0f} MiB")


def hand_in(submitted: Path, student: str, assignments: list[str]) -> None:
    for assignment in assignments:
        destination = submitted / student / assignment / f"{assignment}.ipynb"
        destination.parent.mkdir(parents=True)
        shutil.copy(ROOT / "solutions" / assignment / f"{assignment}.ipynb", destination)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--students", type=int, default=3, help="submissions in the batch (default 3)")
    parser.add_argument("--assignments", help="comma-separated assignments (default: all of them)")
    args = parser.parse_args()
    assignments = args.assignments.split(",") if args.assignments else list(EXERCISES)
    unknown = sorted(set(assignments) - set(EXERCISES))
    if unknown:
        parser.error(f"unknown assignment(s) {unknown}; the course has {', '.join(EXERCISES)}")

    with tempfile.TemporaryDirectory(prefix="bench-grading-") as tmp:
        submitted = Path(tmp) / "submitted"
        for index in range(args.students):
            hand_in(submitted, f"student{index:02d}", assignments)

        built = walls.available()
        if isinstance(built, str):
            sys.exit(f"bench_grading: {built}; the walls' cost cannot be measured here")
        print(f"one submission, notebook by notebook (a child process each; {built.describe()}):")
        print(f"  {'notebook':<36} {'walls':>8} {'no walls':>9} {'ratio':>6}   points")
        sums = {True: 0.0, False: 0.0}
        for index, assignment in enumerate(assignments):
            notebook = submitted / "student00" / assignment / f"{assignment}.ipynb"
            order = (True, False) if index % 2 == 0 else (False, True)
            timed_grade(notebook, False)  # untimed: the parent's imports and reference runs, made once a batch
            seconds, points = {}, {}
            for walled in order:
                seconds[walled], points[walled] = timed_grade(notebook, walled)
                sums[walled] += seconds[walled]
            same = points[True] if points[True] == points[False] else f"{points[True]} vs {points[False]}!"
            print(f"  {assignment:<36} {seconds[True]:7.1f}s {seconds[False]:8.1f}s "
                  f"{seconds[True] / seconds[False]:5.2f}x   {same}")
        ratio = sums[True] / sums[False]
        print(f"  {'all notebooks':<36} {sums[True]:7.1f}s {sums[False]:8.1f}s {ratio:5.2f}x")
        print(f"  with walls: {sums[True]:.1f} s per submission (target < {TARGET_SECONDS:g} s: "
              f"{'met' if sums[True] < TARGET_SECONDS else 'NOT met'}); {ratio:.2f}x the time without "
              f"(target < {TARGET_WALLS_RATIO:g}x: {'met' if ratio < TARGET_WALLS_RATIO else 'NOT met'})")

        kernel_memory_costs(assignments)

        grades = Path(tmp) / "grades.csv"
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "autograder", "grade", str(submitted), "--out", str(grades),
             "--feedback", str(Path(tmp) / "feedback"), "--no-progress", "--assignments", ",".join(assignments)],
            cwd=ROOT, check=True, capture_output=True,
        )
        wall = time.perf_counter() - started
        with grades.open(newline="") as handle:
            rows = list(csv.DictReader(handle))
        per_submission = [float(row["seconds"]) for row in rows]
        print(f"\nbatch of {len(rows)} submissions with `python -m autograder grade`:")
        print(f"  per submission: mean {sum(per_submission) / len(rows):.1f} s, max {max(per_submission):.1f} s")
        print(f"  wall time {wall:.1f} s: {len(rows) / wall * 60:.1f} submissions per minute")
        print(f"  totals: {', '.join(sorted({row['total'] + '/' + row['max_total'] for row in rows}))}")


if __name__ == "__main__":
    main()
