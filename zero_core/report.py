"""What one run of a stage measured, gathered into a report: the numbers the course's claims are about.

The report holds the loss at every step; the fp32 master weights (assembled from the ranks' shards, to
compare stages bit for bit); each rank's model-state bytes by category beside the paper's formula (ZeRO §5,
Figure 1); peak bytes with transients and activations; bytes on the wire per rank per step beside the
formula (ZeRO §7); FLOPs per phase; time per step and time spent inside collectives.

It is built from what each rank measured (`RankResult`), its ledger and its memory tracker, wherever the
ranks ran: threads of the virtual cluster (`zero_core.experiment`) or torchrun processes (`zero_core.launch`).
Stages are the paper's numbers 0-3, or the names of the stages beyond the paper, which take
`gpus_per_node`; each stage class names its configuration, whose formulas `zero_core.configurations` holds
(`simulated_gpu_bytes`, `simulated_comm_elements`; the paper's four through `zero_core.formulas`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from zero_core import configurations, memory
from zero_core.comm import CommLedger
from zero_core.stages import TrainConfig, stage_class
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


def timed_steps(steps: int) -> list[int]:
    """The steps whose times are typical: neither the first (warm-up) nor the last, which is instrumented
    (FLOP counting and activation hooks slow it), when the run is long enough to leave any."""
    if steps >= 3:
        return list(range(1, steps - 1))
    return [0]


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


def stage_configuration(stage: int | str) -> configurations.Configuration:
    """The configuration a stage runs (its class's `configuration`), whose formulas `zero_core.configurations`
    holds. Here, not in the registry: a grading child loads the registry, and must not load the formulas."""
    return configurations.CONFIGURATIONS[stage_class(stage).configuration]


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
    configuration, g = stage_configuration(stage), gpus_per_node or n
    formula = configurations.simulated_gpu_bytes(configuration, psi, n, g, element_bytes)
    comm_formula, comm_formula_padded = (
        configurations.simulated_comm_elements(configuration, elements, n, g, config.zero1_grad_sync)
        for elements in (psi, communicated_psi)
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
