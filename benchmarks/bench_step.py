"""Step time and memory of each stage on N virtual GPUs against the compute floor, for one or several N.

The floor is the same work with no communication: the N micro-batches' forward and backward with plain
autograd, then the Adam steps of the replicas the stage keeps (ZeRO-0: one full replica per rank;
ZeRO-1..3: one replica, partitioned). It is measured twice: in one process (the one-core floor) and spread
over as many processes as the cluster may use cores (the C-core floor, the fair one: against one core, a
cluster that uses two looks better than it is). A stage's ratio to them is what the virtual cluster costs
(threads, rendezvous, copies). Targets: at most 1.3x the C-core floor; with 16 cores or more, at N = 32, a
step at least 4x faster than the one-core floor.

Per stage it also prints:
- `CPU x`: the CPU seconds the whole process spends per step (every rank thread) over the one-core floor's.
  Work does not shrink by being spread over cores, so with the floor spread perfectly this is the lowest
  ratio to the C-core floor any way of running the stage's code could reach: the bound the code itself sets.
- peak RSS of the stage's run alone (the kernel's high-water mark, reset before it), the sum over the ranks
  of their model states and of their peak bytes (what `compare` reports per GPU, summed), and the rest: what
  the process holds beyond what the ranks hold (the interpreter and torch, about 0.23 GB here; Python objects
  per rank; the allocator's free lists).

These machines are shared, and their speed drifts by 10-20% over a minute. So each stage is measured right
after its own floors, and the pair is repeated `--repeats` times at N <= 32 (once above: a step of 256 ranks
takes seconds); the stage's ratio is the median of its pairs' ratios. A floor is the median of its steps
after the first; a stage's step is the cluster's wall time per step over the steps between its first and last
(`StageReport.typical_step_seconds`). `--compare-world-size N` also times `python -m zero_core compare
--world-size N --steps 3` as a user runs it, stages side by side in worker processes from N = 32 on (target:
within 4x its floor, the C-core floor steps of the four stages it trains, measured right before it), and
the peak of its processes' RSS together; then again with `--jobs 1`, all four stages in one process.

    python benchmarks/bench_step.py [--world-sizes 8,32,128,256] [--steps 5] [--repeats 3] [--preset tiny]
                                    [--stages 0,1,2,3] [--compare-world-size 256]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import multiprocessing
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from zero_core.cluster import machine_cores
from zero_core.experiment import run_stage
from zero_core.memory import MemoryTracker
from zero_core.model import build_model, loss_fn, micro_batch, preset
from zero_core.optim import AdamShard, precision_dtype
from zero_core.partition import flatten
from zero_core.report import StageReport
from zero_core.stage_pool import default_jobs
from zero_core.stages import TrainConfig

TARGET_PARALLEL_RATIO = 1.3
"""Against the same work spread over the cores the cluster may use."""
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


def _floor_work(
    config: TrainConfig, world_size: int, steps: int, stage: int, worker: int, workers: int, barrier: Any = None
) -> list[tuple[float, float]]:
    """One worker's share of a step's work, `steps` times; per step (seconds, CPU seconds) (each step between
    two barriers when there are several workers, so that a step lasts as long as its slowest worker).

    The work of a step, split over `workers`: forward and backward of the micro-batches of ranks worker,
    worker + workers, ...; then the Adam steps of the replicas the stage keeps. ZeRO-0 keeps one full
    replica per rank, so the worker steps one for each of its ranks; ZeRO-1..3 keep one replica in all,
    partitioned, so the worker steps its 1/workers of it. No communication: that is what the floor leaves out.
    """
    torch.set_num_threads(1)
    model = build_model(config.model, config.seed).to(precision_dtype(config.precision))
    params = list(model.parameters())
    master = flatten([p.detach().float() for p in params])
    ranks = range(worker, world_size, workers)
    if stage == 0:
        slices = [slice(0, master.numel())] * len(ranks)
    else:
        slices = [slice(worker * master.numel() // workers, (worker + 1) * master.numel() // workers)]
    adams = [AdamShard(master[piece].clone(), config.adam, MemoryTracker(), "floor") for piece in slices]
    times = []
    for step in range(steps):
        if barrier is not None:
            barrier.wait()
        started, cpu_started = time.perf_counter(), time.thread_time()
        for rank in ranks:
            inputs, targets = micro_batch(config.model, rank, step, config.seed)
            loss_fn(model(inputs), targets).backward()
        with torch.no_grad():
            grad = flatten([p.grad for p in params]).float() / world_size
            for adam, piece in zip(adams, slices, strict=True):
                adam.step(grad[piece], step + 1)
                master[piece] = adam.master
            offset = 0
            for p in params:
                p.copy_(master[offset : offset + p.numel()].view_as(p))
                p.grad = None
                offset += p.numel()
        cpu = time.thread_time() - cpu_started
        if barrier is not None:
            barrier.wait()
        times.append((time.perf_counter() - started, cpu))
    return times


def _typical(times: list[float]) -> float:
    return statistics.median(times[1:] if len(times) > 1 else times)


def _worker_main(args: tuple) -> list[tuple[float, float]]:
    *work, barrier = args
    return _floor_work(*work, barrier=barrier)


@dataclass
class Floor:
    """Seconds per step of the floor's work, and the CPU seconds it takes (all workers together)."""

    seconds: float
    cpu_seconds: float


class Floors:
    """Worker processes that run the floors, started once: a new process imports torch again (seconds).

    Their own memory stays out of the bench's peak RSS, which is the cluster's.
    """

    def __init__(self, cores: int) -> None:
        self.cores = cores
        context = multiprocessing.get_context("spawn")
        self._manager = context.Manager()
        self._barrier = self._manager.Barrier(cores)
        self._one = context.Pool(1)
        self._many = context.Pool(cores)

    def measure(self, config: TrainConfig, world_size: int, steps: int, stage: int, cores: int) -> Floor:
        """A step's work spread over `cores` processes (1 or all), one thread each: the median step."""
        pool, barrier = (self._one, None) if cores == 1 else (self._many, self._barrier)
        jobs = [(config, world_size, steps, stage, worker, cores, barrier) for worker in range(cores)]
        per_worker = pool.map(_worker_main, jobs)
        per_step = list(zip(*per_worker, strict=True))
        seconds = _typical([max(wall for wall, _ in step) for step in per_step])
        cpu = _typical([sum(cpu for _, cpu in step) for step in per_step])
        return Floor(seconds, cpu)

    def close(self) -> None:
        self._one.close()
        self._many.close()
        self._manager.shutdown()


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
    cores = floors.cores
    print(f"\nN = {world_size}: {steps} steps per run, {repeats} floor-and-stage pair(s) per stage")
    header = (
        f"{'stage':7} {'1-core floor':>12} {f'{cores}-core floor':>13} {'step':>8} {'x 1-core':>9} "
        f"{f'x {cores}-core':>9} {'CPU x':>6} {'peak RSS':>9} {'states':>8} {'rank peaks':>10} {'rest':>8}"
    )
    print(header)
    results = {}
    for stage in stages:
        rows = []
        for _ in range(repeats):
            floor = floors.measure(config, world_size, steps, stage, 1)
            parallel_floor = floors.measure(config, world_size, steps, stage, cores)
            run = run_measured(stage, world_size, steps, config)
            report = run.report
            states = report.model_state_bytes_mean * world_size
            rank_peaks = sum(tracker.peak_bytes() for tracker in report.trackers)
            step = report.typical_step_seconds
            row = {
                "floor": floor.seconds,
                "parallel_floor": parallel_floor.seconds,
                "step": step,
                "ratio": step / floor.seconds,
                "parallel_ratio": step / parallel_floor.seconds,
                "cpu_ratio": run.cpu_seconds_per_step / floor.cpu_seconds,
                "rss": run.peak_rss_bytes,
                "states": states,
                "rank_peaks": rank_peaks,
            }
            rows.append(row)
            print(
                f"ZeRO-{stage:<2} {floor.seconds:11.3f}s {parallel_floor.seconds:12.3f}s {step:7.3f}s "
                f"{row['ratio']:8.2f}x {row['parallel_ratio']:8.2f}x {row['cpu_ratio']:5.2f}x "
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
        f"preset {args.preset}, {cores} cores; each stage right after its floors (the N micro-batches with no "
        f"communication, in 1 process and in {cores}); peak RSS of the stage's run alone; process at rest "
        f"{peak_rss_bytes() / 1e6:.0f} MB"
    )
    floors = Floors(cores)
    try:
        by_n = {n: sweep_world_size(floors, config, n, stages, args) for n in world_sizes}
        compare = None
        if args.compare_world_size:
            n = args.compare_world_size
            floor_steps = [floors.measure(config, n, BIG_STEPS, stage, cores).seconds for stage in COMPARE_STAGES]
            compare = (
                COMPARE_STEPS * sum(floor_steps),
                time_compare(n, args.preset),
                time_compare(n, args.preset, "--jobs", "1"),
            )
    finally:
        floors.close()

    print("\nTargets")
    for n, results in by_n.items():
        worst = max(results.values(), key=lambda r: r["parallel_ratio"])
        worst_stage = next(stage for stage, r in results.items() if r is worst)
        bound = max(r["cpu_ratio"] for r in results.values())
        print(
            f"  N = {n}: worst {worst['parallel_ratio']:.2f}x the {cores}-core floor (ZeRO-{worst_stage}; target <= "
            f"{TARGET_PARALLEL_RATIO}x: {_verdict(worst['parallel_ratio'] <= TARGET_PARALLEL_RATIO)}); "
            f"the code's own bound, CPU x, up to {bound:.2f}x"
        )
        if n == 32:
            rss = max(r["rss"] for r in results.values())
            print(f"  N = 32: peak RSS {rss / 1e6:.0f} MB (target < 1000 MB: {_verdict(rss < TARGET_RSS_BYTES)})")
            if cores >= 16:
                speedup = min(r["floor"] / r["step"] for r in results.values())
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
        floor_seconds, (seconds, rss), (seconds_alone, rss_alone) = compare
        ratio = seconds / floor_seconds
        jobs = default_jobs(len(COMPARE_STAGES), args.compare_world_size)
        print(
            f"  compare --world-size {args.compare_world_size} --steps {COMPARE_STEPS} ({jobs} stage(s) at a time): "
            f"{seconds:.1f} s, floor {floor_seconds:.1f} s ({ratio:.2f}x, target <= {TARGET_COMPARE_RATIO}x: "
            f"{_verdict(ratio <= TARGET_COMPARE_RATIO)}), peak RSS {rss / 1e6:.0f} MB (its processes together); "
            f"with --jobs 1 {seconds_alone:.1f} s ({seconds_alone / floor_seconds:.2f}x), {rss_alone / 1e6:.0f} MB"
        )


if __name__ == "__main__":
    main()
