"""An observation that no run can make earns nothing, with a message that says which part cannot be true.

For each exercise, the solution is observed once in this process, on the smallest sizes, as the grading child
would observe it; each test changes one thing into what no run makes (a negative or zero peak where the stage
registers one, a size beyond the address space, another world size, a time that is not a number, a list of
the wrong length, a value of the wrong type) and judges the result as the grading parent does.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from autograder.checks import IMPOSSIBLE, Check, judge_check, through_json
from autograder.harness import layer_partitions
from autograder.plain_data import ADDRESS_SPACE_BYTES
from autograder.records import encode_floats
from autograder.sandbox import Limits
from autograder.submission import exercise_module, load

ROOT = Path(__file__).resolve().parents[1]
STAGE_EXERCISES = {
    "ex02_zero1_sharded_adam": 2,
    "ex03_zero2_reduce_scatter_backward": 2,
    "ex04_zero3_gather_linear": 2,
    "ex06_bucketed_overlap": 2,
    "ex07_zero3_prefetch": 2,
    "ex08_clip_and_accumulate": 2,
    "ex09_hierarchical_allgather": 4,
}
"""Each stage exercise and the smallest world size it is checked on."""
SCHEDULED = {"ex06_bucketed_overlap", "ex07_zero3_prefetch", "ex08_clip_and_accumulate"}
"""The exercises whose stage marks moments of the run (`zero_core.schedule`)."""


def marker(assignment: str) -> pytest.MarkDecorator:
    return getattr(pytest.mark, assignment[:4])


@cache
def genuine(assignment: str, check_name: str, **kwargs: Any) -> tuple[Check, Any]:
    """The check with `kwargs`, and the solution's observation of it, as it leaves the grading child."""
    namespace = load(ROOT / "solutions" / assignment / f"{assignment}.ipynb").namespace
    check = next(c for c in exercise_module(assignment).CHECKS if c.name == check_name)
    check = replace(check, kwargs={**check.kwargs, **{k: list(v) for k, v in kwargs.items()}})
    return check, through_json(check.function.observe(*(namespace[name] for name in check.names), **check.kwargs))


def assert_cannot_be_true(check: Check, observation: Any, phrase: str) -> None:
    result = judge_check(check, observation)
    assert result.points == 0 and result.message.startswith(IMPOSSIBLE), result.message
    assert phrase in result.message, result.message


def test_no_run_holds_more_than_the_grading_childs_address_space() -> None:
    assert ADDRESS_SPACE_BYTES == Limits().memory_bytes


# -- the stage exercises: one run's data, changed ------------------------------------------------------------


def stage_observation(assignment: str) -> tuple[Check, Any]:
    return genuine(assignment, "test_memory", world_sizes=(STAGE_EXERCISES[assignment],))


def _first_collective(run: dict) -> list:
    return run["collectives"][0][0]


def _larger_adam_gradient(run: dict) -> None:
    layer, step, _ = run["ranks"][0]["adam_grads"][0]
    too_many = layer_partitions(run["world_size"])[layer].padded_numel + 1
    run["ranks"][0]["adam_grads"][0] = [layer, step, encode_floats(torch.zeros(too_many))]


RUN_CHANGES: dict[str, tuple[Callable[[dict], Any], str]] = {
    "a negative peak": (lambda run: run["memory"][0]["peaks"].update({"grad.fp16": -1}), "peak of grad.fp16"),
    "no peak of what the stage registers itself": (
        lambda run: run["memory"][0]["peaks"].update({"master.fp32": 0}),
        "yet the stage itself registers",
    ),
    "a peak beyond the address space": (
        lambda run: run["memory"][1]["peaks"].update({"activations": ADDRESS_SPACE_BYTES + 1}),
        "peak of activations",
    ),
    "a peak that is no integer": (
        lambda run: run["memory"][0]["peaks"].update({"param.fp16": 1e4}),
        "not an integer",
    ),
    "a buffer registered with no bytes": (
        lambda run: run["memory"][0]["registrations"].append(["grad.bucket", 0, 0]),
        "registered grad.bucket",
    ),
    "a leftover of negative bytes": (
        lambda run: run["memory"][0]["leftovers"].append([0, "forward", "untracked", "a buffer", -8]),
        "leftover of untracked",
    ),
    "a collective of negative elements": (lambda run: _first_collective(run).__setitem__(2, -1), "elements"),
    "negative bytes sent": (lambda run: _first_collective(run).__setitem__(5, -64), "bytes sent"),
    "more bytes sent than the collective carries": (
        lambda run: _first_collective(run).__setitem__(5, 10**9),
        "bytes sent",
    ),
    "a collective of a dtype torch does not have": (
        lambda run: _first_collective(run).__setitem__(1, "float128"),
        "no torch dtype",
    ),
    "a collective in a step the run did not have": (lambda run: _first_collective(run).__setitem__(4, 2), "step"),
    "a start that is not a number": (
        lambda run: _first_collective(run).__setitem__(7, math.nan),
        "not a finite number of seconds",
    ),
    "a wait that never began": (
        lambda run: _first_collective(run).__setitem__(8, math.inf),
        "not a finite number of seconds",
    ),
    "a wait before the start": (
        lambda run: _first_collective(run).__setitem__(8, _first_collective(run)[7] - 1.0),
        "waited for before it started",
    ),
    "collectives out of the order they started in": (
        lambda run: run["collectives"][0].reverse(),
        "not in the order it started them",
    ),
    "a run of another world size": (lambda run: run.update(world_size=run["world_size"] + 1), "the check asked for"),
    "a rank missing": (lambda run: run["memory"].pop(), "malformed data"),
    "a loss that is no number": (lambda run: run["ranks"][0]["losses"].__setitem__(0, "2.3"), "malformed data"),
    "a loss too many": (lambda run: run["ranks"][0]["losses"].append(2.3), "malformed data"),
    "an Adam gradient larger than its whole layer": (_larger_adam_gradient, "more than the whole layer's"),
}
SCHEDULE_CHANGES: dict[str, tuple[Callable[[dict], Any], str]] = {
    "marks that go back in time": (
        lambda run: run["ranks"][0]["schedule"][1].__setitem__(0, run["ranks"][0]["schedule"][0][0] - 1.0),
        "go back in time",
    ),
    "a mark the stage did not make": (lambda run: run["ranks"][1]["schedule"].pop(), "the stage makes"),
    "negative unnamed bytes at a mark": (
        lambda run: run["ranks"][0]["schedule"][0].__setitem__(3, -1),
        "unnamed bytes",
    ),
}


def stage_cases() -> list:
    cases = [
        pytest.param(assignment, change, id=f"{assignment[:4]}-{change}", marks=marker(assignment))
        for assignment in STAGE_EXERCISES
        for change in RUN_CHANGES
    ]
    return cases + [
        pytest.param(assignment, change, id=f"{assignment[:4]}-{change}", marks=marker(assignment))
        for assignment in sorted(SCHEDULED)
        for change in SCHEDULE_CHANGES
    ]


@pytest.mark.parametrize("assignment", [pytest.param(a, marks=marker(a)) for a in STAGE_EXERCISES])
def test_the_solutions_genuine_observation_passes(assignment: str) -> None:
    check, observation = stage_observation(assignment)
    assert judge_check(check, observation).passed, judge_check(check, observation).message


@pytest.mark.parametrize(("assignment", "change"), stage_cases())
def test_a_run_that_cannot_be_true_earns_nothing(assignment: str, change: str) -> None:
    check, observation = stage_observation(assignment)
    changed = copy.deepcopy(observation)
    world_size = str(STAGE_EXERCISES[assignment])
    edit, phrase = {**RUN_CHANGES, **SCHEDULE_CHANGES}[change]
    edit(changed["runs"][world_size]["run"])
    assert_cannot_be_true(check, changed, phrase)


@pytest.mark.parametrize("assignment", [pytest.param(a, marks=marker(a)) for a in STAGE_EXERCISES])
def test_runs_on_other_world_sizes_than_the_check_asked_for_earn_nothing(assignment: str) -> None:
    check, observation = stage_observation(assignment)
    runs = observation["runs"]
    (entry,) = runs.values()
    assert_cannot_be_true(check, {"runs": {"3": entry}}, "the check asked for")
    assert_cannot_be_true(check, {"runs": {**runs, "3": entry}}, "the check asked for")


@pytest.mark.ex09
@pytest.mark.parametrize(
    ("change", "phrase"),
    [
        ("negative transient bytes", "bytes alive beside the layer"),
        ("bytes left beyond the address space", "bytes left alive after it"),
        ("a gather measured twice", "one of each layer in each pass of each step"),
    ],
)
def test_ex09_gather_measurements_that_cannot_be_true_earn_nothing(change: str, phrase: str) -> None:
    check, observation = stage_observation("ex09_hierarchical_allgather")
    changed = copy.deepcopy(observation)
    gathers = changed["runs"]["4"]["links"]["gathers"][0]
    if change == "negative transient bytes":
        gathers[0][3] = -2
    elif change == "bytes left beyond the address space":
        gathers[0][4] = ADDRESS_SPACE_BYTES + 1
    else:
        gathers[1] = list(gathers[0])
    assert_cannot_be_true(check, changed, phrase)


# -- ex10: what the course read of the files, and of the runs resumed from them ------------------------------


def _ex10_rank_file(o: dict) -> dict:
    return o["stages"]["2"]["files"][0]


EX10_CHANGES = {
    "a file larger than the address space": (
        "test_files", lambda o: _ex10_rank_file(o).__setitem__("bytes", ADDRESS_SPACE_BYTES + 1), "size"),
    "a file of negative size": ("test_files", lambda o: _ex10_rank_file(o).__setitem__("bytes", -1), "size"),
    "a file missing from the list": ("test_files", lambda o: o["stages"]["1"]["files"].pop(), "one file per rank"),
    "shards that are no values": (
        "test_files", lambda o: _ex10_rank_file(o)["shards"]["m"].__setitem__(2, "not base64!"), "base64"),
    "a negative memory figure": ("test_memory", lambda o: o["stages"]["3"]["growth"].__setitem__(0, -8), "memory"),
    "a rank without a memory figure": ("test_memory", lambda o: o["stages"]["3"]["growth"].pop(), "memory figure"),
    "a consolidated state without a layer": (
        "test_consolidation", lambda o: o["stages"]["1"]["consolidated"]["v"].pop("wte"), "layers"),
    "losses that are not numbers": (
        "test_resume", lambda o: o["stages"]["1"]["resumed"]["losses"][0].__setitem__(0, "3.9"), "numbers"),
    "a master range beyond its layer": (
        "test_resume", lambda o: o["stages"]["1"]["resumed"]["masters"][0]["wte"].__setitem__(1, 10**9), "a range"),
    "no resume on the second world size": ("test_resume", lambda o: o["resized"].pop("3"), "resized/3"),
}


@pytest.mark.ex10
def test_ex10_observations_that_cannot_be_true_earn_nothing() -> None:
    """One observation serves every check (they share it), changed one part at a time."""
    check, observation = genuine("ex10_sharded_checkpoints", "test_files")
    checks = {c.name: c for c in exercise_module("ex10_sharded_checkpoints").CHECKS}
    assert all(judge_check(checks[name], observation).passed for name, _, _ in EX10_CHANGES.values())
    for change, (name, edit, phrase) in EX10_CHANGES.items():
        changed = copy.deepcopy(observation)
        edit(changed)
        result = judge_check(checks[name], changed)
        assert result.points == 0 and result.message.startswith(IMPOSSIBLE) and phrase in result.message, (
            change, result.message)


# -- ex01 and ex05: values returned by the student's functions -----------------------------------------------


@pytest.mark.ex01
def test_ex01_observations_that_cannot_be_true_earn_nothing() -> None:
    check, observation = genuine("ex01_collectives", "test_all_reduce_collectives", world_sizes=(2,))
    assert judge_check(check, observation).passed
    entry = observation["runs"]["2"]
    changes = {
        "a run on another world size": ({"runs": {"3": entry}}, "the check asked for"),
        "a rank missing": ({"runs": {"2": {**entry, "results": entry["results"][:1]}}}, "malformed data"),
        "a case missing": ({"runs": {"2": {**entry, "collectives": entry["collectives"][:-1]}}}, "malformed data"),
    }
    for op, dtype, elements, phrase in [
        ("all_reduce", "float32", -8, "elements"),
        ("all_reduce_twice", "float32", 8, "no collective the ledger records"),
        ("all_reduce", "float128", 8, "dtype"),
        ("all_reduce", "float32", True, "not an integer"),
    ]:
        collectives = copy.deepcopy(entry["collectives"])
        collectives[0][0] = [op, dtype, elements]
        changed = {"runs": {"2": {**entry, "collectives": collectives}}}
        changes[f"a collective {op} {dtype} {elements}"] = (changed, phrase)
    results = copy.deepcopy(entry["results"])
    results[0][0] = 12.0
    changes["a result that is no tensor's values"] = ({"runs": {"2": {**entry, "results": results}}}, "malformed data")
    for name, (changed, phrase) in changes.items():
        result = judge_check(check, changed)
        assert result.points == 0 and result.message.startswith(IMPOSSIBLE) and phrase in result.message, name


@pytest.mark.parametrize(
    ("assignment", "check_name", "key"),
    [
        pytest.param("ex01_collectives", "test_ring_bytes", "returned", marks=pytest.mark.ex01),
        pytest.param("ex05_memory_planning", "test_model_state_bytes", "returned", marks=pytest.mark.ex05),
        pytest.param("ex05_memory_planning", "test_hidden_answers", "answers", marks=pytest.mark.ex05),
    ],
)
def test_returned_values_that_cannot_be_true_earn_nothing(assignment: str, check_name: str, key: str) -> None:
    check, observation = genuine(assignment, check_name)
    assert judge_check(check, observation).passed
    values = observation[key]
    for changed in (
        {key: values[:-1]},
        {key: [*values, 1.0]},
        {key: [[values[0]], *values[1:]]},
        {key: ["1e9", *values[1:]]},
        {key: [{"repr": 3}, *values[1:]]},
        {key: {"0": values[0]}},
    ):
        assert_cannot_be_true(check, changed, "malformed data")
