"""How much a virtual-cluster collective costs over the bare thread synchronisation it cannot avoid.

At N = 32 a small all-reduce (4 fp32 elements, so the arithmetic is negligible) is timed against one
round of a plain `threading.Barrier` across 32 threads, both in this run and interleaved, best of a few
repeats, so that the ratio depends little on the machine or its load. The target is a ratio of at most
3: the checks that make the cluster safe to teach on (mismatch, deadlock and timeout detection, the
ledger) may cost, but not dominate. The figure is printed, never asserted.

    python benchmarks/bench_collectives.py [--world-size 32] [--rounds 300] [--repeats 5]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zero_core import dist  # noqa: E402
from zero_core.cluster import VirtualCluster  # noqa: E402

TARGET_RATIO = 3.0


def barrier_round_seconds(world_size: int, rounds: int) -> float:
    """Seconds per round of a bare `threading.Barrier` across `world_size` threads."""
    barrier = threading.Barrier(world_size)
    started: list[float] = []
    finished: list[float] = []

    def worker(rank: int) -> None:
        barrier.wait()
        if rank == 0:
            started.append(time.perf_counter())
        for _ in range(rounds):
            barrier.wait()
        if rank == 0:
            finished.append(time.perf_counter())

    threads = [threading.Thread(target=worker, args=(r,), name=f"bench-barrier-{r}") for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return (finished[0] - started[0]) / rounds


def all_reduce_seconds(cluster: VirtualCluster, rounds: int, numel: int) -> float:
    """Seconds per small all-reduce on the virtual cluster (timed on rank 0, after a warm-up barrier)."""

    def rank_fn() -> float:
        tensor = torch.ones(numel)
        dist.barrier()
        started = time.perf_counter()
        for _ in range(rounds):
            dist.all_reduce(tensor, op=dist.ReduceOp.AVG)
        return time.perf_counter() - started

    return cluster.run(rank_fn)[0] / rounds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--numel", type=int, default=4)
    args = parser.parse_args(argv)

    cluster = VirtualCluster(args.world_size, timeout_s=60.0, record_timeline=False)
    barrier_runs, all_reduce_runs = [], []
    for _ in range(args.repeats):
        barrier_runs.append(barrier_round_seconds(args.world_size, args.rounds))
        all_reduce_runs.append(all_reduce_seconds(cluster, args.rounds, args.numel))
    barrier_s, all_reduce_s = min(barrier_runs), min(all_reduce_runs)
    ratio = all_reduce_s / barrier_s
    verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
    print(f"world size {args.world_size}, {args.rounds} rounds, best of {args.repeats}")
    print(f"threading.Barrier round       {barrier_s * 1e3:8.3f} ms")
    print(f"all_reduce of {args.numel} fp32 elements {all_reduce_s * 1e3:8.3f} ms")
    print(f"ratio {ratio:.2f}x (target <= {TARGET_RATIO:.0f}x: {verdict})")


if __name__ == "__main__":
    main()
