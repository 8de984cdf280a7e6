"""The configurations table shared by `table --configs` and `plan --nodes`: memory, traffic, step time, fit.

One row per configuration of `zero_core.configurations` for Ψ on N GPUs in nodes of G: GPU and host bytes
per GPU, bytes sent per GPU per step inside and across nodes, PCIe bytes, the predicted step time on a
`zero_core.planner.time_model` machine (`zero_core.planner.configuration_time`) and whether the model states fit.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from zero_core import configurations
from zero_core.cli import whole
from zero_core.cli.errors import UsageError
from zero_core.cli.machines import machine_argument
from zero_core.cli.render import table
from zero_core.planner import configuration_time
from zero_core.planner.time_model import MACHINES, Layer, Machine
from zero_core.quantized_bytes import QUANT_BLOCK_ELEMENTS
from zero_core.units import format_seconds

DEFAULT_TOKENS_PER_GPU = 4096


def add_arguments(p: argparse.ArgumentParser, default_configs: str) -> None:
    p.add_argument(
        "--configs",
        help=f"configurations, comma-separated: {', '.join(configurations.CONFIGURATIONS)}, hsdp:S "
        f"(default {default_configs})",
    )
    machine_argument(p, "a machine preset, for predicted step times")
    p.add_argument(
        "--tokens-per-gpu",
        type=int,
        default=DEFAULT_TOKENS_PER_GPU,
        help=f"tokens each GPU trains per step, for step times (default {DEFAULT_TOKENS_PER_GPU})",
    )
    whole.add_arguments(p)


def parse(text: str, option: str = "--configs") -> list[configurations.Configuration]:
    try:
        return configurations.parse_configurations(text)
    except ValueError as error:
        raise UsageError(f"{option}: {error}") from None


def machine_of(name: str | None) -> Machine | None:
    return MACHINES[name] if name else None


def rows(
    configs: list[configurations.Configuration],
    psi: int,
    n_gpus: int,
    gpus_per_node: int,
    gpu_memory: int,
    machine: Machine | None,
    tokens_per_gpu: int,
    algorithm: str,
    schedule: Callable[[int], list[Layer]] | None = None,
    setup: whole.Setup | None = None,
) -> list[dict[str, Any]]:
    """One dict per configuration, in bytes and seconds; `step_s` is None without a machine. `schedule(tokens)`
    gives the layers a step is timed for (default: a GPT of Ψ, `configuration_time.model_layers`). With a
    `setup` (`zero_core.cli.whole`), each row gains its whole memory, judged on the total, and its step in parts,
    timed with the recomputation its checkpointing adds."""
    if tokens_per_gpu < 1:
        raise UsageError(f"--tokens-per-gpu must be at least 1, got {tokens_per_gpu}")
    schedule = schedule or (lambda tokens: configuration_time.model_layers(psi, tokens))
    model_layers = schedule(tokens_per_gpu) if machine or setup else None
    layers = model_layers
    if setup and machine:
        layers = whole.timed_layers(model_layers, setup, tokens_per_gpu)
    out = []
    for config in configs:
        try:
            cost = configurations.cost(config, psi, n_gpus, gpus_per_node, algorithm)
            shard = configurations.shard_group_size(config, n_gpus, gpus_per_node)
            prediction = (
                configuration_time.predict(config, layers, machine, n_gpus, gpus_per_node) if machine else None
            )
        except ValueError as error:
            raise UsageError(f"--configs: {error}") from None
        host_per_node = cost.host_bytes * gpus_per_node
        host_fits = not machine or not machine.host_memory_bytes or host_per_node <= machine.host_memory_bytes
        extra = {}
        if setup:
            extra = whole.terms(config, cost.gpu_bytes, psi, n_gpus, gpu_memory, setup, model_layers, prediction,
                                machine, tokens_per_gpu)
        gpu_total = extra.get("total_gpu_bytes", cost.gpu_bytes)
        out.append(
            {
                "config": config.name,
                "label": f"HSDP, S = {shard}" if config.hsdp else config.label,
                "stage": config.stage,
                "shard_group": shard,
                "gpu_formula": cost.gpu_formula,
                "host_formula": cost.host_formula,
                "gpu_bytes": cost.gpu_bytes,
                "host_bytes_per_gpu": cost.host_bytes,
                "host_bytes_per_node": host_per_node,
                "fits": gpu_total <= gpu_memory and host_fits,
                "comm_bytes_intra_node": cost.intra_node_bytes,
                "comm_bytes_inter_node": cost.inter_node_bytes,
                "comm_bytes_inter_node_max": cost.inter_node_bytes_max,
                "pcie_bytes_to_host": cost.pcie_down_bytes,
                "pcie_bytes_to_gpu": cost.pcie_up_bytes,
                "step_s": prediction.step_s if prediction else None,
                "compute_s": prediction.compute_s if prediction else None,
                "exposed_comm_s": prediction.exposed_comm_s if prediction else None,
                "tokens_per_s_per_gpu": tokens_per_gpu / prediction.step_s if prediction else None,
                **extra,
            }
        )
    return out


def ranked(found: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Configurations that fit, fastest first; equal step times (to the microsecond) by less GPU memory."""
    return sorted(
        (r for r in found if r["fits"]),
        key=lambda r: (round(r["step_s"], 6) if r["step_s"] is not None else 0.0, r["gpu_bytes"]),
    )


def render(
    found: list[dict[str, Any]],
    show_bytes: Any,
    unit: str,
    title: str,
    numbered: bool = False,
    width: int | None = None,
) -> str:
    """The rows as a table (cut to `width`, each part led by the configuration); `show_bytes(bytes, unit)` formats
    memory and traffic."""
    timed = any(r["step_s"] is not None for r in found)
    headers = ["#"] * numbered + ["configuration", "GPU formula", "GPU", "host/GPU", "fits"]
    headers += ["intra-node/GPU", "inter-node/GPU", "inter-node, busiest", "PCIe each way"]
    headers += ["step time", "exposed comm", "tokens/s/GPU"] * timed
    body = []
    for rank, r in enumerate(found, start=1):
        row = [str(r.get("rank", rank))] * numbered + [
            r["label"],
            r["gpu_formula"],
            show_bytes(r["gpu_bytes"], unit),
            show_bytes(r["host_bytes_per_gpu"], unit) if r["host_bytes_per_gpu"] else "-",
            "yes" if r["fits"] else "no",
            show_bytes(r["comm_bytes_intra_node"], unit),
            show_bytes(r["comm_bytes_inter_node"], unit),
            show_bytes(r["comm_bytes_inter_node_max"], unit),
            show_bytes(r["pcie_bytes_to_host"], unit) if r["pcie_bytes_to_host"] else "-",
        ]
        if timed:
            row += [format_seconds(r["step_s"]), format_seconds(r["exposed_comm_s"])]
            row.append(f"{r['tokens_per_s_per_gpu']:,.0f}")
        body.append(row)
    return table(headers, body, title=title, width=width, keys=1 + numbered)


NOTES = (
    "G = GPUs per node, S = HSDP's shard group. hpZ's 2Ψ/G is its secondary fp16 copy of the weights;\n"
    f"qwZ and qgZ send int8 and int4 with one fp32 scale per {QUANT_BLOCK_ELEMENTS} elements; offload keeps fp32 "
    "master\nweights, Adam states and the gradient partition on the host (14Ψ/N per GPU) and moves 2Ψ/N over PCIe\n"
    "each way. Step time: `zero_core.planner.configuration_time` (compute and collectives overlapped per\n"
    "layer, α-β links, host Adam at the node's DRAM bandwidth)."
)
