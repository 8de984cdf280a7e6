"""Step time of each stage on 32 virtual GPUs against the compute floor, and peak memory of the process.

The floor is the same work with no distribution at all: the 32 micro-batches' forward and backward run
one after another in one thread with plain autograd, then one Adam step, no communication. A stage's
ratio to it is what the virtual cluster costs (threads, rendezvous, copies); the target is <= 1.5x.
Both are measured in this run, because these machines are shared: the floor as the median of its steps
after the first, a stage as the cluster's wall time per step over the steps between its first and last
(`StageReport.typical_step_seconds`).

    python benchmarks/bench_step.py [--world-size 32] [--steps 5] [--preset tiny]
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
    parser.add_argument("--preset", default="tiny")
    args = parser.parse_args()
    config = TrainConfig(model=preset(args.preset))
    floor = floor_step_seconds(config, args.world_size, args.steps)
    print(f"compute floor ({args.world_size} micro-batches, one thread, no communication): {floor:.3f} s/step")
    worst = 0.0
    for stage in range(4):
        report = run_stage(stage, args.world_size, args.steps, config)
        seconds = report.typical_step_seconds
        ratio = seconds / floor
        worst = max(worst, ratio)
        print(
            f"ZeRO-{stage}: {seconds:.3f} s/step  = {ratio:.2f}x floor  "
            f"(inside collectives {report.collective_seconds_per_step_mean:.3f} s/rank; "
            f"peak RSS so far {peak_rss_bytes() / 1e6:.0f} MB)"
        )
    verdict = "met" if worst <= TARGET_RATIO else "NOT met"
    print(f"worst stage/floor ratio: {worst:.2f}x (target <= {TARGET_RATIO}x: {verdict})")
    rss = peak_rss_bytes()
    print(
        f"peak RSS: {rss / 1e6:.0f} MB (target < {TARGET_RSS_BYTES / 1e6:.0f} MB: "
        f"{'met' if rss < TARGET_RSS_BYTES else 'NOT met'})"
    )


if __name__ == "__main__":
    main()
