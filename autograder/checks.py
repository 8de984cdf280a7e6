"""What a check is, what it returns, and the ways to run one: in a notebook, and for a grade.

A check has two halves, so that a grade can be decided where the student's code never runs:

- `observe(*objects, **kwargs)` runs the student's objects (a class, a function, numbers) and returns
  what it saw as plain JSON data: losses, weights, ledgers, memory observations, returned values. It runs
  wherever the student's code runs, and its data is only evidence: it can be wrong, or forged.
- `judge(observation, **kwargs)` compares that data with what the course's own reference gives, and either
  returns a one-line success message or raises `CheckFailed` with a message that says what was expected,
  what was seen, and where to look. It validates the data first (`ObservationInvalid`): data that is not
  what `observe` makes earns nothing.

`graded(observe, judge)` makes the two into the function a notebook's test cell calls. Each exercise lists
its checks as `Check`s, with the points each is worth and the grade id of the nbgrader test cell that runs
it, so that nbgrader and the `python -m autograder` commands give the same points for the same code.

- In a notebook, a test cell calls the check directly (`grader.check_training(ReduceScatterLinear,
  world_sizes=[2, 4])`): both halves run in the kernel, success prints one line on stdout, failure raises
  `AssertionError`. Whatever the student's code writes to stderr or warns is captured and shown on stdout
  instead, because nbgrader scores a test cell that writes to stderr as failed.
- For a grade (`autograder.sandbox`), a child process runs `observe` and writes the observation; the
  parent, which never runs student code, runs `judge` and assigns the points. `run_check` does both in
  one process (tests), passing the observation through JSON as the child does.

A hidden check's parameters (its world sizes, bucket sizes, ...) are not in the course's files: the grading
parent draws them (`drawn`) from the instructor's secret (`grading_secret`) and hands them to the child as
the check's arguments (`drawn_parameters`, `with_parameters`). A check's `kwargs` are then only what the
solution notebook's hidden test cell calls in an instructor's kernel.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import io
import json
import os
import random
import secrets
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

MAX_CAPTURED_CHARS = 2000


class CheckFailed(AssertionError):
    """A check's verdict: the student's code does not do what the exercise asks; the message says why."""


class ObservationInvalid(CheckFailed):
    """The data a check's `observe` returned is not what it makes: 0 points, whatever it claims."""


IMPOSSIBLE = "the observation cannot be true"


def impossible(what: str) -> ObservationInvalid:
    """The verdict on data that no run of any code makes (a negative peak, a run on other world sizes than
    the check asked for, a list of the wrong length): `what` says which part cannot be true."""
    return ObservationInvalid(f"{IMPOSSIBLE}: {what}: no points")


@dataclass(frozen=True)
class CheckResult:
    """One check's outcome, as the CLI prints it and the grade CSV sums it."""

    name: str
    points: float
    max_points: float
    message: str

    @property
    def passed(self) -> bool:
        return self.points == self.max_points

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Check:
    """One graded check: `function(*objects named in names, **kwargs)`, worth `points`.

    `name` is the grade id of the nbgrader test cell that makes the same call, and `call()` is the code
    that cell runs (the notebooks are tested to contain it).
    """

    name: str
    points: float
    function: Callable[..., str]
    names: tuple[str, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    hidden: bool = False
    draw: Callable[[random.Random], dict[str, Any]] | None = None
    """A hidden check's arguments when graded, drawn from the instructor's secret (`drawn`); checks that
    share a draw get the same arguments, so their runs are made once. `kwargs` are then the call of the
    solution notebook's hidden test cell."""

    def call(self) -> str:
        arguments = list(self.names) + [f"{key}={value!r}" for key, value in self.kwargs.items()]
        return f"grader.{self.function.__name__}({', '.join(arguments)})"


@contextlib.contextmanager
def captured_output() -> Iterator[io.StringIO]:
    """Collect what the student's code writes to stderr or warns, so that nothing reaches stderr."""
    buffer = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(buffer):
        warnings.simplefilter("always")
        try:
            yield buffer
        finally:
            for w in caught:
                buffer.write(warnings.formatwarning(w.message, w.category, w.filename, w.lineno))


def _tail(text: str) -> str:
    text = text.strip()
    return text if len(text) <= MAX_CAPTURED_CHARS else "..." + text[-MAX_CAPTURED_CHARS:]


def through_json(observation: Any) -> Any:
    """The observation as the parent receives it from the child: JSON, nothing else survives."""
    return json.loads(json.dumps(observation))


def graded(name: str, observe: Callable[..., Any], judge: Callable[..., str], doc: str = "") -> Callable[..., None]:
    """The check called `name` that a test cell calls: observe the student's objects, judge the observation,
    in this process. The cell prints the verdict on stdout and raises AssertionError on failure; `.observe`
    and `.judge` are the halves the grader runs in two processes.
    """

    def check(*objects: Any, **kwargs: Any) -> str:
        return judge(through_json(observe(*objects, **kwargs)), **kwargs)

    check.__name__ = check.__qualname__ = name
    check.__doc__ = doc or judge.__doc__
    run_in_cell = notebook_check(check)
    run_in_cell.observe, run_in_cell.judge = observe, judge
    return run_in_cell


def notebook_check(function: Callable[..., str]) -> Callable[..., None]:
    """Make a check callable from a test cell: print the verdict on stdout, raise AssertionError on failure."""

    @functools.wraps(function)
    def run_in_cell(*args: Any, **kwargs: Any) -> None:
        failure = None
        with captured_output() as captured:
            try:
                message = function(*args, **kwargs)
            except CheckFailed as error:
                failure = str(error)
        printed = _tail(captured.getvalue())
        if printed:
            print(f"(your code wrote to stderr or warned; shown here instead)\n{printed}")
        if failure is not None:
            raise AssertionError(failure) from None
        print(f"passed: {message}")

    run_in_cell.check = function
    return run_in_cell


_MACHINERY = (str(Path(__file__).parent), str(Path(traceback.__file__).parent))
"""The grader's and Python's own frames: never where a student's bug is."""
_MACHINERY_PARTS = (
    "/torch/",
    "/zero_core/stages/",
    "/zero_core/variants/",
    "/zero_core/answers/",
    "/zero_core/cluster.py",
)
"""torch's, the reference stages' and the virtual cluster's frames, wherever the course is installed."""


def _is_machinery(filename: str) -> bool:
    return filename.startswith(_MACHINERY) or any(part in filename for part in _MACHINERY_PARTS)


def describe_exception(error: BaseException, limit: int = 3) -> str:
    """`Type: message` and the last frames of the traceback that are not the grader's or torch's machinery."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not _is_machinery(f.filename)]
    where = "".join(traceback.format_list(frames[-limit:])).rstrip()
    text = f"{type(error).__name__}: {error}".rstrip(": ")
    if isinstance(error, NotImplementedError):
        text += " (not done yet: replace `raise NotImplementedError()` with your code)"
    return f"{text}\n{where}" if where else text


@dataclass(frozen=True)
class Observed:
    """What the observing half of a check produced: an observation to judge, or why there is none."""

    observation: Any = None
    failure: str | None = None


def observe_check(check: Check, namespace: dict[str, Any]) -> Observed:
    """Run the observing half on the objects a submission defined; never raises (except KeyboardInterrupt)."""
    missing = [name for name in check.names if name not in namespace]
    if missing:
        return Observed(failure=f"the notebook defines no {', '.join(f'`{name}`' for name in missing)}")
    try:
        with captured_output():
            return Observed(check.function.observe(*(namespace[name] for name in check.names), **check.kwargs))
    except CheckFailed as failure:
        return Observed(failure=str(failure))
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # the student's code may raise anything, SystemExit included
        return Observed(failure=f"the check stopped with {describe_exception(error)}")


ROOT = Path(__file__).resolve().parents[1]
SECRET_FILE = ROOT / ".grading-secret"
"""The instructor's secret (git-ignored, mode 0600), from which the hidden checks' parameters are drawn."""
SECRET_FILE_VARIABLE = "AUTOGRADER_SECRET_FILE"
"""An environment variable naming another file that holds the secret (a copy kept outside the course)."""


def secret_path() -> Path:
    return Path(os.environ.get(SECRET_FILE_VARIABLE) or SECRET_FILE)


def grading_secret(create: bool = False) -> bytes:
    """The secret the hidden checks' parameters are drawn from: the file `secret_path()` names.

    Without that file, `create` makes it (32 random bytes in hex, mode 0600: the instructor's grading does,
    on its first run); otherwise, as in a student's copy of the course, each call returns a fresh random
    secret, so the hidden checks run on other parameters every time and none can be tuned to. A file that
    other users may read is refused: they could compute every hidden parameter from it.
    """
    path = secret_path()
    if create:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as handle:
                handle.write(secrets.token_hex(32) + "\n")
    if not path.exists():
        if SECRET_FILE_VARIABLE in os.environ:
            raise FileNotFoundError(f"{SECRET_FILE_VARIABLE} names {path}, which does not exist")
        return secrets.token_bytes(32)
    if path.stat().st_mode & 0o077:
        raise PermissionError(f"{path} may be read by other users, who could draw the hidden checks: chmod 600 it")
    secret = path.read_bytes().strip()
    if not secret:
        raise ValueError(f"{path} is empty: delete it, and the next grading makes a new secret")
    return secret


def parameter_random(secret: bytes, assignment: str, draw: Callable[..., Any]) -> random.Random:
    """The random numbers `draw` takes for `assignment`: seeded by HMAC-SHA256(secret, assignment/draw)."""
    message = f"{assignment}/{draw.__qualname__}".encode()
    return random.Random(int.from_bytes(hmac.new(secret, message, hashlib.sha256).digest(), "big"))


def drawn(checks: tuple[Check, ...], assignment: str, secret: bytes) -> tuple[Check, ...]:
    """The checks as graded: each check with a `draw` gets the arguments it draws for `assignment` from
    `secret` (as JSON data, what the child receives); the others stay as they are."""
    return tuple(
        replace(check, kwargs=through_json(check.draw(parameter_random(secret, assignment, check.draw))))
        if check.draw
        else check
        for check in checks
    )


def drawn_parameters(checks: tuple[Check, ...]) -> dict[str, dict[str, Any]]:
    """{check name: arguments} of the drawn checks: what the grading parent passes to its child."""
    return {check.name: check.kwargs for check in checks if check.draw}


def with_parameters(checks: tuple[Check, ...], parameters: dict[str, dict[str, Any]]) -> tuple[Check, ...]:
    """In the child: `checks` with the arguments the parent drew (`drawn_parameters`)."""
    drawable = {check.name for check in checks if check.draw}
    if not isinstance(parameters, dict) or not set(parameters) <= drawable:
        raise ValueError(f"grader bug: the parent drew parameters for no such checks: {parameters!r:.200}")
    return tuple(replace(check, kwargs=parameters.get(check.name, check.kwargs)) for check in checks)


def judge_check(check: Check, observation: Any) -> CheckResult:
    """The verdict on an observation, with the check's points or none: never more than `check.points`."""
    try:
        message = check.function.judge(observation, **check.kwargs)
    except CheckFailed as failure:
        return CheckResult(check.name, 0, check.points, str(failure))
    except Exception as error:  # data the judge cannot read is data observe did not make
        return CheckResult(check.name, 0, check.points, f"the observation could not be judged ({error!r})")
    return CheckResult(check.name, check.points, check.points, message)


def run_check(check: Check, namespace: dict[str, Any]) -> CheckResult:
    """Observe and judge in this process, the observation passed through JSON as between two processes."""
    observed = observe_check(check, namespace)
    if observed.failure is not None:
        return CheckResult(check.name, 0, check.points, observed.failure)
    try:
        observation = through_json(observed.observation)
    except (TypeError, ValueError) as error:
        return CheckResult(check.name, 0, check.points, f"the observation is not JSON data ({error})")
    return judge_check(check, observation)


def total(results: list[CheckResult]) -> tuple[float, float]:
    return sum(r.points for r in results), sum(r.max_points for r in results)


def format_points(value: float) -> str:
    return f"{value:g}"


def shared_tail(results: list[CheckResult]) -> list[str]:
    """The lines every failed check's message ends with, where two or more failed (a cell that raised, added
    to each check it cost): said once after the checks rather than once per check."""
    failed = [result.message.splitlines() for result in results if not result.passed]
    if len(failed) < 2:
        return []
    tail: list[str] = []
    while all(len(lines) > len(tail) + 1 for lines in failed) and len({lines[-1 - len(tail)] for lines in failed}) == 1:
        tail.insert(0, failed[0][-1 - len(tail)])
    return tail


def results_text(results: list[CheckResult]) -> str:
    """Every check's points and message, a line each (continuation lines indented), what every failed check
    shares said once at the end."""
    tail = shared_tail(results)
    out = []
    for result in results:
        lines = result.message.splitlines() or [""]
        if tail and not result.passed:
            lines = lines[: len(lines) - len(tail)]
        out.append(f"[{format_points(result.points)}/{format_points(result.max_points)}] {result.name}: {lines[0]}")
        out += [f"      {line}" for line in lines[1:]]
    if tail:
        out.append("every check that failed above also failed because:")
        out += [f"      {line}" for line in tail]
    return "\n".join(out) + "\n"


def print_results(results: list[CheckResult], out: Any = sys.stdout) -> None:
    out.write(results_text(results))
