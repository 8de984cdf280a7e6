"""Build what a class's students receive for one assignment: the course without its answers.

`python -m autograder student-release ASSIGNMENT OUT` (`make student-release ASSIGNMENT=...`) writes OUT, a
folder to hand out (or to push to the class's repository), holding the course's tracked files except:

- `solutions/`, `tests/`, `benchmarks/`, `.ci/` and `nbgrader_config.py` (the instructor's side);
- every other assignment's folder under `exercises/`;
- the assignment's answer modules (`ANSWER_MODULES`: the reference code, but the scaffolding the exercise
  plugs the student's code into, which earlier assignments' answers may be), absent as in the grading
  child's walls (`autograder.walls`);
- the instructor's secret (`.grading-secret`, never tracked), from which the hidden checks draw.

The lessons run the reference stages, which are answers: the release holds them executed, with their
outputs (`--lessons copy` copies them as they are, without outputs, for a quick build). What the visible
checks' judges need of the reference code is recorded by grading the solution notebook's visible checks
here (`autograder.recorded`): `check` then works in the release on the visible checks, and says that the
hidden ones and the kernel's count of memory run when the instructor grades.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

from autograder import harness, recorded, walls
from autograder.sandbox import grade_submission
from autograder.submission import EXERCISES, exercise_module, load

ROOT = Path(__file__).resolve().parents[1]
INSTRUCTOR_ONLY = ("solutions/", "tests/", "benchmarks/", ".ci/", "nbgrader_config.py")
LESSON_TIMEOUT_S = 600
GUIDE = "RELEASE.md"


class ReleaseError(RuntimeError):
    """The release cannot be built; the message says why and what to do."""


def tracked_files(root: Path = ROOT) -> list[str]:
    """The course's files as git tracks them (untracked work, outputs and secrets never ship)."""
    try:
        listed = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError) as error:
        raise ReleaseError(f"a student release is built from a git checkout of the course ({error})") from None
    return sorted(name for name in listed.stdout.decode().split("\0") if name)


def shipped(files: list[str], assignment: str, root: Path = ROOT) -> list[str]:
    """`files` less the instructor's side, the other assignments and the assignment's answer modules."""
    modules = walls.module_files(exercise_module(assignment).ANSWER_MODULES)
    answers = [path.relative_to(root).as_posix() for path in modules if path.is_relative_to(root)]
    others = [f"exercises/{other}/" for other in EXERCISES if other != assignment]

    def keep(name: str) -> bool:
        if name.startswith((*INSTRUCTOR_ONLY, *others)):
            return False
        return not any(name == answer or name.startswith(answer + "/") for answer in answers)

    return [name for name in files if keep(name)]


def record_references(assignment: str) -> dict:
    """Grade the solution notebook's visible checks here, recording what their judges read of the reference
    code; `ReleaseError` if the solution does not earn every visible point."""
    solution = ROOT / "solutions" / assignment / f"{assignment}.ipynb"
    if not solution.exists():
        raise ReleaseError(f"no solution notebook at {solution}: build the release from the instructor's copy")
    visible = tuple(check for check in exercise_module(assignment).CHECKS if not check.hidden)
    forget_cached_references()
    with recorded.recording() as book:
        results = list(grade_submission(load(solution, assignment), visible))
    failed = [f"{r.name}: {r.message[:300]}" for r in results if not r.passed]
    if failed:
        raise ReleaseError("the solution fails its visible checks, so nothing can be recorded:\n" + "\n".join(failed))
    return book


def forget_cached_references() -> None:
    """Forget every reference this process's judges made (runs, oracles, the kernel's figures), so the next
    judge makes its own: runs made earlier would not be recorded, and `benchmarks/bench_class.py` times a
    notebook graded from nothing."""
    from autograder import kernel_memory, stage_checks

    harness.forget_runs()
    stage_checks.oracle_run.cache_clear()
    for assignment in EXERCISES:
        cached = getattr(exercise_module(assignment), "oracle_run", None)
        if cached is not stage_checks.oracle_run and hasattr(cached, "cache_clear"):
            cached.cache_clear()
    kernel_memory.reference_figures.cache_clear()


def execute_lesson(source: Path, target: Path) -> None:
    """Run a lesson notebook top to bottom, as JupyterLab would, and save it with its outputs."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(source, as_version=4)
    NotebookClient(notebook, timeout=LESSON_TIMEOUT_S, kernel_name="python3",
                   resources={"metadata": {"path": str(source.parent)}}).execute()
    nbformat.write(notebook, target)


def build(assignment: str, out: Path, run_lessons: bool = True, say: Callable[[str], None] = print) -> Path:
    """Write the student release of `assignment` into `out` (new or empty); returns `out`."""
    if assignment not in EXERCISES:
        raise ReleaseError(f"unknown assignment {assignment!r}; the course has {', '.join(EXERCISES)}")
    out = Path(out).resolve()
    if out.exists() and any(out.iterdir()):
        raise ReleaseError(f"{out} is not empty: give a new folder")
    if out.is_relative_to(ROOT):
        raise ReleaseError(f"{out} is inside the course: give a folder outside it")
    files = shipped(tracked_files(), assignment)
    say(f"recording the references of {assignment}'s visible checks (grading its solution here)...")
    book = record_references(assignment)
    out.mkdir(parents=True, exist_ok=True)
    for name in files:
        target = out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)
    (out / recorded.RECORD_FILE.relative_to(ROOT)).write_text(json.dumps(book, sort_keys=True))
    lessons = [name for name in files if name.startswith("lessons/") and name.endswith(".ipynb")]
    if run_lessons:
        for index, name in enumerate(lessons, 1):
            say(f"running lesson {index}/{len(lessons)}: {name}")
            execute_lesson(ROOT / name, out / name)
    (out / GUIDE).write_text(guide(assignment, run_lessons))
    say(f"wrote {out}: {len(files)} files, {len(book)} recorded references; see {GUIDE} there")
    return out


def guide(assignment: str, ran_lessons: bool) -> str:
    lessons = (
        "The lessons are saved with their outputs: read them, or run the cells that do not train a ZeRO stage."
        if ran_lessons
        else "The lessons are copied without outputs; the cells that train a ZeRO stage need the instructor's copy."
    )
    return f"""# Your release: {assignment}

This folder is the course as your class receives it for `{assignment}`: the simulator, the lessons and
your exercise notebook, without the answers (the reference code of this exercise, `solutions/`, the tests).

    make lab        # copies lessons/ and exercises/ into work/ (yours), then serves JupyterLab on work/lessons/
    python -m autograder check work/exercises/{assignment}/{assignment}.ipynb   # the visible checks

Work in `work/`: hand in `work/exercises/{assignment}/{assignment}.ipynb`, its name unchanged.

`check` grades your notebook on the visible checks, as the notebook's own test cells do, in a child
process walled off where the machine allows it. The hidden checks, and the comparison of your run's
memory as the kernel counts it with the reference's, run when your instructor grades your submission.

{lessons}
"""
