"""ex05: memory planning with the paper's formulas: bytes per GPU, the largest model, how many GPUs.

The student writes four functions (model-state bytes per GPU, ZeRO §5 and Figure 1; the largest model
that fits, Table 2; the smallest GPU count that fits a model, of counts given in any order; elements sent
per step, §7) and answers five numeric questions. Everything is checked against `zero_core.formulas`, which
the student may not use. The hidden check's models and GPU counts are drawn at grading time (`draw_hidden`).
"""

from __future__ import annotations

import importlib
import math
import random
from collections.abc import Callable
from typing import Any

from autograder import recorded
from autograder.checks import Check, CheckFailed, graded
from autograder.integrity import REFERENCE_MODULES, answer_modules, require_own_code
from autograder.plain_data import returned_values

ASSIGNMENT = "ex05_memory_planning"
ANSWER_MODULES = answer_modules()
"""Not loaded, and not loadable, where the student's code is graded (`autograder.sandbox`)."""
FORBIDDEN = REFERENCE_MODULES + ("zero_core.formulas", "zero_core.planner")
FUNCTIONS = ("model_state_bytes", "largest_model", "fewest_gpus", "comm_elements_per_step")
ANSWERS = ("q1_gb_per_gpu", "q2_stage", "q2_gpus", "q3_gpus", "q4_gb_sent")
GB = 1e9
MEMORY_FORMULAS = {0: "16Ψ", 1: "4Ψ + 12Ψ/N", 2: "2Ψ + 14Ψ/N", 3: "16Ψ/N"}
COMM_FORMULAS = {0: "2(N-1)/N·Ψ", 1: "2(N-1)/N·Ψ", 2: "2(N-1)/N·Ψ", 3: "3(N-1)/N·Ψ"}
POWERS_OF_TWO = [2**i for i in range(11)]
VISIBLE = {"psis": [7_500_000_000, 128_000_000_000], "world_sizes": [1, 4, 16, 64]}
HIDDEN_CELL = {"psis": [1_500_000_000, 40_000_000_000, 1_000_000_000_000, 123_456_789], "world_sizes": [1, 3, 7, 1000]}
"""What the solution notebook's hidden test cell calls in a kernel; a grade draws its own (`draw_hidden`)."""
HIDDEN_PSI_DECADES = ((8, 9), (9, 10), (10, 11), (11, 12.3))
"""log10 of the hidden models' sizes, one model per range: 100M to 2T parameters, as 123M to 1T before."""
HIDDEN_WORLD_SIZE_RANGES = (range(1, 2), range(2, 9), range(9, 65), range(65, 2049))
"""One hidden GPU count per range (1, 3, 7 and 1000 before)."""
HIDDEN_GPU_COUNTS = range(2, 2049)


def _integrity(objects: dict) -> None:
    require_own_code(objects, FUNCTIONS, FORBIDDEN, ASSIGNMENT)


def _same(got: object, expected: float | None) -> bool:
    if expected is None or got is None:
        return got is None and expected is None
    try:
        return math.isclose(float(got), expected, rel_tol=1e-9)
    except (TypeError, ValueError):
        return False


def _signature(name: str, kwargs: dict) -> str:
    return f"{name}({', '.join(f'{k}={v:g}' if isinstance(v, float) else f'{k}={v!r}' for k, v in kwargs.items())})"


def _as_data(value: object) -> object:
    """A returned value as JSON data: numbers and None as they are, anything else as its repr."""
    if value is None or isinstance(value, bool | int | float):
        return value
    return {"repr": repr(value)[:200]}


def _as_shown(value: object) -> object:
    return value["repr"] if isinstance(value, dict) and isinstance(value.get("repr"), str) else value


STAGES = (0, 1, 2, 3)
MEMORY_GBS = (16, 32, 80)


def unsorted_counts(world_sizes: list[int]) -> list[int]:
    """GPU counts out of order and repeated: the check's world sizes largest first, then smallest first. Of
    these the smallest that fits is often not the first that fits."""
    descending = sorted(set(world_sizes), reverse=True)
    return descending + descending[::-1]


def _calls(
    group: str, psis: list[float], world_sizes: list[int], gpu_counts: list[int] | None = None
) -> list[tuple[str, dict]]:
    """The calls a check makes of the student's functions, in order: (function name, keyword arguments).
    `fewest_gpus` is asked about the powers of two (Table 1's question) and about `gpu_counts`, unsorted
    and repeated (by default `unsorted_counts(world_sizes)`)."""
    counts_lists = (POWERS_OF_TWO, gpu_counts or unsorted_counts(world_sizes))
    if group == "model_state_bytes":
        return [
            ("model_state_bytes", {"stage": stage, "psi": psi, "n_gpus": n})
            for stage in STAGES
            for psi in psis
            for n in world_sizes
        ]
    if group == "largest_and_fewest":
        calls = []
        for stage in STAGES:
            calls += [
                ("largest_model", {"stage": stage, "n_gpus": n, "gpu_memory_bytes": gb * GB})
                for n in world_sizes
                for gb in MEMORY_GBS
            ]
            calls += [
                ("fewest_gpus", {"stage": stage, "psi": psi, "gpu_memory_bytes": gb * GB, "gpu_counts": list(counts)})
                for counts in counts_lists
                for psi in psis
                for gb in MEMORY_GBS
            ]
        return calls
    return [
        ("comm_elements_per_step", {"stage": stage, "psi": psi, "n_gpus": n})
        for stage in STAGES
        for psi in psis
        for n in world_sizes
    ]


def _formulas() -> Any:
    """`zero_core.formulas`, this exercise's answer: imported by the judge only, never loaded (and not
    loadable) where the student's code runs."""
    return importlib.import_module("zero_core.formulas")


def _expected(name: str, kwargs: dict) -> tuple[float | None, str]:
    """What a call should return, and why: from `zero_core.formulas` in the process that decides, or from a
    student release's record of its values (`autograder.recorded`)."""
    key = (name, tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in kwargs.items())))
    value = recorded.outcome("formula", key, lambda: _value(name, kwargs), recorded.identity, recorded.identity)
    return value, _why(name, kwargs)


def _value(name: str, kwargs: dict) -> float | None:
    """What `zero_core.formulas` returns for the call."""
    stage, formulas = kwargs["stage"], _formulas()
    if name == "model_state_bytes":
        return formulas.model_state_bytes(stage, kwargs["psi"], kwargs["n_gpus"])
    if name == "largest_model":
        return formulas.largest_model_params(kwargs["gpu_memory_bytes"], kwargs["n_gpus"], stage)
    if name == "fewest_gpus":
        return formulas.plan(kwargs["psi"], kwargs["gpu_memory_bytes"], tuple(kwargs["gpu_counts"]))[stage]
    return formulas.comm_elements(stage, kwargs["psi"], kwargs["n_gpus"])


def _why(name: str, kwargs: dict) -> str:
    """Where the expected value of the call comes from, as a message says it."""
    stage = kwargs["stage"]
    if name == "model_state_bytes":
        return f"{MEMORY_FORMULAS[stage]} bytes (ZeRO §5, Figure 1; K = 12, 2-byte parameters and gradients)"
    if name == "largest_model":
        return f"the Ψ with {MEMORY_FORMULAS[stage]} = {kwargs['gpu_memory_bytes'] / GB:g} GB (ZeRO Table 2)"
    if name == "fewest_gpus":
        return (
            "the smallest count in gpu_counts (in any order, repeats allowed) whose per-GPU model states fit, or None"
        )
    return f"{COMM_FORMULAS[stage]} on a ring (ZeRO §7: 2Ψ for stages 0-2, 3Ψ for stage 3)"


GROUPS = {
    "model_state_bytes": ("model_state_bytes",),
    "largest_and_fewest": ("largest_model", "fewest_gpus"),
    "comm_elements": ("comm_elements_per_step",),
}


def _observer(groups: tuple[str, ...]) -> Callable[..., dict]:
    """Observe: call the student's functions (named by the groups, in order) and keep what they return."""
    names = tuple(name for group in groups for name in GROUPS[group])

    def observe(
        *functions: Callable, psis: list[float], world_sizes: list[int], gpu_counts: list[int] | None = None
    ) -> dict:
        by_name = dict(zip(names, functions, strict=True))
        _integrity(by_name)
        calls = [call for group in groups for call in _calls(group, psis, world_sizes, gpu_counts)]
        return {"returned": [_as_data(by_name[name](**kwargs)) for name, kwargs in calls]}

    return observe


def _judge(groups: tuple[str, ...], summary: str) -> Callable[..., str]:
    """Judge: each returned value against the reference formula's, in the order of the calls."""

    def judge(
        observation: object, psis: list[float], world_sizes: list[int], gpu_counts: list[int] | None = None
    ) -> str:
        calls = [call for group in groups for call in _calls(group, psis, world_sizes, gpu_counts)]
        returned = returned_values(observation, "returned", len(calls))
        for (name, kwargs), got in zip(calls, returned, strict=True):
            expected, why = _expected(name, kwargs)
            if not _same(got, expected):
                shown = _as_shown(got)
                raise CheckFailed(f"{_signature(name, kwargs)} returned {shown!r}; expected {expected!r}: {why}")
        models = ", ".join(f"{psi:.3g}" for psi in psis)
        return f"{len(calls)} cases (Ψ = {models}; on {', '.join(map(str, world_sizes))} GPUs){summary}"

    return judge


def _formula_check(name: str, groups: tuple[str, ...], summary: str) -> Callable[..., None]:
    return graded(name, _observer(groups), _judge(groups, summary))


check_model_state_bytes = _formula_check(
    "check_model_state_bytes", ("model_state_bytes",), ": the model-state bytes per GPU of ZeRO §5"
)
check_largest_model_and_fewest_gpus = _formula_check(
    "check_largest_model_and_fewest_gpus",
    ("largest_and_fewest",),
    ": Table 2's largest models and the smallest GPU counts that fit, of counts in any order",
)
check_comm_elements = _formula_check(
    "check_comm_elements", ("comm_elements",), ": the elements each GPU sends per step (ZeRO §7)"
)
check_all_formulas = _formula_check(
    "check_all_formulas",
    ("model_state_bytes", "largest_and_fewest", "comm_elements"),
    " on other models and GPU counts: all four formulas",
)


def expected_answers() -> dict[str, float]:
    """The five questions' answers, from the reference formulas."""
    formulas = _formulas()
    stage_for_40b = next(s for s in formulas.STAGES if formulas.plan(40e9, 32 * GB, tuple(POWERS_OF_TWO))[s])
    return {
        "q1_gb_per_gpu": formulas.model_state_bytes(2, 7.5e9, 64) / GB,
        "q2_stage": stage_for_40b,
        "q2_gpus": formulas.plan(40e9, 32 * GB, tuple(POWERS_OF_TWO))[stage_for_40b],
        "q3_gpus": formulas.plan(1.5e9, 16 * GB, tuple(POWERS_OF_TWO))[1],
        "q4_gb_sent": formulas.comm_bytes(3, 7.5e9, 64) / GB,
    }


def observe_answers(*answers: object) -> dict:
    return {"answers": [_as_data(answer) for answer in answers]}


def judge_answers(observation: object) -> str:
    """Numbers within 1% (GB answers may be rounded to 0.1 GB); stages and GPU counts exactly."""
    given = dict(zip(ANSWERS, returned_values(observation, "answers", len(ANSWERS)), strict=True))
    wrong = []
    for name, expected in expected_answers().items():
        got = given[name]
        exact = isinstance(expected, int)
        try:
            ok = float(got) == expected if exact else math.isclose(float(got), expected, rel_tol=1e-2)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            wrong.append(f"{name} = {_as_shown(got)!r} is not right")
    if wrong:
        raise CheckFailed("; ".join(wrong) + ". Compute each answer with your own functions above.")
    return "all five answers are right"


check_answers = graded("check_answers", observe_answers, judge_answers)


def draw_hidden(rng: random.Random) -> dict:
    """The hidden check's models (one per `HIDDEN_PSI_DECADES`), GPU counts (one per
    `HIDDEN_WORLD_SIZE_RANGES`) and `fewest_gpus`'s counts: seven of 1 to 2048, the largest first, then all
    shuffled, then three of them again. As many calls as the notebook's hidden cell makes."""
    psis = [int(10 ** rng.uniform(low, high)) for low, high in HIDDEN_PSI_DECADES]
    world_sizes = [rng.choice(sizes) for sizes in HIDDEN_WORLD_SIZE_RANGES]
    counts = [1, *rng.sample(HIDDEN_GPU_COUNTS, 6)]
    gpu_counts = [max(counts), *rng.sample(counts, len(counts)), *rng.sample(counts, 3)]
    return {"psis": psis, "world_sizes": world_sizes, "gpu_counts": gpu_counts}


CHECKS = (
    Check("test_model_state_bytes", 2, check_model_state_bytes, ("model_state_bytes",), VISIBLE),
    Check(
        "test_largest_model_and_fewest_gpus",
        2,
        check_largest_model_and_fewest_gpus,
        ("largest_model", "fewest_gpus"),
        VISIBLE,
    ),
    Check("test_comm_elements", 2, check_comm_elements, ("comm_elements_per_step",), VISIBLE),
    Check("test_hidden_formulas", 2, check_all_formulas, FUNCTIONS, HIDDEN_CELL, hidden=True, draw=draw_hidden),
    Check("test_hidden_answers", 2, check_answers, ANSWERS, hidden=True),
)
