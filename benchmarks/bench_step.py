"""Step time and memory of each stage on N virtual GPUs against the two-process floor, for one or several N.

The floor (`benchmarks/floor.py`, its one definition) is the same work with no communication and no
cluster: the N micro-batches' forward and backward with plain autograd, then the Adam steps of the
replicas the stage keeps, split over two processes. It is printed beside the same work in one process. A
stage's ratio to the two-process floor is what the virtual cluster costs (threads, rendezvous, copies,
ledgers). Each stage trains alone in this process, one after the other, as `compare --jobs 1` trains them:
no other stage shares the cores while one is timed. Targets: every stage at most 2.0x the two-process
floor at N = 8 and N = 32; with 16 cores or more, at N = 32, a step at least 4x faster than the one-process
floor.

Per stage it also prints:
- `lockstep` and `x lockstep`: the lockstep floor (`benchmarks/floor.py`), the floor's work as N rank threads
  of the virtual cluster that meet in a barrier wherever the stage meets in a collective (counted from the
  stage's own ledger), with no stage code; and the stage's step over it, what the stage's own code adds.
  Where a stage misses the target, the summary sets the two side by side: the lockstep floor's ratio to the
  two-process floor is the bound rank threads put on that stage's schedule.
- `CPU x`: the CPU seconds the whole process spends per step (every rank thread) over the one-process
  floor's. Work does not shrink by being spread over cores: this is the work the stage's code does for
  every unit of the floor's, whatever runs it.
- peak RSS of the stage's run alone (the kernel's high-water mark, reset before it), the sum over the ranks
  of their model states and of their peak bytes (what `compare` reports per GPU, summed), and the rest: what
  the process holds beyond what the ranks hold (the interpreter and torch, about 0.23 GB here; Python objects
  per rank; the allocator's free lists).

These machines are shared, and their speed drifts by 10-20% over a minute. So each stage is measured right
after its own floors, and the pair is repeated `--repeats` times at N <= 32 (once above: a step of 256 ranks
takes seconds); the stage's ratio is the median of its pairs' ratios. A floor is the median of its steps
after the first; a stage's step is the cluster's wall time per step over the steps between its first and last
(`StageReport.typical_step_seconds`). `--compare-world-size N` also times `python -m zero_core compare
--world-size N --steps 3 --jobs 1`, the four stages one after the other in one process (target: within 4x
its floor, the two-process floor steps of the four stages it trains, measured right before it), and the
peak of its RSS; then as a user runs it by default, stages side by side in worker processes from N = 32 on
(each pinned to its share of the cores, so its ratio to a floor that has both cores is not like with
like: printed beside, not judged).

    python benchmarks/bench_step.py [--world-sizes 8,32,128,256] [--steps 5] [--repeats 3] [--preset tiny]
                                    [--stages 0,1,2,3] [--compare-world-size 256]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
from floor import FLOOR_METHOD, FLOOR_PROCESSES, Floors, Meetings, lockstep_floor

from zero_core.cluster import machine_cores
from zero_core.experiment import run_stage
from zero_core.model import build_model, parameter_layers, preset
from zero_core.report import StageReport
from zero_core.stage_pool import default_jobs
from zero_core.stages import TrainConfig

TARGET_FLOOR_RATIO = 2.0
"""Every stage's step against the two-process floor, at N = 8 and N = 32 (`--jobs 1`)."""
TARGET_SPEEDUP_ON_16_CORES = 4.0
"""With 16 cores or more, at N = 32: a step at least this much faster than the one-core floor."""
TARGET_RSS_BYTES = 1e9
"""Peak RSS of a stage's run at N = 32."""
TARGET_COMPARE_RATIO = 4.0
BIG_WORLD_SIZE = 32
"""Above it, one floor-and-stage pair per stage and `BIG_STEPS` steps."""
BIG_STEPS = 4
COMPARE_STEPS = 3
COMPARE_STAGES = (0, 1, 2, 3)


def peak_rss_bytes() -> int:
    """The process's peak resident memory so far (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _trim_heap() -> None:
    """Give freed heap pages back (glibc), so that a run's peak does not start from the previous run's heap."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak_rss() -> bool:
    """Restart the kernel's high-water mark of this process's RSS (Linux: `clear_refs` 5). False if it cannot."""
    gc.collect()
    _trim_heap()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def high_water_rss_bytes() -> int:
    """Peak RSS since the last `reset_peak_rss` (VmHWM), or since the start where there is no /proc."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return peak_rss_bytes()


@dataclass
class StageRun:
    report: StageReport
    cpu_seconds_per_step: float
    peak_rss_bytes: int
    """The run's own peak (or the process's so far, where it cannot be reset)."""


def run_measured(stage: int, world_size: int, steps: int, config: TrainConfig) -> StageRun:
    """`run_stage`, with the process's CPU seconds per step between rank 0's end of the first step and its end
    of the last timed one (other ranks finishing a step late at one end make up for those at the other), and
    the run's peak RSS."""
    marks: dict[int, float] = {}

    def on_step(step: int) -> None:
        if step in (0, steps - 2):
            marks[step] = time.process_time()

    reset_peak_rss()
    report = run_stage(stage, world_size, steps, config, on_step=on_step)
    cpu = (marks[steps - 2] - marks[0]) / (steps - 2)
    return StageRun(report, cpu, high_water_rss_bytes())


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def sweep_world_size(
    floors: Floors, config: TrainConfig, world_size: int, stages: list[int], args: argparse.Namespace
) -> dict[int, dict[str, float]]:
    """Every stage at one N, printed as it goes; returns per stage the medians the summary needs."""
    big = world_size > BIG_WORLD_SIZE
    steps, repeats = (BIG_STEPS, 1) if big else (args.steps, args.repeats)
    print(f"\nN = {world_size}: {steps} steps per run, {repeats} floor-and-stage pair(s) per stage")
    header = (
        f"{'stage':7} {'1-proc floor':>12} {'2-proc floor':>13} {'lockstep':>9} {'step':>8} {'x 1-proc':>9} "
        f"{'x 2-proc':>9} {'x lockstep':>10} {'CPU x':>6} {'peak RSS':>9} {'states':>8} {'rank peaks':>10} {'rest':>8}"
    )
    layers = len(parameter_layers(build_model(config.model, config.seed)))
    print(header)
    results = {}
    for stage in stages:
        rows = []
        for _ in range(repeats):
            one_process = floors.one_process(config, world_size, steps, stage)
            floor = floors.floor(config, world_size, steps, stage)
            run = run_measured(stage, world_size, steps, config)
            report = run.report
            meetings = Meetings.of_ledger(report.ledger.ranks[0].entries, 1, layers)
            lockstep = lockstep_floor(config, world_size, steps, stage, meetings)
            states = report.model_state_bytes_mean * world_size
            rank_peaks = sum(tracker.peak_bytes() for tracker in report.trackers)
            step = report.typical_step_seconds
            row = {
                "one_process": one_process.seconds,
                "floor": floor.seconds,
                "lockstep": lockstep,
                "lockstep_ratio": lockstep / floor.seconds,
                "step": step,
                "one_process_ratio": step / one_process.seconds,
                "ratio": step / floor.seconds,
                "cpu_ratio": run.cpu_seconds_per_step / one_process.cpu_seconds,
                "rss": run.peak_rss_bytes,
                "states": states,
                "rank_peaks": rank_peaks,
            }
            rows.append(row)
            print(
                f"ZeRO-{stage:<2} {one_process.seconds:11.3f}s {floor.seconds:12.3f}s {lockstep:8.3f}s {step:7.3f}s "
                f"{row['one_process_ratio']:8.2f}x {row['ratio']:8.2f}x {step / lockstep:9.2f}x "
                f"{row['cpu_ratio']:5.2f}x "
                f"{run.peak_rss_bytes / 1e6:6.0f} MB {states / 1e6:5.0f} MB {rank_peaks / 1e6:7.0f} MB "
                f"{(run.peak_rss_bytes - rank_peaks) / 1e6:5.0f} MB",
                flush=True,
            )
        results[stage] = {key: statistics.median(row[key] for row in rows) for key in rows[0]}
    return results


def time_compare(world_size: int, config_preset: str, *jobs_option: str) -> tuple[float, int]:
    """Wall seconds and peak RSS of `python -m zero_core compare --world-size N --steps 3 [--jobs J]`."""
    command = [
        sys.executable,
        "-m",
        "zero_core",
        "compare",
        "--world-size",
        str(world_size),
        "--steps",
        str(COMPARE_STEPS),
        "--preset",
        config_preset,
        "--no-progress",
        *jobs_option,
    ]
    started = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    peak = _peak_tree_rss_until_exit(child)
    seconds = time.perf_counter() - started
    if child.returncode:
        raise SystemExit(f"{' '.join(command)} failed with exit code {child.returncode}")
    return seconds, peak


def _peak_tree_rss_until_exit(child: subprocess.Popen, every_s: float = 0.1) -> int:
    """The highest RSS of `child` and its worker processes together, sampled until it exits (compare trains
    stages side by side in workers, and the kernel's high-water marks are per process, not per tree)."""
    parent, peak = psutil.Process(child.pid), 0
    while child.poll() is None:
        try:
            peak = max(peak, sum(p.memory_info().rss for p in (parent, *parent.children(recursive=True))))
        except psutil.Error:  # a worker exited between listing it and reading it: the next sample counts
            pass
        time.sleep(every_s)
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="32", help="comma-separated N to sweep (default 32)")
    parser.add_argument("--world-size", type=int, help="one N (the same as --world-sizes N)")
    parser.add_argument("--steps", type=int, default=5, help=f"steps per run at N <= {BIG_WORLD_SIZE}")
    parser.add_argument(
        "--repeats", type=int, default=3, help=f"floor-and-stage pairs per stage at N <= {BIG_WORLD_SIZE}"
    )
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--stages", default="0,1,2,3", help="comma-separated stages to time (default: all four)")
    parser.add_argument(
        "--compare-world-size", type=int, default=0, help="also time `compare --world-size N --steps 3` (0: not)"
    )
    args = parser.parse_args()
    try:
        stages = [int(stage) for stage in args.stages.split(",")]
        world_sizes = [args.world_size] if args.world_size else [int(n) for n in args.world_sizes.split(",")]
    except ValueError:
        parser.error(f"--stages and --world-sizes take numbers separated by commas; got {args.stages!r}")
    if not stages or any(stage not in range(4) for stage in stages):
        parser.error(f"--stages takes stages 0 to 3, got {args.stages!r}")
    if any(n < 1 for n in world_sizes) or args.compare_world_size < 0:
        parser.error("world sizes must be at least 1")
    if args.steps < 3 or args.repeats < 1:
        parser.error("--steps must be at least 3 (a timed step between the first and the last), --repeats at least 1")
    config = TrainConfig(model=preset(args.preset))
    cores = len(machine_cores())
    print(
        f"preset {args.preset}, {cores} cores. Each stage trains alone in this process (as `compare --jobs 1`), "
        f"right after its floors; {FLOOR_METHOD}; beside it, the same in 1 process. Peak RSS of the stage's "
        f"run alone; process at rest {peak_rss_bytes() / 1e6:.0f} MB"
    )
    floors = Floors()
    try:
        by_n = {n: sweep_world_size(floors, config, n, stages, args) for n in world_sizes}
        compare = None
        if args.compare_world_size:
            n = args.compare_world_size
            floor_steps = [floors.floor(config, n, BIG_STEPS, stage).seconds for stage in COMPARE_STAGES]
            compare = (
                COMPARE_STEPS * sum(floor_steps),
                time_compare(n, args.preset, "--jobs", "1"),
                time_compare(n, args.preset),
            )
    finally:
        floors.close()

    print("\nTargets")
    for n, results in by_n.items():
        worst_stage, worst = max(results.items(), key=lambda item: item[1]["ratio"])
        verdict = _verdict(worst["ratio"] <= TARGET_FLOOR_RATIO)
        print(
            f"  N = {n}: worst {worst['ratio']:.2f}x the {FLOOR_PROCESSES}-process floor (ZeRO-{worst_stage}; target "
            f"<= {TARGET_FLOOR_RATIO}x: {verdict}); the code's own work, CPU x, up to "
            f"{max(r['cpu_ratio'] for r in results.values()):.2f}x the floor's"
        )
        for stage, r in results.items():
            if r["ratio"] > TARGET_FLOOR_RATIO:
                print(
                    f"    over the target, ZeRO-{stage} at {r['ratio']:.2f}x: rank threads meeting where it meets, "
                    f"with no stage code (the lockstep floor), take {r['lockstep_ratio']:.2f}x; its own code adds "
                    f"{r['step'] / r['lockstep']:.2f}x on top"
                )
        if n == 32:
            rss = max(r["rss"] for r in results.values())
            print(f"  N = 32: peak RSS {rss / 1e6:.0f} MB (target < 1000 MB: {_verdict(rss < TARGET_RSS_BYTES)})")
            if cores >= 16:
                speedup = min(r["one_process"] / r["step"] for r in results.values())
                verdict = _verdict(speedup >= TARGET_SPEEDUP_ON_16_CORES)
                print(f"  N = 32: slowest stage {speedup:.2f}x faster than one core (target >= 4x: {verdict})")
        if n == max(world_sizes) and n > BIG_WORLD_SIZE:
            rest = max(r["rss"] - r["rank_peaks"] for r in results.values())
            print(f"  N = {n}: peak RSS beyond the sum of the ranks' peaks: at most {rest / 1e6:.0f} MB (a stage)")
    if len(by_n) >= 2:
        print(f"  peak RSS beyond the sum of the ranks' peaks, as a line through N = {', '.join(map(str, by_n))}:")
        for stage in stages:
            rest = [(n, (results[stage]["rss"] - results[stage]["rank_peaks"]) / 1e6) for n, results in by_n.items()]
            per_rank, fixed = statistics.linear_regression(*zip(*rest, strict=True))
            why = " (below zero: its ranks do not all peak at once, so the sum of their peaks overstates)"
            print(f"    ZeRO-{stage}: {fixed:.0f} MB {per_rank:+.2f} MB per rank{why if per_rank < 0 else ''}")
    if compare is not None:
        floor_seconds, (seconds, rss), (seconds_pooled, rss_pooled) = compare
        ratio = seconds / floor_seconds
        jobs = default_jobs(len(COMPARE_STAGES), args.compare_world_size)
        print(
            f"  compare --world-size {args.compare_world_size} --steps {COMPARE_STEPS} --jobs 1: {seconds:.1f} s, "
            f"floor {floor_seconds:.1f} s ({ratio:.2f}x, target <= {TARGET_COMPARE_RATIO}x: "
            f"{_verdict(ratio <= TARGET_COMPARE_RATIO)}), peak RSS {rss / 1e6:.0f} MB; as run by default "
            f"({jobs} stage(s) at a time, each on its share of the cores) {seconds_pooled:.1f} s, "
            f"{rss_pooled / 1e6:.0f} MB (its processes together)"
        )


if __name__ == "__main__":
    main()
