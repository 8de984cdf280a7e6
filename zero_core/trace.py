"""One training step as a Chrome trace: open it in https://ui.perfetto.dev or chrome://tracing.

Each rank is a lane (thread) of one process per stage; on it, the step's phases (forward, backward,
grad_sync, optimizer) are spans, and every collective the rank called is a span nested in its phase,
with its op, tag, dtype, element count and ring bytes as arguments. A collective started with
`async_op=True` (ZeRO-2's and ZeRO-3's reduce-scatters) has a second span, "wait ...", where the rank
later waited for it; in between, it was in flight while the rank computed. Seeing ZeRO-3's all-gathers
interleaved with forward and backward, one per layer (ZeRO §5.3, §7.2.2), is the point.

Format: the Trace Event Format's JSON object form: {"traceEvents": [...]}, complete events ("ph": "X")
with `ts` and `dur` in microseconds, metadata events ("ph": "M") naming processes and threads. The
step starts at ts 0; all ranks share one clock (`time.perf_counter()`), so their lanes line up.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from zero_core.stages import NAMED_STAGE_NAMES, stage_class

if TYPE_CHECKING:
    from zero_core.report import StageReport

US_PER_S = 1e6


def _step(report: StageReport, step: int | None) -> int:
    step = report.steps - 1 if step is None else step
    label = stage_class(report.stage).label
    if not 0 <= step < report.steps:
        raise ValueError(f"step must be in 0..{report.steps - 1} for this {label} report, got {step}")
    if report.ledger is None or len(report.rank_origins_s) != report.world_size:
        raise ValueError(f"this {label} report has no ledger or rank clocks; build it with experiment.run_stage")
    return step


def process_id(stage: int | str) -> int:
    """The trace's process of a stage: k for ZeRO-k, then 4, 5, ... for the named stages in table order."""
    return stage if isinstance(stage, int) else 4 + NAMED_STAGE_NAMES.index(stage)


def chrome_trace(report: StageReport, step: int | None = None) -> dict[str, Any]:
    """Step `step` (default: the last) of `report` as a Chrome trace dict; `pid` is the stage's `process_id`.

    Per rank: a "step k" span, its phase spans inside, and one span per collective inside its phase.
    Times are clamped into the enclosing span, so float rounding never breaks the nesting a viewer needs;
    spans come sorted by lane, start, and longest first, so a parent always precedes its children.
    """
    step = _step(report, step)
    pid, label = process_id(report.stage), stage_class(report.stage).label
    spans_abs = [
        [(phase, origin + start, origin + end) for s, phase, start, end in spans if s == step]
        for origin, spans in zip(report.rank_origins_s, report.phase_spans, strict=True)
    ]
    if not all(spans_abs):
        raise ValueError(f"{label}: some ranks recorded no phase of step {step}")
    zero = min(start for spans in spans_abs for _, start, _ in spans)

    def us(seconds: float) -> float:
        return round((seconds - zero) * US_PER_S, 3)

    events: list[dict[str, Any]] = [
        {
            "name": "process_name",
            "ph": "M",
            "pid": pid,
            "tid": 0,
            "args": {"name": f"{label}, {report.world_size} virtual GPUs, step {step}"},
        },
        {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
    ]
    for rank, spans in enumerate(spans_abs):
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": rank, "args": {"name": f"rank {rank}"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": rank, "args": {"sort_index": rank}})
        step_start, step_end = us(min(s for _, s, _ in spans)), us(max(e for _, _, e in spans))
        events.append(_complete(f"step {step}", "step", pid, rank, step_start, step_end, {"step": step}))
        bounds = {}
        for phase, start, end in spans:
            begin, finish = _clamp(us(start), us(end), step_start, step_end)
            bounds[phase] = (begin, finish)
            events.append(_complete(phase, "phase", pid, rank, begin, finish, {"step": step}))
        for entry in report.ledger.entries(rank, step=step):
            outer = bounds.get(entry.phase, (step_start, step_end))
            start_seconds = entry.seconds - entry.waited_s
            begin, finish = _clamp(us(entry.started_s), us(entry.started_s + start_seconds), *outer)
            args = {
                "op": entry.op,
                "tag": entry.tag,
                "dtype": entry.dtype,
                "elements": entry.elements,
                "bytes_sent": entry.bytes_sent,
                "bytes_received": entry.bytes_received,
                "phase": entry.phase,
                "seq": entry.seq,
            }
            name = entry.op if entry.tag == entry.op else f"{entry.op} {entry.tag}"
            events.append(_complete(name, "collective", pid, rank, begin, finish, args))
            if entry.wait_started_s:
                waited = us(entry.wait_started_s), us(entry.wait_started_s + entry.waited_s)
                begin, finish = _clamp(*waited, step_start, step_end)
                events.append(_complete(f"wait {name}", "collective wait", pid, rank, begin, finish, args))
    timed = sorted((e for e in events if e["ph"] == "X"), key=lambda e: (e["tid"], e["ts"], -e["dur"]))
    return {
        "traceEvents": [e for e in events if e["ph"] == "M"] + timed,
        "displayTimeUnit": "ms",
        "otherData": {"stage": report.stage, "world_size": report.world_size, "step": step, "psi": report.psi},
    }


def _complete(
    name: str, category: str, pid: int, tid: int, begin: float, end: float, args: dict[str, Any]
) -> dict[str, Any]:
    return {
        "name": name,
        "cat": category,
        "ph": "X",
        "pid": pid,
        "tid": tid,
        "ts": begin,
        "dur": round(end - begin, 3),
        "args": args,
    }


def _clamp(begin: float, end: float, low: float, high: float) -> tuple[float, float]:
    begin = min(max(begin, low), high)
    return begin, min(max(end, begin), high)


def write_trace(reports: StageReport | Sequence[StageReport], path: str | Path, step: int | None = None) -> Path:
    """Write the trace of one report, or of several (one process per stage), atomically; returns the path."""
    reports = [reports] if not isinstance(reports, Sequence) else list(reports)
    if not reports:
        raise ValueError("write_trace needs at least one StageReport")
    traces = [chrome_trace(r, step) for r in reports]
    trace = (
        traces[0]
        if len(traces) == 1
        else {
            "traceEvents": [event for t in traces for event in t["traceEvents"]],
            "displayTimeUnit": "ms",
            "otherData": {"stages": [t["otherData"] for t in traces]},
        }
    )
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.resolve().parent, suffix=".tmp")
    with os.fdopen(fd, "w") as handle:
        json.dump(trace, handle)
    os.replace(tmp, path)
    return path
