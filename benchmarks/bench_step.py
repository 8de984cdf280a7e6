"""Step time of each stage on 32 virtual GPUs against the compute floor, and peak memory of the process.

The floor is the same work with no distribution at all: the 32 micro-batches' forward and backward run
one after another in one thread with plain autograd, then one Adam step, no communication. A stage's
ratio to it is what the virtual cluster costs (threads, rendezvous, copies); the target is <= 1.5x.

These machines are shared, and their speed drifts by 10-20% over a minute. So each stage is measured
right after its own floor, the pair is repeated `--repeats` times, and the stage's ratio is the median
of its pairs' ratios (every pair is printed). The floor is the median of its steps after the first; a
stage's step is the cluster's wall time per step over the steps between its first and last
(`StageReport.typical_step_seconds`).

    python benchmarks/bench_step.py [--world-size 32] [--steps 5] [--repeats 3] [--preset tiny] [--stages 0,1,2,3]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

from zero_core.experiment import run_stage
from zero_core.memory import MemoryTracker
from zero_core.model import build_model, loss_fn, micro_batch, preset
from zero_core.optim import AdamShard, precision_dtype
from zero_core.partition import flatten
from zero_core.stages import TrainConfig

TARGET_RATIO = 1.5
TARGET_RSS_BYTES = 1e9


def peak_rss_bytes() -> int:
    """The process's peak resident memory so far (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def floor_step_seconds(config: TrainConfig, world_size: int, steps: int) -> float:
    """Median seconds of one step's work done serially in one thread, without any collective."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = build_model(config.model, config.seed).to(precision_dtype(config.precision))
        params = list(model.parameters())
        adam = AdamShard(flatten([p.detach().float() for p in params]), config.adam, MemoryTracker(), "all")
        times = []
        for step in range(steps):
            started = time.perf_counter()
            for rank in range(world_size):
                inputs, targets = micro_batch(config.model, rank, step, config.seed)
                loss_fn(model(inputs), targets).backward()
            with torch.no_grad():
                adam.step(flatten([p.grad for p in params]).float() / world_size, step + 1)
                offset = 0
                for p in params:
                    p.copy_(adam.master[offset : offset + p.numel()].view_as(p))
                    p.grad = None
                    offset += p.numel()
            times.append(time.perf_counter() - started)
        return statistics.median(times[1:] if len(times) > 1 else times)
    finally:
        torch.set_num_threads(threads)


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
    worst = 0.0
    for stage in stages:
        ratios = []
        for _ in range(args.repeats):
            floor = floor_step_seconds(config, args.world_size, args.steps)
            report = run_stage(stage, args.world_size, args.steps, config)
            ratios.append(report.typical_step_seconds / floor)
            print(
                f"  ZeRO-{stage}: {report.typical_step_seconds:.3f} s/step against a floor of {floor:.3f} s/step "
                f"= {ratios[-1]:.2f}x  (inside collectives {report.collective_seconds_per_step_mean:.3f} s/rank)"
            )
        ratio = statistics.median(ratios)
        worst = max(worst, ratio)
        print(f"ZeRO-{stage}: median {ratio:.2f}x floor  (peak RSS so far {peak_rss_bytes() / 1e6:.0f} MB)")
    verdict = "met" if worst <= TARGET_RATIO else "NOT met"
    print(f"worst stage/floor ratio: {worst:.2f}x (target <= {TARGET_RATIO}x: {verdict})")
    rss = peak_rss_bytes()
    print(
        f"peak RSS: {rss / 1e6:.0f} MB (target < {TARGET_RSS_BYTES / 1e6:.0f} MB: "
        f"{'met' if rss < TARGET_RSS_BYTES else 'NOT met'})"
    )


if __name__ == "__main__":
    main()
