"""The virtual cluster: SPMD runs on rank threads, and every way a run can go wrong ends fast and cleanly."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

import pytest
import torch

from zero_core import dist
from zero_core.cluster import (
    RUN_WALL_FACTOR,
    ClusterError,
    CollectiveDeadlock,
    CollectiveMismatch,
    CollectiveTimeout,
    RankFailed,
    RunTimeout,
    VirtualCluster,
)
from zero_core.context import current

ROOT = Path(__file__).resolve().parents[1]


def rank_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("rank-")]


def spin_forever() -> None:
    count = 0
    while True:
        count += 1


def test_run_returns_every_ranks_result_in_rank_order():
    def fn(offset):
        time.sleep(0.01 * (4 - dist.get_rank()))
        return dist.get_rank() * 10 + offset

    assert VirtualCluster(5).run(fn, 1) == [1, 11, 21, 31, 41]


def test_each_rank_knows_its_rank_and_the_world_size():
    assert VirtualCluster(4).run(lambda: (dist.get_rank(), dist.get_world_size())) == [(r, 4) for r in range(4)]


def test_run_passes_keyword_arguments_to_every_rank():
    assert VirtualCluster(2).run(lambda *, scale: scale * dist.get_rank(), scale=3) == [0, 3]


def test_rank_generators_differ_between_ranks():
    draws = VirtualCluster(8).run(lambda: torch.randn(16, generator=dist.current().generator))
    for a in range(8):
        for b in range(a + 1, 8):
            assert not torch.equal(draws[a], draws[b]), f"ranks {a} and {b} drew the same numbers"


def test_rank_generators_are_reproducible_across_runs_with_the_same_seed():
    def draw():
        return torch.randn(16, generator=dist.current().generator)

    first = VirtualCluster(4, seed=7).run(draw)
    again = VirtualCluster(4, seed=7).run(draw)
    other_seed = VirtualCluster(4, seed=8).run(draw)
    for rank in range(4):
        assert torch.equal(first[rank], again[rank])
        assert not torch.equal(first[rank], other_seed[rank])


def test_rank_generators_do_not_depend_on_torchs_global_seed():
    def draw():
        return torch.randn(4, generator=dist.current().generator)

    torch.manual_seed(1)
    first = VirtualCluster(2).run(draw)
    torch.manual_seed(2)
    assert all(torch.equal(a, b) for a, b in zip(first, VirtualCluster(2).run(draw), strict=True))


@pytest.mark.parametrize("world_size", [0, -1, 1.5, True])
def test_a_world_size_that_is_not_a_positive_integer_is_rejected(world_size):
    with pytest.raises(ValueError, match="world_size"):
        VirtualCluster(world_size)


def test_a_non_positive_timeout_is_rejected():
    with pytest.raises(ValueError, match="timeout_s"):
        VirtualCluster(2, timeout_s=0)


@pytest.mark.timeout(10)
def test_a_rank_that_raises_releases_the_others_within_a_second():
    def fn():
        if dist.get_rank() == 2:
            raise KeyError("no such layer")
        dist.barrier()

    started = time.monotonic()
    with pytest.raises(RankFailed) as info:
        VirtualCluster(4, timeout_s=30.0).run(fn)
    assert time.monotonic() - started < 1.0
    assert info.value.rank == 2
    assert "rank 2" in str(info.value) and "KeyError" in str(info.value)


@pytest.mark.timeout(10)
def test_the_error_of_a_failed_rank_chains_the_original_traceback():
    def failing_layer():
        raise ZeroDivisionError("division by zero in the loss")

    def fn():
        if dist.get_rank() == 1:
            failing_layer()
        dist.barrier()

    with pytest.raises(RankFailed) as info:
        VirtualCluster(3, timeout_s=30.0).run(fn)
    cause = info.value.__cause__
    assert isinstance(cause, ZeroDivisionError) and info.value.error is cause
    frames = [frame.name for frame in traceback.extract_tb(cause.__traceback__)]
    assert "failing_layer" in frames


@pytest.mark.timeout(10)
def test_the_first_failure_is_the_one_reported():
    def fn():
        if dist.get_rank() == 0:
            raise RuntimeError("first")
        time.sleep(0.3)
        raise RuntimeError("second")

    with pytest.raises(RankFailed, match="first") as info:
        VirtualCluster(3, timeout_s=30.0).run(fn)
    assert info.value.rank == 0


@pytest.mark.timeout(10)
def test_a_collective_that_times_out_says_what_every_rank_is_waiting_in():
    def fn():
        dist.barrier()
        if dist.get_rank() == 2:
            spin_forever()
        dist.all_reduce(torch.zeros(2, 3, dtype=torch.float16), tag="grad blocks.0")

    started = time.monotonic()
    with pytest.raises(CollectiveTimeout) as info:
        VirtualCluster(3, timeout_s=1.0).run(fn)
    elapsed = time.monotonic() - started
    assert 1.0 <= elapsed < 5.0
    lines = str(info.value).splitlines()
    for rank in (0, 1):
        (line,) = [line for line in lines if line.strip().startswith(f"rank {rank}:")]
        assert "waiting in all_reduce #1" in line
        assert "tag='grad blocks.0'" in line and "float16 [2, 3]" in line and "op=SUM" in line
    (stuck,) = [line for line in lines if line.strip().startswith("rank 2:")]
    assert "its own code after 1 collective(s)" in stuck


@pytest.mark.timeout(10)
def test_a_deadlock_error_names_the_rank_that_returned_the_collective_and_the_ranks_waiting_in_it():
    def fn():
        if dist.get_rank() == 1:
            time.sleep(0.2)
            return
        dist.broadcast(torch.zeros(5), src=0, tag="weights")

    with pytest.raises(CollectiveDeadlock) as info:
        VirtualCluster(3, timeout_s=30.0).run(fn)
    message = str(info.value)
    assert "rank 1 returned without calling broadcast #0 tag='weights' float32 [5] src=0" in message
    assert "[0, 2]" in message


@pytest.mark.timeout(10)
def test_a_stopped_rank_runs_its_finally_blocks_to_the_end():
    cleaned_up = threading.Event()

    def fn():
        if dist.get_rank() == 1:
            try:
                spin_forever()
            finally:
                end = time.monotonic() + 0.3
                while time.monotonic() < end:
                    pass
                cleaned_up.set()
        dist.barrier()

    with pytest.raises(CollectiveTimeout):
        VirtualCluster(2, timeout_s=0.5).run(fn)
    assert cleaned_up.is_set()


@pytest.mark.timeout(10)
def test_a_rank_that_skips_a_collective_gives_the_others_a_deadlock_error_at_once():
    def fn():
        dist.barrier()
        if dist.get_rank() == 3:
            return "skipped"
        dist.all_reduce(torch.ones(8))
        return "reduced"

    started = time.monotonic()
    with pytest.raises(CollectiveDeadlock, match="rank 3 returned without calling all_reduce #1"):
        VirtualCluster(4, timeout_s=30.0).run(fn)
    assert time.monotonic() - started < 1.0


@pytest.mark.timeout(10)
def test_a_rank_that_calls_one_collective_too_many_gets_a_deadlock_error():
    def fn():
        for _ in range(2 if dist.get_rank() == 0 else 1):
            dist.all_reduce(torch.ones(3))

    with pytest.raises(CollectiveDeadlock, match="all_reduce #1"):
        VirtualCluster(2, timeout_s=30.0).run(fn)


MISMATCHES = {
    "op": (lambda: dist.all_reduce(torch.ones(4)), lambda: dist.broadcast(torch.ones(4), src=0)),
    "shape": (lambda: dist.all_reduce(torch.ones(4)), lambda: dist.all_reduce(torch.ones(5))),
    "dtype": (lambda: dist.all_reduce(torch.ones(4)), lambda: dist.all_reduce(torch.ones(4, dtype=torch.float16))),
    "src": (lambda: dist.broadcast(torch.ones(4), src=0), lambda: dist.broadcast(torch.ones(4), src=1)),
    "reduce op": (
        lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.SUM),
        lambda: dist.all_reduce(torch.ones(4), op=dist.ReduceOp.MAX),
    ),
    "barrier": (lambda: dist.barrier(), lambda: dist.all_reduce(torch.ones(4))),
}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("difference", list(MISMATCHES))
def test_ranks_that_call_different_collectives_get_a_mismatch_error_naming_both_at_once(difference):
    on_rank_0, on_others = MISMATCHES[difference]

    def fn():
        dist.barrier()
        if dist.get_rank() == 0:
            time.sleep(0.05)
            on_rank_0()
        else:
            on_others()

    started = time.monotonic()
    with pytest.raises(CollectiveMismatch) as info:
        VirtualCluster(3, timeout_s=30.0).run(fn)
    assert time.monotonic() - started < 1.0
    message = str(info.value)
    assert "position #1" in message and "rank 0 called" in message
    describe = {
        "op": ("all_reduce #1", "broadcast #1"),
        "shape": ("float32 [4]", "float32 [5]"),
        "dtype": ("float32 [4]", "float16 [4]"),
        "src": ("src=0", "src=1"),
        "reduce op": ("op=SUM", "op=MAX"),
        "barrier": ("barrier #1", "all_reduce #1"),
    }[difference]
    for text in describe:
        assert text in message


def test_ranks_may_label_the_same_collective_with_different_tags():
    def fn():
        tensor = torch.ones(2)
        dist.all_reduce(tensor, tag=f"from rank {dist.get_rank()}")
        return tensor

    assert all(torch.equal(t, torch.full((2,), 2.0)) for t in VirtualCluster(2).run(fn))


def rank_raises():
    if dist.get_rank() == 1:
        raise ValueError("bad batch")
    dist.barrier()


def rank_skips():
    if dist.get_rank() != 1:
        dist.barrier()


def ranks_mismatch():
    if dist.get_rank() == 1:
        dist.all_reduce(torch.ones(2))
    else:
        dist.barrier()


def rank_is_stuck():
    if dist.get_rank() == 1:
        spin_forever()
    dist.barrier()


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "failing_fn, error",
    [
        (rank_raises, RankFailed),
        (rank_skips, CollectiveDeadlock),
        (ranks_mismatch, CollectiveMismatch),
        (rank_is_stuck, CollectiveTimeout),
    ],
    ids=["raises", "skips", "mismatch", "stuck"],
)
def test_after_any_failure_no_rank_thread_is_left_and_a_new_run_works(failing_fn, error):
    """Includes a rank stuck in `while True:`: the others time out, and the stuck thread is stopped."""
    cluster = VirtualCluster(4, timeout_s=1.0)
    with pytest.raises(error):
        cluster.run(failing_fn)
    assert rank_threads() == []

    def all_reduce_rank():
        tensor = torch.full((3,), float(dist.get_rank()))
        dist.all_reduce(tensor)
        return tensor

    assert all(torch.equal(t, torch.full((3,), 6.0)) for t in cluster.run(all_reduce_rank))
    assert [len(cluster.ledger.ranks[r].entries) for r in range(4)] == [1, 1, 1, 1]
    assert rank_threads() == []


STUCK_UNDER_THE_AUDIT_HOOK = """
import sys
from autograder import child_guard
from zero_core import dist
from zero_core.cluster import CollectiveTimeout, VirtualCluster

child_guard.install()


def stuck() -> None:
    if dist.get_rank() == 1:
        while True:
            pass
    dist.barrier()


try:
    VirtualCluster(2, timeout_s=0.3).run(stuck)
except CollectiveTimeout:
    sys.exit(0)
"""


@pytest.mark.timeout(60)
def test_a_stuck_rank_is_stopped_in_a_grading_child_and_the_timeout_is_what_it_reports():
    """A grading child imports the cluster, then installs the audit hook that refuses looking native code up
    through ctypes (`autograder.child_guard`): the cluster still interrupts a rank stuck in its own code, and
    the run's error is the timeout, not the hook's refusal (which a loaded grading machine once showed a
    student in its place)."""
    done = subprocess.run([sys.executable, "-c", STUCK_UNDER_THE_AUDIT_HOOK], capture_output=True, text=True,
                          timeout=50, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.timeout(10)
def test_a_run_deadline_stops_ranks_that_never_communicate():
    started = time.monotonic()
    with pytest.raises(RunTimeout, match="deadline of 0.3 s"):
        VirtualCluster(2, timeout_s=30.0).run(spin_forever, deadline_s=0.3)
    assert time.monotonic() - started < 5.0
    assert rank_threads() == []


def pause(seconds: float) -> None:
    for _ in range(round(seconds / 0.01)):  # short sleeps: a rank stopped between two of them unwinds at once
        time.sleep(0.01)


@pytest.mark.timeout(20)
def test_a_run_deadline_counts_cpu_time_and_stops_ranks_that_only_wait_at_a_multiple_of_it():
    """Ranks that pause past the deadline, using no CPU (what a loaded machine looks like to the run), finish;
    ranks that wait for good are stopped at `RUN_WALL_FACTOR` times the deadline in wall-clock time."""
    assert VirtualCluster(2, timeout_s=30.0).run(lambda: pause(0.6) or dist.get_rank(), deadline_s=0.3) == [0, 1]
    started = time.monotonic()
    with pytest.raises(RunTimeout, match="deadline of 0.3 s of CPU time"):
        VirtualCluster(2, timeout_s=30.0).run(pause, 100.0, deadline_s=0.3)
    assert RUN_WALL_FACTOR * 0.3 <= time.monotonic() - started < 5.0
    assert rank_threads() == []


def test_objects_older_than_a_run_are_frozen_for_the_garbage_collector_only_while_it_runs():
    """A full collection during a run traverses what the ranks allocate, not all of torch (~150 ms)."""
    before = gc.get_freeze_count()
    during = VirtualCluster(2).run(gc.get_freeze_count)
    assert min(during) > before + 1000
    assert gc.get_freeze_count() == before
    with pytest.raises(RankFailed):
        VirtualCluster(2).run(lambda: 1 / 0)
    assert gc.get_freeze_count() == before


def test_cluster_errors_share_one_base_class():
    for error in (RankFailed, CollectiveMismatch, CollectiveDeadlock, CollectiveTimeout, RunTimeout):
        assert issubclass(error, ClusterError)


@pytest.mark.timeout(60)
def test_256_ranks_complete_an_all_reduce():
    def fn():
        tensor = torch.full((4,), float(dist.get_rank()))
        dist.all_reduce(tensor)
        return tensor

    results = VirtualCluster(256, timeout_s=30.0).run(fn)
    expected = torch.full((4,), float(sum(range(256))))
    assert len(results) == 256 and all(torch.equal(t, expected) for t in results)
    assert rank_threads() == []


def test_at_most_max_running_ranks_run_their_own_code_at_once():
    lock = threading.Lock()
    state = {"now": 0, "most": 0}

    def busy_between_collectives():
        for _ in range(3):
            with lock:
                state["now"] += 1
                state["most"] = max(state["most"], state["now"])
            time.sleep(0.002)
            with lock:
                state["now"] -= 1
            dist.barrier()

    VirtualCluster(8, timeout_s=5.0, max_running=2).run(busy_between_collectives)
    assert state["most"] == 2


def test_a_rank_can_lower_the_limit_for_the_rest_of_the_run_and_raise_it_again():
    """`limit_running(1)` from one rank: after the next collective no two ranks run at once; raised back to 3,
    three do; the next run starts with the cluster's own limit."""
    lock = threading.Lock()
    most = {"alone": 0, "raised": 0}
    state = {"now": 0}

    def busy(phase: str) -> None:
        with lock:
            state["now"] += 1
            most[phase] = max(most[phase], state["now"])
        time.sleep(0.002)
        with lock:
            state["now"] -= 1

    def lowered_then_raised():
        if dist.get_rank() == 0:
            current().backend.cluster.limit_running(1)
        dist.barrier()
        for _ in range(3):
            busy("alone")
            dist.barrier()
        current().backend.cluster.limit_running(3)
        dist.barrier()
        for _ in range(3):
            busy("raised")
            dist.barrier()

    cluster = VirtualCluster(8, timeout_s=5.0, max_running=2)
    cluster.run(lowered_then_raised)
    assert most == {"alone": 1, "raised": 3}
    most["alone"] = 0
    cluster.run(lambda: [busy("alone"), dist.barrier()])
    assert most["alone"] == 2
    with pytest.raises(ValueError, match="max_running must be at least 1"):
        cluster.limit_running(0)


def test_max_running_must_be_positive():
    with pytest.raises(ValueError, match="max_running"):
        VirtualCluster(2, max_running=0)


@pytest.mark.timeout(10)
def test_a_rank_that_keeps_the_cpu_forever_gives_the_waiting_ranks_a_clear_error():
    def rank_zero_spins():
        if dist.get_rank() == 0:
            spin_forever()
        dist.barrier()

    started = time.monotonic()
    with pytest.raises(CollectiveTimeout, match="turn on the CPU") as error:
        VirtualCluster(3, timeout_s=1.0, max_running=1).run(rank_zero_spins)
    assert time.monotonic() - started < 5.0
    assert "rank 0" in str(error.value)
    assert not rank_threads()


@pytest.mark.timeout(10)
def test_a_rank_left_without_a_turn_after_a_collective_gets_a_clear_error():
    """The barrier completes, but the one rank allowed to run never reaches another collective."""

    def all_spin_after_a_barrier():
        dist.barrier()
        spin_forever()

    started = time.monotonic()
    with pytest.raises(CollectiveTimeout, match="waited 1.0 s for a turn on the CPU") as error:
        VirtualCluster(2, timeout_s=1.0, max_running=1).run(all_spin_after_a_barrier)
    assert time.monotonic() - started < 5.0
    lines = str(error.value).splitlines()
    assert sum("waiting for a turn on the CPU after 1 collective(s)" in line for line in lines) == 1
    assert sum("running its own code after 1 collective(s)" in line for line in lines) == 1
    assert not rank_threads()
