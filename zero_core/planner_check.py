"""The planner checked against reality: DeepSpeed's estimators, Megatron-Core's table and the virtual cluster.

The planner (`zero_core.planner`) answers in closed form for models never run here. This module sets its answers
beside three references, each at the same configuration, and gives each row its error, (planner - reference) /
reference:

- **DeepSpeed**: the installed `deepspeed` package's own `estimate_zero2_model_states_mem_needs`
  (`deepspeed/runtime/zero/stage_1_and_2.py`) and `estimate_zero3_model_states_mem_needs` (`stage3.py`), called
  from the package (not the course's copy, `planner.deepspeed_estimators`), for real models' shapes
  (`planner.models.PRESETS`), against the planner's model states per GPU (`configurations.gpu_bytes`);
- **Megatron-Core**: its distributed optimizer's bytes per parameter, non-distributed and with d data-parallel
  ranks (entries of `zero_core/data/facts.toml`, read from Megatron-LM's documentation), against the planner's
  ZeRO-0 and ZeRO-1 (the distributed optimizer shards the optimizer states, as ZeRO-1 does);
- **the virtual cluster**: each stage of the course's own tiny GPT trained for a step (`experiment.run_stage`),
  its audited model states, activations and peak per rank, against the planner's whole memory per GPU
  (`planner.gpu_memory`, `planner.activations`) fed the same layers, width, vocabulary, sequence and
  micro-batch, with no allowance (a virtual GPU has no CUDA context).

It runs the simulator, so it is no part of the planner (which never imports it: `tests/test_planner_apart.py`);
`python -m zero_core check-planner` prints it (`zero_core.cli.check_planner.render`); lessons call `check_planner`.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import re
from dataclasses import asdict, dataclass, replace
from types import ModuleType
from typing import Any

from zero_core import configurations
from zero_core.experiment import run_stage
from zero_core.facts import fact
from zero_core.model import preset
from zero_core.planner import gpu_memory
from zero_core.planner.activations import activation_bytes
from zero_core.planner.configuration_time import shape_layers
from zero_core.planner.models import GPT, PRESETS, ModelShape, custom_shape
from zero_core.report import StageReport
from zero_core.stages import TrainConfig

DEEPSPEED_MODELS = ("llama-2-13b", "llama-2-70b", "gpt-3-175b")
DEEPSPEED_GPUS = (8, 256)
DEEPSPEED_CONFIGS = ("zero2", "zero2+offload", "zero3", "zero3+offload")
GPUS_PER_NODE = 8
MEGATRON_ROWS = ("megatron_dist_optimizer_fp16_fp16", "megatron_dist_optimizer_fp16_fp32",
                 "megatron_dist_optimizer_fp32_fp32")
MEGATRON_DATA_PARALLEL = (8, 64)
CLUSTER_PRESETS = ("micro", "tiny")
CLUSTER_WORLD_SIZE = 4
_DISTRIBUTED_CELL = re.compile(r"^(\d+) \+ (\d+)/d$")


def error(planner: float, reference: float) -> float:
    """The planner's relative error against a reference: (planner - reference) / reference."""
    return (planner - reference) / reference


@dataclass(frozen=True)
class DeepSpeedRow:
    """Model states per GPU of one model and configuration on N GPUs: DeepSpeed's estimate and the planner's."""

    model: str
    config: str
    n_gpus: int
    largest_layer_params: int
    deepspeed_bytes: int
    planner_bytes: float

    @property
    def error(self) -> float:
        return error(self.planner_bytes, self.deepspeed_bytes)


@dataclass(frozen=True)
class MegatronRow:
    """Bytes per parameter of one dtype combination, without (d = None) or with the distributed optimizer."""

    fact: str
    dtypes: str
    data_parallel: int | None
    megatron_bytes_per_param: float
    planner_config: str
    planner_bytes_per_param: float

    @property
    def error(self) -> float:
        return error(self.planner_bytes_per_param, self.megatron_bytes_per_param)


@dataclass(frozen=True)
class ClusterRow:
    """One stage of a course preset on the virtual cluster: audited bytes per rank beside the planner's terms."""

    preset: str
    stage: int
    world_size: int
    checkpointing: str
    measured_states: int
    measured_activations: int
    measured_peak: int
    peak_phase: str
    """The phase of the step in which the fullest rank reached its peak (its first moment at it)."""
    planner_psi: int
    measured_psi: int
    planner_states: float
    planner_activations: float
    planner_buffers: float
    planner_total: float

    @property
    def errors(self) -> dict[str, float]:
        return {"states": error(self.planner_states, self.measured_states),
                "activations": error(self.planner_activations, self.measured_activations),
                "peak": error(self.planner_total, self.measured_peak)}


def deepspeed_modules() -> tuple[ModuleType, ModuleType]:
    """DeepSpeed's ZeRO-1/2 and ZeRO-3 modules from the installed package. Importing them takes seconds and prints
    an accelerator warning on stdout (on a machine without a GPU), which is kept out of the course's output."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return (importlib.import_module("deepspeed.runtime.zero.stage_1_and_2"),
                    importlib.import_module("deepspeed.runtime.zero.stage3"))
    except ModuleNotFoundError as missing:
        raise RuntimeError(f"the DeepSpeed rows need the deepspeed package ({missing}): install the course's "
                           "pinned requirements") from None


def largest_module_params(shape: ModelShape) -> int:
    """DeepSpeed's `largest_layer_params`: the parameters of the largest module (what its `..._all_live` estimators
    measure on a model): the embedding V·h or one FFN matrix h·ffn (GPT's with its bias, or its fused QKV)."""
    h, ffn = shape.hidden, shape.ffn
    if shape.family == GPT:
        return max(shape.vocabulary * h, h * ffn + ffn, 3 * h * h + 3 * h)
    return max(shape.vocabulary * h, h * ffn)


def deepspeed_gpu_bytes(modules: tuple[ModuleType, ModuleType], config: str, psi: int, largest: int,
                        n_gpus: int) -> int:
    """GPU bytes of model states that the package's estimator gives for `config` on `n_gpus` in nodes of 8."""
    zero2, zero3 = modules
    placement = {"num_gpus_per_node": min(n_gpus, GPUS_PER_NODE), "num_nodes": max(1, n_gpus // GPUS_PER_NODE)}
    offload = config.endswith("+offload")
    if config.startswith("zero2"):
        return zero2.estimate_zero2_model_states_mem_needs(total_params=psi, cpu_offload=offload, **placement)[1]
    return zero3.estimate_zero3_model_states_mem_needs(total_params=psi, largest_layer_params=largest,
                                                       cpu_offload=offload, cpu_offload_params=False,
                                                       **placement)[1]


def deepspeed_rows(models: tuple[str, ...] = DEEPSPEED_MODELS, gpus: tuple[int, ...] = DEEPSPEED_GPUS,
                   configs: tuple[str, ...] = DEEPSPEED_CONFIGS) -> list[DeepSpeedRow]:
    """(a) The package's estimators against the planner's model states, for each model, configuration and N."""
    modules = deepspeed_modules()
    rows = []
    for name in models:
        shape = PRESETS[name]
        largest = largest_module_params(shape)
        for config in configs:
            for n in gpus:
                planner = configurations.gpu_bytes(configurations.CONFIGURATIONS[config], shape.psi, n, GPUS_PER_NODE)
                rows.append(DeepSpeedRow(name, config, n, largest,
                                         deepspeed_gpu_bytes(modules, config, shape.psi, largest, n), planner))
    return rows


def megatron_cells(name: str) -> tuple[float, float, float]:
    """(non-distributed, replicated, sharded) bytes per parameter of a row of Megatron-Core's table: "4 + 16/d"
    is 4 bytes on every rank and 16 shared by the d data-parallel ranks."""
    entry = fact(name)
    non_distributed, distributed = entry.printed
    match = _DISTRIBUTED_CELL.match(distributed)
    if match is None:
        raise ValueError(f"facts.toml [{name}]: the distributed cell {distributed!r} is not of the form 'A + B/d'")
    return float(non_distributed), float(match.group(1)), float(match.group(2))


def planner_bytes_per_param(config: str, n_gpus: int) -> float:
    """The planner's model-state bytes per parameter of `config` on N GPUs (ZeRO §5: 16, 4 + 12/N, ...)."""
    psi = 10**9
    return configurations.gpu_bytes(configurations.CONFIGURATIONS[config], psi, n_gpus, n_gpus) / psi


def megatron_rows(data_parallel: tuple[int, ...] = MEGATRON_DATA_PARALLEL) -> list[MegatronRow]:
    """(b) Megatron-Core's bytes per parameter against the planner's ZeRO-0 (non-distributed) and ZeRO-1."""
    rows = []
    for name in MEGATRON_ROWS:
        non_distributed, replicated, sharded = megatron_cells(name)
        dtypes = fact(name).unit.removeprefix("bytes per parameter, ")
        rows.append(MegatronRow(name, dtypes, None, non_distributed, "zero0", planner_bytes_per_param("zero0", 1)))
        rows += [MegatronRow(name, dtypes, d, replicated + sharded / d, "zero1", planner_bytes_per_param("zero1", d))
                 for d in data_parallel]
    return rows


def peak_phase(report: StageReport) -> str:
    """The phase in which the fullest rank first held its peak: where the planner's terms should all stand."""
    fullest = max(report.trackers, key=lambda tracker: tracker.peak_bytes())
    return next(e.phase for e in fullest.timeline if e.total_bytes == fullest.peak_bytes())


def cluster_rows(presets: tuple[str, ...] = CLUSTER_PRESETS, world_size: int = CLUSTER_WORLD_SIZE,
                 checkpointing: str = "none") -> list[ClusterRow]:
    """(c) Each paper stage of each course preset, one step on `world_size` virtual GPUs, beside the planner's
    whole memory at the same shape. `checkpointing` is "none" (the stages' default) or "full" (every block)."""
    if checkpointing not in ("none", "full"):
        raise ValueError(f"the course's GPT checkpoints every block or none: 'none' or 'full', got {checkpointing!r}")
    rows = []
    for name in presets:
        model = replace(preset(name), activation_checkpointing=checkpointing == "full")
        shape = custom_shape(model.n_layer, model.n_embd, model.vocab_size, model.block_size)
        seq, batch = model.block_size, model.micro_batch_size
        activations = activation_bytes(model.n_layer, model.n_embd, model.n_head, shape.ffn, model.vocab_size, seq,
                                       batch, checkpointing)
        largest = max(layer.params for layer in shape_layers(shape, seq * batch, seq))
        for stage in range(4):
            report = run_stage(stage, world_size, 1, TrainConfig(model=model))
            states = configurations.gpu_bytes(configurations.CONFIGURATIONS[f"zero{stage}"], shape.psi, world_size,
                                              world_size)
            planned = gpu_memory.gpu_memory(stage, states, activations, shape.psi, largest,
                                            gpu_memory.small_tensor_elements(shape), world_size, allowance_bytes=0)
            rows.append(ClusterRow(name, stage, world_size, checkpointing, report.model_state_bytes_max,
                                   report.activation_peak_bytes_max, report.peak_bytes_max, peak_phase(report),
                                   shape.psi, report.psi,
                                   planned.model_states, planned.activations, planned.buffers, planned.total))
    return rows


@dataclass(frozen=True)
class PlannerCheck:
    """The three parts, each a list of rows with the planner's error."""

    deepspeed: list[DeepSpeedRow]
    megatron: list[MegatronRow]
    cluster: list[ClusterRow]

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": "zero-course/check-planner/1",
            "deepspeed": [{**asdict(r), "error": r.error} for r in self.deepspeed],
            "megatron": [{**asdict(r), "error": r.error} for r in self.megatron],
            "cluster": [{**asdict(r), "errors": r.errors} for r in self.cluster],
        }


def check_planner(world_size: int = CLUSTER_WORLD_SIZE, presets: tuple[str, ...] = CLUSTER_PRESETS,
                  checkpointing: str = "none") -> PlannerCheck:
    """All three comparisons with their defaults (a few seconds: DeepSpeed's import and eight short runs)."""
    return PlannerCheck(deepspeed_rows(), megatron_rows(), cluster_rows(presets, world_size, checkpointing))
