"""Run a ZeRO stage on the virtual cluster for k steps and report what it did, measured.

The report holds what the course's claims are about: the loss at every step; the fp32 master weights
(assembled from the ranks' shards, to compare stages bit for bit); each rank's model-state bytes by
category beside the paper's formula (ZeRO §5, Figure 1); peak bytes with transients and activations;
bytes on the wire per rank per step beside the formula (ZeRO §7); FLOPs per phase; time per step and
time spent inside collectives.

Stages are the paper's numbers 0-3, or the names of the stages that shard by node ("hsdp", "hpz"), which
take `gpus_per_node` and bring their own formulas (`formula_model_state_bytes`, `formula_comm_elements`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from zero_core import formulas, memory
from zero_core.backends.virtual import VirtualBackend
from zero_core.cluster import CollectiveCall, VirtualCluster
from zero_core.comm import CommLedger
from zero_core.context import current
from zero_core.flops import FlopMeter
from zero_core.stages import STAGES, TrainConfig, stage_class
from zero_core.stages.base import OVERFLOW_TAG

PHASES = ("forward", "backward", "grad_sync", "optimizer")


@dataclass
class StageReport:
    """Everything measured about one stage's run. `to_dict()` is the JSON schema documented in docs/report-schema.md."""

    stage: int | str
    world_size: int
    steps: int
    psi: int
    precision: str
    zero1_grad_sync: str
    losses: list[float]
    skipped_steps: int
    model_state_bytes_mean: float
    model_state_bytes_max: int
    model_state_bytes_by_category_mean: dict[str, float]
    model_state_bytes_by_category_max: dict[str, int]
    formula_bytes: float
    formula_ratio: float
    padding_bytes_mean: float
    peak_bytes_max: int
    peak_bytes_by_category_max: dict[str, int]
    activation_peak_bytes_max: int
    untracked_bytes_max: int
    """Bytes a rank still held after the last step that nobody named (the fullest rank): 0 for the reference."""
    comm_bytes_per_step_mean: float
    comm_elements_per_step_mean: float
    comm_psi_per_step: float
    comm_formula_psi: float
    comm_formula_psi_padded: float
    overflow_flag_bytes_per_step_mean: float
    collectives_per_step: int
    collectives_by_op_per_step: dict[str, int]
    flops_per_step_mean: dict[str, float]
    step_seconds: list[float]
    """Per step, the slowest rank's own duration of it."""
    typical_step_seconds: float
    """The cluster's wall time per step over the timed steps (`cluster_step_seconds`)."""
    collective_seconds_per_step_mean: float
    master_weights: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)
    ledger: CommLedger | None = field(repr=False, default=None)
    trackers: list[memory.MemoryTracker] = field(repr=False, default_factory=list)
    phase_spans: list[list[tuple[int, str, float, float]]] = field(repr=False, default_factory=list)
    step_bounds: list[list[tuple[float, float]]] = field(repr=False, default_factory=list)
    """Per rank, per step, (start, end) in seconds after the rank's origin in `rank_origins_s`."""
    rank_origins_s: list[float] = field(repr=False, default_factory=list)
    """Per rank, the `time.perf_counter()` its `phase_spans` are relative to (`CommEntry.started_s` is absolute)."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.repr}


@dataclass
class RankResult:
    """What one rank measured about itself during `train_on_rank`, before its buffers were freed."""

    losses: list[float]
    master: dict[str, tuple[int, torch.Tensor]]
    step_seconds: list[float]
    flops: dict[str, int]
    skipped_steps: int
    psi: int
    communicated_numels: list[int]
    held_bytes_by_category: dict[str, int]
    spans: list[tuple[int, str, float, float]]
    step_bounds: list[tuple[float, float]]
    """Per step, (start, end) in seconds after `origin_s`."""
    origin_s: float


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


def timed_steps(steps: int) -> list[int]:
    """The steps whose times are typical: neither the first (warm-up) nor the last, which is instrumented
    (FLOP counting and activation hooks slow it), when the run is long enough to leave any."""
    if steps >= 3:
        return list(range(1, steps - 1))
    return [0]


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


def cluster_step_seconds(steps: int, results: Sequence[RankResult], *, shared_clock: bool = True) -> float:
    """Wall time per step of the whole cluster over the timed steps: from the first rank starting the first
    timed step to the last rank finishing the last one, divided by their number.

    That compares the ranks' clocks (`shared_clock`: threads of one process). Processes, possibly on
    several machines, share none; but no rank waits for a turn there, so all leave the fence before the
    first timed step together, and the slowest rank's own span is the cluster's.
    """
    timed = timed_steps(steps)
    if shared_clock:
        first = min(r.origin_s + r.step_bounds[timed[0]][0] for r in results)
        last = max(r.origin_s + r.step_bounds[timed[-1]][1] for r in results)
        return (last - first) / len(timed)
    return max(r.step_bounds[timed[-1]][1] - r.step_bounds[timed[0]][0] for r in results) / len(timed)


def assemble_master_weights(shards_per_rank: list[dict[str, tuple[int, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Each layer's full fp32 master vector, stitched from the ranks' (offset, values) shards."""
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for shards in shards_per_rank:
        for name, (start, values) in shards.items():
            if values.numel():
                pieces.setdefault(name, {})[start] = values
    return {name: torch.cat([by_start[s] for s in sorted(by_start)]) for name, by_start in pieces.items()}


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
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results: list[RankResult] = cluster.run(train_on_rank, config, stage, steps, functions, on_step, gpus_per_node)
    finally:
        torch.set_num_threads(threads)
    return build_report(
        stage, world_size, steps, config, cluster.ledger, cluster.trackers, results, gpus_per_node=gpus_per_node
    )


def build_report(
    stage: int | str,
    n: int,
    steps: int,
    config: TrainConfig,
    ledger: CommLedger,
    trackers: Sequence[memory.MemoryTracker],
    results: list[RankResult],
    *,
    shared_clock: bool = True,
    gpus_per_node: int | None = None,
) -> StageReport:
    """The report of one run from what each rank measured, wherever the ranks ran.

    `ledger` holds every rank's collectives; `trackers[r]` is rank r's `MemoryTracker`, or a snapshot of
    its read side (`peak_bytes`, `timeline`) gathered from another process (`zero_core.launch`).
    `shared_clock`: the ranks' `perf_counter` clocks are one (see `cluster_step_seconds`).
    """
    psi = results[0].psi
    communicated_psi = sum(results[0].communicated_numels)
    element_bytes = {"fp16": 2, "bf16": 2, "fp32": 4}[config.precision]
    by_category = [r.held_bytes_by_category for r in results]
    state_bytes = [sum(c[k] for k in memory.MODEL_STATES) for c in by_category]
    if isinstance(stage, str):
        stage_type, g = stage_class(stage), gpus_per_node or n
        formula = stage_type.formula_model_state_bytes(psi, n, g, element_bytes)
        comm_formula = stage_type.formula_comm_elements(psi, n, g)
        comm_formula_padded = stage_type.formula_comm_elements(communicated_psi, n, g)
    else:
        formula = formulas.model_state_bytes(stage, psi, n, param_bytes=element_bytes, grad_bytes=element_bytes)
        comm_formula = formulas.comm_elements(stage, psi, n, exact=True, zero1_grad_sync=config.zero1_grad_sync)
        comm_formula_padded = formulas.comm_elements(
            stage, communicated_psi, n, exact=True, zero1_grad_sync=config.zero1_grad_sync
        )
    last = steps - 1
    comm_bytes = ledger.mean_bytes_sent(step=last, exclude_tags=(OVERFLOW_TAG,))
    comm_elements = ledger.mean_elements_sent(step=last, exclude_tags=(OVERFLOW_TAG,))
    rank0_last = ledger.rank_summary(0, step=last)
    step_seconds = [max(r.step_seconds[k] for r in results) for k in range(steps)]
    return StageReport(
        stage=stage,
        world_size=n,
        steps=steps,
        psi=psi,
        precision=config.precision,
        zero1_grad_sync=config.zero1_grad_sync,
        losses=[sum(r.losses[k] for r in results) / n for k in range(steps)],
        skipped_steps=results[0].skipped_steps,
        model_state_bytes_mean=sum(state_bytes) / n,
        model_state_bytes_max=max(state_bytes),
        model_state_bytes_by_category_mean={k: sum(c[k] for c in by_category) / n for k in memory.MODEL_STATES},
        model_state_bytes_by_category_max={k: max(c[k] for c in by_category) for k in memory.MODEL_STATES},
        formula_bytes=formula,
        formula_ratio=(sum(state_bytes) / n) / formula,
        padding_bytes_mean=sum(c[memory.PADDING] for c in by_category) / n,
        peak_bytes_max=max(t.peak_bytes() for t in trackers),
        peak_bytes_by_category_max={k: max(t.peak_bytes(k) for t in trackers) for k in memory.CATEGORIES},
        activation_peak_bytes_max=max(t.peak_bytes(memory.ACTIVATIONS) for t in trackers),
        untracked_bytes_max=max(c[memory.UNTRACKED] for c in by_category),
        comm_bytes_per_step_mean=comm_bytes,
        comm_elements_per_step_mean=comm_elements,
        comm_psi_per_step=comm_elements / psi,
        comm_formula_psi=comm_formula / psi,
        comm_formula_psi_padded=comm_formula_padded / psi,
        overflow_flag_bytes_per_step_mean=ledger.mean_bytes_sent(step=last) - comm_bytes,
        collectives_per_step=rank0_last.collectives,
        collectives_by_op_per_step=rank0_last.by_op,
        flops_per_step_mean={p: sum(r.flops[p] for r in results) / n for p in PHASES},
        step_seconds=step_seconds,
        typical_step_seconds=cluster_step_seconds(steps, results, shared_clock=shared_clock),
        collective_seconds_per_step_mean=ledger.collective_seconds(timed_steps(steps)) / (n * len(timed_steps(steps))),
        master_weights=assemble_master_weights([r.master for r in results]),
        ledger=ledger,
        trackers=list(trackers),
        phase_spans=[r.spans for r in results],
        step_bounds=[r.step_bounds for r in results],
        rank_origins_s=[r.origin_s for r in results],
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
        from zero_core.stage_pool import train_in_workers  # it imports this module

        return train_in_workers(stages, world_size, steps, config or TrainConfig(), jobs, on_step, gpus_per_node)
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
