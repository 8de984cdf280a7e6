"""How long grading takes: each exercise, one complete submission (every notebook), and a batch of them.

Builds a class of `--students` students, each handing in every solution notebook in nbgrader's
`submitted/<student>/<assignment>/<assignment>.ipynb` layout, and grades it with
`python -m autograder grade`, exactly as an instructor would: every notebook in its own child process,
with the default time and memory limits. First grades one submission notebook by notebook, to show
where the time goes. The target is under 60 s per complete submission on 2 cores.

    python benchmarks/bench_grading.py [--students 3]
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

from autograder.checks import total  # noqa: E402
from autograder.sandbox import grade_notebook  # noqa: E402
from autograder.submission import EXERCISES  # noqa: E402

TARGET_SECONDS = 60.0


def hand_in(submitted: Path, student: str) -> None:
    for assignment in EXERCISES:
        destination = submitted / student / assignment / f"{assignment}.ipynb"
        destination.parent.mkdir(parents=True)
        shutil.copy(ROOT / "solutions" / assignment / f"{assignment}.ipynb", destination)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--students", type=int, default=3, help="submissions in the batch (default 3)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench-grading-") as tmp:
        submitted = Path(tmp) / "submitted"
        for index in range(args.students):
            hand_in(submitted, f"student{index:02d}")

        print("one submission, notebook by notebook (child process each):")
        one = 0.0
        for assignment in EXERCISES:
            started = time.perf_counter()
            results = grade_notebook(submitted / "student00" / assignment / f"{assignment}.ipynb")
            seconds = time.perf_counter() - started
            one += seconds
            points, max_points = total(results)
            print(f"  {assignment:<36} {seconds:6.1f} s   {points:g}/{max_points:g} points")
        print(f"  {'all notebooks':<36} {one:6.1f} s   (target < {TARGET_SECONDS:g} s)")

        grades = Path(tmp) / "grades.csv"
        started = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "autograder", "grade", str(submitted), "--out", str(grades),
             "--feedback", str(Path(tmp) / "feedback"), "--no-progress"],
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
