"""`python -m zero_core table`: the paper's arithmetic at real scale, for one model on N GPUs.

For each stage: model-state memory per GPU (ZeRO §5, Figure 1) and whether it fits the GPU; bytes each
GPU sends per step, on a ring (exact) and as the paper counts them for large N (2Ψ, 2Ψ, 2Ψ, 3Ψ, ZeRO §7),
and how long that takes on the link; with `--gpus-per-node` or `--collectives`, how much of it stays inside
a node and how much crosses between nodes (`zero_core.topology`'s closed forms); then DeepSpeed's own
estimators beside the paper's formulas. With `--configs` or `--machine`, one more table: configurations beyond
the paper's stages (offload, hpZ, qwZ, ZeRO++, HSDP; `zero_core.configurations`) with memory, traffic by link
and, on a machine, the predicted step time (`zero_core.cli.configs`).
Nothing is trained: this is `zero_core.formulas` with human units in and out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from zero_core import configurations, formulas
from zero_core.cli import configs as config_table
from zero_core.cli import model_choice, whole
from zero_core.cli.compare import add_topology_arguments, link_title, links_asked, topology_of
from zero_core.cli.errors import UsageError
from zero_core.cli.render import WIDTH, fit, table
from zero_core.planner.deepspeed_estimators import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs,
)
from zero_core.stages import stage_class
from zero_core.topology import RING, Topology, pass_split
from zero_core.units import GB, GiB, format_count, format_seconds, parse_bandwidth, parse_bytes, parse_count

PAPER_PASSES = {0: 2, 1: 2, 2: 2, 3: 3}
CONFIG_STAGES = ("zero0", "zero1", "zero2", "zero3")
BYTES_PER_ELEMENT = 2
MODEL_STATES_NOTE = (
    "Model states only: fp16 parameters and gradients, fp32 Adam master weights, momentum and variance\n"
    "(16 bytes per parameter, K = 12); activations, temporary buffers and fragmentation need room on top."
)
_SECONDS = re.compile(r"^\s*(\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)\s*(s|ms|us|µs|ns)?\s*$")
_SECONDS_SCALE = {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def units_argument(parse: Any) -> Any:
    """Wrap a units parser so argparse reports its message as one line ("argument --params: ...")."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    convert.__name__ = parse.__name__
    return convert


def parse_gpu_count(text: str) -> int:
    """A number of GPUs: a whole number, at least 1 ("64")."""
    if not re.fullmatch(r"\s*\d+\s*", text) or int(text) < 1:
        raise ValueError(f"a GPU count must be a whole number of at least 1, like 64; got {text!r}")
    return int(text)


def parse_memory(text: str) -> int:
    """A GPU's memory, positive: "32GB" (decimal, as the paper) or "40GiB" (binary)."""
    size = parse_bytes(text)
    if size == 0:
        raise ValueError(f"a GPU needs some memory, got {text!r}; write it like 32GB or 40GiB")
    return size


def parse_seconds(text: str) -> float:
    """A latency: "0", "5us", "5µs", "0.01ms", "1e-5s". Only 0 goes without a unit: "5" could be s or µs."""
    match = _SECONDS.match(text)
    if match is None:
        raise ValueError(f"could not read {text!r} as a latency; write it like 0, 5us or 0.01ms (not negative)")
    value = float(match.group(1))
    if match.group(2) is None and value != 0:
        raise ValueError(f"{text!r} has no unit: write a latency with one, like 5us or 0.01ms (only 0 needs none)")
    return value * _SECONDS_SCALE[match.group(2)]


def gpu_memory_argument(text: str) -> int:
    """--gpu-memory is parsed after argparse (its text also picks the display unit), so errors are UsageErrors."""
    try:
        return parse_memory(text)
    except ValueError as error:
        raise UsageError(f"argument --gpu-memory: {error}") from None


def show_bytes(n_bytes: float, unit: str) -> str:
    """Bytes in GB or GiB with two decimals ("1.88 GB"), or three significant digits when smaller than that."""
    value = n_bytes / (GiB if unit == "GiB" else GB)
    return f"{value:.2f} {unit}" if value >= 0.01 or value == 0 else f"{value:.3g} {unit}"


def show_size(n_bytes: float, unit: str) -> str:
    """A size as its owner would write it: "32 GB", "40 GiB", "12.5 GB"."""
    return f"{n_bytes / (GiB if unit == 'GiB' else GB):g} {unit}"


def display_unit(memory_text: str) -> str:
    """GiB when the user gave the GPU memory in binary units, else the paper's decimal GB."""
    return "GiB" if "iB" in memory_text else "GB"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "table", help="memory and traffic per GPU of ZeRO-0..3 for a model on N GPUs (the paper's formulas)"
    )
    model_choice.add_arguments(p, "7.5B or 1.3e9")
    p.add_argument("--gpus", required=True, type=units_argument(parse_gpu_count), help="data-parallel GPUs N, like 64")
    p.add_argument("--gpu-memory", default="32GB", help="memory of one GPU: 32GB (1e9 bytes) or 40GiB (default 32GB)")
    p.add_argument(
        "--bandwidth",
        default="50GB/s",
        type=units_argument(parse_bandwidth),
        help="bytes per second each GPU sends: 50GB/s, 100Gbit/s (default 50GB/s)",
    )
    p.add_argument(
        "--latency",
        default="0",
        type=units_argument(parse_seconds),
        help="latency per ring step: 0, 5us, 0.01ms (default 0)",
    )
    p.add_argument(
        "--largest-layer",
        type=units_argument(parse_count),
        help="parameters of the largest layer, for DeepSpeed's ZeRO-3 estimate (default: left out)",
    )
    add_topology_arguments(p, "--gpus")
    config_table.add_arguments(p, default_configs=",".join(CONFIG_STAGES))
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    p.add_argument("--wide", action="store_true", help="one table however wide (default: tables fit 100 columns)")


def check_json_path(path: str | None) -> Path | None:
    if path is None:
        return None
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        raise UsageError(f"--json: folder {folder} does not exist")
    return Path(path)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write atomically: a reader never sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.resolve().parent, suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle, indent=2)
    os.replace(tmp, path)


def ring_messages_per_step(stage: int, n_gpus: int) -> int:
    """Sequential ring steps per training step if each pass over the model is one fused collective.

    A ring collective takes N-1 steps per pass (an all-reduce is two passes): 2(N-1) for stages 0-2 and
    3(N-1) for ZeRO-3. Real systems send one collective per bucket or layer, which multiplies this.
    """
    return PAPER_PASSES[stage] * (n_gpus - 1)


def stage_rows(
    psi: int,
    n_gpus: int,
    gpu_memory: int,
    bandwidth: float,
    latency: float,
    topology: Topology | None = None,
    algorithm: str = RING,
) -> list[dict[str, Any]]:
    """The numbers of the table, one dict per stage, in bytes, elements and seconds.

    The link split counts each pass over the model (PAPER_PASSES) as one reduce-scatter or all-gather of
    Ψ elements on `topology` (default: one node), with `zero_core.topology.pass_split`'s closed forms.
    """
    split = pass_split(psi, topology or Topology.single_node(n_gpus), algorithm)
    rows = []
    for stage in formulas.STAGES:
        memory_bytes = formulas.model_state_bytes(stage, psi, n_gpus)
        ring_elements = formulas.comm_elements(stage, psi, n_gpus, exact=True)
        paper_elements = formulas.comm_elements(stage, psi, n_gpus, exact=False)
        messages = ring_messages_per_step(stage, n_gpus) if n_gpus > 1 else 0
        rows.append(
            {
                "stage": stage,
                "memory_formula": formulas.MEMORY_FORMULAS[stage],
                "model_state_bytes": memory_bytes,
                "fits": formulas.fits(stage, psi, n_gpus, gpu_memory),
                "comm_elements_ring": ring_elements,
                "comm_bytes_ring": ring_elements * BYTES_PER_ELEMENT,
                "comm_psi_ring": ring_elements / psi,
                "comm_elements_paper": paper_elements,
                "comm_bytes_paper": paper_elements * BYTES_PER_ELEMENT,
                "comm_psi_paper": paper_elements / psi,
                "comm_seconds_ring": formulas.comm_seconds(
                    ring_elements * BYTES_PER_ELEMENT, bandwidth, latency, messages
                ),
                "comm_seconds_paper": formulas.comm_seconds(paper_elements * BYTES_PER_ELEMENT, bandwidth),
                **link_fields(PAPER_PASSES[stage], split, psi),
            }
        )
    return rows


def link_fields(passes: int, split: Any, psi: int) -> dict[str, float]:
    """Elements, bytes and Ψ-multiples sent per GPU per step inside its node and across nodes."""
    elements = {
        "intra_node": passes * split.intra_node_mean,
        "inter_node": passes * split.inter_node_mean,
        "inter_node_max": passes * split.inter_node_max,
    }
    fields: dict[str, float] = {}
    for unit, scale in (("elements", 1), ("bytes", BYTES_PER_ELEMENT)):
        fields |= {f"comm_{unit}_{link}": value * scale for link, value in elements.items()}
    return fields | {f"comm_psi_{link}": value / psi for link, value in elements.items()}


def deepspeed_rows(psi: int, n_gpus: int, largest_layer: int | None) -> list[dict[str, Any]]:
    """DeepSpeed's GPU estimates without offload, beside the paper's, and why they differ."""
    zero2 = estimate_zero2_model_states_mem_needs(psi, num_gpus_per_node=n_gpus, cpu_offload=False)
    zero3 = estimate_zero3_model_states_mem_needs(
        psi, largest_layer or 0, num_gpus_per_node=n_gpus, cpu_offload=False, cpu_offload_params=False
    )
    return [
        {
            "stage": 2,
            "paper_formula": formulas.MEMORY_FORMULAS[2],
            "deepspeed_formula": "2P + 18P/N",
            "paper_bytes": formulas.model_state_bytes(2, psi, n_gpus),
            "deepspeed_bytes": zero2.gpu_bytes,
            "why": "DeepSpeed also keeps an fp32 copy of its gradient partition: 4P/N more",
        },
        {
            "stage": 3,
            "paper_formula": formulas.MEMORY_FORMULAS[3],
            "deepspeed_formula": "4L + 18P/N",
            "paper_bytes": formulas.model_state_bytes(3, psi, n_gpus),
            "deepspeed_bytes": zero3.gpu_bytes,
            "why": "18 not 16 bytes per parameter partitioned, plus 4 bytes × the largest layer L it gathers",
            "largest_layer_params": largest_layer or 0,
        },
    ]


def run(args: argparse.Namespace) -> int:
    gpu_memory = gpu_memory_argument(args.gpu_memory)
    json_path = check_json_path(args.json)
    planned = model_choice.resolve(args)
    width = None if args.wide else WIDTH
    psi, n_gpus, unit = planned.psi, args.gpus, display_unit(args.gpu_memory)
    machine = config_table.machine_of(args.machine)
    if args.gpus_per_node is None and machine and n_gpus % machine.gpus_per_node == 0:
        args.gpus_per_node = machine.gpus_per_node
    topology = topology_of(args, n_gpus, "--gpus")
    rows = stage_rows(psi, n_gpus, gpu_memory, args.bandwidth, args.latency, topology, args.collectives)
    ds_rows = deepspeed_rows(psi, n_gpus, args.largest_layer)
    extra = []
    if args.configs or machine:
        chosen = config_table.parse(args.configs or ",".join(CONFIG_STAGES))
        setup = whole.setup(planned, args.tokens_per_gpu, args.micro_batch, args.checkpointing, args.allowance)
        extra = config_table.rows(
            chosen, psi, n_gpus, topology.gpus_per_node, gpu_memory, machine, args.tokens_per_gpu, args.collectives,
            planned.schedule, setup,
        )
    text = render(args, psi, n_gpus, gpu_memory, unit, rows, ds_rows, topology, planned)
    if extra:
        where = f"on {machine.name}, {args.tokens_per_gpu:,} tokens per GPU" if machine else "(no --machine: no times)"
        title = (
            f"Configurations: model states per GPU, bytes sent per GPU per step, predicted step {where}\n"
            f"{link_title(topology, args.collectives)}"
        )
        notes = configurations.formula_notes([c.name for c in chosen])
        assumed = [model_choice.assumptions_text(planned, args.tokens_per_gpu, args.machine, setup.checkpointing)
                   ] if machine else []
        text += "\n\n" + "\n".join(
            [config_table.render(extra, show_bytes, unit, title, width=width), *notes, config_table.NOTES, *assumed]
        )
        text += "\n\n" + "\n".join(
            [whole.render(extra, setup, gpu_memory, args.tokens_per_gpu, width, unit=unit), whole.notes(extra, setup)]
        )
    print(fit(text, width))
    if json_path is not None:
        write_json(
            json_path,
            {
                "schema": "zero-course/table/1",
                "psi": psi,
                "n_gpus": n_gpus,
                "gpu_memory_bytes": gpu_memory,
                "bandwidth_bytes_per_s": args.bandwidth,
                "latency_s": args.latency,
                "gpus_per_node": topology.gpus_per_node,
                "nodes": topology.nodes,
                "collectives": args.collectives,
                "bytes_per_element": BYTES_PER_ELEMENT,
                "model_states_only": True,
                "model": planned.to_dict(),
                "stages": rows,
                "deepspeed": ds_rows,
                **({"machine": machine.name if machine else None, "tokens_per_gpu": args.tokens_per_gpu,
                    "whole": setup.to_dict(), "configurations": extra} if extra else {}),
                **({"assumptions": model_choice.assumptions(planned, args.tokens_per_gpu, args.machine,
                                                            setup.checkpointing)}
                   if extra and machine else {}),
            },
        )
        print(f"\nwrote {json_path}")
    return 0


def render(
    args: argparse.Namespace,
    psi: int,
    n_gpus: int,
    gpu_memory: int,
    unit: str,
    rows: list[dict[str, Any]],
    ds_rows: list[dict[str, Any]],
    topology: Topology | None = None,
    planned: model_choice.PlannedModel | None = None,
) -> str:
    memory_label = show_size(gpu_memory, unit)
    bandwidth_label = show_size(args.bandwidth, "GB") + "/s"
    width = None if getattr(args, "wide", False) else WIDTH
    header = (
        f"ZeRO at scale: Ψ = {format_count(psi)} parameters on N = {n_gpus} GPUs of {memory_label}, "
        f"link {bandwidth_label}, latency {format_seconds(args.latency)}\n"
        + (f"{model_choice.model_text(planned)}\n" if planned and planned.shape else "")
        + f"{MODEL_STATES_NOTE}\n"
        f"{unit} = {'2^30' if unit == 'GiB' else '10^9'} bytes."
    )
    memory = table(
        ["stage", "partitioned", "formula", "model states/GPU", f"fits {memory_label}"],
        [
            [
                f"ZeRO-{r['stage']}",
                stage_class(r["stage"]).partitioned,
                r["memory_formula"],
                show_bytes(r["model_state_bytes"], unit),
                "yes" if r["fits"] else "no",
            ]
            for r in rows
        ],
        title="Memory per GPU (ZeRO §5, Figure 1)",
        width=width,
    )
    latency_note = (
        f"\nthe ring's time adds latency × {PAPER_PASSES[0]}(N-1) ring steps (ZeRO-3: {PAPER_PASSES[3]}(N-1)), "
        "as if each pass were one fused buffer"
        if args.latency
        else ""
    )
    headers = ["stage", "ring (exact)", "elements", "bytes", "time", "paper (N → ∞)", "elements", "bytes", "time"]
    comm_rows = [
        [
            f"ZeRO-{r['stage']}",
            f"{r['comm_psi_ring']:.4f}Ψ",
            format_count(r["comm_elements_ring"]),
            show_bytes(r["comm_bytes_ring"], unit),
            format_seconds(r["comm_seconds_ring"]),
            f"{r['comm_psi_paper']:g}Ψ",
            format_count(r["comm_elements_paper"]),
            show_bytes(r["comm_bytes_paper"], unit),
            format_seconds(r["comm_seconds_paper"]),
        ]
        for r in rows
    ]
    link_note = ""
    if links_asked(args):
        link_note = f"\n{link_title(topology or Topology.single_node(n_gpus), args.collectives)}"
        headers += ["intra-node", "inter-node", "inter-node, busiest GPU"]
        for row, r in zip(comm_rows, rows, strict=True):
            row += [f"{r[f'comm_psi_{link}']:.4f}Ψ" for link in ("intra_node", "inter_node", "inter_node_max")]
    comm = table(
        headers,
        comm_rows,
        title=(
            f"Communication sent per GPU per step (ZeRO §7), and its time at {bandwidth_label}\n"
            f"fp16, 2 bytes per element; a ring sends (N-1)/N of the buffer per pass, the paper counts N → ∞"
            f"{latency_note}{link_note}"
        ),
        width=width,
    )
    deepspeed = table(
        ["stage", "paper", "DeepSpeed", "paper/GPU", "DeepSpeed/GPU", "why they differ"],
        [
            [
                f"ZeRO-{r['stage']}",
                r["paper_formula"],
                r["deepspeed_formula"],
                show_bytes(r["paper_bytes"], unit),
                f'{show_bytes(r["deepspeed_bytes"], unit)} (prints {r["deepspeed_bytes"] / GiB:.2f} "GB")',
                r["why"],
            ]
            for r in ds_rows
        ],
        title=(
            'DeepSpeed\'s estimators beside the paper (no offload; DeepSpeed prints bytes / 2^30 and labels it "GB")'
        ),
        width=width,
    )
    if not args.largest_layer:
        deepspeed += "\nL = 0: give the largest layer's parameters with --largest-layer to count DeepSpeed's 4L."
    return "\n\n".join([header, memory, comm, deepspeed])
