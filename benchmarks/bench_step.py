"""Step time of each stage on 32 virtual GPUs against the compute floor, and peak memory of the process.

The floor is the same work with no communication: the 32 micro-batches' forward and backward with plain
autograd, then the Adam steps of the replicas the stage keeps (ZeRO-0: one full replica per rank;
ZeRO-1..3: one replica, partitioned). It is measured twice: in one thread (the one-core floor, target
<= 1.5x) and spread over as many processes as the cluster may use cores (the fair floor, target <= 1.3x):
against one core, a cluster that uses two looks better than it is. A stage's ratio to them is what the
virtual cluster costs (threads, rendezvous, copies).

These machines are shared, and their speed drifts by 10-20% over a minute. So each stage is measured
right after its own floor, the pair is repeated `--repeats` times, and the stage's ratio is the median
of its pairs' ratios (every pair is printed). The floor is the median of its steps after the first; a
stage's step is the cluster's wall time per step over the steps between its first and last
(`StageReport.typical_step_seconds`).

    python benchmarks/bench_step.py [--world-size 32] [--steps 5] [--repeats 3] [--preset tiny] [--stages 0,1,2,3]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import statistics
import time
from typing import Any

import torch

from zero_core.experiment import run_stage
from zero_core.memory import MemoryTracker
from zero_core.model import build_model, loss_fn, micro_batch, preset
from zero_core.optim import AdamShard, precision_dtype
from zero_core.partition import flatten
from zero_core.stages import TrainConfig

TARGET_RATIO = 1.5
TARGET_PARALLEL_RATIO = 1.3
"""Against the same work spread over the cores the cluster may use (issue: at most 1.3x on 2 cores)."""
TARGET_RSS_BYTES = 1e9


def peak_rss_bytes() -> int:
    """The process's peak resident memory so far (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _floor_work(
    config: TrainConfig, world_size: int, steps: int, stage: int, worker: int, workers: int, barrier: Any = None
) -> list[float]:
    """One worker's share of a step's work, `steps` times; seconds per step (each between two barriers when
    there are several workers, so that a step lasts as long as its slowest worker).

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
        started = time.perf_counter()
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
        if barrier is not None:
            barrier.wait()
        times.append(time.perf_counter() - started)
    return times


def _typical(times: list[float]) -> float:
    return statistics.median(times[1:] if len(times) > 1 else times)


def _worker_main(args: tuple) -> list[float]:
    *work, barrier = args
    return _floor_work(*work, barrier=barrier)


def floor_step_seconds(config: TrainConfig, world_size: int, steps: int, stage: int, cores: int) -> float:
    """Median seconds of one step's work spread over `cores` processes, one thread each: with `cores` = 1
    the serial floor, with the cores the cluster may use the fair one (the serial floor flatters any
    parallel run). The floors run in processes of their own, so the bench's peak RSS is the cluster's."""
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        barrier = manager.Barrier(cores)
        with context.Pool(cores) as pool:
            jobs = [(config, world_size, steps, stage, worker, cores, barrier) for worker in range(cores)]
            per_worker = pool.map(_worker_main, jobs)
    return _typical([max(step) for step in zip(*per_worker, strict=True)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3, help="floor-and-stage pairs per stage (median)")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--stages", default="0,1,2,3", help="comma-separated stages to time (default: all four)")
    args = parser.parse_args()
    try:
        stages = [int(stage) for stage in args.stages.split(",")]
    except ValueError:
        parser.error(f"--stages takes stage numbers separated by commas, e.g. 0,3; got {args.stages!r}")
    if not stages or any(stage not in range(4) for stage in stages):
        parser.error(f"--stages takes stages 0 to 3, got {args.stages!r}")
    if args.world_size < 1:
        parser.error(f"--world-size must be at least 1, got {args.world_size}")
    if args.steps < 3 or args.repeats < 1:
        parser.error("--steps must be at least 3 (a timed step between the first and the last), --repeats at least 1")
    config = TrainConfig(model=preset(args.preset))
    print(
        f"{args.world_size} virtual GPUs, preset {args.preset}, {args.steps} steps per run; each stage is timed "
        f"right after its floor ({args.world_size} micro-batches in one thread, no communication), "
        f"{args.repeats} times"
    )
    cores = len(os.sched_getaffinity(0))
    worst = worst_parallel = 0.0
    for stage in stages:
        ratios, parallel_ratios = [], []
        for _ in range(args.repeats):
            floor = floor_step_seconds(config, args.world_size, args.steps, stage, 1)
            parallel_floor = floor_step_seconds(config, args.world_size, args.steps, stage, cores)
            report = run_stage(stage, args.world_size, args.steps, config)
            ratios.append(report.typical_step_seconds / floor)
            parallel_ratios.append(report.typical_step_seconds / parallel_floor)
            print(
                f"  ZeRO-{stage}: {report.typical_step_seconds:.3f} s/step; floor on 1 core {floor:.3f} s/step "
                f"({ratios[-1]:.2f}x), on {cores} cores {parallel_floor:.3f} s/step ({parallel_ratios[-1]:.2f}x); "
                f"inside collectives {report.collective_seconds_per_step_mean:.3f} s/rank"
            )
        ratio, parallel_ratio = statistics.median(ratios), statistics.median(parallel_ratios)
        worst, worst_parallel = max(worst, ratio), max(worst_parallel, parallel_ratio)
        print(
            f"ZeRO-{stage}: median {ratio:.2f}x the 1-core floor, {parallel_ratio:.2f}x the {cores}-core floor  "
            f"(peak RSS so far {peak_rss_bytes() / 1e6:.0f} MB)"
        )
    verdict = "met" if worst <= TARGET_RATIO else "NOT met"
    print(f"worst stage/floor ratio: {worst:.2f}x the 1-core floor (target <= {TARGET_RATIO}x: {verdict})")
    verdict = "met" if worst_parallel <= TARGET_PARALLEL_RATIO else "NOT met"
    print(
        f"worst stage/floor ratio: {worst_parallel:.2f}x the {cores}-core floor "
        f"(target <= {TARGET_PARALLEL_RATIO}x: {verdict})"
    )
    rss = peak_rss_bytes()
    print(
        f"peak RSS: {rss / 1e6:.0f} MB (target < {TARGET_RSS_BYTES / 1e6:.0f} MB: "
        f"{'met' if rss < TARGET_RSS_BYTES else 'NOT met'})"
    )


if __name__ == "__main__":
    main()
