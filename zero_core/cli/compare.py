"""`python -m zero_core compare`: train the four stages on the virtual cluster and compare them.

Prints the model-states table (memory per GPU against the paper's formula, traffic per step), the
equivalence table (every stage against ZeRO-0), the compute table and the memory breakdown. With
`--gpus-per-node G` (nodes of G consecutive ranks) or `--collectives hierarchical`, the traffic also splits
into intra-node and inter-node bytes (`zero_core.topology`), recomputed from the ledger of what ran.
`--stages` also takes the stages that shard by node, `hsdp` (ZeRO-3 inside a node, replicated across
nodes) and `hpz` (ZeRO++'s hierarchical partitioning), which use `--gpus-per-node`, and ZeRO++'s quantized
stages, `qwz` (int8 weight gathers), `qgz` (int4 gradient all-to-all, by node) and `zeropp` (hpZ + qwZ +
qgZ): for them one more table counts bytes, since an int8 or int4 element is not an fp16 one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from tqdm import tqdm

from zero_core import configurations, memory
from zero_core.cli import predicted
from zero_core.cli.errors import UsageError
from zero_core.cli.render import WIDTH, fit, mb, table
from zero_core.cluster import MAX_WORLD_SIZE
from zero_core.experiment import Equivalence, compare_stages, equivalence
from zero_core.model import PRESETS, count_parameters, preset
from zero_core.planner.time_model import MACHINES
from zero_core.report import StageReport, stage_configuration
from zero_core.stage_pool import SMALLEST_WORLD_FOR_WORKERS, core_shares, default_jobs
from zero_core.stages import NAMED_STAGE_NAMES, TrainConfig, stage_class
from zero_core.stages.base import OVERFLOW_TAG, ZERO1_GRAD_SYNCS
from zero_core.topology import ALGORITHMS, RING, Topology
from zero_core.trace import write_trace

QUANTIZED_STAGES = ("qwz", "qgz", "zeropp")
MAX_STEPS = 10_000


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("compare", help="train ZeRO-0..3 on N virtual GPUs and compare memory, traffic, loss")
    p.add_argument("--world-size", type=int, default=32, help="number of virtual GPUs (default 32)")
    p.add_argument("--steps", type=int, default=3, help="training steps per stage (default 3)")
    p.add_argument(
        "--stages",
        default="0,1,2,3",
        help="comma-separated stages: 0-3, offload (ZeRO-Offload), hsdp (ZeRO-3 in a node, replicas across nodes), "
        "hpz (ZeRO++ hpZ), qwz, qgz, zeropp (ZeRO++ quantized) "
        "(default 0,1,2,3)",
    )
    p.add_argument("--preset", default="tiny", help=f"model size: {', '.join(PRESETS)} (default tiny)")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"], help="training precision")
    p.add_argument(
        "--zero1-grad-sync",
        default="reduce_scatter",
        choices=ZERO1_GRAD_SYNCS,
        help="ZeRO-1 gradient sync: the paper's reduce-scatter or DeepSpeed's all-reduce",
    )
    add_topology_arguments(p, "--world-size")
    predicted.add_arguments(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--jobs",
        type=int,
        help="how many stages train at once, each in a process of its own on its share of the cores "
        f"(default: one per core, at most one per stage, from --world-size {SMALLEST_WORLD_FOR_WORKERS} on; "
        "1: one after another in this process)",
    )
    p.add_argument("--json", metavar="PATH", help="also write every measurement as JSON (docs/report-schema.md)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--plots", metavar="DIR", help="also write the figures as PNGs into DIR (created if missing)")
    p.add_argument("--trace", metavar="PATH", help="also write the last step as a Chrome trace (open in Perfetto)")
    p.add_argument("--wide", action="store_true", help="one table however wide (default: tables fit 100 columns)")


def add_topology_arguments(p: argparse.ArgumentParser, world_option: str) -> None:
    """--gpus-per-node and --collectives, shared with `table`."""
    p.add_argument(
        "--gpus-per-node",
        type=int,
        metavar="G",
        help=f"GPUs per node (ranks r·G..r·G+G-1 share a node); must divide {world_option} (default: one node)",
    )
    p.add_argument(
        "--collectives",
        default=RING,
        choices=ALGORITHMS,
        help="how collectives cross nodes: NCCL's flat ring, or hierarchical (inside nodes, then across) "
        "(default ring)",
    )


def topology_of(args: argparse.Namespace, world_size: int, world_option: str) -> Topology:
    """The nodes `--gpus-per-node` asks for; all ranks on one node when it is not given."""
    gpus_per_node = world_size if args.gpus_per_node is None else args.gpus_per_node
    try:
        return Topology(world_size, gpus_per_node)
    except ValueError as error:
        raise UsageError(f"--gpus-per-node {gpus_per_node} with {world_option} {world_size}: {error}") from None


def links_asked(args: argparse.Namespace) -> bool:
    """Intra-/inter-node columns show when asked for, so the default tables stay as they were."""
    return args.gpus_per_node is not None or args.collectives != RING


def link_summary(report: StageReport, topology: Topology, algorithm: str) -> dict:
    """The last step's traffic per GPU by link class (overflow flag excluded, as in `comm_psi_per_step`)."""
    if report.ledger is None:
        return {}
    step, skip = report.steps - 1, (OVERFLOW_TAG,)
    traffic = report.ledger.link_traffic(topology, algorithm, step=step, exclude_tags=skip)
    elements = report.ledger.link_traffic(topology, algorithm, step=step, exclude_tags=skip, in_elements=True)
    n, psi = report.world_size, report.psi
    return {
        "comm_intra_node_bytes_per_step_mean": sum(t.intra_node_sent for t in traffic) / n,
        "comm_inter_node_bytes_per_step_mean": sum(t.inter_node_sent for t in traffic) / n,
        "comm_inter_node_bytes_per_step_max": max(t.inter_node_sent for t in traffic),
        "comm_intra_node_psi_per_step": sum(e.intra_node_sent for e in elements) / n / psi,
        "comm_inter_node_psi_per_step": sum(e.inter_node_sent for e in elements) / n / psi,
        "comm_inter_node_psi_per_step_max": max(e.inter_node_sent for e in elements) / psi,
        "link_bytes_per_step_by_rank": [t.to_dict() for t in traffic],
    }


def stage_label(stage: int | str) -> str:
    return stage_class(stage).label


def parse_stages(text: str) -> list[int | str]:
    parts = [part.strip().lower() for part in text.split(",") if part.strip()]
    named = [part for part in parts if part in NAMED_STAGE_NAMES]
    try:
        stages = [int(part) for part in parts if part not in NAMED_STAGE_NAMES]
    except ValueError:
        raise UsageError(
            f"--stages takes stage numbers like 0,1,2,3 (or {', '.join(NAMED_STAGE_NAMES)}), got {text!r}"
        ) from None
    bad = [s for s in stages if s not in (0, 1, 2, 3)]
    if bad or not parts:
        raise UsageError(
            f"--stages takes stages from 0 to 3 or named ({', '.join(NAMED_STAGE_NAMES)}), like 0,1,2,3; got {text!r}"
        )
    return [*sorted(set(stages)), *(name for name in NAMED_STAGE_NAMES if name in named)]


def check(args: argparse.Namespace) -> list[int | str]:
    if not 1 <= args.world_size <= MAX_WORLD_SIZE:
        raise UsageError(f"--world-size must be between 1 and {MAX_WORLD_SIZE}, got {args.world_size}")
    if not 1 <= args.steps <= MAX_STEPS:
        raise UsageError(f"--steps must be between 1 and {MAX_STEPS}, got {args.steps}")
    if args.preset not in PRESETS:
        raise UsageError(f"unknown --preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
    predicted.check(args)
    if args.jobs is not None and args.jobs < 1:
        raise UsageError(f"--jobs must be at least 1, got {args.jobs}")
    if args.json:
        folder = Path(args.json).resolve().parent
        if not folder.is_dir():
            raise UsageError(f"--json: folder {folder} does not exist")
    if args.trace and not Path(args.trace).resolve().parent.is_dir():
        raise UsageError(f"--trace: folder {Path(args.trace).resolve().parent} does not exist")
    if args.plots and Path(args.plots).exists() and not Path(args.plots).is_dir():
        raise UsageError(f"--plots: {args.plots} exists and is not a folder")
    return parse_stages(args.stages)


def run(args: argparse.Namespace) -> int:
    stages = check(args)
    topology = topology_of(args, args.world_size, "--world-size")
    model = preset(args.preset)
    config = TrainConfig(model=model, precision=args.precision, seed=args.seed, zero1_grad_sync=args.zero1_grad_sync)
    psi = count_parameters(model)
    width = None if args.wide else WIDTH
    print(fit(
        f"ZeRO on {args.world_size} virtual GPUs: {args.preset} GPT, Ψ = {psi:,} parameters, {args.precision}, "
        f"{args.steps} step(s), micro-batch {model.micro_batch_size}x{model.block_size} per GPU", width
    ))
    jobs = args.jobs = min(len(stages), args.jobs or default_jobs(len(stages), args.world_size))
    if jobs > 1:
        shares = core_shares(jobs)
        print(fit(
            f"Training {len(stages)} stages {len(shares)} at a time, each in its own process on {_cores(shares)} "
            f"of this machine's {sum(map(len, shares))} (--jobs; a stage's times are on its cores alone)", width
        ))
    with tqdm(
        total=len(stages) * args.steps,
        desc="training",
        unit="step",
        disable=args.no_progress,
        file=sys.stderr,
        leave=False,
    ) as bar:
        reports = compare_stages(
            stages, args.world_size, args.steps, config, lambda step: bar.update(), topology.gpus_per_node, jobs=jobs
        )
    reference = next((r for r in reports if r.stage == 0), reports[0])
    if any(isinstance(s, str) for s in stages):
        print(f"HSDP, hpZ, qgZ and ZeRO++ use nodes of G = {topology.gpus_per_node} GPUs (--gpus-per-node)")
    equivalences = [equivalence(reference, r) for r in reports]
    print()
    links = [link_summary(r, topology, args.collectives) for r in reports] if links_asked(args) else None
    text = render(
        reports, equivalences, reference, links=links, topology=topology, algorithm=args.collectives, width=width
    )
    print(fit(text, width))
    nodes = predicted.prediction_topology(args.world_size, args.gpus_per_node, args.machine)
    times = predicted.rows(reports, nodes, args)
    print()
    print(fit(predicted.render(times, nodes, args, width), width))
    if args.json:
        write_json(
            Path(args.json),
            args,
            psi,
            reports,
            equivalences,
            topology=topology,
            algorithm=args.collectives,
            predictions=times,
        )
        print(f"\nwrote {args.json}")
    if args.plots:
        from zero_core.plots import save_all  # matplotlib loads only when figures are asked for

        paths = save_all(reports, args.plots)
        print(f"\nwrote {len(paths)} figures to {args.plots}: {', '.join(path.name for path in paths)}")
    if args.trace:
        print(f"\nwrote {write_trace(reports, args.trace)} (the last step; open it in https://ui.perfetto.dev)")
    return 0


def _cores(shares: list[list[int]]) -> str:
    sizes = sorted({len(share) for share in shares})
    count = " or ".join(map(str, sizes))
    return f"{count} core{'' if sizes == [1] else 's'}"


def render(
    reports: list[StageReport],
    equivalences: list[Equivalence],
    reference: StageReport,
    *,
    links: list[dict] | None = None,
    topology: Topology | None = None,
    algorithm: str = RING,
    width: int | None = None,
) -> str:
    """The four tables; `links` (from `link_summary`, one per report) adds intra-/inter-node columns; `width`
    cuts each table into narrower ones that fit it."""
    psi = reports[0].psi
    title = "Model states per GPU (mean over ranks; padding reported apart) and traffic per GPU per step"
    headers = [
        "stage",
        "partitioned",
        "measured/GPU",
        "formula",
        "formula bytes",
        "ratio",
        "comm/step/GPU",
        "formula",
        "collectives/step",
    ]
    rows = [
        [
            stage_label(r.stage),
            stage_class(r.stage).partitioned,
            f"{mb(r.model_state_bytes_mean)} ({r.model_state_bytes_mean / psi:.2f}Ψ)",
            configurations.simulated_gpu_formula(stage_configuration(r.stage)),
            mb(r.formula_bytes),
            f"{r.formula_ratio:.4f}",
            f"{r.comm_psi_per_step:.4f}Ψ",
            f"{r.comm_formula_psi:.4f}Ψ",
            str(r.collectives_per_step),
        ]
        for r in reports
    ]
    if links is not None:
        topology = topology or Topology.single_node(reports[0].world_size)
        title += f"\n{link_title(topology, algorithm)}"
        headers += ["intra-node", "inter-node", "inter-node, busiest GPU"]
        for row, link in zip(rows, links, strict=True):
            row += [
                f"{link['comm_intra_node_psi_per_step']:.4f}Ψ",
                f"{link['comm_inter_node_psi_per_step']:.4f}Ψ",
                f"{link['comm_inter_node_psi_per_step_max']:.4f}Ψ",
            ]
    notes = configurations.formula_notes([stage_configuration(r.stage).name for r in reports])
    states = "\n".join([table(headers, rows, title=title, width=width), *notes])
    same = table(
        [
            "stage",
            f"loss at step {reports[0].steps - 1}",
            f"max |Δloss| vs {stage_label(reference.stage)}",
            "max |Δmaster weight|",
            "bit-identical",
        ],
        [
            [
                stage_label(e.stage),
                f"{e.final_loss:.6f}",
                f"{e.max_loss_delta:.1e}",
                f"{e.max_master_delta:.1e}",
                "yes" if e.bit_identical else "NO",
            ]
            for e in equivalences
        ],
        title="Equivalence: the same training, whatever the stage",
        width=width,
    )
    compute = table(
        ["stage", "fwd GFLOP/GPU", "bwd GFLOP/GPU", "optimizer MFLOP/GPU", "step time", "in collectives"],
        [
            [
                stage_label(r.stage),
                f"{r.flops_per_step_mean['forward'] / 1e9:.3f}",
                f"{r.flops_per_step_mean['backward'] / 1e9:.3f}",
                f"{r.flops_per_step_mean['optimizer'] / 1e6:.2f}",
                f"{r.typical_step_seconds:.2f} s",
                f"{r.collective_seconds_per_step_mean:.2f} s",
            ]
            for r in reports
        ],
        title=(
            "Compute per GPU per step (FLOPs: last step; times: over the steps between the first and the last, "
            "the cluster's wall time per step and a rank's time inside collectives; they time this simulation on "
            "this machine's CPU, every rank a thread, not ZeRO on GPUs: `plan --machine` predicts those)"
        ),
        width=width,
    )
    breakdown = table(
        [
            "stage",
            "param",
            "grad",
            "master",
            "adam m",
            "adam v",
            "padding",
            "gather peak",
            "bucket peak",
            "activations peak",
            "temporary peak",
            "peak total",
            "untracked",
        ],
        [
            [
                stage_label(r.stage),
                *(
                    mb(r.model_state_bytes_by_category_mean[c])
                    for c in ("param.fp16", "grad.fp16", "master.fp32", "adam.m", "adam.v")
                ),
                mb(r.padding_bytes_mean),
                mb(r.peak_bytes_by_category_max["gather.fp16"]),
                mb(r.peak_bytes_by_category_max["grad.bucket"]),
                mb(r.activation_peak_bytes_max),
                mb(r.peak_bytes_by_category_max["temporary"]),
                mb(r.peak_bytes_max),
                f"{r.untracked_bytes_max:,} B",
            ]
            for r in reports
        ],
        title=(
            "Memory breakdown per GPU (model states: mean over ranks; peaks: max over ranks, last step, every "
            "storage a rank allocated; untracked: bytes held after the step that no category names)"
        ),
        width=width,
    )
    return "\n\n".join(
        [states, same, compute, breakdown, *host_table(reports, width), *wire_table(reports, links, width)]
    )


def host_table(reports: list[StageReport], width: int | None = None) -> list[str]:
    """ZeRO-Offload's host memory and PCIe copies per GPU, beside its formulas (none without offload)."""
    rows = []
    for r in reports:
        if r.stage != "offload" or r.ledger is None:
            continue
        n, psi, step = r.world_size, r.psi, r.steps - 1
        host = sum(r.peak_bytes_by_category_max[c] for c in memory.HOST_STATES)
        down = sum(r.ledger.pcie_bytes(k, "d2h", step=step) for k in range(n)) / n
        up = sum(r.ledger.pcie_bytes(k, "h2d", step=step) for k in range(n)) / n
        rows.append(
            [
                stage_label(r.stage),
                f"{mb(host)} ({host / psi:.2f}Ψ)",
                configurations.memory_formulas(stage_configuration(r.stage))[1],
                f"{down / psi:.4f}Ψ B",
                f"{up / psi:.4f}Ψ B",
                f"{configurations.PCIE_FORMULA} each way",
            ]
        )
    if not rows:
        return []
    headers = ["stage", "host/GPU", "formula", "PCIe d2h/step", "PCIe h2d/step", "formula"]
    title = "Host memory and PCIe bytes per GPU (last step; no network bytes)"
    return [table(headers, rows, title=title, width=width)]


def wire_table(reports: list[StageReport], links: list[dict] | None, width: int | None = None) -> list[str]:
    """Bytes sent per GPU per step (last step, overflow flag excluded), with a ZeRO++ quantized stage only:
    its int8 and int4 elements, and its fp32 scales, are no fp16 elements, so the Ψ columns cannot compare
    it. Against ZeRO-3 when it ran: how many times fewer bytes, in all and across nodes (ZeRO++'s "4x")."""
    if not any(r.stage in QUANTIZED_STAGES for r in reports):
        return []
    links = links or [None] * len(reports)
    zero3 = next(((r, link) for r, link in zip(reports, links, strict=True) if r.stage == 3), None)

    def fewer(base: float, value: float) -> str:
        return f"{base / value:.2f}x" if value else "-"

    headers = ["stage", "bytes/GPU", "ZeRO-3 / this"]
    if links[0] is not None:
        headers += ["intra-node", "inter-node", "inter-node, busiest GPU", "ZeRO-3 / this, inter-node"]
    rows = []
    for r, link in zip(reports, links, strict=True):
        row = [stage_label(r.stage), f"{r.comm_bytes_per_step_mean:,.0f} B"]
        row.append(fewer(zero3[0].comm_bytes_per_step_mean, r.comm_bytes_per_step_mean) if zero3 else "-")
        if link is not None:
            inter = link["comm_inter_node_bytes_per_step_mean"]
            row += [
                f"{link['comm_intra_node_bytes_per_step_mean']:,.0f} B",
                f"{inter:,.0f} B",
                f"{link['comm_inter_node_bytes_per_step_max']:,.0f} B",
                fewer(zero3[1]["comm_inter_node_bytes_per_step_mean"], inter) if zero3 else "-",
            ]
        rows.append(row)
    title = (
        "Bytes on the wire per GPU per step (mean over GPUs; ZeRO++ sends int8 weights, int4 gradients, fp32 scales)"
    )
    return [table(headers, rows, title=title, width=width)]


def link_title(topology: Topology, algorithm: str) -> str:
    how = "one flat ring" if algorithm == RING else "hierarchical (in the node, then across nodes)"
    return (
        f"by link: {topology.nodes} node{'' if topology.nodes == 1 else 's'} of {topology.gpus_per_node} GPUs, "
        f"collectives {how}; intra-/inter-node: mean over GPUs"
    )


def write_json(
    path: Path,
    args: argparse.Namespace,
    psi: int,
    reports: list[StageReport],
    equivalences: list[Equivalence],
    *,
    topology: Topology | None = None,
    algorithm: str = RING,
    predictions: list[dict] | None = None,
) -> None:
    """Write atomically: a reader never sees half a file. Without a topology, all ranks are on one node.
    `predictions` (`predicted.rows`) go under "predicted", with the machine and the larger GPT they assume."""
    topology = topology or Topology.single_node(args.world_size)
    data = {
        "schema": "zero-course/compare/1",
        "world_size": args.world_size,
        "steps": args.steps,
        "preset": args.preset,
        "precision": args.precision,
        "zero1_grad_sync": args.zero1_grad_sync,
        "psi": psi,
        "gpus_per_node": topology.gpus_per_node,
        "nodes": topology.nodes,
        "collectives": algorithm,
        "jobs": getattr(args, "jobs", None) or 1,
        "stages": [{**r.to_dict(), **link_summary(r, topology, algorithm)} for r in reports],
        "equivalence": [
            {
                "stage": e.stage,
                "final_loss": e.final_loss,
                "max_loss_delta": e.max_loss_delta,
                "max_master_delta": e.max_master_delta,
                "bit_identical": e.bit_identical,
            }
            for e in equivalences
        ],
    }
    if predictions is not None:
        data["predicted"] = {
            "machine": MACHINES[args.machine].name,
            "gpus_per_node": predicted.prediction_topology(
                args.world_size, getattr(args, "gpus_per_node", None), args.machine
            ).gpus_per_node,
            "scaled_psi": args.predict_params,
            "tokens_per_gpu": args.tokens_per_gpu,
            "stages": predictions,
        }
    fd, tmp = tempfile.mkstemp(dir=path.resolve().parent, suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle, indent=2)
    os.replace(tmp, path)
