"""The memory the kernel saw (`autograder.kernel_memory`): the audit's figure cross-checked with the grading
child's resident memory in a sized run, against a reference child's.

The child-graded fixture `ex07_keeps_every_layer_gathered_outside_torch.patch` is graded by
tests/test_grading_integrity.py with and without the walls, and loses the memory check in both; here is its
control (graded in one process, where no kernel counts, it keeps every point), and the verdict's arithmetic.
"""

from __future__ import annotations

import pytest

from autograder import kernel_memory, witness
from autograder.checks import CheckFailed, ObservationInvalid, total
from autograder.kernel_memory import Figures

MiB = 2**20


def reference() -> Figures:
    return Figures(kernel_bytes=1200 * MiB, audit_bytes=500 * MiB)


def test_one_sized_copy_of_the_parameters_is_what_the_verdict_counts_in() -> None:
    assert kernel_memory.parameter_count() > 25_000_000, "a copy must stand clear of a process's noise"
    assert kernel_memory.copy_bytes() == 2 * kernel_memory.parameter_count()


def test_the_kernel_may_see_up_to_the_allowed_copies_more_than_the_reference_and_no_more() -> None:
    allowed = kernel_memory.ALLOWED_COPIES * kernel_memory.copy_bytes()
    within = Figures(reference().kernel_bytes + allowed, reference().audit_bytes)
    assert "the kernel agrees" in kernel_memory.judge(within, reference)
    beyond = Figures(reference().kernel_bytes + allowed + MiB, reference().audit_bytes)
    with pytest.raises(CheckFailed, match="memory the audit cannot see"):
        kernel_memory.judge(beyond, reference)


def test_what_the_audit_also_saw_explains_the_excess_but_only_up_to_one_copy() -> None:
    copy = kernel_memory.copy_bytes()
    allowed = kernel_memory.ALLOWED_COPIES * copy
    seen = Figures(reference().kernel_bytes + allowed + copy, reference().audit_bytes + copy)
    assert "the kernel agrees" in kernel_memory.judge(seen, reference)
    inflated = Figures(reference().kernel_bytes + allowed + 2 * copy, reference().audit_bytes + 10 * copy)
    with pytest.raises(CheckFailed, match="held outside torch"):
        kernel_memory.judge(inflated, reference)


def test_a_check_called_in_a_notebook_says_the_kernel_counts_when_graded() -> None:
    assert kernel_memory.measured({witness.UNMEASURED_KEY: "in a notebook"}) is None
    assert "when the notebook is graded" in kernel_memory.judge(None, reference)


def test_a_graded_run_that_was_not_measured_earns_nothing() -> None:
    seen = witness.Witness.__new__(witness.Witness)
    seen.runs, seen.problem = [], None
    with pytest.raises(ObservationInvalid, match="not measured"):
        witness.verify_runs({"runs": {}, "kernel": {witness.UNMEASURED_KEY: "skipped"}}, seen)


def entry(**changes: object) -> dict:
    good = {
        witness.WITNESS_KEY: 3,
        "world_size": kernel_memory.SIZED_WORLD_SIZE,
        "audit_bytes": [100 * MiB] * kernel_memory.SIZED_WORLD_SIZE,
        "kernel_peak_bytes": 1300 * MiB,
    }
    return {**good, **changes}


def test_a_sized_run_summary_must_be_well_formed() -> None:
    assert kernel_memory.measured(entry()) == Figures(1300 * MiB, 400 * MiB)
    for malformed in (
        entry(world_size=2),
        entry(audit_bytes=[-1] * kernel_memory.SIZED_WORLD_SIZE),
        entry(kernel_peak_bytes=0),
        {**entry(), "extra": 1},
    ):
        with pytest.raises(ObservationInvalid):
            kernel_memory.measured(malformed)


def witnessed(*collectives: bool) -> witness.Witness:
    """A witness that saw runs begin, with or without their collectives, the kernel's peak 1 GiB each."""
    seen = witness.Witness.__new__(witness.Witness)
    seen.problem = None
    seen.runs = [
        witness.WitnessedRun(4, [[]] * 4, [[]] * 4, collectives=c, kernel_peak_bytes=2**30) for c in collectives
    ]
    return seen


def test_the_sized_run_named_must_be_the_one_the_child_announced_as_sized() -> None:
    summary = {witness.WITNESS_KEY: 1, "world_size": 4, "audit_bytes": [0] * 4}
    verified = witness.verify_runs({"kernel": summary}, witnessed(True, False, True))
    assert verified["kernel"]["kernel_peak_bytes"] == 2**30
    for claimed in (0, 2):  # an ordinary run's number: a later beginning would leave the sized run uncounted
        with pytest.raises(ObservationInvalid, match="sized run"):
            witness.verify_runs({"kernel": {**summary, witness.WITNESS_KEY: claimed}}, witnessed(True, False, True))
    with pytest.raises(ObservationInvalid, match="not once"):
        witness.verify_runs({"kernel": summary}, witnessed(True, False, False))
    with pytest.raises(ObservationInvalid, match="did not go through"):
        witness.verify_runs({witness.WITNESS_KEY: 1, **{k: [] for k in witness.RUN_KEYS}}, witnessed(True, False))


@pytest.mark.ex07
def test_copies_outside_torch_keep_every_point_where_no_kernel_counts(tmp_path) -> None:
    """The control of the child-graded fixture: in one process, the audit alone judges memory."""
    from tests.test_grading_integrity import FIXTURES, WrongSubmission, grade_in_process

    wrong = WrongSubmission.read(FIXTURES / "ex07_keeps_every_layer_gathered_outside_torch.patch")
    results = grade_in_process(wrong.notebook(tmp_path))
    assert total(results) == (10, 10)
    assert "when the notebook is graded" in next(r.message for r in results if r.name == "test_memory")
