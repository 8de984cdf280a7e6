"""What a virtual-cluster collective costs, against PyTorch's own threaded process group and bare threads.

Two comparisons, each timed on rank 0 after a warm-up barrier, best of a few repeats, so that a ratio
depends little on the machine or its load:

1. Against the reference a user would otherwise pick to run N ranks as threads of one process: PyTorch's
   threaded process group (`torch.testing._internal.distributed.multi_threaded_pg`, the backend
   "threaded" that PyTorch's own tests use). Per collective (all-reduce, reduce-scatter, all-gather,
   barrier), per size (1 KB and 1 MB of fp32, the full buffer: the all-reduce's tensor, the reduce-scatter's
   input, the all-gather's output) and per N: microseconds per call on each, and the threaded group's
   time over the virtual cluster's (above 1: the virtual cluster is faster). Reductions are sums on both.
2. Against the thread synchronisation a collective cannot avoid: a small all-reduce (4 fp32 elements, so
   the arithmetic is negligible) against one round of a plain `threading.Barrier` across the same threads.
   The target is a ratio of at most 3: the checks that make the cluster safe to teach on (mismatch,
   deadlock and timeout detection, the ledger) may cost, but not dominate.

The figures are printed, never asserted.

    python benchmarks/bench_collectives.py [--world-sizes 8,32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zero_core import dist  # noqa: E402
from zero_core.cluster import VirtualCluster  # noqa: E402

TARGET_RATIO = 3.0
OPS = ("all_reduce", "reduce_scatter", "all_gather", "barrier")
SIZES = {"1KB": 1024, "1MB": 1024 * 1024}
FP32_BYTES = 4
CALL_SECONDS = 0.3
"""About how long each cell's timed calls last, whatever one call costs (at least 5 calls, at most 300)."""


def _rounds(nbytes: int, world_size: int) -> int:
    """Calls per timed run: many for small collectives, few for large ones (which cost about N x bytes)."""
    guess = CALL_SECONDS / (2e-5 + world_size * nbytes / 1e9)
    return max(5, min(300, int(guess)))


def _buffers(op: str, nbytes: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, output) of `op` on a full buffer of `nbytes` (an all-reduce's are one tensor)."""
    full = torch.ones(max(world_size, nbytes // FP32_BYTES // world_size * world_size))
    shard = torch.ones(full.numel() // world_size)
    if op == "reduce_scatter":
        return full, shard
    if op == "all_gather":
        return shard, full
    return full, full


def virtual_seconds(cluster: VirtualCluster, op: str, nbytes: int, rounds: int) -> float:
    """Seconds per `op` on the virtual cluster (rank 0's wall time after a barrier)."""

    def rank_fn() -> float:
        source, target = _buffers(op, nbytes, cluster.world_size)
        call: Callable[[], object] = {
            "all_reduce": lambda: dist.all_reduce(source),
            "reduce_scatter": lambda: dist.reduce_scatter_single(target, source),
            "all_gather": lambda: dist.all_gather_single(target, source),
            "barrier": dist.barrier,
        }[op]
        dist.barrier()
        started = time.perf_counter()
        for _ in range(rounds):
            call()
        return time.perf_counter() - started

    return cluster.run(rank_fn)[0] / rounds


def threaded_group_seconds(world_size: int, op: str, nbytes: int, rounds: int) -> float:
    """Seconds per `op` on PyTorch's threaded process group: `world_size` threads, as its own tests run it."""
    import torch.distributed as tdist
    from torch.testing._internal.distributed import multi_threaded_pg

    reduce_scatter = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor
    all_gather = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
    store = tdist.HashStore()
    results: list[float] = [0.0] * world_size
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        tdist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
        try:
            source, target = _buffers(op, nbytes, world_size)
            call: Callable[[], object] = {
                "all_reduce": lambda: tdist.all_reduce(source),
                "reduce_scatter": lambda: reduce_scatter(target, source),
                "all_gather": lambda: all_gather(target, source),
                "barrier": tdist.barrier,
            }[op]
            tdist.barrier()
            started = time.perf_counter()
            for _ in range(rounds):
                call()
            results[rank] = (time.perf_counter() - started) / rounds
        except BaseException as error:  # noqa: BLE001 - handed to the caller, which raises it
            errors.append(error)
        finally:
            tdist.destroy_process_group()

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    multi_threaded_pg._install_threaded_pg()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            threads = [threading.Thread(target=worker, args=(rank,)) for rank in range(world_size)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    finally:
        multi_threaded_pg._uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        raise errors[0]
    return results[0]


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


def against_threaded_group(world_sizes: list[int], repeats: int) -> None:
    """Part 1's table: every op, size and N on both, best of `repeats`."""
    print("1. the virtual cluster against PyTorch's threaded process group (us per call, rank 0, best of "
          f"{repeats}; x: the threaded group's time over the virtual cluster's)")
    print(f"{'collective':15} {'size':>5} {'N':>4} {'virtual':>10} {'threaded':>10} {'x':>7}")
    ratios = []
    for world_size in world_sizes:
        cluster = VirtualCluster(world_size, timeout_s=120.0, record_timeline=False)
        for op in OPS:
            for size_name, nbytes in SIZES.items() if op != "barrier" else (("-", 0),):
                rounds = _rounds(nbytes, world_size)
                virtual = min(virtual_seconds(cluster, op, nbytes, rounds) for _ in range(repeats))
                threaded = min(threaded_group_seconds(world_size, op, nbytes, rounds) for _ in range(repeats))
                ratios.append(threaded / virtual)
                print(
                    f"{op:15} {size_name:>5} {world_size:>4} {virtual * 1e6:10.1f} {threaded * 1e6:10.1f} "
                    f"{threaded / virtual:6.2f}x",
                    flush=True,
                )
    faster = sum(ratio > 1 for ratio in ratios)
    print(
        f"the virtual cluster is faster in {faster} of {len(ratios)} cells "
        f"(the threaded group's time over it: {min(ratios):.2f}x to {max(ratios):.2f}x)"
    )


def against_bare_threads(world_size: int, repeats: int, rounds: int = 300, numel: int = 4) -> None:
    """Part 2: a tiny all-reduce against a `threading.Barrier` round, interleaved, best of `repeats`."""
    cluster = VirtualCluster(world_size, timeout_s=60.0, record_timeline=False)
    barrier_runs, all_reduce_runs = [], []
    for _ in range(repeats):
        barrier_runs.append(barrier_round_seconds(world_size, rounds))
        all_reduce_runs.append(virtual_seconds(cluster, "all_reduce", numel * FP32_BYTES, rounds))
    barrier_s, all_reduce_s = min(barrier_runs), min(all_reduce_runs)
    ratio = all_reduce_s / barrier_s
    verdict = "met" if ratio <= TARGET_RATIO else "NOT met"
    print(f"\n2. world size {world_size}, {rounds} rounds, best of {repeats}")
    print(f"threading.Barrier round       {barrier_s * 1e3:8.3f} ms")
    print(f"all_reduce of {numel} fp32 elements {all_reduce_s * 1e3:8.3f} ms")
    print(f"ratio {ratio:.2f}x (target <= {TARGET_RATIO:.0f}x: {verdict})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", default="8,32", help="comma-separated N (default 8,32)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    try:
        world_sizes = [int(n) for n in args.world_sizes.split(",")]
    except ValueError:
        parser.error(f"--world-sizes takes numbers separated by commas, got {args.world_sizes!r}")
    if any(n < 2 for n in world_sizes) or args.repeats < 1:
        parser.error("world sizes must be at least 2, --repeats at least 1")
    torch.set_num_threads(1)
    against_threaded_group(world_sizes, args.repeats)
    against_bare_threads(max(world_sizes), args.repeats)


if __name__ == "__main__":
    main()
