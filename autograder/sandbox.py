"""Grade one notebook in a child process, with a time limit and a memory limit.

`grade_notebook(path)` starts `python -m autograder.sandbox` (the same interpreter), which limits its own
address space (`RLIMIT_AS`), loads the notebook's solution cells (`autograder.submission`) and runs the
assignment's checks, appending each result to a JSON-lines file as soon as it is known. The parent
waits up to the time limit, then kills the child's whole process group. Checks without a result get 0
points and a message saying why: the time limit (an infinite loop), the process dying (`os._exit`, a
crash, the memory limit; `sys.exit` only costs the check that called it). Inside the child, each check
also has its own alarm, and the virtual cluster's deadlines stop ranks that loop or wait for each
other, so one bad check rarely costs the others.

This protects the grader from mistakes, not from a student set on cheating: like nbgrader's, the child
runs the student's code with the grader's permissions.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from autograder.checks import Check, CheckResult, run_check
from autograder.integrity import verdict
from autograder.submission import Submission, assignment_of, exercise_module, load

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
CHILD_ENVIRONMENT = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}
"""One compute thread per process and few malloc arenas: the address space a correct submission needs
(under 1 GB) then does not grow with the machine's core count, so one memory limit fits every machine."""


@dataclass(frozen=True)
class Limits:
    """Per notebook: wall-clock seconds for the child, its address-space bytes, seconds per check."""

    time_s: float = 180.0
    memory_bytes: int = 4096 * MiB
    check_time_s: float = 90.0


class CheckTimeLimit(BaseException):
    """Raised in the child by the per-check alarm (a BaseException, so `except Exception` cannot swallow it)."""


def _missing_message(returncode: int | None, timed_out: bool, limits: Limits, stderr_tail: str) -> str:
    if timed_out:
        return (
            f"not graded: the notebook hit the time limit of {limits.time_s:g} s before this check "
            "(an infinite loop, or code far slower than needed)"
        )
    if returncode is not None and returncode < 0:
        reason = f"was killed by signal {-returncode}"
    else:
        reason = f"exited with code {returncode}"
    hint = "does the code call sys.exit or os._exit, or exceed the memory limit?"
    tail = f"\nlast lines on stderr:\n{stderr_tail}" if stderr_tail else ""
    return f"not graded: the grading process {reason} before this check ({hint}){tail}"


def _tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


def grade_notebook(path: Path, assignment: str | None = None, limits: Limits = Limits()) -> list[CheckResult]:
    """Every check of the notebook's assignment, graded in a child process; never raises for the notebook."""
    path = Path(path).resolve()
    assignment = assignment or assignment_of(path)
    checks: tuple[Check, ...] = exercise_module(assignment).CHECKS
    with tempfile.TemporaryDirectory(prefix="autograder-") as tmp:
        results_file, stdout_file, stderr_file = (Path(tmp) / name for name in ("results.jsonl", "stdout", "stderr"))
        env = dict(os.environ, **CHILD_ENVIRONMENT)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        command = [
            sys.executable,
            "-m",
            "autograder.sandbox",
            str(path),
            assignment,
            str(results_file),
            str(limits.memory_bytes),
            str(limits.check_time_s),
        ]
        with stdout_file.open("wb") as out, stderr_file.open("wb") as err:
            child = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=path.parent,
                env=env,
                start_new_session=True,
            )
            timed_out = False
            try:
                child.wait(timeout=limits.time_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(child.pid, signal.SIGKILL)
                child.wait()
        done = {}
        if results_file.exists():
            for line in results_file.read_text().splitlines():
                result = CheckResult(**json.loads(line))
                done[result.name] = result
        stderr_tail = _tail(stderr_file)
    missing = _missing_message(child.returncode, timed_out, limits, stderr_tail)
    return [done.get(check.name) or CheckResult(check.name, 0, check.points, missing) for check in checks]


def _on_alarm(seconds: float, signum: int, frame: object) -> None:
    raise CheckTimeLimit(f"this check did not finish within {seconds:g} s (an infinite loop?)")


def _limit_resources(memory_bytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def grade_submission(submission: Submission, checks: tuple[Check, ...]) -> Iterator[CheckResult]:
    """Each check's result for a loaded submission: 0 everywhere if it uses the reference implementation,
    and the failing cells' errors added to the messages of the checks they cost."""
    for check in checks:
        if submission.integrity_problems:
            message = verdict(submission.integrity_problems, submission.assignment)
            yield CheckResult(check.name, 0, check.points, message)
            continue
        result = run_check(check, submission.namespace)
        if not result.passed and submission.cell_errors:
            message = "\n".join([result.message, *submission.cell_errors])
            result = CheckResult(result.name, 0, result.max_points, message)
        yield result


def child_main(argv: list[str]) -> int:
    """In the child: load the notebook, run every check, append each result to the results file."""
    path, assignment, results_file, memory_bytes, check_time_s = argv
    _limit_resources(int(memory_bytes))
    seconds = float(check_time_s)
    signal.signal(signal.SIGALRM, functools.partial(_on_alarm, seconds))
    checks: tuple[Check, ...] = exercise_module(assignment).CHECKS
    with open(results_file, "a") as out:

        def report(result: CheckResult) -> None:
            out.write(json.dumps(result.to_dict()) + "\n")
            out.flush()

        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            submission = load(Path(path), assignment)
        except CheckTimeLimit:
            message = f"not graded: loading the notebook's cells took over {seconds:g} s (an infinite loop?)"
            for check in checks:
                report(CheckResult(check.name, 0, check.points, message))
            return 0
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        results = grade_submission(submission, checks)
        while True:
            signal.setitimer(signal.ITIMER_REAL, seconds)
            try:
                result = next(results, None)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            if result is None:
                return 0
            report(result)


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
