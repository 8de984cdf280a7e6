"""zero_core.trace: one step as Chrome trace JSON, a lane per rank, every collective nested in its phase."""

from __future__ import annotations

import json

import pytest

from zero_core.experiment import run_stage
from zero_core.model import preset
from zero_core.report import PHASES
from zero_core.stages import TrainConfig
from zero_core.trace import chrome_trace, write_trace

WORLD_SIZE = 3


@pytest.fixture(scope="module")
def report():
    return run_stage(3, WORLD_SIZE, 2, TrainConfig(model=preset("micro")))


def spans(trace: dict, category: str, rank: int) -> list[dict]:
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == category and e["tid"] == rank]


def test_the_trace_file_is_valid_json_with_the_standard_fields(report, tmp_path) -> None:
    path = write_trace(report, tmp_path / "step.json")
    trace = json.loads(path.read_text())
    assert isinstance(trace["traceEvents"], list) and trace["traceEvents"]
    for event in trace["traceEvents"]:
        assert {"name", "ph", "pid", "tid"} <= event.keys()
        assert event["ph"] in ("X", "M")
        if event["ph"] == "X":
            assert isinstance(event["ts"], float | int) and isinstance(event["dur"], float | int)


def test_each_rank_has_its_own_named_lane(report) -> None:
    trace = chrome_trace(report)
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == {rank: f"rank {rank}" for rank in range(WORLD_SIZE)}
    assert {e["tid"] for e in trace["traceEvents"] if e["ph"] == "X"} == set(range(WORLD_SIZE))


def test_every_phase_of_the_step_is_a_span_on_every_rank(report) -> None:
    trace = chrome_trace(report)
    for rank in range(WORLD_SIZE):
        assert [e["name"] for e in spans(trace, "phase", rank)] == list(PHASES)


def test_every_collective_of_the_step_is_present_with_its_bytes(report) -> None:
    trace = chrome_trace(report, step=1)
    for rank in range(WORLD_SIZE):
        drawn = [e["args"] for e in spans(trace, "collective", rank)]
        recorded = report.ledger.entries(rank, step=1)
        assert len(drawn) == len(recorded) > 0
        for args, entry in zip(sorted(drawn, key=lambda a: a["seq"]), recorded, strict=True):
            assert (args["op"], args["tag"], args["dtype"], args["elements"]) == (
                entry.op,
                entry.tag,
                entry.dtype,
                entry.elements,
            )
            assert (args["bytes_sent"], args["bytes_received"]) == (entry.bytes_sent, entry.bytes_received)


def test_spans_are_non_negative_and_nested_within_the_step(report) -> None:
    trace = chrome_trace(report)
    timed = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert min(e["ts"] for e in timed) == 0, "the step starts at ts 0"
    for rank in range(WORLD_SIZE):
        (step,) = spans(trace, "step", rank)
        phases = {e["name"]: e for e in spans(trace, "phase", rank)}
        for outer, inner in [(step, p) for p in phases.values()] + [
            (phases[c["args"]["phase"]], c) for c in spans(trace, "collective", rank)
        ]:
            assert inner["ts"] >= 0 and inner["dur"] >= 0
            assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + 1e-3


def test_collectives_start_inside_their_phase_on_the_ranks_clock(report) -> None:
    """No clamping here: `CommEntry.started_s` and `phase_spans` + `rank_origins_s` share one clock."""
    for rank in range(WORLD_SIZE):
        origin = report.rank_origins_s[rank]
        bounds = {(s, phase): (origin + start, origin + end) for s, phase, start, end in report.phase_spans[rank]}
        for entry in report.ledger.entries(rank):
            start, end = bounds[(entry.step, entry.phase)]
            assert start <= entry.started_s <= entry.started_s + entry.seconds - entry.waited_s <= end
            if entry.op == "reduce_scatter":  # started with async_op=True, waited for later in the same step
                step_end = max(end for s, _, _, end in report.phase_spans[rank] if s == entry.step) + origin
                assert entry.started_s < entry.wait_started_s <= entry.wait_started_s + entry.waited_s <= step_end
            else:
                assert entry.wait_started_s == entry.waited_s == 0.0


def test_zero3_gathers_parameters_in_forward_and_backward(report) -> None:
    trace = chrome_trace(report)
    gathers = [c["args"]["phase"] for c in spans(trace, "collective", 0) if c["args"]["op"] == "all_gather"]
    assert gathers.count("forward") == gathers.count("backward") > 0


def test_each_reduce_scatter_has_a_wait_span_after_it_on_its_rank(report) -> None:
    trace = chrome_trace(report)
    for rank in range(WORLD_SIZE):
        started = {c["args"]["seq"]: c for c in spans(trace, "collective", rank) if c["args"]["op"] == "reduce_scatter"}
        waits = {w["args"]["seq"]: w for w in spans(trace, "collective wait", rank)}
        assert sorted(waits) == sorted(started) and waits
        for seq, wait in waits.items():
            assert wait["name"] == "wait " + started[seq]["name"]
            assert wait["ts"] >= started[seq]["ts"] + started[seq]["dur"]


def test_several_reports_share_one_file_one_process_per_stage(report, tmp_path) -> None:
    zero0 = run_stage(0, 2, 1, TrainConfig(model=preset("micro")))
    trace = json.loads(write_trace([zero0, report], tmp_path / "both.json").read_text())
    processes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert sorted(processes) == [0, 3] and processes[3].startswith("ZeRO-3")


def test_a_step_that_did_not_run_is_refused(report) -> None:
    with pytest.raises(ValueError, match="step"):
        chrome_trace(report, step=2)
