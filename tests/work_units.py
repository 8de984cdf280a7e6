"""Which tests share a test worker under `make test` (pytest-xdist, `-n`).

A test worker is a process of its own, so a module-scoped fixture is made once in every worker that runs a
test of its module. The modules whose fixtures train, launch or grade (`SHARED_MODULE_FIXTURES`) run whole in
one worker; the nbgrader round trip grades one class per assignment, and each assignment's tests run in one
worker (`PER_ASSIGNMENT_MODULES`), so its classes (one per assignment) are graded side by side, each once.

The units go out longest first (`longest_first`, by `EXPECTED_SECONDS`), so that the run does not end on one
worker grading a class while the others have nothing left to do.

xdist's own grouping by mark (`--dist loadgroup`) does not group under pytest 9.2: it renames `item._nodeid`,
which pytest 9 no longer reads. `tests/conftest.py` hands xdist this scheduler instead, which groups by the
test's id.
"""

from __future__ import annotations

import re
from collections import OrderedDict

from xdist.scheduler import LoadScopeScheduling

SHARED_MODULE_FIXTURES = {
    "tests/test_all_to_all.py",
    "tests/test_browser.py",
    "tests/test_check_planner.py",
    "tests/test_exercises_in_sync.py",
    "tests/test_hsdp.py",
    "tests/test_launch.py",
    "tests/test_offload.py",
    "tests/test_plots.py",
    "tests/test_student_release.py",
    "tests/test_torch_backend.py",
    "tests/test_trace.py",
    "tests/test_zeropp.py",
}
"""Test modules whose module-scoped fixtures train, launch or grade: each runs whole in one worker
(tests/test_test_workers.py keeps this list complete)."""
PER_ASSIGNMENT_MODULES = {"tests/test_nbgrader_roundtrip.py"}
"""Modules with a module-scoped fixture per assignment: each assignment's tests run in one worker."""
VENV_WRITERS = ("ex05_writes_a_pth_file_into_the_venv", "test_a_submission_writing_into_the_venv")
"""Tests whose submission writes a file into the shared venv where nothing stops it (graded without the walls),
or that check no such file is there, or remove it: they run in one worker with the round trip's ex05 class
(which grades that submission too), so that no test removes or finds another's file (one worker's control run
once lost its file to another's clean-up)."""
VENV_UNIT = "tests/test_nbgrader_roundtrip.py::ex05"


def work_unit(nodeid: str) -> str:
    """The tests that must run in one worker share a unit: a module of `SHARED_MODULE_FIXTURES`, an assignment
    of a `PER_ASSIGNMENT_MODULES` module, the `VENV_WRITERS`; any other test is a unit of its own."""
    path = nodeid.split("::", 1)[0]
    if any(name in nodeid for name in VENV_WRITERS):
        return VENV_UNIT
    if path in SHARED_MODULE_FIXTURES:
        return path
    assignment = re.search(r"\[(ex\d\d)_", nodeid)
    if path in PER_ASSIGNMENT_MODULES and assignment:
        return f"{path}::{assignment.group(1)}"
    return nodeid


EXPECTED_SECONDS = {
    "tests/test_launch.py": 120,
    "tests/test_student_release.py": 65,
    "tests/test_nbgrader_roundtrip.py::ex08": 65,
    "tests/test_nbgrader_roundtrip.py::ex07": 60,
    "tests/test_nbgrader_roundtrip.py::ex06": 55,
    "tests/test_nbgrader_roundtrip.py::ex09": 50,
    "tests/test_nbgrader_roundtrip.py::ex10": 45,
    "tests/test_browser.py": 35,
    "tests/test_nbgrader_roundtrip.py::ex03": 35,
    "tests/test_nbgrader_roundtrip.py::ex04": 30,
    "tests/test_readme_instructor.py::test_the_instructor_commands_grade_a_class": 30,
    "tests/test_readme_instructor.py::test_a_term_of_two_weeks": 30,
    "tests/test_grading_walls.py::test_the_walls_hold_for_a_grader_who_is_a_normal_user": 20,
    "tests/test_nbgrader_roundtrip.py::ex05": 15,
    "tests/test_autograder_cli.py::test_grade_writes_the_csv_and_feedback_the_same_at_any_jobs": 15,
    "tests/test_grading_integrity.py::test_a_check_is_limited_in_cpu_time": 15,
    "tests/test_lessons.py::test_lesson_runs_top_to_bottom": 15,
    "tests/test_autograder_cli.py::test_a_term_of_two_weeks": 10,
    "tests/test_benchmarks.py::test_bench_bound": 10,
    "tests/test_benchmarks.py::test_bench_step": 10,
    "tests/test_grading_walls.py::test_a_correct_notebook_earns_full_marks": 10,
    "tests/test_nbgrader_roundtrip.py::ex01": 10,
    "tests/test_test_workers.py::test_a_parallel_run": 10,
    "tests/test_benchmarks.py::test_bench_class": 8,
}
"""About how long a unit takes, by the unit (a shared module, a round-trip class) or by the start of its test's id
(then per test), in seconds of a worker's time: rounded from one run of the suite with three workers on the course's
2-core test machine (2026-12-07, 527 s in all). `python -m pytest -n 3 --durations=0` prints them per test (a unit's
is the sum of its tests' setup, call and teardown): a run in a slower hour gave 0.9x to 1.5x these, the same
units the longest, in another order among themselves. Only the order matters: a figure that is off costs the
balance of the workers at the end of a run, never a test. Units not named here count `DEFAULT_SECONDS` a test."""
DEFAULT_SECONDS = 0.5


def expected_seconds(unit: str, nodeids: list[str]) -> float:
    """About how long `unit`, whose tests are `nodeids`, keeps a worker busy (`EXPECTED_SECONDS`)."""
    if unit in EXPECTED_SECONDS:
        return EXPECTED_SECONDS[unit]
    return sum(
        next((s for start, s in EXPECTED_SECONDS.items() if nodeid.startswith(start)), DEFAULT_SECONDS)
        for nodeid in nodeids
    )


def longest_first(units: OrderedDict[str, dict[str, bool]]) -> OrderedDict[str, dict[str, bool]]:
    """xdist's work queue ({unit: {test id: done}}) in the order of `expected_seconds`, longest first; units
    expected to take as long keep their order."""
    return OrderedDict(sorted(units.items(), key=lambda item: -expected_seconds(item[0], list(item[1]))))


class WorkUnitScheduling(LoadScopeScheduling):
    """xdist's scheduling by scope (a unit at a time to the next free worker), with `work_unit` as the scope and
    the units handed out longest first (`longest_first`): the last units of a run are short ones."""

    _ordered = False

    def _split_scope(self, nodeid: str) -> str:
        return work_unit(nodeid)

    def _assign_work_unit(self, node: object) -> None:
        # xdist fills the whole queue before it assigns the first unit: order it then, once
        if not self._ordered:
            self.workqueue = longest_first(self.workqueue)
            self._ordered = True
        super()._assign_work_unit(node)
