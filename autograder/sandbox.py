"""Grade one notebook: the student's code runs in a child process, the points are decided in this one.

`grade_notebook(path)` first reads the notebook's solution cells as text and looks for uses of the
reference implementation (`submission.reference_uses`: a parse, nothing runs). Then it starts
`python -m autograder.sandbox` (the same interpreter), which limits its own address space
(`RLIMIT_AS`), loads the solution cells (`autograder.submission`) and runs the observing half of every
check (`Check.function.observe`), appending each observation, or why there is none, to a JSON-lines
file as soon as it is known. The parent waits up to the time limit, then kills the child's whole process
group, reads the file and judges each observation itself (`Check.function.judge`), against reference
runs it makes itself: the child's data is evidence, never a verdict. Whatever the child writes, a check
earns at most its own points, once: the first line for a check counts, malformed data earns nothing.

Checks without an observation get 0 points and a message saying why: the time limit (an infinite loop),
the process dying (`os._exit`, a crash, the memory limit; `sys.exit` only costs the check that called it).
Inside the child, each check also has its own alarm, and the virtual cluster's deadlines stop ranks that
loop or wait for each other, so one bad check rarely costs the others.

The child still runs with the grader's permissions: it can read what the grader can read. What keeps a
submission from the answers is the subject of the README's section on the grader's trust boundary.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from autograder import child_guard
from autograder.checks import (
    Check,
    CheckResult,
    Observed,
    judge_check,
    observe_check,
    run_check,
    through_json,
)
from autograder.integrity import verdict
from autograder.isolation import module_files, namespaced
from autograder.submission import Submission, assignment_of, exercise_module, load, reference_uses, unreadable

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
    isolate: bool = True
    """Run the child in namespaces of its own where this machine can (`autograder.isolation`)."""


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


MAX_MESSAGE_CHARS = 4000
"""A failure message written by the child is shown to the student, truncated to this."""
MAX_CELL_ERRORS = 20
"""At most this many of the child's cell errors are added to a failed check's message."""


def grade_notebook(
    path: Path, assignment: str | None = None, limits: Limits = Limits(), protected: tuple[Path, ...] = ()
) -> list[CheckResult]:
    """Every check of the notebook's assignment, observed in a child process and judged here; never raises
    for the notebook. The child may neither read nor write the `protected` paths (grades, feedback)."""
    path = Path(path).resolve()
    assignment = assignment or assignment_of(path)
    exercise = exercise_module(assignment)
    checks: tuple[Check, ...] = exercise.CHECKS
    protected = tuple(protected) + module_files(exercise.ANSWER_MODULES)
    not_a_notebook = unreadable(path)
    if not_a_notebook:
        return [CheckResult(check.name, 0, check.points, f"not graded: {not_a_notebook}") for check in checks]
    problems = reference_uses(path, assignment)
    if problems:
        message = verdict(problems, assignment)
        return [CheckResult(check.name, 0, check.points, message) for check in checks]
    with tempfile.TemporaryDirectory(prefix="autograder-") as tmp:
        results_file, stdout_file, stderr_file = (Path(tmp) / name for name in ("results.jsonl", "stdout", "stderr"))
        notebook = Path(tmp) / "submission" / path.name
        notebook.parent.mkdir()
        shutil.copyfile(path, notebook)
        env = dict(os.environ, **CHILD_ENVIRONMENT)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env[child_guard.PROTECTED_VARIABLE] = os.pathsep.join(str(p.resolve()) for p in protected)
        command = [
            sys.executable,
            "-m",
            "autograder.sandbox",
            str(notebook),
            assignment,
            str(results_file),
            str(limits.memory_bytes),
            str(limits.check_time_s),
        ]
        if limits.isolate:
            command = namespaced(command, protected=tuple(p.resolve() for p in protected)) or command
        with stdout_file.open("wb") as out, stderr_file.open("wb") as err:
            child = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                cwd=notebook.parent,
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
        observed = read_observations(results_file, {check.name for check in checks})
        stderr_tail = _tail(stderr_file)
    missing = _missing_message(child.returncode, timed_out, limits, stderr_tail)
    cell_errors = observed.pop(CELL_ERRORS, Observed(observation=[])).observation
    return [judge_observed(check, observed.get(check.name), missing, cell_errors) for check in checks]


CELL_ERRORS = "<cell errors>"


def read_observations(path: Path, names: set[str]) -> dict[str, Observed]:
    """The first observation (or failure) the child wrote for each known check; anything else is ignored."""
    observed: dict[str, Observed] = {}
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return observed
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("check"), str):
            continue
        name = record["check"]
        if (name not in names and name != CELL_ERRORS) or name in observed:
            continue
        if isinstance(record.get("failure"), str):
            observed[name] = Observed(failure=record["failure"][:MAX_MESSAGE_CHARS])
        elif "observation" in record:
            observed[name] = Observed(observation=record["observation"])
    return observed


def judge_observed(check: Check, observed: Observed | None, missing: str, cell_errors: object) -> CheckResult:
    """The check's result from what the child observed: judged here, 0 points without an observation."""
    if observed is None:
        result = CheckResult(check.name, 0, check.points, missing)
    elif observed.failure is not None:
        result = CheckResult(check.name, 0, check.points, observed.failure)
    else:
        result = judge_check(check, observed.observation)
    listed = cell_errors[:MAX_CELL_ERRORS] if isinstance(cell_errors, list) else []
    errors = [e[:MAX_MESSAGE_CHARS] for e in listed if isinstance(e, str)]
    if not result.passed and errors:
        result = CheckResult(result.name, 0, result.max_points, "\n".join([result.message, *errors]))
    return result


def _on_alarm(seconds: float, signum: int, frame: object) -> None:
    raise CheckTimeLimit(f"this check did not finish within {seconds:g} s (an infinite loop?)")


def _limit_resources(memory_bytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def grade_submission(submission: Submission, checks: tuple[Check, ...]) -> Iterator[CheckResult]:
    """Each check's result for a submission loaded in this process (observed and judged here, the
    observation passed through JSON): 0 everywhere if it uses the reference implementation, and the
    failing cells' errors added to the messages of the checks they cost."""
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
    """In the child: load the notebook, observe every check, append each observation to the results file."""
    path, assignment, results_file, memory_bytes, check_time_s = argv
    _limit_resources(int(memory_bytes))
    seconds = float(check_time_s)
    signal.signal(signal.SIGALRM, functools.partial(_on_alarm, seconds))
    exercise = exercise_module(assignment)
    checks: tuple[Check, ...] = exercise.CHECKS
    loaded = sorted(set(exercise.ANSWER_MODULES) & set(sys.modules))
    if loaded:
        raise RuntimeError(f"grader bug: the grading child loaded the reference answers {loaded}")
    with open(results_file, "a") as out:

        def report(name: str, observed: Observed) -> None:
            if observed.failure is not None:
                record = {"check": name, "failure": observed.failure}
            else:
                try:
                    record = {"check": name, "observation": through_json(observed.observation)}
                except (TypeError, ValueError) as error:
                    record = {"check": name, "failure": f"the observation is not JSON data ({error})"}
            out.write(json.dumps(record) + "\n")
            out.flush()

        child_guard.install()
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            submission = load(Path(path), assignment)
        except CheckTimeLimit:
            message = f"not graded: loading the notebook's cells took over {seconds:g} s (an infinite loop?)"
            for check in checks:
                report(check.name, Observed(failure=message))
            return 0
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        report(CELL_ERRORS, Observed(observation=submission.cell_errors))
        for check in checks:
            signal.setitimer(signal.ITIMER_REAL, seconds)
            try:
                observed = observe_check(check, submission.namespace)
            except CheckTimeLimit as error:
                observed = Observed(failure=str(error))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            report(check.name, observed)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
