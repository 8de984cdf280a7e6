"""Run ZeRO stages on the virtual cluster for k steps, measuring them, and compare their training.

`run_stage` trains one stage on N rank threads: every rank runs `train_on_rank`, which times each phase
and instruments the last step (FLOPs, activations, an audit of every storage); `zero_core.report` turns
what the ranks measured into a `StageReport`. `compare_stages` runs several stages on one configuration
(side by side in worker processes when asked: `zero_core.stage_pool`), and `equivalence` says how far a
stage's training is from ZeRO-0's, which the course claims is nothing at all.

Stages are the paper's numbers 0-3, or the names of the stages beyond the paper ("offload", "hsdp", ...),
which take `gpus_per_node`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

from zero_core import memory
from zero_core.backends.base import CollectiveCall
from zero_core.backends.virtual import VirtualBackend
from zero_core.cluster import VirtualCluster, one_torch_thread
from zero_core.context import current
from zero_core.flops import FlopMeter
from zero_core.report import PHASES, RankResult, StageReport, build_report
from zero_core.stage_pool import train_in_workers
from zero_core.stages import STAGES, TrainConfig, stage_class


def train_on_rank(
    config: TrainConfig,
    stage: int | str,
    steps: int,
    functions: dict | None,
    on_step: Callable[[int], None] | None,
    gpus_per_node: int | None = None,
) -> RankResult:
    """Train `stage` on the calling rank for `steps` steps, timing every phase and instrumenting the last.

    The last step counts FLOPs per phase and the activations autograd saves, and audits every storage
    the rank allocates (`memory.StorageAudit`, which carries the FLOP meter: one dispatch mode, not two
    stacked, so each tensor operation passes through Python once), as does the stage's setup: its memory
    peaks are the report's, true peaks of live bytes with every temporary in them. The audit sees each
    tensor operation, which makes a step about twice as slow at N = 32 even one rank at a time, as the
    instrumented step runs on the virtual cluster (`benchmarks/bench_memory_audit.py`), so the steps
    between run without it; what they allocate and keep would be missed, and a test walking
    every storage the stages hold finds none.
    Runs the same on a virtual-cluster thread and in a torchrun process. `gpus_per_node` goes to the stages
    that shard by node ("hsdp", "hpz"); the others ignore it.
    """
    tracker = current().tracker
    with tracker.audit():
        trainer = make_stage(stage, config, functions, gpus_per_node)
    flops: dict[str, int] = dict.fromkeys(PHASES, 0)
    spans: list[tuple[int, str, float, float]] = []
    step_seconds, losses = [], []
    step_bounds: list[tuple[float, float]] = []
    origin = time.perf_counter()

    for step in range(steps):
        last = step == steps - 1
        audit = memory.StorageAudit(tracker) if last else None

        @contextmanager
        def measure(phase: str, step: int = step, audit: memory.StorageAudit | None = audit) -> Iterator[None]:
            started = time.perf_counter()
            if audit is not None:
                with audit.counting(FlopMeter()) as meter:
                    yield
                flops[phase] = meter.flops
            else:
                yield
            spans.append((step, phase, started - origin, time.perf_counter() - origin))

        if step in fenced_steps(steps):
            _fence()
        if last:
            _one_rank_at_a_time()
            tracker.reset_peaks()
        started = time.perf_counter()
        with audit or nullcontext():
            losses.append(trainer.train_step(step, measure, count_activations=last))
        step_seconds.append(time.perf_counter() - started)
        step_bounds.append((started - origin, step_seconds[-1] + started - origin))
        if on_step is not None and trainer.rank == 0:
            on_step(step)
    return RankResult(
        losses=losses,
        master=trainer.master_shards(),
        step_seconds=step_seconds,
        flops=flops,
        skipped_steps=trainer.scaler.skipped_steps,
        psi=trainer.psi,
        communicated_numels=[trainer.communicated_numel(layer) for layer in trainer.layers],
        held_bytes_by_category=tracker.current_by_category(),
        spans=spans,
        step_bounds=step_bounds,
        origin_s=origin,
    )


def make_stage(stage: int | str, config: TrainConfig, functions: dict | None, gpus_per_node: int | None) -> Any:
    """A stage's trainer on the calling rank; a stage named by string gets `gpus_per_node`."""
    if isinstance(stage, str):
        return stage_class(stage)(config, functions, gpus_per_node=gpus_per_node)
    return STAGES[stage](config, functions=functions)


def fenced_steps(steps: int) -> list[int]:
    """The steps every rank waits for the others before starting: the first timed step and the last.

    Ranks overlap steps (rank 0 starts step k+1 while rank 31 still finishes step k), so without the
    fences the timed steps would share time with the warm-up step and the slow instrumented one.
    """
    if steps >= 3:
        return [1, steps - 1]
    return [steps - 1] if steps == 2 else []


def _one_rank_at_a_time() -> None:
    """On the virtual cluster, let one rank thread at a time run the instrumented step.

    The audit takes every tensor operation through Python, so rank threads running that step side by side
    mostly trade the interpreter lock: one at a time, the step takes less wall time and much less CPU
    (`benchmarks/bench_memory_audit.py` measures both). Said after the fence, when every rank has finished
    the timed steps: said before it, a rank that got there first would slow the others' last timed step.
    Under torchrun each rank is a process of its own: nothing to do.
    """
    backend = current().backend
    if isinstance(backend, VirtualBackend):
        backend.cluster.limit_running(1)


def _fence() -> None:
    """Wait for every rank, outside the ledger: a barrier of the measurement, not of the training."""
    finish = current().backend.barrier(CollectiveCall("barrier", "", (), (), tag="fence between measured steps"))
    finish()


def run_stage(
    stage: int | str,
    world_size: int,
    steps: int,
    config: TrainConfig | None = None,
    *,
    functions: dict | None = None,
    timeout_s: float = 60.0,
    on_step: Callable[[int], None] | None = None,
    gpus_per_node: int | None = None,
    max_running: int | None = None,
) -> StageReport:
    """Train `stage` on `world_size` virtual GPUs for `steps` steps and measure it.

    `functions` swaps in other layer Functions (exercises); `on_step(step)` runs on rank 0 after each step;
    `gpus_per_node` places the ranks in nodes for the stages that shard by node (all on one by default);
    `max_running` rank threads may run their own code at once (`VirtualCluster`; default one per core, plus one).
    """
    if stage not in STAGES:
        stage_class(stage)
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    config = config or TrainConfig()
    cluster = VirtualCluster(world_size, timeout_s=timeout_s, seed=config.seed, max_running=max_running)
    with one_torch_thread():
        results: list[RankResult] = cluster.run(train_on_rank, config, stage, steps, functions, on_step, gpus_per_node)
    return build_report(
        stage, world_size, steps, config, cluster.ledger, cluster.trackers, results, gpus_per_node=gpus_per_node
    )


def compare_stages(
    stages: list[int | str],
    world_size: int,
    steps: int,
    config: TrainConfig | None = None,
    on_step: Callable[[int], None] | None = None,
    gpus_per_node: int | None = None,
    jobs: int = 1,
) -> list[StageReport]:
    """Run several stages with the same configuration: one after another in this process, or `jobs` at a
    time in worker processes, each on its own share of the cores (`zero_core.stage_pool`)."""
    if jobs > 1 and len(stages) > 1:
        config = config or TrainConfig()
        return train_in_workers(run_stage, stages, world_size, steps, config, jobs, on_step, gpus_per_node)
    return [
        run_stage(stage, world_size, steps, config, on_step=on_step, gpus_per_node=gpus_per_node) for stage in stages
    ]


@dataclass(frozen=True)
class Equivalence:
    """How far a stage's training is from ZeRO-0's: the course's claim is 0.0 for both."""

    stage: int | str
    final_loss: float
    max_loss_delta: float
    max_master_delta: float

    @property
    def bit_identical(self) -> bool:
        return self.max_loss_delta == 0.0 and self.max_master_delta == 0.0


def equivalence(reference: StageReport, report: StageReport) -> Equivalence:
    """Max |Δloss| over all steps and max |Δ fp32 master weight| of `report` against `reference`."""
    loss_delta = max(abs(a - b) for a, b in zip(reference.losses, report.losses, strict=True))
    master_delta = max(
        (reference.master_weights[name] - values).abs().max().item() for name, values in report.master_weights.items()
    )
    return Equivalence(report.stage, report.losses[-1], loss_delta, master_delta)
