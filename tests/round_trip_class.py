"""Who hands in what in the nbgrader round trip (tests/test_nbgrader_roundtrip.py), and so which fixtures'
verdicts it holds.

The round trip grades each of these notebooks inside the walls, as `make autograde` does, and holds every
check's points in the gradebook and the first lost check's message to the fixture's header. Where that header
has no `RULES`, this is everything tests/test_grading_integrity.py would hold the same notebook to, so that
test grades such a fixture no second time (`held_by_the_round_trip`); a fixture that breaks a rule for graded
cells loses every check in the round trip, and the integrity test still grades it with the rules set aside.
"""

from __future__ import annotations

from pathlib import Path

from tests.fixture_text import FIXTURES, read_fixture

CLASS = {
    "ex01_collectives": {"mallory": "wrong/ex01_patches_torch_equal.patch"},
    "ex03_zero2_reduce_scatter_backward": {
        "bob": "wrong/ex03_all_reduce_instead_of_reduce_scatter.patch",
        "mallory": "wrong/ex03_patches_torch_equal.patch",
        "walter": "wrong/ex03_unwraps_the_shard_for_the_reference_collective.py",
        "ursula": "correct/ex03_logs_gradient_norms_and_helpers.py",
    },
    "ex04_zero3_gather_linear": {
        "mallory": "wrong/ex04_imports_the_reference_by_a_built_name.py",
        "ursula": "correct/ex04_names_the_reference_in_strings_and_helpers.py",
    },
    "ex06_bucketed_overlap": {
        "bob": "wrong/ex06_waits_at_once.patch",
        "mallory": "wrong/ex06_imports_the_reference_by_a_built_name.py",
        "ursula": "correct/ex06_plans_from_the_far_end.py",
        "zach": "wrong/ex06_rewrites_its_waits_in_the_ledger.patch",
    },
    "ex07_zero3_prefetch": {
        "bob": "wrong/ex07_gathers_on_demand.patch",
        "ursula": "correct/ex07_prefetches_on_release.py",
        "zach": "wrong/ex07_keeps_every_layer_gathered_outside_torch.patch",
    },
    "ex08_clip_and_accumulate": {
        "bob": "wrong/ex08_defers_to_the_last_micro_batch.py",
        "ursula": "correct/ex08_first_micro_batch_in_place_and_gathered_norms.py",
    },
    "ex09_hierarchical_allgather": {
        "bob": "wrong/ex09_flat_all_gather.py",
        "ursula": "correct/ex09_one_gather_in_the_node_then_block_swaps.py",
    },
    "ex10_sharded_checkpoints": {
        "bob": "wrong/ex10_resumes_with_the_step_at_zero.patch",
        "ursula": "correct/ex10_recomputes_the_ranges_from_the_partition.py",
    },
    "ex05_memory_planning": {
        "bob": "wrong/ex05_wrong_formula.patch",
        "mallory": "wrong/ex05_forges_the_results_file.py",
        "oscar": "wrong/ex05_patches_the_grader.py",
        "peggy": "wrong/ex05_reads_the_solutions.py",
        "trent": "wrong/ex05_leaves_a_process_behind.py",
        "victor": "wrong/ex05_kills_its_parent.py",
        "xavier": "wrong/ex05_writes_a_pth_file_into_the_venv.py",
        "yvonne": "wrong/ex05_reads_the_solutions_through_torch.py",
    },
}
"""Who hands in which fixture, besides alice (the solution) and carol (the release untouched): one student
per class of attack on the grader, and correct submissions written unusually (`ursula`)."""
ASSIGNMENTS = tuple(CLASS)


HELD = frozenset(
    FIXTURES / name
    for students in CLASS.values()
    for name in students.values()
    if "RULES" not in read_fixture(FIXTURES / name)[0]
)
"""The fixtures the round trip hands in that break no rule for graded cells."""


def held_by_the_round_trip(fixture: Path) -> bool:
    """Whether the round trip hands `fixture` in and holds it to its whole header: checks lost and message."""
    return fixture in HELD
