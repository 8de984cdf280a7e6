"""Grade one notebook: the student's code runs in a walled child process, the points are decided in this one.

`grade_notebook(path)` first reads the notebook's solution cells as text and checks them against the
course's policy for graded cells (`submission.reference_uses`: a parse, nothing runs). Then it starts the
child, `python -I` with the course first on its path, inside the operating system's walls
(`autograder.walls`: bubblewrap, an allowlisted read-only root without the answers, uid 65534, no
capabilities, seccomp). The child limits its own address space (`RLIMIT_AS`), loads the solution cells
(`autograder.submission`) and runs the observing half of every check (`Check.function.observe`), writing
each observation, or why there is none, as one JSON line to a pipe the parent reads (at most
`MAX_RESULTS_BYTES`). The parent waits up to the time limit, then kills the child's whole process group,
and judges each observation itself (`Check.function.judge`), against reference runs it makes itself: the
child's data is evidence, never a verdict. Whatever the child writes, a check earns at most its own
points, once: the first line for a check counts, malformed data earns nothing.

Checks without an observation get 0 points and a message saying why: the time limit (an infinite loop),
the process dying (`os._exit`, a crash, the memory limit; `sys.exit` only costs the check that called it).
Inside the child, each check also has its own limit, in CPU time (`CHECK_WALL_FACTOR`), and the virtual
cluster's deadlines stop ranks that loop or wait for each other, so one bad check rarely costs the others.

`Limits(walls=False)` runs the child as a plain process of the grader's user, with the audit hook
(`autograder.child_guard`) as its only fence: a tripwire, not a wall. The CLI and nbgrader use it only
when asked (`--no-walls`), and mark every grade made so.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from autograder import child_guard, recorded, reference_store, walls
from autograder.checks import (
    Check,
    CheckResult,
    ObservationInvalid,
    Observed,
    drawn,
    drawn_parameters,
    grading_secret,
    judge_check,
    observe_check,
    run_check,
    secret_path,
    through_json,
    with_parameters,
)
from autograder.child_process import ChildRun, MiB, run_child
from autograder.integrity import verdict
from autograder.submission import (
    RELEASE_DIR,
    Submission,
    assignment_of,
    cells_name_torch,
    exercise_module,
    load,
    reference_uses,
    unreadable,
)
from zero_core.long_lived import freeze_what_is_loaded

if TYPE_CHECKING:
    from autograder.witness import Witness

ROOT = Path(__file__).resolve().parents[1]
CHILD_ENVIRONMENT = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MALLOC_ARENA_MAX": "2",
    "MALLOC_MMAP_THRESHOLD_": "131072",
}
"""One compute thread per process and few malloc arenas: the address space a correct submission needs
(under 1 GB) then does not grow with the machine's core count, so one memory limit fits every machine.
Every allocation of 128 KiB or more is its own mapping, returned to the kernel when freed (glibc's
threshold, fixed: by default it rises after the first free, and freed buffers then stay resident): the
kernel's count of a child's memory (`autograder.kernel_memory`) follows what is alive, not what a
correct submission's temporaries left behind (one that logs each gradient's fp32 norm ran 94 to 203 MiB
above the reference with the default, 3 to 37 MiB with this)."""


@dataclass(frozen=True)
class Limits:
    """Per notebook: wall-clock seconds for the child, its address-space bytes, CPU seconds per check (and
    `CHECK_WALL_FACTOR` times that of wall-clock time), and whether the child runs inside the operating
    system's walls (`autograder.walls`)."""

    time_s: float = 180.0
    memory_bytes: int = 4096 * MiB
    check_time_s: float = 90.0
    walls: bool = True
    """True: inside the walls, or `WallsUnavailable` where this machine cannot build them. False: a plain
    child process with the audit hook (`child_guard`) as its only fence; a grade made so is marked."""


class CheckTimeLimit(BaseException):
    """Raised in the child by the per-check clocks (a BaseException, so `except Exception` cannot swallow it):
    `seconds` of CPU time spent (`on_cpu`), or `CHECK_WALL_FACTOR` times that of wall-clock time."""

    def __init__(self, seconds: float, on_cpu: bool) -> None:
        super().__init__(seconds, on_cpu)
        self.seconds, self.on_cpu = seconds, on_cpu

    def describe(self, what: str) -> str:
        if self.on_cpu:
            return f"{what} did not finish within {self.seconds:g} s of CPU time (an infinite loop?)"
        return (
            f"{what} did not finish within {CHECK_WALL_FACTOR * self.seconds:g} s, using little CPU: it waits for "
            "something that never comes (a sleep, a lock, an event)?"
        )

    def __str__(self) -> str:
        return self.describe("this check")


def _missing_message(run: ChildRun, limits: Limits) -> str:
    """Why a check has no observation: the time limit, or how the process ended, with its peak memory as the
    kernel counted it (so a student can tell an exit from the memory limit) and the end of its stderr."""
    returncode, timed_out, stderr_tail = run.returncode, run.timed_out, run.stderr_tail
    if timed_out:
        return (
            f"not graded: the notebook hit the time limit of {limits.time_s:g} s before this check "
            "(an infinite loop, or code far slower than needed)"
        )
    if returncode is not None and returncode < 0:
        reason = f"was killed by signal {-returncode}"
    else:
        reason = f"exited with code {returncode}"
    hint = (
        f"does the code call sys.exit or os._exit, or exceed the memory limit? It held up to "
        f"{run.peak_rss_bytes / MiB:,.0f} MiB; the limit is {limits.memory_bytes / MiB:,.0f} MiB of address space"
    )
    tail = f"\nlast lines on stderr:\n{stderr_tail}" if stderr_tail else ""
    return f"not graded: the grading process {reason} before this check ({hint}){tail}"


MAX_MESSAGE_CHARS = 4000
"""A failure message written by the child is shown to the student, truncated to this."""
MAX_CELL_ERRORS = 20
"""At most this many of the child's cell errors are added to a failed check's message."""


def grade_notebook(
    path: Path,
    assignment: str | None = None,
    limits: Limits = Limits(),
    protected: tuple[Path, ...] = (),
    secret: bytes | None = None,
) -> list[CheckResult]:
    """Every check of the notebook's assignment, observed in a child process and judged here; never raises
    for the notebook. The hidden checks' parameters are drawn here from `secret` (`checks.drawn`; the
    instructor's secret file, or a fresh random one where there is none) and handed to the child. Without
    walls, the child's audit hook refuses it the `protected` paths (grades, feedback, the secret); inside
    them, those paths do not exist for it."""
    path = Path(path).resolve()
    assignment = assignment or assignment_of(path)
    exercise = exercise_module(assignment)
    if recorded.replaying():  # a student release: the hidden checks run when the instructor grades
        checks: tuple[Check, ...] = tuple(check for check in exercise.CHECKS if not check.hidden)
    else:
        checks = drawn(exercise.CHECKS, assignment, grading_secret() if secret is None else secret)
    not_a_notebook = unreadable(path)
    if not_a_notebook:
        return [CheckResult(check.name, 0, check.points, f"not graded: {not_a_notebook}") for check in checks]
    problems = reference_uses(path, assignment)
    if problems:
        message = verdict(problems, assignment)
        return [CheckResult(check.name, 0, check.points, message) for check in checks]
    answers = walls.module_files(exercise.ANSWER_MODULES)
    built = walls.require() if limits.walls else None
    with tempfile.TemporaryDirectory(prefix="autograder-") as tmp:
        notebook = Path(tmp) / "submission" / path.name
        notebook.parent.mkdir()
        shutil.copyfile(path, notebook)
        results_read, results_write = os.pipe()
        witness, witness_fd = start_witness(exercise)
        arguments = [str(notebook), assignment, str(results_write), str(limits.memory_bytes), str(limits.check_time_s),
                     str(witness_fd), json.dumps(drawn_parameters(checks))]
        command = [sys.executable, "-I", "-c", CHILD_BOOT, *arguments]
        if built is not None:
            readable = [*walls.course_files(excluded=answers), RELEASE_DIR / assignment / f"{assignment}.ipynb",
                        notebook.parent]
            command, seccomp_fd = built.wrap(command, readable, dict(WALLED_ENVIRONMENT))
            env = None
        else:
            seccomp_fd = -1
            env = dict(os.environ, **CHILD_ENVIRONMENT)
            hidden = (*protected, *answers, secret_path(), reference_store.location())
            env[child_guard.PROTECTED_VARIABLE] = os.pathsep.join(str(p.resolve()) for p in hidden)
        passed = tuple(fd for fd in (witness_fd, seccomp_fd) if fd >= 0)
        preparing = threading.Thread(target=prepare_judges, args=(exercise, checks), name="prepare-judges")
        preparing.start()
        run = run_child(command, env, limits.time_s, (results_read, results_write), passed)
        preparing.join()
        if witness is not None:
            witness.join(timeout=WITNESS_JOIN_S)
            witness.measure(run.peak_since)
    observed = read_observations(run.results, {check.name for check in checks})
    missing = _missing_message(run, limits)
    cell_errors = observed.pop(CELL_ERRORS, Observed(observation=[])).observation
    with JUDGES_TAKE_TURNS:
        return [judge_observed(check, observed.get(check.name), missing, cell_errors, witness) for check in checks]


JUDGES_TAKE_TURNS = threading.Lock()
"""Held while a notebook's judges run or prepare, in this process: `grade --jobs` grades several notebooks at
once from threads of one parent, and the judges' reference runs share its caches (`harness.run_once`,
`functools.cache`) and torch's thread count, which each run sets to 1 and restores; two at once could make
the same reference twice, or change the count under the other. The children, where the time goes, still run
side by side, and a reference made once is then read from the cache."""


def prepare_judges(exercise: ModuleType, checks: tuple[Check, ...]) -> None:
    """While the child runs the student's code, make what the judges read that does not depend on it (an
    exercise's `prepare`: reference runs, the oracle's, the kernel's reference figures): the parent otherwise
    waits idle for the child, then makes them one after another. Only the course's code runs here."""
    prepare = getattr(getattr(exercise, "EXERCISE", None), "prepare", None)
    if prepare is None:
        return
    with JUDGES_TAKE_TURNS:
        for check in checks:
            try:
                prepare(check)
            except Exception:  # the judge that needs it makes it again, and reports the failure
                continue


def start_witness(exercise: ModuleType) -> tuple[Witness | None, int]:
    """The witness of the child's graded runs and the descriptor of its link, for an exercise whose checks
    train (its module uses `autograder.harness`); (None, -1) for one whose checks only call functions."""
    if not any(getattr(value, "__module__", None) == "autograder.harness" for value in vars(exercise).values()):
        return None, -1
    from autograder import witness

    return witness.start()


WITNESS_JOIN_S = 10.0
"""How long the parent waits, once the child is gone, for the witness to read the link's last messages."""
CHILD_BOOT = (
    f"import sys; sys.path.insert(0, {str(ROOT)!r}); from autograder.sandbox import child_main; "
    "sys.exit(child_main(sys.argv[1:]))"
)
"""The child's whole program: `python -I` (no PYTHONPATH, no user site) with the course first on its path."""
WALLED_ENVIRONMENT = {
    **CHILD_ENVIRONMENT,
    "PATH": "/usr/bin:/bin",
    "HOME": walls.SANDBOX_HOME,
    "TMPDIR": walls.SANDBOX_HOME,
    "MPLCONFIGDIR": walls.SANDBOX_HOME,
    "LANG": "C.UTF-8",
}
"""The walled child's whole environment: nothing of the grader's (no key, no token, no path) reaches it."""


CELL_ERRORS = "<cell errors>"


def read_observations(data: bytes, names: set[str]) -> dict[str, Observed]:
    """The first observation (or failure) the child wrote for each known check; anything else is ignored."""
    observed: dict[str, Observed] = {}
    for line in data.decode("utf-8", errors="replace").splitlines():
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


def judge_observed(
    check: Check, observed: Observed | None, missing: str, cell_errors: object, witness: Witness | None = None
) -> CheckResult:
    """The check's result from what the child observed: judged here, 0 points without an observation. Every
    graded run in the observation is first held against what the `witness` carried (`verify_runs`)."""
    if observed is None:
        result = CheckResult(check.name, 0, check.points, missing)
    elif observed.failure is not None:
        result = CheckResult(check.name, 0, check.points, observed.failure)
    else:
        try:
            observation = observed.observation
            if witness is not None:
                from autograder.witness import verify_runs

                observation = verify_runs(observation, witness)
        except ObservationInvalid as error:
            result = CheckResult(check.name, 0, check.points, str(error))
        else:
            result = judge_check(check, observation)
    listed = cell_errors[:MAX_CELL_ERRORS] if isinstance(cell_errors, list) else []
    errors = [e[:MAX_MESSAGE_CHARS] for e in listed if isinstance(e, str)]
    if not result.passed and errors:
        result = CheckResult(result.name, 0, result.max_points, "\n".join([result.message, *errors]))
    return result


CHECK_WALL_FACTOR = 4
"""A check's limit (`Limits.check_time_s`) counts the CPU time the child spends on it (all its threads):
what the check's code did, however loaded the machine. Wall-clock time would also count the waits a loaded
machine adds, and the grading parent's own work (its reference runs beside the child, the witness that
carries the child's collectives): a correct ex08 notebook lost its memory check to a 30 s wall-clock limit
in a loaded test run. Code that waits without using the CPU (a sleep, a lock nobody releases) is stopped at
this many times the limit in wall-clock seconds instead."""


def _on_alarm(seconds: float, signum: int, frame: object) -> None:
    raise CheckTimeLimit(seconds, on_cpu=signum == signal.SIGPROF)


def _start_check_clocks(seconds: float) -> None:
    """The per-check limits: `seconds` of the child's CPU time, `CHECK_WALL_FACTOR` times that of wall time."""
    signal.setitimer(signal.ITIMER_PROF, seconds)
    signal.setitimer(signal.ITIMER_REAL, CHECK_WALL_FACTOR * seconds)


def _stop_check_clocks() -> None:
    signal.setitimer(signal.ITIMER_PROF, 0)
    signal.setitimer(signal.ITIMER_REAL, 0)


def limit_resources(memory_bytes: int) -> None:
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
    path, assignment, results_fd, memory_bytes, check_time_s, witness_fd, parameters = argv
    limit_resources(int(memory_bytes))
    seconds = float(check_time_s)
    for clock in (signal.SIGPROF, signal.SIGALRM):
        signal.signal(clock, functools.partial(_on_alarm, seconds))
    exercise = exercise_module(assignment)
    checks: tuple[Check, ...] = with_parameters(exercise.CHECKS, json.loads(parameters))
    loaded = sorted(set(exercise.ANSWER_MODULES) & set(sys.modules))
    if loaded:
        raise RuntimeError(f"grader bug: the grading child loaded the reference answers {loaded}")
    if int(witness_fd) >= 0:
        from autograder import harness
        from zero_core.backends.witnessed import connect

        harness.use_witness(connect(int(witness_fd)))
    with os.fdopen(int(results_fd), "w") as out:

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

        if cells_name_torch(Path(path), assignment):  # its native libraries load before the hook refuses ctypes
            import torch  # noqa: F401

        freeze_what_is_loaded()
        child_guard.install()
        _start_check_clocks(seconds)
        try:
            submission = load(Path(path), assignment, rules=False)
        except CheckTimeLimit as error:
            message = "not graded: " + error.describe("loading the notebook's cells")
            for check in checks:
                report(check.name, Observed(failure=message))
            return 0
        finally:
            _stop_check_clocks()
        report(CELL_ERRORS, Observed(observation=submission.cell_errors))
        # The check whose sized run the kernel measures goes first: nothing other runs left counts in its figure.
        for check in sorted(checks, key=lambda c: not getattr(c.function, "measured_by_the_kernel", False)):
            _start_check_clocks(seconds)
            try:
                observed = observe_check(check, submission.namespace)
            except CheckTimeLimit as error:
                observed = Observed(failure=str(error))
            finally:
                _stop_check_clocks()
            report(check.name, observed)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
