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

The lockstep floor is the same work again, as the virtual cluster runs it: one rank thread per rank, and
the ranks meeting in a `dist.barrier` wherever the stage meets them in a collective (as many per layer in
forward and in backward, after backward and after the update, as a run of the stage records in its
ledger), with no stage code, no data moved and nothing tracked. Between two collectives every rank but
the last to arrive must stop and let the others run, so N ranks on a few cores take turns at every
collective: a thread switch and a cold cache each time. That is what simulating the stage's schedule on
rank threads costs before any of its code runs; a stage's step over it is what the stage's own code adds.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from zero_core import dist
from zero_core.cluster import VirtualCluster
from zero_core.memory import MemoryTracker
from zero_core.model import build_model, loss_fn, micro_batch, parameter_layers
from zero_core.optim import AdamShard, precision_dtype
from zero_core.partition import flatten
from zero_core.stage_pool import worker_context
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
    """The worker processes that run the floors, started once, as the stage pool's are
    (`zero_core.stage_pool.worker_context`).

    Their memory stays out of a benchmark's peak RSS, which is the cluster's.
    """

    def __init__(self) -> None:
        context = worker_context()
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


@dataclass(frozen=True)
class Meetings:
    """Where a stage's ranks meet in collectives in one step, as counts: per parameter layer in forward and in
    backward, then after backward and after the update (the stage's gradient sync and optimizer phases)."""

    forward_per_layer: int
    backward_per_layer: int
    after_backward: int
    after_update: int

    @classmethod
    def of_ledger(cls, entries: list[Any], step: int, layers: int) -> Meetings:
        """The counts of a rank's ledger entries (`comm.CommEntry`) in `step`, by the phase they ran in."""
        by_phase = {phase: 0 for phase in ("forward", "backward", "grad_sync", "optimizer")}
        for entry in entries:
            if entry.step == step and entry.phase in by_phase:
                by_phase[entry.phase] += 1
        if by_phase["forward"] % layers or by_phase["backward"] % layers:
            raise ValueError(f"{by_phase} collectives in one step do not split evenly over {layers} layers")
        return cls(by_phase["forward"] // layers, by_phase["backward"] // layers, by_phase["grad_sync"],
                   by_phase["optimizer"])


def lockstep_work(config: TrainConfig, steps: int, stage: int, meetings: Meetings) -> list[float]:
    """One rank thread's floor work on the virtual cluster, meeting the others at `meetings`; seconds per step.

    A forward pre-hook on each parameter layer meets the ranks before the layer runs; a hook on the layer's
    first parameter meets them when its gradient is computed. ZeRO-0 steps Adam on a full replica, ZeRO-1..3
    on the rank's 1/N of it, as the floor does.
    """
    torch.set_num_threads(1)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_model(config.model, config.seed).to(precision_dtype(config.precision))

    def meet(times: int) -> None:
        for _ in range(times):
            dist.barrier()

    for _, layer in parameter_layers(model):
        if meetings.forward_per_layer:
            layer.register_forward_pre_hook(lambda *_: meet(meetings.forward_per_layer))
        if meetings.backward_per_layer:
            next(layer.parameters()).register_hook(lambda grad: meet(meetings.backward_per_layer))
    params = list(model.parameters())
    master = flatten([p.detach().float() for p in params])
    if stage == 0:
        piece = slice(0, master.numel())
    else:
        piece = slice(rank * master.numel() // world_size, (rank + 1) * master.numel() // world_size)
    adam = AdamShard(master[piece].clone(), config.adam, MemoryTracker(), "floor")
    times = []
    for step in range(steps):
        dist.barrier()
        started = time.perf_counter()
        inputs, targets = micro_batch(config.model, rank, step, config.seed)
        loss_fn(model(inputs), targets).backward()
        meet(meetings.after_backward)
        with torch.no_grad():
            grad = flatten([p.grad for p in params]).float() / world_size
            adam.step(grad[piece], step + 1)
            for p in params:
                p.grad = None
        meet(meetings.after_update)
        times.append(time.perf_counter() - started)
    return times


def lockstep_floor(config: TrainConfig, world_size: int, steps: int, stage: int, meetings: Meetings) -> float:
    """The lockstep floor: seconds per step of `lockstep_work` on `world_size` rank threads (the slowest rank's
    step, the median after the first), with the virtual cluster's default CPU slots."""
    per_rank = VirtualCluster(world_size, timeout_s=120.0).run(lockstep_work, config, steps, stage, meetings)
    return typical([max(step) for step in zip(*per_rank, strict=True)])
