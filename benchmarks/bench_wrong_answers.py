"""Per assignment: how long grading the reference solution takes, and which checks the course's own plausible
wrong answers fail.

Each assignment's solution notebook is graded as an instructor's `grade` would, in a child process (so its
time includes starting the child and the reference runs the judge makes). Then every wrong answer in
`tests/fixtures/wrong/` (one mistake each, its header naming the assignment and the solution cell it
replaces) is put into the solution notebook and graded the same way; the table lists, per assignment, how
many wrong answers there are, how many of the checks at least one of them fails, and each answer's lost
checks. A check that no wrong answer fails is one nothing has shown can fail.

    python benchmarks/bench_wrong_answers.py [--assignments ex06_bucketed_overlap,...]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autograder.checks import total  # noqa: E402
from autograder.sandbox import grade_notebook  # noqa: E402
from autograder.submission import EXERCISES, exercise_module  # noqa: E402
from tests.fixture_text import read_fixture, wrong_fixtures  # noqa: E402


def fixture(path: Path) -> tuple[str, str, str]:
    """(assignment, solution cell replaced, the cell's source) of one wrong answer."""
    meta, source = read_fixture(path)
    return meta["EXERCISE"], meta["CELL"], source


def notebook_with(assignment: str, cell: str, source: str, directory: Path) -> Path:
    notebook = json.loads((ROOT / "solutions" / assignment / f"{assignment}.ipynb").read_text())
    for c in notebook["cells"]:
        if c["metadata"].get("nbgrader", {}).get("grade_id") == cell:
            c["source"] = source
    path = directory / f"{assignment}.ipynb"
    path.write_text(json.dumps(notebook))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--assignments", default=",".join(EXERCISES), help="comma-separated (default: all)")
    args = parser.parse_args()
    assignments = [a for a in args.assignments.split(",") if a]
    unknown = [a for a in assignments if a not in EXERCISES]
    if unknown:
        parser.error(f"unknown assignment(s) {unknown}; the course has {', '.join(EXERCISES)}")
    rows = []
    for assignment in assignments:
        checks = [c.name for c in exercise_module(assignment).CHECKS]
        started = time.perf_counter()
        points, _ = total(grade_notebook(ROOT / "solutions" / assignment / f"{assignment}.ipynb"))
        seconds = time.perf_counter() - started
        failed: set[str] = set()
        answers = []
        for path in [p for p in wrong_fixtures() if p.stem.startswith(f"{assignment[:4]}_")]:
            _, cell, source = fixture(path)
            with tempfile.TemporaryDirectory() as tmp:
                results = grade_notebook(notebook_with(assignment, cell, source, Path(tmp)), assignment)
            lost = [r.name for r in results if not r.passed]
            failed.update(lost)
            answers.append(f"    {path.stem}: fails {len(lost)} of {len(checks)} ({', '.join(lost) or 'none!'})")
            print(answers[-1], flush=True)
        rows.append((assignment, points, seconds, len(answers), len(failed), len(checks)))
        print(
            f"{assignment}: solution {points:g}/10 in {seconds:.1f} s; {len(answers)} wrong answers fail "
            f"{len(failed)} of its {len(checks)} checks",
            flush=True,
        )
    print("\nassignment                          solution  grading  wrong answers  checks failed by one")
    for assignment, points, seconds, answers, failed, checks in rows:
        print(f"{assignment:35s} {points:5g}/10  {seconds:6.1f} s  {answers:13d}  {failed:>9d} of {checks}")


if __name__ == "__main__":
    main()
