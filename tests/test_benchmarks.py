"""The benchmarks `make bench` runs still run: each at the smallest sizes, its tables read back.

Their figures are measured, never asserted (the machines are shared): these tests check only that every
table is printed whole, so that a change to the stages cannot quietly break `make bench`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from autograder import walls

ROOT = Path(__file__).resolve().parent.parent


def run_benchmark(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_bench_step_prints_a_row_per_stage_and_n_the_targets_and_the_overhead_per_rank() -> None:
    sizes = ("--world-sizes", "2,3", "--repeats", "1", "--steps", "3")
    out = run_benchmark("bench_step.py", *sizes, "--preset", "micro", "--stages", "0,3")
    rows = [line.split()[0] for line in out.splitlines() if line.startswith("ZeRO-")]
    assert rows == ["ZeRO-0", "ZeRO-3"] * 2, out
    assert "N = 2: worst" in out and "N = 3: worst" in out and "the code's own work, CPU x" in out, out
    header = next(line for line in out.splitlines() if line.startswith("stage "))
    assert "2-proc floor" in header and "lockstep" in header and "x lockstep" in header, out
    bounds = [line for line in out.splitlines() if line.startswith("    over the target, ZeRO-")]
    ratios = [line for line in out.splitlines() if line.startswith("  N = ") and "NOT met" in line]
    assert all("(the lockstep floor), take" in line for line in bounds) and len(bounds) >= len(ratios), out
    fits = [line.split() for line in out.splitlines() if line.startswith("    ZeRO-")]
    assert [fit[0] for fit in fits] == ["ZeRO-0:", "ZeRO-3:"], out
    assert all(fit[2] == "MB" and fit[3][0] in "+-" and fit[4:7] == ["MB", "per", "rank"] for fit in fits), out


def test_bench_collectives_prints_every_collective_beside_torchs_threaded_group_and_the_barrier_ratio() -> None:
    out = run_benchmark("bench_collectives.py", "--world-sizes", "2", "--repeats", "1")
    table = [line.split() for line in out.splitlines() if len(line.split()) == 6]
    rows = [row for row in table if row[0] in ("all_reduce", "reduce_scatter", "all_gather", "barrier")]
    assert [row[0] for row in rows] == ["all_reduce"] * 2 + ["reduce_scatter"] * 2 + ["all_gather"] * 2 + ["barrier"]
    assert all(float(row[-3]) > 0 and float(row[-2]) > 0 and row[-1].endswith("x") for row in rows), out
    assert "of 7 cells" in out and "ratio" in out and "target <= 3x" in out, out


def test_bench_bound_prints_its_three_ratios_what_a_collective_costs_and_the_locks_bound() -> None:
    # 20 watched steps of 10-20 ms: 40-80 ticks at 200 Hz, so a lock held a quarter of the time is surely sampled
    sizes = ("--world-size", "4", "--steps", "3", "--lock-steps", "20")
    out = run_benchmark("bench_bound.py", *sizes, "--preset", "micro", "--stages", "3")
    ratios, lock = [line for line in out.splitlines() if line.startswith("ZeRO-3 ")]
    assert ratios.count("x") == 3, out
    held = float(lock.split()[2].rstrip("%"))
    assert 0 < held <= 100 and "the 16-core target" in lock, out  # py-spy saw the lock held in the watched steps
    plain, bucketed = (
        int(line.split()[-2]) for line in out.splitlines() if line.startswith(("ZeRO-2 ", "ZeRO-2, bucketed"))
    )
    assert bucketed < plain, out
    assert "each collective fewer saves a rank" in out, out


def test_bench_slots_prints_each_stage_over_the_slot_counts_and_names_the_fastest() -> None:
    out = run_benchmark("bench_slots.py", "--world-size", "4", "--steps", "3", "--preset", "micro", "--stages", "1")
    header = next(line for line in out.splitlines() if line.startswith("stage "))
    counts = header.count(" slots")
    assert counts >= 2 and "*" in header, out  # 1 and 2 slots at least, and the default marked
    row = next(line for line in out.splitlines() if line.startswith("ZeRO-1 "))
    assert row.count("cpu") == row.count("MB") == counts and "the default takes" in row, out


@pytest.mark.skipif(isinstance(walls.available(), str), reason="no walls on this machine to measure")
def test_bench_class_prints_jobs_1_and_j_the_speedup_identical_grades_and_the_time_without_sharing() -> None:
    out = run_benchmark("bench_class.py", "--students", "2", "--assignment", "ex05_memory_planning",
                        "--term-students", "0", "--unshared", "1", "--jobs", "2")
    assert "2 students x 1 assignment(s): 2 notebooks (1 untouched, 1 solution)" in out, out
    rows = [line.split("  ")[1] for line in out.splitlines() if line.endswith(" s per notebook")]
    assert rows == ["grade --jobs 1", "grade --jobs 1 again, references kept", "grade --jobs 2",
                    "nothing shared (a grader per student, first 1)"], out
    assert "x the speed of the first" in out and ": the references read back from its store" in out, out
    assert "x the speed of --jobs 1 (target 1.8x: " in out and "; the grades identical" in out, out
    busy = [line for line in out.splitlines() if line.startswith("    the machine busy ")]
    assert len(busy) == 3 and all(line.endswith(" cores on average") for line in busy), out
    assert "one grader for the class is " in out and max(len(line) for line in out.splitlines()) <= 100, out
    (share,) = [line.split() for line in out.splitlines() if line.startswith("    ex05_memory_planning ")]
    assert share[2] == share[4] == "s" and share[5].endswith("%"), out  # from nothing, references made, share


@pytest.mark.skipif(isinstance(walls.available(), str), reason="no walls on this machine to measure")
def test_bench_grading_prints_each_notebook_with_and_without_the_walls_and_the_targets() -> None:
    out = run_benchmark("bench_grading.py", "--students", "1", "--assignments", "ex05_memory_planning")
    (row,) = [line.split() for line in out.splitlines() if line.strip().startswith("ex05_memory_planning")]
    assert row[1].endswith("s") and row[2].endswith("s") and row[3].endswith("x") and row[4] == "10/10", out
    assert "per submission (target < 60 s:" in out and "the time without (target < 1.5x:" in out, out
    assert "totals: 10/10" in out, out
