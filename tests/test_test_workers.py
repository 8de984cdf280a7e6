"""`make test`'s workers (pytest-xdist) run the tests that share a module-scoped fixture in one worker, so each
such fixture is made once (tests/work_units.py): the list is complete, and a parallel run keeps it."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

from tests.round_trip_class import ASSIGNMENTS
from tests.work_units import EXPECTED_SECONDS, PER_ASSIGNMENT_MODULES, SHARED_MODULE_FIXTURES, longest_first, work_unit

ROOT = Path(__file__).resolve().parents[1]


def modules_with_module_fixtures() -> set[str]:
    return {
        f"tests/{path.name}"
        for path in (ROOT / "tests").glob("test_*.py")
        if re.search(r"@pytest\.fixture\([^)]*scope=\"module\"", path.read_text())
    }


def test_every_module_with_a_module_fixture_is_kept_in_one_worker() -> None:
    assert modules_with_module_fixtures() == SHARED_MODULE_FIXTURES | PER_ASSIGNMENT_MODULES


def test_the_round_trip_shares_a_worker_per_assignment_and_other_tests_go_alone() -> None:
    roundtrip = "tests/test_nbgrader_roundtrip.py"
    ex03 = {work_unit(f"{roundtrip}::{test}[ex03_zero2_reduce_scatter_backward]") for test in ("test_a", "test_b")}
    ex04 = work_unit(f"{roundtrip}::test_a[ex04_zero3_gather_linear]")
    assert len(ex03) == 1 and ex04 not in ex03
    assert work_unit("tests/test_trace.py::test_a") == work_unit("tests/test_trace.py::test_b[1]")
    assert work_unit("tests/test_cluster.py::test_a") != work_unit("tests/test_cluster.py::test_b")


def test_the_tests_that_write_into_the_shared_venv_or_look_there_share_the_round_trip_s_ex05_worker() -> None:
    units = {
        work_unit("tests/test_grading_walls.py::test_a_submission_writing_into_the_venv_leaves_nothing_only_inside"
                  "_the_walls[control-without-walls]"),
        work_unit("tests/test_grading_integrity.py::test_a_submission_graded_in_a_child_process_loses_exactly_its"
                  "_checks[ex05_writes_a_pth_file_into_the_venv-audit-hook-only]"),
        work_unit("tests/test_nbgrader_roundtrip.py::test_autograde_leaves_no_file_in_the_venv_and_no_solution_in_the"
                  "_feedback[ex05_memory_planning]"),
    }
    assert units == {"tests/test_nbgrader_roundtrip.py::ex05"}
    assert work_unit("tests/test_grading_integrity.py::test_x[walls-ex05_os_exit]") not in units


def test_a_parallel_run_keeps_a_module_with_a_fixture_in_one_worker() -> None:
    modules = ["tests/test_trace.py", "tests/test_offload.py"]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "-v", *modules],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert run.returncode == 0, run.stdout[-3000:]
    workers: dict[str, set[str]] = {}
    for worker, module in re.findall(r"\[(gw\d)\] \[ *\d+%\] PASSED (tests/\S+\.py)::", run.stdout):
        workers.setdefault(module, set()).add(worker)
    assert set(workers) == set(modules) and all(len(w) == 1 for w in workers.values()), workers


def test_the_longest_units_go_out_first_and_the_rest_keep_their_order() -> None:
    lesson = "tests/test_lessons.py::test_lesson_runs_top_to_bottom_without_errors_or_stderr[07_buckets]"
    roundtrip = [f"tests/test_nbgrader_roundtrip.py::test_{name}[ex08_clip_and_accumulate]" for name in "abcde"]
    tests = ["tests/test_units.py::test_a", *roundtrip, "tests/test_cluster.py::test_b", lesson,
             "tests/test_plots.py::test_a", "tests/test_plots.py::test_b", "tests/test_plots.py::test_c"]
    queue: OrderedDict[str, dict[str, bool]] = OrderedDict()
    for test in tests:
        queue.setdefault(work_unit(test), {})[test] = False
    assert list(longest_first(queue)) == [
        "tests/test_nbgrader_roundtrip.py::ex08", lesson, "tests/test_plots.py", "tests/test_units.py::test_a",
        "tests/test_cluster.py::test_b",
    ]


def test_every_expected_duration_names_a_unit_or_a_test_that_exists() -> None:
    """A renamed test or module would leave its figure behind, and its unit would go out last."""
    for key in EXPECTED_SECONDS:
        path, _, rest = key.partition("::")
        assert (ROOT / path).is_file(), key
        if re.fullmatch(r"ex\d\d", rest):
            assert path in PER_ASSIGNMENT_MODULES and any(a.startswith(rest) for a in ASSIGNMENTS), key
        elif rest:
            assert f"def {rest}" in (ROOT / path).read_text(), key
