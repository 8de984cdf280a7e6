"""The answer of `plan --nodes` as one function of plain values: which configuration on M nodes of G GPUs?

`ranked_plan` takes the model (`model_choice.planned_model`: a preset by name, a shape, or Ψ), the GPU memory as
its owner writes it ("40GiB", which also picks the unit of the answer), the nodes, the machine, the configurations
and the whole-memory choices (micro-batch, checkpointing, allowance), and returns every configuration's row: its
whole memory per GPU (`zero_core.cli.whole`), its predicted step on the machine (`zero_core.cli.configs`), whether
it fits, and the ranking. `RankedPlan.text` is what `python -m zero_core plan --nodes` prints, `RankedPlan.to_json`
what it writes with `--json`, and `RankedPlan.command` the command line that gives this answer. The command and
lesson 05's calculator both call `ranked_plan`, so a learner's widget and the command cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zero_core import configurations
from zero_core.cli import configs as config_table
from zero_core.cli import model_choice, whole
from zero_core.cli.errors import UsageError
from zero_core.cli.render import WIDTH, fit
from zero_core.cli.table import display_unit, gpu_memory_argument, show_bytes, show_size
from zero_core.planner.time_model import MACHINES
from zero_core.topology import RING
from zero_core.units import format_count, format_seconds

WHOLE_MEMORY_NOTE = (
    "Memory is the whole per GPU: model states (fp16 parameters and gradients, fp32 Adam: 16 bytes per\n"
    "parameter, K = 12), activations, the stage's buffers and an allowance; a configuration fits on the total."
)


def candidates(n_gpus: int, gpus_per_node: int) -> list[configurations.Configuration]:
    """Every named configuration but single-node HSDP, then HSDP at S = G, 2G, 4G, ... while S < N."""
    named = [c for name, c in configurations.CONFIGURATIONS.items() if name != "hsdp"]
    sizes, s = [], gpus_per_node
    while s < n_gpus and n_gpus % s == 0:
        sizes.append(s)
        s *= 2
    return named + [configurations.Configuration(f"hsdp:{s}", 3, hsdp=True, shard_group=s) for s in sizes]


def nodes_for(n_gpus: int, machine: str) -> tuple[int, int]:
    """N GPUs as (nodes, GPUs per node) of `machine`: N/G nodes of its G when G divides N, else one node of N."""
    gpus_per_node = MACHINES[machine].gpus_per_node
    return (n_gpus // gpus_per_node, gpus_per_node) if n_gpus % gpus_per_node == 0 else (1, n_gpus)


@dataclass(frozen=True)
class RankedPlan:
    """The rows of one `plan --nodes` answer and what they were computed for."""

    planned: model_choice.PlannedModel
    gpu_memory: str
    gpu_memory_bytes: int
    nodes: int
    gpus_per_node: int
    machine: str
    configs: str | None
    tokens_per_gpu: int
    setup: whole.Setup
    allowance: str
    chosen: list[configurations.Configuration]
    found: list[dict[str, Any]]
    best: list[dict[str, Any]]
    time_model_error: float
    time_model_error_basis: str

    @property
    def n_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def unit(self) -> str:
        return display_unit(self.gpu_memory)

    def row(self, config: str) -> dict[str, Any]:
        """The row of one configuration by name ("zero2")."""
        return next(r for r in self.found if r["config"] == config)

    def command(self) -> str:
        """The command line that prints this answer."""
        s = self.setup
        machine = MACHINES[self.machine]
        args = ["python -m zero_core plan", *model_choice.model_arguments(self.planned),
                "--gpu-memory", self.gpu_memory, "--nodes", str(self.nodes)]
        if self.gpus_per_node != machine.gpus_per_node:
            args += ["--gpus-per-node", str(self.gpus_per_node)]
        args += ["--machine", self.machine]
        if self.configs:
            args += ["--configs", self.configs]
        if self.tokens_per_gpu != config_table.DEFAULT_TOKENS_PER_GPU:
            args += ["--tokens-per-gpu", str(self.tokens_per_gpu)]
        if s.micro_batch != whole.DEFAULT_MICRO_BATCH:
            args += ["--micro-batch", str(s.micro_batch)]
        args += ["--checkpointing", s.checkpointing]
        if self.allowance != whole.DEFAULT_ALLOWANCE:
            args += ["--allowance", self.allowance]
        return " ".join(args)

    def text(self, width: int | None = WIDTH) -> str:
        """What `plan --nodes` prints: the header, the ranking, the whole memory and the step, the answer and its
        notes, each table cut to `width` columns (None: whole)."""
        unit, planned, machine = self.unit, self.planned, MACHINES[self.machine]
        header = (
            f"Which configuration for Ψ = {format_count(planned.psi)} parameters on {self.nodes} nodes of "
            f"{self.gpus_per_node} GPUs of {show_size(self.gpu_memory_bytes, unit)} (N = {self.n_gpus})?\n"
            f"{model_choice.model_text(planned)}\n"
            f"{machine.name}; {self.tokens_per_gpu:,} tokens per GPU per step.\n{WHOLE_MEMORY_NOTE}\n"
            f"{unit} = {'2^30' if unit == 'GiB' else '10^9'} bytes; traffic is per GPU per step, on flat rings.\n"
            f"{model_choice.assumptions_text(planned, self.tokens_per_gpu, self.machine, self.setup.checkpointing)}"
        )
        title = (
            "Ranked: the configurations that fit, fastest predicted step first (equal times: less memory first); "
            f"times within the time model's measured error, {self.time_model_error:.0%} "
            f"({self.time_model_error_basis}), share a rank"
        )
        ranking = "Nothing fits."
        if self.best:
            ranking = config_table.render(self.best, show_bytes, unit, title, numbered=True, width=width)
        misfits = [r for r in self.found if not r["fits"]]
        parts = [header, ranking, whole.render(self.best + misfits, self.setup, self.gpu_memory_bytes,
                                               self.tokens_per_gpu, width, numbered=True, unit=unit)]
        if misfits:
            parts.append(
                "Do not fit: "
                + "; ".join(f"{r['label']} ({show_bytes(r['total_gpu_bytes'], unit)} per GPU)" for r in misfits)
                + "."
            )
        if self.best:
            parts.append(f"{self.answer_text()}\n{whole.notes(self.found, self.setup)}\n{config_table.NOTES}")
        return fit("\n\n".join(parts), width)

    def answer_text(self) -> str:
        """The answer: the fastest configuration's total memory and step, and those tied with it."""
        top, step, unit = self.best[0], self.best[0]["step"], self.unit
        tied = [r["label"] for r in self.best[1:] if r.get("rank") == top.get("rank")]
        return (
            f"Answer: {top['label']}, {show_bytes(top['total_gpu_bytes'], unit)} per GPU in all "
            f"({show_bytes(top['gpu_bytes'], unit)} of model states, {self.setup.checkpointing} checkpointing), "
            f"{format_seconds(step['step_s'])} per step, MFU {step['mfu']:.1%}, "
            f"{step['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, bound by {step['bound']}"
            + (f"; tied within the time model's error with {', '.join(tied)}." if tied else ".")
        )

    def to_json(self) -> dict[str, Any]:
        """What `plan --nodes --json` writes (schema zero-course/plan/2)."""
        return {
            "schema": "zero-course/plan/2",
            "psi": self.planned.psi,
            "model": self.planned.to_dict(),
            "assumptions": model_choice.assumptions(self.planned, self.tokens_per_gpu, self.machine,
                                                    self.setup.checkpointing),
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "n_gpus": self.n_gpus,
            "machine": MACHINES[self.machine].name,
            "tokens_per_gpu": self.tokens_per_gpu,
            "model_states_only": False,
            "whole": self.setup.to_dict(),
            "time_model_error": self.time_model_error,
            "time_model_error_basis": self.time_model_error_basis,
            "ranked": [r["config"] for r in self.best],
            "ranks": [r.get("rank") for r in self.best],
            "configurations": self.found,
        }


def ranked_plan(
    planned: model_choice.PlannedModel,
    gpu_memory: str,
    nodes: int,
    machine: str,
    gpus_per_node: int | None = None,
    configs: str | None = None,
    tokens_per_gpu: int = config_table.DEFAULT_TOKENS_PER_GPU,
    micro_batch: int = whole.DEFAULT_MICRO_BATCH,
    checkpointing: str = whole.DEFAULT_CHECKPOINTING,
    allowance: str = whole.DEFAULT_ALLOWANCE,
) -> RankedPlan:
    """The configurations (`configs`, comma-separated; default: every one, and HSDP at S = G, 2G, ... below N)
    for `planned` on `nodes` nodes of `gpus_per_node` GPUs (default: the machine's) of `gpu_memory` each, ranked
    by predicted step time on `machine`, each judged on its whole memory. Bad values are UsageErrors that name
    the command's option."""
    if machine not in MACHINES:
        raise UsageError(f"--machine: no preset {machine!r}; the presets are {', '.join(MACHINES)}")
    if nodes < 1 or (gpus_per_node is not None and gpus_per_node < 1):
        raise UsageError(f"--nodes and --gpus-per-node must be at least 1, got {nodes} and {gpus_per_node}")
    memory_bytes = gpu_memory_argument(gpu_memory)
    g = gpus_per_node or MACHINES[machine].gpus_per_node
    chosen = config_table.parse(configs) if configs else candidates(nodes * g, g)
    setup = whole.setup(planned, tokens_per_gpu, micro_batch, checkpointing, allowance)
    found = config_table.rows(chosen, planned.psi, nodes * g, g, memory_bytes, MACHINES[machine], tokens_per_gpu,
                              RING, planned.schedule, setup)
    best = config_table.ranked(found)
    error, basis = whole.rank(best, planned.psi)
    return RankedPlan(planned, gpu_memory, memory_bytes, nodes, g, machine, configs, tokens_per_gpu, setup, allowance,
                      chosen, found, best, error, basis)
