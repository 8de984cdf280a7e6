"""`python -m zero_core check-planner`: the planner against DeepSpeed, Megatron-Core and the virtual cluster.

Three tables, each row with the planner's error, (planner - reference) / reference (`zero_core.planner_check`):
DeepSpeed's estimators called from the installed package, Megatron-Core's distributed-optimizer bytes per
parameter (from the facts file) and the virtual cluster's audited memory of the course's own presets. Notes under
each table say what its errors are made of; nothing here is tuned to make them small.
"""

from __future__ import annotations

import argparse

from zero_core.cli.errors import UsageError
from zero_core.cli.render import WIDTH, fit, table
from zero_core.cli.table import check_json_path, write_json
from zero_core.cluster import MAX_WORLD_SIZE
from zero_core.configurations import CONFIGURATIONS
from zero_core.facts import fact
from zero_core.model import PRESETS
from zero_core.planner_check import (
    CLUSTER_PRESETS,
    CLUSTER_WORLD_SIZE,
    GPUS_PER_NODE,
    MEGATRON_ROWS,
    ClusterRow,
    DeepSpeedRow,
    MegatronRow,
    PlannerCheck,
    check_planner,
)
from zero_core.units import GiB

DEEPSPEED_NOTE = """\
DeepSpeed: its estimators count model states only, like the planner, and return bytes its printout calls "GB"
(GiB here). ZeRO-2: DeepSpeed keeps an fp32 copy of its gradient partition, 2P + 18P/N against the planner's
(the paper's) 2P + 14P/N. ZeRO-3: 18P/N against 16P/N, plus 4 bytes × the largest module (L, the embedding
or an FFN matrix), the layer it gathers; the planner's whole memory counts gathered layers apart (plan
--nodes). With offload both leave the fp16 parameters on the GPU (2P; ZeRO-3 2P/N + 4L): the error is 4L."""
MEGATRON_NOTE = """\
Megatron-Core: the planner counts mixed precision as the paper does, 2-byte parameters and gradients with fp32
master weights and Adam (16 bytes; ZeRO-1 4 + 12/d), whatever the row's dtypes. Megatron's fp16 row keeps an
fp32 copy of the gradients too (20; 4 + 16/d: the planner lacks 4/d); its fp32-gradient row keeps them
replicated (6 + 12/d); its fp32 row keeps no master copy (8 + 8/d). The planner has neither mode."""
CLUSTER_NOTE = """\
Virtual cluster: one bf16 step per stage, the fullest rank's audited bytes. States: the planner's GPT ties its
output head to the embedding, the course's does not (V·h + V more parameters, 16 bytes each in ZeRO-0).
Activations: the planner's formula is Megatron's GPT-3 block (Korthikanti et al.) with dropout masks, which
the course's GPT does not have, and it counts fp32 logits for the loss. Peak: the audited peak holds
temporaries no formula counts (in backward, the gradients of activations; a row that peaks in the optimizer
step holds Adam's fp32 scratch there, its activations already freed), and the planner adds DeepSpeed's
buffers where the course's stages hold less: a gradient bucket of min(5e8, Ψ) elements (the stages reduce one
layer at a time), two gathered blocks in ZeRO-3 (the stages gather one layer), norms and biases persistent in
ZeRO-3 (the stages gather them too)."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "check-planner",
        help="the planner against DeepSpeed's estimators, Megatron-Core's table and the virtual cluster, with errors",
        description="Set the planner's memory beside three references, each row with the planner's error: "
        "DeepSpeed's estimators (from the installed deepspeed package), Megatron-Core's distributed-optimizer "
        "bytes per parameter (sourced in zero_core/data/facts.toml) and the virtual cluster's audited memory "
        "of the course's presets (a few seconds).",
    )
    p.add_argument("--world-size", type=int, default=CLUSTER_WORLD_SIZE,
                   help=f"virtual GPUs for the cluster rows (default {CLUSTER_WORLD_SIZE})")
    p.add_argument("--presets", default=",".join(CLUSTER_PRESETS),
                   help=f"course presets for the cluster rows, of {', '.join(PRESETS)} "
                   f"(default {','.join(CLUSTER_PRESETS)})")
    p.add_argument("--checkpointing", choices=("none", "full"), default="none",
                   help="activation checkpointing of the course's GPT and of the planner's formula (default none, "
                   "as the stages train)")
    p.add_argument("--json", metavar="PATH", help="also write every row as JSON")
    p.add_argument("--wide", action="store_true", help="print each table whole, however wide")


def _percent(value: float) -> str:
    return f"{value:+.1%}"


def _gib(n_bytes: float) -> str:
    return f"{n_bytes / GiB:.2f}"


def _mb(n_bytes: float) -> str:
    return f"{n_bytes / 1e6:.3f}"


def render_deepspeed(rows: list[DeepSpeedRow], width: int | None = WIDTH) -> str:
    body = [[r.model, CONFIGURATIONS[r.config].label, str(r.n_gpus), f"{r.largest_layer_params / 1e6:,.1f}M",
             _gib(r.deepspeed_bytes), _gib(r.planner_bytes), _percent(r.error)] for r in rows]
    headers = ["model", "configuration", "N", "largest L", "DeepSpeed", "planner", "error"]
    title = ("(a) Model states per GPU, GiB: DeepSpeed's estimators (the installed package) against the planner, "
             f"nodes of {GPUS_PER_NODE} GPUs")
    return table(headers, body, title=title, width=width, keys=3)


def render_megatron(rows: list[MegatronRow], width: int | None = WIDTH) -> str:
    body = [[r.dtypes, "non-distributed" if r.data_parallel is None else f"distributed, d = {r.data_parallel}",
             f"{r.megatron_bytes_per_param:.3f}", f"{r.planner_bytes_per_param:.3f}",
             CONFIGURATIONS[r.planner_config].label, _percent(r.error)] for r in rows]
    headers = ["dtypes", "optimizer", "Megatron-Core", "planner", "as", "error"]
    source = fact(MEGATRON_ROWS[0]).cite()
    title = f"(b) Model-state bytes per parameter: Megatron-Core's distributed optimizer ({source}) against the planner"
    return table(headers, body, title=title, width=width, keys=2)


def render_cluster(rows: list[ClusterRow], width: int | None = WIDTH) -> str:
    body = []
    for r in rows:
        errors = r.errors
        body.append([r.preset, str(r.stage), _mb(r.measured_states), _mb(r.planner_states),
                     _percent(errors["states"]), _mb(r.measured_activations), _mb(r.planner_activations),
                     _percent(errors["activations"]), _mb(r.measured_peak), _mb(r.planner_total),
                     _percent(errors["peak"]), r.peak_phase])
    headers = ["preset", "ZeRO", "states", "planner", "error", "act.", "planner", "error", "peak", "planner",
               "error", "peak in"]
    first = rows[0] if rows else None
    setting = f"N = {first.world_size}, checkpointing: {first.checkpointing}" if first else ""
    psis = ", ".join(dict.fromkeys(f"{r.preset} Ψ {r.measured_psi:,} (planner {r.planner_psi:,})" for r in rows))
    title = (f"(c) Memory per GPU, MB: the virtual cluster's audited model states, activations (act.) and peak "
             f"against the planner's whole memory (no allowance), {setting}; {psis}")
    return table(headers, body, title=title, width=width, keys=2)


def render(check: PlannerCheck, width: int | None = WIDTH) -> str:
    """The three tables, each with its note: what `check-planner` prints."""
    return "\n\n".join([
        render_deepspeed(check.deepspeed, width), fit(DEEPSPEED_NOTE.replace("\n", " "), width),
        render_megatron(check.megatron, width), fit(MEGATRON_NOTE.replace("\n", " "), width),
        render_cluster(check.cluster, width), fit(CLUSTER_NOTE.replace("\n", " "), width),
    ])


def run(args: argparse.Namespace) -> int:
    json_path = check_json_path(args.json)
    if not 1 <= args.world_size <= MAX_WORLD_SIZE:
        raise UsageError(f"--world-size must be between 1 and {MAX_WORLD_SIZE}, got {args.world_size}")
    presets = tuple(p.strip() for p in args.presets.split(",") if p.strip())
    unknown = [p for p in presets if p not in PRESETS]
    if unknown or not presets:
        raise UsageError(f"--presets: choose from {', '.join(PRESETS)}, got {args.presets!r}")
    try:
        check = check_planner(args.world_size, presets, args.checkpointing)
    except RuntimeError as missing:
        raise UsageError(str(missing)) from None
    print(render(check, None if args.wide else WIDTH))
    if json_path is not None:
        write_json(json_path, check.to_dict())
        print(f"\nwrote {json_path}")
    return 0
