"""The grader grades what it should: solutions earn every point, untouched exercises none, and each wrong
submission in tests/fixtures/wrong loses exactly the checks its header names, with a message that says why.
The nbgrader round trip (tests/test_nbgrader_roundtrip.py) grades some of these notebooks inside the walls and
holds them to the same: the solution and the untouched release of each assignment it sets, and the fixtures it
hands in that break no rule for graded cells (`tests.round_trip_class.held_by_the_round_trip`). They are graded
there, not a second time here.

A fixture that breaks a rule for graded cells (its header's `RULES`) loses every check before anything runs
(tests/test_graded_cell_policy.py); here it is graded with the rules set aside, so that what its header names
is the work of the nets behind them: the run-time checks, the shard a student receives, the walls, the judge."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from autograder import sandbox
from autograder.checks import CheckResult, total
from autograder.harness import CONFIG
from autograder.integrity import StudentShard
from autograder.sandbox import Limits, grade_notebook, grade_submission
from autograder.submission import EXERCISES, exercise_module, load
from tests.fixture_text import read_fixture, wrong_fixtures
from tests.round_trip_class import ASSIGNMENTS as ROUND_TRIP_ASSIGNMENTS
from tests.round_trip_class import held_by_the_round_trip
from tests.solution_notebooks import solution_notebook, with_cell
from zero_core.cluster import VirtualCluster
from zero_core.stages import Zero2, Zero3

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "wrong"


def marker(assignment: str) -> pytest.MarkDecorator:
    return getattr(pytest.mark, assignment[:4])


def release_notebook(assignment: str) -> Path:
    return ROOT / "exercises" / assignment / f"{assignment}.ipynb"


def grade_in_process(notebook: Path, behind_the_rules: bool = False) -> list[CheckResult]:
    """What the CLI's child process does, in this process: load the cells, run every check; `behind_the_rules`:
    as if the cells broke no rule for graded cells."""
    submission = load(notebook)
    if behind_the_rules:
        submission.integrity_problems = []
    return list(grade_submission(submission, exercise_module(submission.assignment).CHECKS))


@dataclass(frozen=True)
class WrongSubmission:
    """One fixture of tests/fixtures/wrong: its header, and the cell it puts in place of a solution cell."""

    path: Path
    exercise: str
    cell: str
    loses: frozenset[str]
    message: str
    child: bool
    source: str
    rules: str | None = None
    """A phrase of the rules' verdict on the cell, if it breaks a rule for graded cells."""
    writes: str | None = None
    """A file the submission writes where it can (its header's `WRITES`): removed after each grade here."""

    @classmethod
    def read(cls, path: Path) -> WrongSubmission:
        meta, source = read_fixture(path)
        return cls(
            path,
            meta["EXERCISE"],
            meta["CELL"],
            frozenset(meta["LOSES"]),
            meta["MESSAGE"],
            meta["CHILD"],
            source,
            meta.get("RULES"),
            meta.get("WRITES"),
        )

    def notebook(self, directory: Path) -> Path:
        """The solution notebook with this submission's cell in place of `cell`."""
        return with_cell(self.exercise, self.cell, self.source, directory / self.exercise / f"{self.exercise}.ipynb")


WRONG = [WrongSubmission.read(path) for path in wrong_fixtures()]
UNUSUAL = [WrongSubmission.read(path) for path in sorted((ROOT / "tests" / "fixtures" / "correct").glob("*.py"))]


def wrong_params(child: bool) -> list:
    return [
        pytest.param(w, id=w.path.stem, marks=marker(w.exercise))
        for w in WRONG
        if w.child == child and not held_by_the_round_trip(w.path)
    ]


def child_params() -> list:
    """(fixture, walled) for each fixture only a child can grade, with the audit hook alone and inside the walls,
    where the round trip does not grade it inside the walls already."""
    return [
        pytest.param(w, walled, id=f"{w.path.stem}-{'walls' if walled else 'audit-hook-only'}",
                     marks=marker(w.exercise))
        for w in WRONG
        if w.child
        for walled in (True, False)
        if not (walled and held_by_the_round_trip(w.path))
    ]


NOT_IN_THE_ROUND_TRIP = [pytest.param(a, marks=marker(a)) for a in EXERCISES if a not in ROUND_TRIP_ASSIGNMENTS]
"""The assignments whose solution and release the round trip does not grade."""


def assert_loses_exactly(wrong: WrongSubmission, results: list[CheckResult]) -> None:
    lost = {r.name for r in results if not r.passed}
    assert lost == wrong.loses, f"{wrong.path.name}: lost {sorted(lost)}, expected {sorted(wrong.loses)}\n" + "\n".join(
        f"{r.name}: {r.message}" for r in results
    )
    first_lost = next((r for r in results if not r.passed), None)
    assert first_lost is None or wrong.message in first_lost.message, first_lost.message


@pytest.mark.parametrize("assignment", NOT_IN_THE_ROUND_TRIP)
def test_the_solution_earns_every_point(assignment: str) -> None:
    results = grade_in_process(solution_notebook(assignment))
    assert [r.message for r in results if not r.passed] == []
    assert total(results) == (10, 10)


@pytest.mark.parametrize("assignment", NOT_IN_THE_ROUND_TRIP)
def test_the_untouched_exercise_earns_nothing_and_says_it_is_not_done(assignment: str) -> None:
    results = grade_in_process(release_notebook(assignment))
    assert total(results) == (0, 10)
    assert all("NotImplementedError" in r.message for r in results), [r.message for r in results]


@pytest.mark.parametrize("wrong", wrong_params(child=False))
def test_a_wrong_submission_loses_exactly_its_checks(wrong: WrongSubmission, tmp_path: Path) -> None:
    assert_loses_exactly(wrong, grade_in_process(wrong.notebook(tmp_path), behind_the_rules=wrong.rules is not None))


@pytest.mark.parametrize(
    "unusual",
    [pytest.param(u, id=u.path.stem, marks=marker(u.exercise)) for u in UNUSUAL if not held_by_the_round_trip(u.path)],
)
def test_a_correct_but_unusual_submission_earns_every_point(unusual: WrongSubmission, tmp_path: Path) -> None:
    results = grade_in_process(unusual.notebook(tmp_path))
    assert [r.message for r in results if not r.passed] == []
    assert total(results) == (10, 10)


@pytest.mark.parametrize("wrong, walled", child_params())
def test_a_submission_graded_in_a_child_process_loses_exactly_its_checks(
    wrong: WrongSubmission, walled: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Loops, exits and attacks on a grader beside them: graded as the CLI grades, with the child in
    namespaces of its own where this machine makes them, and with the audit hook alone (a laptop)."""
    if wrong.rules is not None:
        monkeypatch.setattr(sandbox, "reference_uses", lambda path, assignment: [])
    if "in_function" in wrong.path.stem or "infinite_loop" in wrong.path.stem:
        # a check's limit is CPU time: the loops stop after 1.5 CPU seconds each (ex01's other checks take a
        # tenth of that), later on a loaded machine; a loop while the notebook loads, at the child's 3 s
        seconds = {"time_s": 30, "check_time_s": 1.5} if "in_function" in wrong.path.stem else {"time_s": 3}
    else:  # a run that finishes: room for a loaded machine (ex03's takes about 5 s on two idle cores)
        seconds = {"time_s": 60}
    limits = Limits(walls=walled, **seconds)
    try:
        assert_loses_exactly(wrong, grade_notebook(wrong.notebook(tmp_path), limits=limits))
    finally:  # without the walls a file written into the venv would stay for every later test to find
        if wrong.writes:
            Path(wrong.writes).unlink(missing_ok=True)


PAUSES_THEN_WAITS_FOREVER = """
import time

calls = []


def ring_bytes_sent(op: str, numel: int, element_size: int, world_size: int) -> int:
    calls.append(op)
    if len(calls) == 1:
        time.sleep({pause})  # the visible check's first call: a pause that uses no CPU
    if len(calls) > {visible_calls}:
        time.sleep(10**6)  # the hidden check: waits for good
    chunks = {{"reduce_scatter": 1, "all_gather": 1, "all_reduce": 2}}[op] * (world_size - 1)
    return chunks * -(-numel // world_size) * element_size
"""


def test_a_check_is_limited_in_cpu_time_and_one_that_waits_in_wall_clock_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`check_time_s` is the CPU time a check may use, so the waits a loaded machine adds cost no points: a
    check that pauses longer than its limit without using the CPU keeps them. Code that waits for good is
    stopped at `CHECK_WALL_FACTOR` times the limit in wall-clock time, and costs its own check only. (The
    cell imports `time`, which the rules for graded cells refuse: they are set aside here.)"""
    from autograder.ex01 import VISIBLE_WORLD_SIZES, _ring_calls

    monkeypatch.setattr(sandbox, "reference_uses", lambda path, assignment: [])
    limit_s = 2.0
    cell = PAUSES_THEN_WAITS_FOREVER.format(pause=2 * limit_s, visible_calls=len(_ring_calls(VISIBLE_WORLD_SIZES)))
    submission = WrongSubmission(solution_notebook("ex01_collectives"), "ex01_collectives", "ring_bytes_sent",
                                 frozenset(), "", True, cell)
    results = grade_notebook(submission.notebook(tmp_path), limits=Limits(walls=False, time_s=60,
                                                                           check_time_s=limit_s))
    lost = {r.name: r.message for r in results if not r.passed}
    assert list(lost) == ["test_hidden_ring_bytes"], lost
    assert f"did not finish within {sandbox.CHECK_WALL_FACTOR * limit_s:g} s, using little CPU" in lost[
        "test_hidden_ring_bytes"], lost


def test_every_assignment_has_a_wrong_submission_and_no_fixture_is_misnamed() -> None:
    assert {w.exercise for w in WRONG} == set(EXERCISES)
    for wrong in WRONG:
        assert wrong.path.stem.startswith(wrong.exercise[:4]), wrong.path.name
        checks = {c.name for c in exercise_module(wrong.exercise).CHECKS}
        assert wrong.loses <= checks, f"{wrong.path.name} names unknown checks {sorted(wrong.loses - checks)}"


def documented_shard_attributes(assignment: str) -> list[str]:
    """The attributes the exercise's table "What the `shard` argument holds" promises a student."""
    notebook = json.loads(solution_notebook(assignment).read_text())
    (contract,) = [
        "".join(c["source"]) for c in notebook["cells"] if "What the `shard` argument holds" in "".join(c["source"])
    ]
    return re.findall(r"^\| `(\w+)` \|", contract, re.MULTILINE)


@pytest.mark.parametrize("stage_cls", [Zero2, Zero3], ids=["zero2", "zero3"])
def test_the_shard_a_student_receives_has_every_attribute_the_exercise_documents(stage_cls) -> None:
    documented = documented_shard_attributes("ex03_zero2_reduce_scatter_backward")
    assert {"name", "partition", "grad", "tracker"} <= set(documented)
    expected = documented + (["param"] if stage_cls is Zero3 else [])  # exercise 4 adds `shard.param`

    def missing_attributes() -> list[str]:
        shard = StudentShard(next(iter(stage_cls(CONFIG).shards.values())), "ex03")
        return [name for name in expected if getattr(shard, name, None) is None]

    assert VirtualCluster(2).run(missing_attributes) == [[], []]
