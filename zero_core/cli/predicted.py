"""`compare`'s predicted step times: each measured stage's schedule on a named machine.

The virtual cluster measures bytes and memory, not a GPU's seconds. The time model does the seconds
(`zero_core.planner.time_model`, lesson 9): each stage runs its configuration's collectives
(`report.stage_configuration`) on a compute, a network and a PCIe stream, with the overlap its schedule
allows, on `--machine` with the run's N and nodes of G. Twice: for the run's own model (its layers and
measured FLOPs; so small that every collective is latency), and for a GPT of `--predict-params` parameters
at `--tokens-per-gpu`, where bandwidth and overlap decide.
"""

from __future__ import annotations

import argparse
from typing import Any

from zero_core.cli.errors import UsageError
from zero_core.cli.machines import machine_argument
from zero_core.cli.render import table
from zero_core.configurations import CONFIGURATIONS
from zero_core.planner.configuration_time import predict_report
from zero_core.planner.time_model import MACHINES, StepPrediction, tokens_per_s
from zero_core.report import StageReport, stage_configuration
from zero_core.stages import stage_class
from zero_core.topology import Topology
from zero_core.units import format_count, format_seconds, parse_count

DEFAULT_MACHINE = "dgx-a100"
DEFAULT_PARAMS = "7.5B"
DEFAULT_TOKENS_PER_GPU = 4096


def add_arguments(p: argparse.ArgumentParser) -> None:
    help_text = f"machine the step times are predicted for (default {DEFAULT_MACHINE})"
    machine_argument(p, help_text, default=DEFAULT_MACHINE)
    p.add_argument(
        "--predict-params",
        default=DEFAULT_PARAMS,
        type=parse_count,
        metavar="PSI",
        help=f"also predict each stage for a GPT of this many parameters (default {DEFAULT_PARAMS}, ZeRO §10's)",
    )
    p.add_argument(
        "--tokens-per-gpu",
        type=int,
        default=DEFAULT_TOKENS_PER_GPU,
        help=f"tokens each GPU processes per step, for that GPT (default {DEFAULT_TOKENS_PER_GPU})",
    )


def check(args: argparse.Namespace) -> None:
    if args.tokens_per_gpu < 1 or args.predict_params < 1:
        raise UsageError(
            f"--tokens-per-gpu and --predict-params must be at least 1, got {args.tokens_per_gpu:,} and "
            f"{args.predict_params:,}"
        )


def prediction_topology(world_size: int, gpus_per_node: int | None, machine: str) -> Topology:
    """The nodes the prediction assumes: the run's `--gpus-per-node` when given, else the machine's own node
    size, or where N is no multiple of it the largest node size below it that divides N. A run without nodes
    puts every rank on one node, but 32 GPUs on one NVLink domain of a DGX A100 (8 per node) would hide the
    network that decides the larger GPT's step."""
    if gpus_per_node is None:
        largest = min(MACHINES[machine].gpus_per_node, world_size)
        gpus_per_node = max(g for g in range(1, largest + 1) if world_size % g == 0)
    return Topology(world_size, gpus_per_node)


def _times(prediction: StepPrediction) -> dict[str, float]:
    return {
        "step_s": prediction.step_s,
        "compute_s": prediction.compute_s,
        "comm_s": prediction.comm_s,
        "exposed_comm_s": prediction.exposed_comm_s,
        "optimizer_s": prediction.optimizer_s,
    }


def rows(reports: list[StageReport], topology: Topology, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Per stage: its configuration and the predicted times of the run's model and of the larger GPT."""
    machine, g = MACHINES[args.machine], topology.gpus_per_node
    out = []
    for r in reports:
        config = stage_configuration(r.stage)
        own = predict_report(r, config, machine, g)
        scaled = predict_report(r, config, machine, g, psi=args.predict_params, tokens=args.tokens_per_gpu)
        out.append(
            {
                "stage": r.stage,
                "configuration": config.name,
                "this_model": _times(own),
                "scaled_model": {**_times(scaled), "tokens_per_s_per_gpu": tokens_per_s(scaled, args.tokens_per_gpu)},
            }
        )
    return out


def render(found: list[dict[str, Any]], topology: Topology, args: argparse.Namespace, width: int | None = None) -> str:
    psi, tokens = args.predict_params, args.tokens_per_gpu
    headers = ["stage", "schedule", "step", "exposed comm"]
    headers += [f"step, Ψ = {format_count(psi)}", "compute", "exposed comm", "tokens/s/GPU"]
    body = []
    for r in found:
        own, scaled = r["this_model"], r["scaled_model"]
        body.append(
            [
                stage_class(r["stage"]).label,
                CONFIGURATIONS[r["configuration"]].label,
                format_seconds(own["step_s"]),
                format_seconds(own["exposed_comm_s"]),
                format_seconds(scaled["step_s"]),
                format_seconds(scaled["compute_s"]),
                format_seconds(scaled["exposed_comm_s"]),
                f"{scaled['tokens_per_s_per_gpu']:,.0f}",
            ]
        )
    whose = "" if getattr(args, "gpus_per_node", None) else " (the machine's; --gpus-per-node sets them)"
    title = (
        f"Predicted step time on {MACHINES[args.machine].name} (--machine), N = {topology.world_size} in nodes of "
        f"{topology.gpus_per_node}{whose} (zero_core.planner.time_model: compute, network and PCIe streams, "
        f"overlapped as each schedule allows);\nfirst this run's model, then a GPT of Ψ = {format_count(psi)} at "
        f"{tokens:,} tokens per GPU (--predict-params, --tokens-per-gpu)"
    )
    return table(headers, body, title=title, width=width)
