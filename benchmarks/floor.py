"""The two-process floor: what a stage's step would cost with no virtual cluster at all, one home for it.

A stage's step on N virtual GPUs does the N ranks' forward and backward and the Adam steps of the
replicas the stage keeps, plus what the cluster adds (threads, rendezvous, copies, the ledgers). The floor
is that same work with no communication and no cluster, split over two processes:

- the N micro-batches' forward and backward with plain autograd, ranks 0, 2, 4, ... in one process and
  1, 3, 5, ... in the other;
- then one Adam step per replica the stage keeps: ZeRO-0 keeps one full replica per rank, so each
  process steps one for each of its ranks; ZeRO-1..3 keep one replica in all, partitioned, so each
  process steps its half of it.

Two processes, each with one thread and an interpreter lock of its own, is the fairest floor for the
course's development machine (two cores) and the cheapest way a user could run the same work in parallel
without the simulator. Every benchmark that prints a ratio to a floor takes it from here
(`benchmarks/bench_step.py`, `benchmarks/bench_bound.py`); the one-process floor, the same work in one
thread, is printed beside it. A step of either is the median of the steps after the first; each step
ends at a barrier of the processes, so it lasts as long as the slower one.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from zero_core.memory import MemoryTracker
from zero_core.model import build_model, loss_fn, micro_batch
from zero_core.optim import AdamShard, precision_dtype
from zero_core.partition import flatten
from zero_core.stages import TrainConfig

FLOOR_PROCESSES = 2
"""The processes the floor's work is split over."""
FLOOR_METHOD = (
    f"the floor: the same micro-batches' forward and backward and one Adam step per replica the stage keeps, "
    f"no communication, split over {FLOOR_PROCESSES} processes (benchmarks/floor.py)"
)
"""How every benchmark that prints a ratio to the floor says what it divides by."""


def floor_work(
    config: TrainConfig, world_size: int, steps: int, stage: int, worker: int, workers: int, barrier: Any = None
) -> list[tuple[float, float]]:
    """One worker's share of the floor's work, `steps` times; per step (seconds, CPU seconds) (each step
    between two barriers when there are several workers, so that a step lasts as long as its slowest one).

    The worker runs forward and backward for the micro-batches of ranks worker, worker + workers, ...; then
    the Adam steps of the replicas the stage keeps (see the module's docstring).
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


def typical(times: list[float]) -> float:
    """The median step after the first (which pays for first-touch allocations and warm-up)."""
    return statistics.median(times[1:] if len(times) > 1 else times)


def _worker_main(args: tuple) -> list[tuple[float, float]]:
    *work, barrier = args
    return floor_work(*work, barrier=barrier)


@dataclass
class Floor:
    """Seconds per step of the floor's work, and the CPU seconds it takes (all processes together)."""

    seconds: float
    cpu_seconds: float


class Floors:
    """The worker processes that run the floors, started once (a new process imports torch again: seconds).

    Their memory stays out of a benchmark's peak RSS, which is the cluster's.
    """

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._manager = context.Manager()
        self._barrier = self._manager.Barrier(FLOOR_PROCESSES)
        self._one = context.Pool(1)
        self._many = context.Pool(FLOOR_PROCESSES)

    def measure(self, config: TrainConfig, world_size: int, steps: int, stage: int, processes: int) -> Floor:
        """The floor's work over `processes` processes (1, or `FLOOR_PROCESSES`), one thread each."""
        if processes not in (1, FLOOR_PROCESSES):
            raise ValueError(f"a floor runs in 1 or {FLOOR_PROCESSES} processes, not {processes}")
        pool, barrier = (self._one, None) if processes == 1 else (self._many, self._barrier)
        jobs = [(config, world_size, steps, stage, worker, processes, barrier) for worker in range(processes)]
        per_worker = pool.map(_worker_main, jobs)
        per_step = list(zip(*per_worker, strict=True))
        seconds = typical([max(wall for wall, _ in step) for step in per_step])
        cpu = typical([sum(cpu for _, cpu in step) for step in per_step])
        return Floor(seconds, cpu)

    def floor(self, config: TrainConfig, world_size: int, steps: int, stage: int) -> Floor:
        """The two-process floor of `stage` at `world_size`."""
        return self.measure(config, world_size, steps, stage, FLOOR_PROCESSES)

    def one_process(self, config: TrainConfig, world_size: int, steps: int, stage: int) -> Floor:
        """The same work in one process."""
        return self.measure(config, world_size, steps, stage, 1)

    def close(self) -> None:
        self._one.close()
        self._many.close()
        self._manager.shutdown()
