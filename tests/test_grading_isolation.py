"""The grading child's walls: Linux namespaces where they can be made, and the audit hook everywhere.

Each wall is tested from the outside (a command run as the grader runs the child) and against a control
that shows the same command does what the wall prevents when the wall is not there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autograder.isolation import ROOT, namespaced
from autograder.submission import EXERCISES

NAMESPACES = namespaced(["true"]) is not None
needs_namespaces = pytest.mark.skipif(not NAMESPACES, reason="no namespaces here (not root, no user namespaces)")


def run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


@needs_namespaces
def test_a_namespaced_child_finds_no_solutions_and_cannot_write_the_course(tmp_path: Path) -> None:
    probe = ROOT / f"probe-{os.getpid()}"
    script = f"ls {ROOT / 'solutions'} | wc -l; ls {ROOT / 'zero_core'} | wc -l; touch {probe}"
    result = run(namespaced(["sh", "-c", script]))
    assert result.stdout.split()[0] == "0" and int(result.stdout.split()[1]) > 5
    assert result.returncode != 0 and "Read-only" in result.stderr
    assert not probe.exists()
    assert len(list((ROOT / "solutions").iterdir())) == len(EXERCISES), "the grader's own view is untouched"


@needs_namespaces
def test_a_process_a_child_leaves_behind_dies_with_it(tmp_path: Path) -> None:
    marker = tmp_path / "written-after-the-grade"
    script = f"setsid sh -c 'sleep 2; touch {marker}' > /dev/null 2>&1 < /dev/null & exit 0"
    run(namespaced(["sh", "-c", script]))
    control = tmp_path / "control"
    run(["sh", "-c", script.replace(str(marker), str(control))])
    time.sleep(3)
    assert control.exists(), "without namespaces the detached process outlives its parent"
    assert not marker.exists()


@needs_namespaces
def test_a_namespaced_child_cannot_signal_the_grader() -> None:
    result = run(namespaced(["sh", "-c", f"kill -0 {os.getpid()} && echo reached"]))
    assert "reached" not in result.stdout and result.returncode != 0
    assert run(["sh", "-c", f"kill -0 {os.getpid()} && echo reached"]).stdout.strip() == "reached"


GUARDED = """
import os, subprocess, sys
from autograder import child_guard
attempts = {
    "process": lambda: subprocess.run(["true"]),
    "fork": lambda: os._exit(0) if os.fork() == 0 else os.wait(),
    "signal the parent": lambda: os.kill(os.getppid(), 0),
    "ctypes": lambda: __import__("ctypes").CDLL(None),
    "read solutions": lambda: open(sys.argv[1]).read(),
    "write the course": lambda: open(sys.argv[2], "w"),
}
if sys.argv[3] == "guarded":
    child_guard.install()
for name, attempt in attempts.items():
    try:
        attempt()
        print(name, "allowed")
    except child_guard.GradingRefused:
        print(name, "refused")
"""


@pytest.mark.parametrize("guarded", [True, False], ids=["guarded", "control"])
def test_the_audit_hook_refuses_processes_signals_native_code_and_the_courses_files(guarded: bool) -> None:
    solution = next((ROOT / "solutions").rglob("*.ipynb"))
    probe = ROOT / f"probe-{os.getpid()}"
    try:
        result = run([sys.executable, "-c", GUARDED, str(solution), str(probe), "guarded" if guarded else "plain"])
    finally:
        probe.unlink(missing_ok=True)
    lines = [line for line in result.stdout.splitlines() if line.endswith(("allowed", "refused"))]
    expected = "refused" if guarded else "allowed"
    assert len(lines) == 6 and all(line.endswith(expected) for line in lines), result.stdout + result.stderr


@needs_namespaces
def test_a_namespaced_child_reads_nothing_of_an_exercise_answer(tmp_path: Path) -> None:
    """The answer modules' sources (and compiled copies) are empty files in the child's view, its
    scaffolding is intact, and the grader's view is untouched."""
    from autograder import ex04
    from autograder.isolation import module_files

    answers = module_files(ex04.ANSWER_MODULES)
    gather = ROOT / "zero_core" / "stages" / "zero3_gather.py"
    scaffolding = ROOT / "zero_core" / "stages" / "zero3.py"
    assert gather in answers and scaffolding not in answers
    script = f"wc -c < {gather}; wc -c < {scaffolding}"
    sizes = run(namespaced(["sh", "-c", script], protected=answers)).stdout.split()
    assert sizes[0] == "0" and int(sizes[1]) > 1000
    assert gather.stat().st_size > 1000


@pytest.mark.ex02
def test_ex02_is_graded_in_a_child_that_never_loads_zero1(tmp_path: Path) -> None:
    """The child refuses to start with an answer module loaded, so full marks prove it ran without."""
    from autograder.checks import total
    from autograder.sandbox import grade_notebook

    assert "zero_core.stages.zero1" in __import__("autograder.ex02").ex02.ANSWER_MODULES
    solution = ROOT / "solutions" / "ex02_zero1_sharded_adam" / "ex02_zero1_sharded_adam.ipynb"
    results = grade_notebook(solution)
    assert total(results) == (10, 10), [r.message for r in results if not r.passed]
