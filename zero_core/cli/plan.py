"""`python -m zero_core plan`: on how many GPUs does each ZeRO stage fit a model? (model states only)

The question ZeRO Table 1's bold cells answer for 7.5B, 128B and 1T on 32 GB V100s, asked of any model
and any GPU: for each stage, the smallest data-parallel degree N whose per-GPU model states (ZeRO §5,
Figure 1) fit the GPU's memory, and the smallest power of two (`formulas.plan`). A stage whose replicated
part alone overflows the GPU never fits, however many GPUs share the rest.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from zero_core import formulas
from zero_core.cli.render import table
from zero_core.cli.table import (
    MEMORY_FORMULA,
    MODEL_STATES_NOTE,
    PARTITIONED,
    check_json_path,
    display_unit,
    gpu_memory_argument,
    show_bytes,
    show_size,
    units_argument,
    write_json,
)
from zero_core.units import format_count, parse_count

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
    p.add_argument("--params", required=True, type=units_argument(parse_count), help="parameters Ψ, like 13B or 1.3e9")
    p.add_argument("--gpu-memory", required=True, help="memory of one GPU: 80GB (1e9 bytes) or 80GiB")
    p.add_argument("--json", metavar="PATH", help="also write the answer as JSON")


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
                "memory_formula": MEMORY_FORMULA[stage],
                "smallest_n_gpus": n,
                "model_state_bytes_at_n": formulas.model_state_bytes(stage, psi, n) if n else None,
                "smallest_power_of_two": powers[stage],
                "replicated_bytes": replicated,
            }
        )
    return rows


def run(args: argparse.Namespace) -> int:
    gpu_memory = gpu_memory_argument(args.gpu_memory)
    json_path = check_json_path(args.json)
    unit = display_unit(args.gpu_memory)
    rows = plan_rows(args.params, gpu_memory)
    print(render(args.params, gpu_memory, unit, rows))
    if json_path is not None:
        write_json(
            json_path,
            {
                "schema": "zero-course/plan/1",
                "psi": args.params,
                "gpu_memory_bytes": gpu_memory,
                "model_states_only": True,
                "stages": rows,
            },
        )
        print(f"\nwrote {json_path}")
    return 0


def render(psi: int, gpu_memory: int, unit: str, rows: list[dict[str, Any]]) -> str:
    memory_label = show_size(gpu_memory, unit)
    header = (
        f"On how many GPUs of {memory_label} does Ψ = {format_count(psi)} parameters fit? (ZeRO §5, Table 1)\n"
        f"{MODEL_STATES_NOTE}\n"
        f"{unit} = {'2^30' if unit == 'GiB' else '10^9'} bytes."
    )
    body = table(
        ["stage", "partitioned", "formula", "smallest N", "model states/GPU at N", "smallest power of 2"],
        [
            [
                f"ZeRO-{r['stage']}",
                PARTITIONED[r["stage"]],
                r["memory_formula"],
                str(r["smallest_n_gpus"]) if r["smallest_n_gpus"] else "never",
                show_bytes(r["model_state_bytes_at_n"], unit) if r["smallest_n_gpus"] else "",
                _power_of_two(r),
            ]
            for r in rows
        ],
        title="Smallest data-parallel degree per stage",
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
