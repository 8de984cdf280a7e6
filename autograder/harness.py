"""Train a reference ZeRO stage with a student's piece plugged in, and record what every rank did.

A run is the reference training loop (`ZeroStage.train_step`) on the virtual cluster, with three
recorders added: the fp32 gradient each rank hands to Adam for each layer and step (to say which shard
a rank kept), the parameters autograd left a `.grad` on (ZeRO-2/3 must leave none), and, from the
cluster, every rank's memory tracker and ledger of collectives, with the moments the stage marked
(`zero_core.schedule`) to set the collectives' times against. The same harness runs the reference
pieces, so a student's run is compared with a reference run made the same way.

Runs use the `micro` model for `STEPS` steps, a collective timeout (`COLLECTIVE_TIMEOUT_S`: a
rank-dependent order of collectives fails at once, the timeout stops ranks that wait for one that never
comes) and a deadline for the whole run in CPU time (a Python-level infinite loop in a rank). Each run is
made once per process: the training, memory and communication checks of one world size read the same run,
and a failure is remembered with it.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any, TypeVar

import torch
import torch.nn as nn

from autograder.checks import CheckFailed, describe_exception
from autograder.integrity import StudentShard
from autograder.records import RankRecord, Run
from zero_core import schedule
from zero_core.backends.witnessed import WitnessedBackend, WitnessLink
from zero_core.cluster import (
    ClusterError,
    CollectiveDeadlock,
    CollectiveMismatch,
    CollectiveTimeout,
    RankFailed,
    RunTimeout,
    VirtualCluster,
    one_torch_thread,
)
from zero_core.comm import CommLedger
from zero_core.context import current
from zero_core.dist import RECORD_ISSUERS
from zero_core.memory import unaudited
from zero_core.model import build_model, parameter_layers, preset
from zero_core.optim import AdamShard, precision_dtype
from zero_core.partition import FlatPartition
from zero_core.stages import TrainConfig, ZeroStage
from zero_core.stages.base import ReplicatedStage
from zero_core.stages.sharding import FunctionLayer

CONFIG = TrainConfig(model=preset("micro"))
"""The memory and communication checks' training: bf16, as the lessons train, so bytes are 2 per element."""
TRAINING_CONFIG = TrainConfig(model=preset("micro"), precision="fp32")
"""The training check's: fp32, where the single-device oracle's rounding is fp32's too, so the tolerance it
gives is tight (`verdicts.Tolerance`) and any correct formulation passes."""
STEPS = 2
RUN_DEADLINE_S = 30.0
COLLECTIVE_TIMEOUT_S = RUN_DEADLINE_S
"""Wall-clock seconds a rank may wait in a collective or for a turn on the CPU. A rank stuck in its own code
uses CPU, and the run's deadline (CPU time, `zero_core.cluster.RUN_WALL_FACTOR`) stops it; this catches the
ones that only wait, so it can be long: at 10 s, a correct ex02 notebook's 4-rank run timed out waiting
for its first turn in a test run with two workers and their grading children on two cores."""
GRADED_RUNNING = 1
"""Rank threads of a graded run that may run their own code at once (`VirtualCluster(max_running=)`). Every
step of a graded run is audited, and the audit takes each tensor operation through Python: rank threads
side by side mostly trade the interpreter lock, as in the instrumented step of `zero_core.experiment`. One
at a time, a ZeRO-2 or ZeRO-3 run of the micro model at N = 4 or 7 took 0.51-0.54x the CPU and 0.62-0.67x
the wall-clock time of the default, one per core plus one, on two cores (`benchmarks/bench_memory_audit.py`,
part 3). What each rank computes, and its ledger, are the same at any number."""
CACHED_RUNS = 96
"""Runs kept in this process (`run_once`), the oldest made forgotten first. The grading parent of a term keeps
every assignment's reference runs at once: 57 for the ten assignments' checks on one draw, 2 to 4 MiB each.
With 24 kept, a term's batch made most of them again for every student, and `grade --jobs 2` stalled on those
remakes (the judges take turns): 1.33x the speed of `--jobs 1` on two cores (docs/grading.md)."""


class RecordingAdam(AdamShard):
    """An `AdamShard` that remembers the fp32 gradient it is given, per layer and training step.

    `pieces(grad)` splits the gradient it is given into {layer: piece}: a layer's own master takes one
    layer's gradient, the stage's optimizer every layer's master range concatenated (`master_gradients`).
    What it records is what Adam really receives: after unscaling and, where the stage clips, clipping.
    """

    def __init__(
        self, inner: AdamShard, pieces: Callable[[torch.Tensor], dict[str, torch.Tensor]], record: RankRecord
    ) -> None:
        self.config, self.master, self.m, self.v = inner.config, inner.master, inner.m, inner.v
        self.pieces, self.record = pieces, record

    def step(self, grad: torch.Tensor, step: int) -> None:
        with unaudited():
            for layer, piece in self.pieces(grad).items():
                self.record.adam_grads[(layer, current().step)] = piece.detach().clone()
        super().step(grad, step)


def record_rank(stage: ZeroStage, exercise: str, functions: dict | None) -> RankRecord:
    """Start recording what `stage`, just built on this rank, does: the gradients Adam receives (through its
    optimizer and its layers' masters); hand student Functions a `StudentShard` (the layer's data, without
    the reference's collectives). The stage keeps its class: recording wraps its parts, it does not derive.

    The exercises' Functions wait for their reduce-scatter at once, so the stage they are compared with does
    too (`InFlightReduceScatter.overlap`): otherwise a reference layer's bucket, still in flight, would be
    alive next to a student layer's, and the bucket peaks would differ for no fault of the student's.
    """
    record = RankRecord()
    stage.optimizer = RecordingAdam(stage.optimizer, stage.master_gradients, record)
    for layer in stage.layers:
        layer.master = RecordingAdam(layer.master, lambda grad, name=layer.name: {name: grad}, record)
    if hasattr(stage, "in_flight"):
        stage.in_flight.overlap = False
    student_functions = set((functions or {}).values())
    for module in stage.model.modules():
        if isinstance(module, FunctionLayer) and module.function in student_functions:
            module.shard = StudentShard(module.shard, exercise)
    if hasattr(stage, "record"):
        stage.record = record
    return record


def stray_gradients(stage: ZeroStage) -> set[str]:
    """The layers whose parameters autograd left a `.grad` on, under a stage that keeps no full gradient."""
    if isinstance(stage, ReplicatedStage):
        return set()  # ZeRO-0 and ZeRO-1 keep every gradient by design, as the parameters' .grad views
    return {name.rsplit(".params.", 1)[0] for name, p in stage.model.named_parameters() if p.grad is not None}


def no_options(world_size: int, dtype: torch.dtype, setting: Any) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class GradedStage:
    """How the grader builds a stage on each rank: its class, the options it is constructed with, and the
    exercise's setting (ex06's bucket size, ...), which `per_rank` turns into options for the rank's world
    size and training dtype. Calling it builds the stage and starts recording it (`record_rank`).

    A plain value, not a class made at run time: the same stage class runs the student's piece and the
    reference's, given different options (`with_options`, `with_setting`)."""

    cls: type[ZeroStage]
    exercise: str
    options: dict[str, Any] = field(default_factory=dict)
    per_rank: Callable[[int, torch.dtype, Any], dict[str, Any]] = no_options
    setting: Any = None

    @property
    def stage(self) -> int | str:
        """The ZeRO stage it runs (a message names it)."""
        return self.cls.stage

    def with_options(self, **options: Any) -> GradedStage:
        return replace(self, options={**self.options, **options})

    def with_setting(self, setting: Any) -> GradedStage:
        return replace(self, setting=setting)

    def __call__(self, config: TrainConfig, functions: dict | None) -> tuple[ZeroStage, RankRecord]:
        options = {**self.per_rank(current().world_size, precision_dtype(config.precision), self.setting)}
        stage = self.cls(config, functions, **options, **self.options)
        return stage, record_rank(stage, self.exercise, functions)


def graded_stage(stage: type[ZeroStage] | GradedStage, exercise: str) -> GradedStage:
    """`stage` as the grader builds it: a stage class with no options, or an exercise's `GradedStage` as it is."""
    return stage if isinstance(stage, GradedStage) else GradedStage(stage, exercise)


def _train_rank(
    graded: GradedStage, functions: dict | None, steps: int, config: TrainConfig, observed: tuple[str, ...]
) -> tuple[RankRecord, dict[str, list]]:
    """Train under the memory audit: every storage the rank allocates, the student's code included, is on
    its ledger whether or not the code registers it, and counts for as long as anything keeps it alive.
    Returns the record and, per key of `observed`, the list the course's stage code appended to under that
    key of `current().extra` (a stage's own measurements, such as ex09's gathers)."""
    current().extra[RECORD_ISSUERS] = True
    observations: dict[str, list] = {key: [] for key in observed}
    current().extra.update(observations)
    with current().tracker.audit(), schedule.record() as marks:
        trainer, record = graded(config, functions)
        for step in range(steps):
            record.losses.append(trainer.train_step(step))
            record.stray_grads.update(stray_gradients(trainer))
    with unaudited():
        record.master = trainer.master_shards()
    record.schedule = marks
    return record, observations


def layer_partitions(world_size: int) -> dict[str, FlatPartition]:
    return {
        layer: FlatPartition(sum(shape.numel() for shape in shapes.values()), world_size)
        for layer, shapes in layer_shapes().items()
    }


@cache
def layer_kinds() -> dict[str, type[nn.Module]]:
    """Per parameter layer of the graded model, its kind (nn.Linear, nn.Embedding, nn.LayerNorm)."""
    return {layer: type(module) for layer, module in parameter_layers(build_model(CONFIG.model, CONFIG.seed))}


@cache
def layer_shapes() -> dict[str, dict[str, torch.Size]]:
    """Per parameter layer of the graded model, its parameters' shapes by name ("weight", "bias")."""
    model = build_model(CONFIG.model, CONFIG.seed)
    return {
        layer: {name: p.shape for name, p in module.named_parameters()} for layer, module in parameter_layers(model)
    }


def train(
    graded: GradedStage,
    world_size: int,
    functions: dict | None = None,
    steps: int = STEPS,
    config: TrainConfig = CONFIG,
    witnessed_collectives: bool = True,
    max_running: int = GRADED_RUNNING,
) -> Run:
    """Train the `graded` stage on `world_size` ranks; cluster errors propagate."""
    return train_observed(graded, world_size, functions, steps, config, (), witnessed_collectives, max_running)[0]


def train_observed(
    graded: GradedStage,
    world_size: int,
    functions: dict | None = None,
    steps: int = STEPS,
    config: TrainConfig = CONFIG,
    observed: tuple[str, ...] = (),
    witnessed_collectives: bool = True,
    max_running: int = GRADED_RUNNING,
) -> tuple[Run, CommLedger, list[dict[str, list]]]:
    """`train`, also returning the full ledger (`Run` keeps a summary of it) and, per rank, what the stage
    code appended under each key of `observed` in `current().extra`. In the grading child, the run's
    collectives go through the witness, unless not `witnessed_collectives` (the sized run whose memory the
    kernel counts: the witness then only marks when it began). `max_running` rank threads run their own code
    at once (`GRADED_RUNNING`; `benchmarks/bench_memory_audit.py` compares it with the cluster's default)."""
    options = {}
    if _witness is not None:
        _witness.begin_run(world_size, collectives=witnessed_collectives)
        if witnessed_collectives:
            options["backend"] = functools.partial(WitnessedBackend, link=_witness)
    cluster = VirtualCluster(
        world_size, timeout_s=COLLECTIVE_TIMEOUT_S, seed=CONFIG.seed, max_running=max_running, **options
    )
    with one_torch_thread():
        results = cluster.run(_train_rank, graded, functions, steps, config, observed, deadline_s=RUN_DEADLINE_S)
    records = [record for record, _ in results]
    run = Run.of(world_size, steps, records, cluster.trackers, cluster.ledger, layer_partitions(world_size))
    if _witness is not None:
        run.witness_run = _witness.runs_begun - 1
    return run, cluster.ledger, [observations for _, observations in results]


_witness: WitnessLink | None = None


def use_witness(link: WitnessLink) -> None:
    """From now on, this process's graded runs send their collectives through `link` to the grading parent's
    witness (`autograder.witness`), whose record the judge reads; the grading child calls it first thing."""
    global _witness
    _witness = link


def witnessed() -> bool:
    """Whether this process's graded runs go through a witness: in a grading child, yes; in a notebook, no."""
    return _witness is not None


def explain_failure(error: BaseException, what: str) -> str:
    """A message for a run that did not finish: the rank, the collective, and what to look at."""
    if isinstance(error, RankFailed):
        return f"{what}: rank {error.rank} raised {describe_exception(error.error)}"
    if isinstance(error, CollectiveMismatch | CollectiveDeadlock | CollectiveTimeout):
        return (
            f"{what}: the ranks did not call the same collectives in the same order "
            f"(in a real cluster this hangs).\n{error}"
        )
    if isinstance(error, RunTimeout):
        return f"{what}: the run did not finish within {RUN_DEADLINE_S:g} s of CPU time (an infinite loop?).\n{error}"
    if isinstance(error, ClusterError):
        return f"{what}: {error}"
    return f"{what}: {describe_exception(error)}"


T = TypeVar("T")
_RUNS: OrderedDict[Hashable, Any] = OrderedDict()
_HUNG: dict[Hashable, str] = {}


def forget_runs() -> None:
    """Forget every run made in this process (a student release records its references afresh)."""
    _RUNS.clear()
    _HUNG.clear()


def run_once(key: Hashable, student: tuple, make: Callable[[], T], what: str) -> T:
    """`make()` once per `key` in this process; a failure raises `CheckFailed`, then and on every later call.

    A run of the same `student` objects that hung once is not tried again (each try would take the
    whole deadline): later runs fail at once with the first message.
    """
    if key not in _RUNS:
        if student in _HUNG:
            raise CheckFailed(
                f"{what}: not run, because an earlier run of the same code did not finish:\n{_HUNG[student]}"
            )
        try:
            outcome: Any = make()
        except CheckFailed:
            raise
        except Exception as error:
            outcome = explain_failure(error, what)
            if isinstance(error, RunTimeout | CollectiveTimeout):
                _HUNG[student] = outcome
        _RUNS[key] = outcome
        while len(_RUNS) > CACHED_RUNS:
            _RUNS.popitem(last=False)
    outcome = _RUNS[key]
    if isinstance(outcome, str):
        raise CheckFailed(outcome)
    return outcome
