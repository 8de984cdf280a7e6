"""Figures of the course: where the bytes live per stage, what goes on the wire, and how it scales.

Every function reads finished `StageReport`s (or, for `memory_vs_gpus`, only the paper's formulas) and
returns a `matplotlib.figure.Figure` with a title, axis units and a legend. Figures are built with the
object-oriented API and never touch pyplot's global state, so rank threads, notebooks and the headless
CLI can draw at once; in a notebook, a returned Figure displays itself. `save_all` writes them as PNGs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from zero_core import formulas, memory
from zero_core.configurations import simulated_gpu_formula
from zero_core.divergence import Divergence
from zero_core.report import StageReport, stage_configuration
from zero_core.stages import stage_class
from zero_core.units import format_count

STATE_LABELS = {
    memory.PARAM: "param ({precision})",
    memory.GRAD: "grad ({precision})",
    memory.MASTER: "master (fp32)",
    memory.ADAM_M: "adam m (fp32)",
    memory.ADAM_V: "adam v (fp32)",
    memory.PADDING: "padding",
}
STATE_COLORS = {
    memory.PARAM: "#4C72B0",
    memory.GRAD: "#DD8452",
    memory.MASTER: "#55A868",
    memory.ADAM_M: "#8172B3",
    memory.ADAM_V: "#937860",
    memory.PADDING: "#BBBBBB",
}
STAGE_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52")
PHASE_COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "grad_sync": "#55A868", "optimizer": "#8172B3"}
DEFAULT_GPU_COUNTS = tuple(2**i for i in range(11))
_BYTE_UNITS = (("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("B", 1.0))


def byte_unit(max_bytes: float) -> tuple[str, float]:
    """The decimal unit (GB, MB, KB, B, as the paper counts) in which `max_bytes` reads as 1 or more."""
    return next(((name, scale) for name, scale in _BYTE_UNITS if max_bytes >= scale), _BYTE_UNITS[-1])


def _new_figure(width: float = 8.0, height: float = 5.0) -> Figure:
    return Figure(figsize=(width, height), layout="constrained")


def stage_name(report: StageReport) -> str:
    """The stage's label ("ZeRO-2", "ZeRO++ hpZ"), with ZeRO-1's DeepSpeed-style all-reduce variant told
    apart from the paper's."""
    variant = " (all-reduce)" if report.stage == 1 and report.zero1_grad_sync == "all_reduce" else ""
    return f"{stage_class(report.stage).label}{variant}"


def stage_color(report: StageReport, index: int) -> str:
    """ZeRO-k keeps its color in every figure; a named stage takes the color of its place in the list."""
    return STAGE_COLORS[(report.stage if isinstance(report.stage, int) else index) % len(STAGE_COLORS)]


def host_bytes(report: StageReport) -> int:
    """Model states a rank keeps in host memory (ZeRO-Offload), max over ranks; 0 for every other stage."""
    return sum(report.peak_bytes_by_category_max.get(category, 0) for category in memory.HOST_STATES)


def _stage_names(reports: Sequence[StageReport]) -> list[str]:
    return [stage_name(r) for r in reports]


def memory_bars(reports: Sequence[StageReport]) -> Figure:
    """Model states per GPU by category, stacked, activations hatched on top, the formula as a marker.

    The bars are the measured means over ranks (ZeRO §5, Figure 1); the markers are the paper's
    2+2+K bytes per parameter split as the stage prescribes. Padding is drawn, never folded in. A red
    triangle marks the measured peak of everything a rank held at once, temporaries included (the
    optimizer step's copies put ZeRO-0's above its bar).
    """
    fig = _new_figure()
    ax = fig.add_subplot()
    totals = [
        sum(r.model_state_bytes_by_category_mean.values())
        + r.padding_bytes_mean
        + r.activation_peak_bytes_max
        + r.untracked_bytes_max
        for r in reports
    ]
    unit, scale = byte_unit(max(totals + [r.formula_bytes for r in reports] + [r.peak_bytes_max for r in reports]))
    x = list(range(len(reports)))
    bottoms = [0.0] * len(reports)
    for category, label in STATE_LABELS.items():
        values = [
            (r.padding_bytes_mean if category == memory.PADDING else r.model_state_bytes_by_category_mean[category])
            / scale
            for r in reports
        ]
        label = label.format(precision=reports[0].precision)
        ax.bar(x, values, bottom=bottoms, color=STATE_COLORS[category], label=label, width=0.6)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    activations = [r.activation_peak_bytes_max / scale for r in reports]
    ax.bar(
        x,
        activations,
        bottom=bottoms,
        width=0.6,
        facecolor="white",
        edgecolor="#555555",
        hatch="//",
        label="activations (peak, max over ranks)",
    )
    if any(r.untracked_bytes_max for r in reports):
        bottoms = [b + a for b, a in zip(bottoms, activations, strict=True)]
        untracked = [r.untracked_bytes_max / scale for r in reports]
        ax.bar(x, untracked, bottom=bottoms, width=0.6, color="#d62728", label="untracked (held, named by nobody)")
    ax.hlines(
        [r.formula_bytes / scale for r in reports],
        [xi - 0.36 for xi in x],
        [xi + 0.36 for xi in x],
        colors="black",
        linewidths=2.5,
        zorder=3,
        label="paper's formula (model states)",
    )
    ax.plot(
        x,
        [r.peak_bytes_max / scale for r in reports],
        linestyle="none",
        marker="v",
        markersize=9,
        color="#d62728",
        zorder=4,
        label="measured peak (every storage, temporaries included)",
    )
    ticks = [f"{stage_name(r)}\n{simulated_gpu_formula(stage_configuration(r.stage))}" for r in reports]
    ticks = [
        f"{tick}\n+ {host_bytes(r) / scale:.3g} {unit} on host" if host_bytes(r) else tick
        for tick, r in zip(ticks, reports, strict=True)
    ]
    ax.set_xticks(x, ticks)
    ax.set_xlabel("stage and its model-state formula per GPU (ZeRO §5)")
    ax.set_ylabel(f"bytes per GPU ({unit})")
    ax.set_title(f"Memory per GPU by stage (Ψ = {format_count(reports[0].psi)}, N = {reports[0].world_size})")
    ax.legend(fontsize=8, loc="upper right")
    return fig


def comm_bars(reports: Sequence[StageReport]) -> Figure:
    """Elements each GPU sends per step, in multiples of Ψ: measured on the ring beside the formula (ZeRO §7).

    The measured bar excludes the loss-scaling overflow flag (a few bytes); the text on it gives the bytes,
    which is what compares a quantized stage (ZeRO++ qwZ, qgZ: an element is an int8 or int4 code) with the rest.
    The paper's large-N counts (2Ψ, 2Ψ, 2Ψ, 3Ψ) are drawn as markers.
    """
    fig = _new_figure()
    ax = fig.add_subplot()
    x = list(range(len(reports)))
    width = 0.38
    measured = [r.comm_psi_per_step for r in reports]
    formula = [r.comm_formula_psi for r in reports]
    bars = ax.bar([xi - width / 2 for xi in x], measured, width, color="#4C72B0", label="measured (ring ledger)")
    ax.bar([xi + width / 2 for xi in x], formula, width, color="#BBBBBB", label="formula, exact ring (N-1)/N")
    paper = {
        xi: formulas.comm_elements(r.stage, r.psi, r.world_size, exact=False, zero1_grad_sync=r.zero1_grad_sync) / r.psi
        for xi, r in zip(x, reports, strict=True)
        if isinstance(r.stage, int)
    }
    if paper:
        ax.hlines(
            list(paper.values()),
            [xi - 0.45 for xi in paper],
            [xi + 0.45 for xi in paper],
            colors="black",
            linewidths=2.5,
            label="paper, N → ∞ (ZeRO-0..3)",
        )
    unit, scale = byte_unit(max(r.comm_bytes_per_step_mean for r in reports))
    for bar, r in zip(bars, reports, strict=True):
        ax.annotate(
            f"{r.comm_bytes_per_step_mean / scale:.3g} {unit}",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            fontsize=8,
        )
    ax.set_xticks(x, _stage_names(reports))
    ax.set_xlabel("stage")
    ax.set_ylabel("elements sent per GPU per step (× Ψ)")
    ax.set_ylim(0, max([*paper.values(), *measured, *formula]) * 1.2)
    ax.set_title(f"Communication per GPU per step (Ψ = {format_count(reports[0].psi)}, N = {reports[0].world_size})")
    ax.legend(fontsize=8, loc="upper left")
    return fig


def memory_vs_gpus(
    psi: float, gpu_counts: Sequence[int] = DEFAULT_GPU_COUNTS, gpu_memory_bytes: float | None = None
) -> Figure:
    """Per-GPU model-state bytes against N for each stage, on log axes (ZeRO §5, Table 1 as curves).

    ZeRO-0 stays flat at 16Ψ, ZeRO-1 and ZeRO-2 flatten out at their replicated 4Ψ and 2Ψ, and only ZeRO-3
    keeps falling as 16Ψ/N. A horizontal line marks the GPU's memory when given.
    """
    fig = _new_figure()
    ax = fig.add_subplot()
    counts = sorted(gpu_counts)
    values = {stage: [formulas.model_state_bytes(stage, psi, n) for n in counts] for stage in formulas.STAGES}
    unit, scale = byte_unit(max(values[0]))
    for stage, color in zip(formulas.STAGES, STAGE_COLORS, strict=True):
        ax.plot(
            counts,
            [v / scale for v in values[stage]],
            marker="o",
            markersize=4,
            color=color,
            label=f"ZeRO-{stage}: {formulas.MEMORY_FORMULAS[stage]}",
        )
    if gpu_memory_bytes is not None:
        ax.axhline(
            gpu_memory_bytes / scale,
            color="black",
            linestyle="--",
            label=f"GPU memory ({gpu_memory_bytes / scale:g} {unit})",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.set_xlabel("data-parallel GPUs N (log scale)")
    ax.set_ylabel(f"model states per GPU ({unit}, log scale)")
    ax.set_title(f"Model states per GPU vs N (Ψ = {format_count(psi)}; fp16 + Adam, K = 12)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def _step_events(report: StageReport, rank: int, step: int) -> list[tuple[float, int, int, str]]:
    """(seconds, total bytes, transient bytes, phase) after each memory event of `step` on `rank`.

    Running sums over the whole timeline give the bytes held per category at every event. Events after
    the step's last phase (the run's teardown) are left out; the first point is the total before the step.
    """
    held = dict.fromkeys(memory.CATEGORIES, 0)
    points: list[tuple[float, int, int, str]] = []
    for event in report.trackers[rank].timeline:
        if event.step == step and not points:
            points.append((event.seconds, event.total_bytes - event.delta_bytes, _transient(held), ""))
        held[event.category] += event.delta_bytes
        if event.step == step:
            points.append((event.seconds, event.total_bytes, _transient(held), event.phase))
        elif event.step > step:
            break
    while points and not points[-1][3]:
        points.pop()
    return points


def _transient(held: dict[str, int]) -> int:
    """Bytes that live for one layer or one operation: gathered parameters, buckets, temporaries."""
    return sum(held[c] for c in (*memory.TRANSIENTS, memory.TEMPORARY))


def memory_timeline(report: StageReport, ranks: Sequence[int] = (0,), step: int | None = None) -> Figure:
    """One step's memory over time on each of `ranks`: the total after every allocation and release.

    Time runs on each rank's memory-ledger clock from the step's first event: the wall time of a virtual
    rank's thread on this CPU, scheduling included, not what a GPU would take. Phases are shaded over the
    events that carry their label, for the first rank drawn (a phase that allocates nothing, like ZeRO-0's
    in-place all-reduce, has no events to shade). ZeRO-3's gathered layers show as
    spikes (ZeRO §5.3: one layer at a time); the filled band is the transients (gathered parameters,
    gradient buckets, and the temporaries every operation allocates, which the memory audit sees) inside
    the total.
    """
    step = report.steps - 1 if step is None else step
    if not 0 <= step < report.steps:
        raise ValueError(f"step must be in 0..{report.steps - 1} for this report, got {step}")
    series = {rank: _step_events(report, rank, step) for rank in ranks}
    if not any(series.values()):
        raise ValueError(f"no memory events recorded for step {step} on ranks {list(ranks)}")
    unit, scale = byte_unit(max(total for points in series.values() for _, total, _, _ in points))
    fig = _new_figure(10.0, 5.0)
    ax = fig.add_subplot()
    for index, (rank, points) in enumerate(series.items()):
        start = points[0][0]
        times = [(seconds - start) * 1e3 for seconds, _, _, _ in points]
        totals = [total / scale for _, total, _, _ in points]
        color = STAGE_COLORS[index % len(STAGE_COLORS)]
        ax.plot(times, totals, drawstyle="steps-post", color=color, linewidth=1.2, label=f"rank {rank}: total")
        if any(transient for _, _, transient, _ in points):
            base = [(total - transient) / scale for _, total, transient, _ in points]
            label = f"rank {rank}: of which transient (gathered params, grad buckets, temporaries)"
            ax.fill_between(times, base, totals, step="post", color=color, alpha=0.35, label=label)
        if index == 0:
            _shade_phases(ax, times, [phase for _, _, _, phase in points])
    ax.set_xlabel("ms since the step's first memory event, on the rank thread's wall clock (this CPU, not a GPU)")
    ax.set_ylabel(f"bytes held per GPU ({unit})")
    ax.set_title(f"{stage_name(report)}: memory over step {step} (N = {report.world_size})")
    ax.legend(fontsize=8, loc="upper right")
    return fig


def _shade_phases(ax: Axes, times: list[float], phases: list[str]) -> None:
    """Shade each run of events with one phase label, from its first event to its last.

    The ledger's events carry their phase but the phase's own start and end are not on this clock, so the
    shading claims no more than the events show: the gap between two runs is unattributed.
    """
    shaded: set[str] = set()
    start = 0
    for i in range(1, len(phases) + 1):
        if i < len(phases) and phases[i] == phases[start]:
            continue
        phase = phases[start]
        if phase in PHASE_COLORS:
            label = None if phase in shaded else f"{phase} (its events)"
            ax.axvspan(times[start], times[i - 1], color=PHASE_COLORS[phase], alpha=0.1, label=label, linewidth=0)
            shaded.add(phase)
        start = i


def loss_curves(reports: Sequence[StageReport]) -> Figure:
    """The stages' losses per step, overlaid: ZeRO changes where bytes live, never the math.

    The curves coincide (bit for bit in this simulator), so each stage gets its own marker size, marker
    and line style: big hollow circles for ZeRO-0 down to small crosses, all visible on top of each other.
    """
    fig = _new_figure()
    ax = fig.add_subplot()
    styles = (("o", "-", 11), ("s", "--", 8), ("^", "-.", 6), ("x", ":", 5))
    for index, r in enumerate(reports):
        marker, linestyle, size = styles[index % len(styles)]
        color = stage_color(r, index)
        ax.plot(
            range(len(r.losses)),
            r.losses,
            marker=marker,
            linestyle=linestyle,
            markersize=size,
            markerfacecolor="none",
            color=color,
            label=stage_name(r),
        )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross-entropy, nats)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title(f"Loss per step: the stages coincide (N = {reports[0].world_size})")
    ax.legend(fontsize=8)
    return fig


def divergence_curves(divergences: Mapping[str, Divergence]) -> Figure:
    """Each broken run's |Δ loss| and largest |Δ fp32 master weight| per step against its reference, on log axes.

    A step with no difference (0.0) has no place on a log axis and is left out: a run that never diverges
    draws nothing, and its legend entry says so.
    """
    fig = _new_figure(11.0, 4.5)
    axes = fig.subplots(1, 2, sharex=True)
    for index, (name, d) in enumerate(divergences.items()):
        color = f"C{index % 10}"
        label = f"{name} (0.0 at every step)" if d.bit_identical else name
        for ax, deltas in zip(axes, (d.loss_deltas, d.master_deltas), strict=True):
            steps = [step for step, delta in enumerate(deltas) if delta > 0.0]
            ax.plot(steps, [deltas[step] for step in steps], marker="o", markersize=4, color=color, label=label)
    for ax, what in zip(axes, ("|Δ loss| (nats)", "max |Δ fp32 master weight|"), strict=True):
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(what)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_title("Loss against the bit-identical run")
    axes[1].set_title("Master weights against the bit-identical run")
    axes[0].legend(fontsize=8)
    return fig


def save_all(reports: Sequence[StageReport], folder: str | Path, dpi: int = 120) -> list[Path]:
    """Write memory_bars, comm_bars, memory_vs_gpus, memory_timeline_zero{k} (memory_timeline_{name} for a
    named stage) and loss_curves PNGs."""
    if not reports:
        raise ValueError("save_all needs at least one StageReport")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    figures = {
        "memory_bars.png": memory_bars(reports),
        "comm_bars.png": comm_bars(reports),
        "memory_vs_gpus.png": memory_vs_gpus(reports[0].psi),
    }
    for r in reports:
        if r.trackers:
            name = f"zero{r.stage}" if isinstance(r.stage, int) else r.stage
            figures[f"memory_timeline_{name}.png"] = memory_timeline(r)
    figures["loss_curves.png"] = loss_curves(reports)
    paths = []
    for name, fig in figures.items():
        path = folder / name
        fig.savefig(path, dpi=dpi)
        paths.append(path)
    return paths
