"""`python -m zero_core plan`: on how many GPUs does each ZeRO stage fit a model? (model states only)

The question ZeRO Table 1's bold cells answer for 7.5B, 128B and 1T on 32 GB V100s, asked of any model
and any GPU: for each stage, the smallest data-parallel degree N whose per-GPU model states (ZeRO §5,
Figure 1) fit the GPU's memory, and the smallest power of two (`formulas.plan`). A stage whose replicated
part alone overflows the GPU never fits, however many GPUs share the rest.

With `--nodes` the question turns around: on these M nodes of G GPUs, which configuration (the paper's
stages, offload, hpZ, qwZ, ZeRO++, HSDP at every shard group S = G, 2G, ... below N) fits, and which is
fastest? The answer is ranked by predicted step time on `--machine`, ties by GPU memory; it is computed by
`zero_core.cli.ranked.ranked_plan`, a function of the options' values that lesson 05's calculator calls too.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from zero_core import formulas
from zero_core.cli import configs as config_table
from zero_core.cli import emit, model_choice, ranked
from zero_core.cli.errors import UsageError
from zero_core.cli.render import WIDTH, fit, table
from zero_core.cli.table import (
    MODEL_STATES_NOTE,
    check_json_path,
    display_unit,
    gpu_memory_argument,
    parse_gpu_count,
    show_bytes,
    show_size,
    units_argument,
    write_json,
)
from zero_core.stages import stage_class
from zero_core.units import format_count

POWERS_OF_TWO = tuple(2**i for i in range(21))


def replicated_and_partitioned_bytes(stage: int, psi: float) -> tuple[float, float]:
    """(R, P) with model states per GPU = R + P/N: what every GPU keeps, and what N GPUs share."""
    one, two = formulas.model_state_bytes(stage, psi, 1), formulas.model_state_bytes(stage, psi, 2)
    partitioned = 2 * (one - two)
    return one - partitioned, partitioned


def smallest_gpu_count(stage: int, psi: float, gpu_memory_bytes: float) -> int | None:
    """The smallest N with R + P/N ≤ memory (ZeRO §5), or None when the replicated R alone does not fit."""
    replicated, partitioned = replicated_and_partitioned_bytes(stage, psi)
    if replicated > gpu_memory_bytes or (partitioned > 0 and replicated == gpu_memory_bytes):
        return None
    n = max(1, math.ceil(partitioned / (gpu_memory_bytes - replicated))) if partitioned else 1
    while n > 1 and formulas.fits(stage, psi, n - 1, gpu_memory_bytes):
        n -= 1
    while not formulas.fits(stage, psi, n, gpu_memory_bytes):
        n += 1
    return n


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="smallest number of GPUs on which each ZeRO stage fits a model")
    model_choice.add_arguments(p, "13B or 1.3e9")
    p.add_argument("--gpu-memory", required=True, help="memory of one GPU: 80GB (1e9 bytes) or 80GiB")
    p.add_argument(
        "--nodes",
        type=units_argument(parse_gpu_count),
        help="rank the configurations on this many nodes (needs --machine)",
    )
    p.add_argument(
        "--gpus-per-node", type=units_argument(parse_gpu_count), help="GPUs per node (default: the machine's)"
    )
    config_table.add_arguments(p, default_configs="all, and HSDP at S = G, 2G, 4G, ... below N")
    p.add_argument("--json", metavar="PATH", help="also write the answer as JSON")
    p.add_argument("--wide", action="store_true", help="one table however wide (default: tables fit 100 columns)")
    emit.add_arguments(p)


def plan_rows(psi: int, gpu_memory: int) -> list[dict[str, Any]]:
    """One dict per stage: smallest N, bytes per GPU there, smallest power of two, what never fits."""
    powers = formulas.plan(psi, gpu_memory, gpu_counts=POWERS_OF_TWO)
    rows = []
    for stage in formulas.STAGES:
        n = smallest_gpu_count(stage, psi, gpu_memory)
        replicated, _ = replicated_and_partitioned_bytes(stage, psi)
        rows.append(
            {
                "stage": stage,
                "memory_formula": formulas.MEMORY_FORMULAS[stage],
                "smallest_n_gpus": n,
                "model_state_bytes_at_n": formulas.model_state_bytes(stage, psi, n) if n else None,
                "smallest_power_of_two": powers[stage],
                "replicated_bytes": replicated,
            }
        )
    return rows


def run_ranked(args: argparse.Namespace, planned: model_choice.PlannedModel, json_path: Any) -> int:
    """`--nodes`: the configurations that fit M nodes of G GPUs, fastest first on `--machine` (`ranked.ranked_plan`,
    which lesson 05's calculator calls too)."""
    if args.machine is None:
        raise UsageError("--nodes ranks configurations by predicted step time: give --machine too")
    answer = ranked.ranked_plan(
        planned, args.gpu_memory, args.nodes, args.machine, args.gpus_per_node, args.configs, args.tokens_per_gpu,
        args.micro_batch, args.checkpointing, args.allowance,
    )
    print(answer.text(None if args.wide else WIDTH))
    if json_path is not None:
        write_json(json_path, answer.to_json())
        print(f"\nwrote {json_path}")
    if args.emit:
        return emit.write(args, planned, answer.best, answer.chosen, answer.n_gpus, answer.gpus_per_node)
    return 0


def run(args: argparse.Namespace) -> int:
    gpu_memory = gpu_memory_argument(args.gpu_memory)
    json_path = check_json_path(args.json)
    unit = display_unit(args.gpu_memory)
    planned = model_choice.resolve(args)
    emit.check(args)
    if args.nodes is not None:
        with emit.plan_output(args):
            return run_ranked(args, planned, json_path)
    if args.configs or args.machine or args.gpus_per_node:
        raise UsageError("--configs, --machine and --gpus-per-node rank configurations on --nodes: give --nodes")
    rows = plan_rows(planned.psi, gpu_memory)
    width = None if args.wide else WIDTH
    print(fit(render(planned.psi, gpu_memory, unit, rows, planned, width), width))
    if json_path is not None:
        write_json(
            json_path,
            {
                "schema": "zero-course/plan/1",
                "psi": planned.psi,
                "model": planned.to_dict(),
                "gpu_memory_bytes": gpu_memory,
                "model_states_only": True,
                "stages": rows,
            },
        )
        print(f"\nwrote {json_path}")
    return 0


def render(
    psi: int,
    gpu_memory: int,
    unit: str,
    rows: list[dict[str, Any]],
    planned: model_choice.PlannedModel | None = None,
    width: int | None = None,
) -> str:
    memory_label = show_size(gpu_memory, unit)
    header = (
        f"On how many GPUs of {memory_label} does Ψ = {format_count(psi)} parameters fit? (ZeRO §5, Table 1)\n"
        + (f"{model_choice.model_text(planned)}\n" if planned and planned.shape else "")
        + f"{MODEL_STATES_NOTE}\n"
        f"{unit} = {'2^30' if unit == 'GiB' else '10^9'} bytes."
    )
    body = table(
        ["stage", "partitioned", "formula", "smallest N", "model states/GPU at N", "smallest power of 2"],
        [
            [
                f"ZeRO-{r['stage']}",
                stage_class(r["stage"]).partitioned,
                r["memory_formula"],
                str(r["smallest_n_gpus"]) if r["smallest_n_gpus"] else "never",
                show_bytes(r["model_state_bytes_at_n"], unit) if r["smallest_n_gpus"] else "",
                _power_of_two(r),
            ]
            for r in rows
        ],
        title="Smallest data-parallel degree per stage",
        width=width,
    )
    never = [
        f"ZeRO-{r['stage']} never fits: every GPU keeps {show_bytes(r['replicated_bytes'], unit)} "
        f"({r['memory_formula'].split(' + ')[0]}) whatever N."
        for r in rows
        if r["smallest_n_gpus"] is None
    ]
    return "\n\n".join([header, "\n".join([body, *never])])


def _power_of_two(row: dict[str, Any]) -> str:
    if row["smallest_n_gpus"] is None:
        return "never"
    power = row["smallest_power_of_two"]
    return str(power) if power else f"> {POWERS_OF_TWO[-1]:,}"
