"""How a run's step time is measured: the timed steps are fenced off from the warm-up and the instrumented
last step, and the step time is the cluster's wall time over them."""

from __future__ import annotations

import pytest

from zero_core.experiment import fenced_steps, run_stage
from zero_core.model import preset
from zero_core.report import RankResult, StageReport, cluster_step_seconds, timed_steps
from zero_core.stages import TrainConfig

MICRO = TrainConfig(model=preset("micro"))


def step_window(report: StageReport, step: int) -> tuple[float, float]:
    """(first start, last end) of `step` over the ranks, on the shared clock."""
    starts_ends = [
        (origin + bounds[step][0], origin + bounds[step][1])
        for origin, bounds in zip(report.rank_origins_s, report.step_bounds, strict=True)
    ]
    return min(start for start, _ in starts_ends), max(end for _, end in starts_ends)


def test_the_timed_steps_are_those_between_the_first_and_the_last() -> None:
    assert timed_steps(5) == [1, 2, 3] and fenced_steps(5) == [1, 4]
    assert timed_steps(2) == [0] and fenced_steps(2) == [1]
    assert timed_steps(1) == [0] and fenced_steps(1) == []


@pytest.mark.parametrize("stage", [0, 3])
def test_no_rank_starts_a_fenced_step_before_every_rank_has_finished_the_step_before(stage: int) -> None:
    """Without the fences, rank 0 starts step k+1 while others still finish step k (ranks overlap steps)."""
    report = run_stage(stage, 6, 5, MICRO)
    for step in fenced_steps(5):
        assert step_window(report, step)[0] >= step_window(report, step - 1)[1]
    assert not any(e.op == "barrier" for rank in report.ledger.ranks for e in rank.entries)


def test_the_step_time_is_the_clusters_wall_time_over_the_timed_steps() -> None:
    report = run_stage(1, 4, 5, MICRO)
    first, _ = step_window(report, 1)
    _, last = step_window(report, 3)
    assert report.typical_step_seconds == pytest.approx((last - first) / 3)


def test_without_a_shared_clock_the_step_time_is_the_slowest_ranks_own_span() -> None:
    """Processes leave the fence together, so each rank's span from there is the cluster's, on its clock."""
    spans = [[(0.0, 1.0), (2.0, 3.0), (3.0, 4.5), (4.5, 5.0)], [(0.0, 1.5), (2.0, 3.5), (3.5, 4.0), (4.0, 6.0)]]
    results = [
        RankResult([], {}, [], {}, 0, 0, [], {}, [], bounds, origin)
        for bounds, origin in zip(spans, [100.0, -7.0], strict=True)
    ]
    assert cluster_step_seconds(4, results, shared_clock=False) == pytest.approx((4.5 - 2.0) / 2)


def test_one_cpu_slot_changes_when_ranks_run_not_what_they_compute() -> None:
    """`max_running=1` (benchmarks/bench_bound.py): one rank thread at a time, the same training and ledger."""
    alone, default = run_stage(3, 4, 2, MICRO, max_running=1), run_stage(3, 4, 2, MICRO)
    assert alone.losses == default.losses
    assert all(w.equal(default.master_weights[name]) for name, w in alone.master_weights.items())
    assert alone.comm_bytes_per_step_mean == default.comm_bytes_per_step_mean
    with pytest.raises(ValueError, match="max_running must be at least 1"):
        run_stage(3, 4, 1, MICRO, max_running=0)
