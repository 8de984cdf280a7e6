"""Which tests share a test worker under `make test` (pytest-xdist, `-n`).

A test worker is a process of its own, so a module-scoped fixture is made once in every worker that runs a
test of its module. The modules whose fixtures train, launch or grade (`SHARED_MODULE_FIXTURES`) run whole in
one worker; the nbgrader round trip grades one class per assignment, and each assignment's tests run in one
worker (`PER_ASSIGNMENT_MODULES`), so its classes (one per assignment) are graded side by side, each once.

xdist's own grouping by mark (`--dist loadgroup`) does not group under pytest 9.2: it renames `item._nodeid`,
which pytest 9 no longer reads. `tests/conftest.py` hands xdist this scheduler instead, which groups by the
test's id.
"""

from __future__ import annotations

import re

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


class WorkUnitScheduling(LoadScopeScheduling):
    """xdist's scheduling by scope (a unit at a time to the next free worker, the largest units first), with
    `work_unit` as the scope."""

    def _split_scope(self, nodeid: str) -> str:
        return work_unit(nodeid)
