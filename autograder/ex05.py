"""ex05: memory planning with the paper's formulas: bytes per GPU, the largest model, how many GPUs.

The student writes four functions (model-state bytes per GPU, ZeRO §5 and Figure 1; the largest model
that fits, Table 2; the fewest GPUs that fit a model; elements sent per step, §7) and answers five
numeric questions. Everything is checked against `zero_core.formulas`, which the student may not use.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

from autograder.checks import Check, CheckFailed, ObservationInvalid, graded
from autograder.integrity import REFERENCE_MODULES, answer_modules, require_own_code

ASSIGNMENT = "ex05_memory_planning"
ANSWER_MODULES = answer_modules()
"""Not loaded, and not loadable, where the student's code is graded (`autograder.sandbox`)."""
FORBIDDEN = REFERENCE_MODULES + ("zero_core.formulas", "zero_core.deepspeed_estimators")
FUNCTIONS = ("model_state_bytes", "largest_model", "fewest_gpus", "comm_elements_per_step")
ANSWERS = ("q1_gb_per_gpu", "q2_stage", "q2_gpus", "q3_gpus", "q4_gb_sent")
GB = 1e9
MEMORY_FORMULAS = {0: "16Ψ", 1: "4Ψ + 12Ψ/N", 2: "2Ψ + 14Ψ/N", 3: "16Ψ/N"}
COMM_FORMULAS = {0: "2(N-1)/N·Ψ", 1: "2(N-1)/N·Ψ", 2: "2(N-1)/N·Ψ", 3: "3(N-1)/N·Ψ"}
POWERS_OF_TWO = [2**i for i in range(11)]
VISIBLE = {"psis": [7_500_000_000, 128_000_000_000], "world_sizes": [1, 4, 16, 64]}
HIDDEN = {"psis": [1_500_000_000, 40_000_000_000, 1_000_000_000_000, 123_456_789], "world_sizes": [1, 3, 7, 1000]}


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


def _calls(group: str, psis: list[float], world_sizes: list[int]) -> list[tuple[str, dict]]:
    """The calls a check makes of the student's functions, in order: (function name, keyword arguments)."""
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
                ("fewest_gpus", {"stage": stage, "psi": psi, "gpu_memory_bytes": gb * GB, "gpu_counts": POWERS_OF_TWO})
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
    """What a call should return, and why (in the process that decides, from `zero_core.formulas`)."""
    stage, formulas = kwargs["stage"], _formulas()
    if name == "model_state_bytes":
        why = f"{MEMORY_FORMULAS[stage]} bytes (ZeRO §5, Figure 1; K = 12, 2-byte parameters and gradients)"
        return formulas.model_state_bytes(stage, kwargs["psi"], kwargs["n_gpus"]), why
    if name == "largest_model":
        why = f"the Ψ with {MEMORY_FORMULAS[stage]} = {kwargs['gpu_memory_bytes'] / GB:g} GB (ZeRO Table 2)"
        return formulas.largest_model_params(kwargs["gpu_memory_bytes"], kwargs["n_gpus"], stage), why
    if name == "fewest_gpus":
        why = "the first count in gpu_counts whose per-GPU model states fit, or None"
        return formulas.plan(kwargs["psi"], kwargs["gpu_memory_bytes"], tuple(kwargs["gpu_counts"]))[stage], why
    why = f"{COMM_FORMULAS[stage]} on a ring (ZeRO §7: 2Ψ for stages 0-2, 3Ψ for stage 3)"
    return formulas.comm_elements(stage, kwargs["psi"], kwargs["n_gpus"]), why


GROUPS = {
    "model_state_bytes": ("model_state_bytes",),
    "largest_and_fewest": ("largest_model", "fewest_gpus"),
    "comm_elements": ("comm_elements_per_step",),
}


def _observer(groups: tuple[str, ...]) -> Callable[..., dict]:
    """Observe: call the student's functions (named by the groups, in order) and keep what they return."""
    names = tuple(name for group in groups for name in GROUPS[group])

    def observe(*functions: Callable, psis: list[float], world_sizes: list[int]) -> dict:
        by_name = dict(zip(names, functions, strict=True))
        _integrity(by_name)
        calls = [call for group in groups for call in _calls(group, psis, world_sizes)]
        return {"returned": [_as_data(by_name[name](**kwargs)) for name, kwargs in calls]}

    return observe


def _judge(groups: tuple[str, ...], summary: str) -> Callable[..., str]:
    """Judge: each returned value against the reference formula's, in the order of the calls."""

    def judge(observation: object, psis: list[float], world_sizes: list[int]) -> str:
        calls = [call for group in groups for call in _calls(group, psis, world_sizes)]
        returned = observation.get("returned") if isinstance(observation, dict) else None
        if not isinstance(returned, list) or len(returned) != len(calls):
            raise ObservationInvalid("the grading process returned malformed data (not one value per call): no points")
        for (name, kwargs), got in zip(calls, returned, strict=True):
            expected, why = _expected(name, kwargs)
            if not _same(got, expected):
                shown = _as_shown(got)
                raise CheckFailed(f"{_signature(name, kwargs)} returned {shown!r}; expected {expected!r}: {why}")
        return f"{len(calls)} cases{summary}"

    return judge


def _formula_check(name: str, groups: tuple[str, ...], summary: str) -> Callable[..., None]:
    return graded(name, _observer(groups), _judge(groups, summary))


check_model_state_bytes = _formula_check(
    "check_model_state_bytes", ("model_state_bytes",), ": the model-state bytes per GPU of ZeRO §5"
)
check_largest_model_and_fewest_gpus = _formula_check(
    "check_largest_model_and_fewest_gpus",
    ("largest_and_fewest",),
    ": Table 2's largest models and the fewest GPUs that fit",
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
    answers = observation.get("answers") if isinstance(observation, dict) else None
    if not isinstance(answers, list) or len(answers) != len(ANSWERS):
        raise ObservationInvalid("the grading process returned malformed data (not five answers): no points")
    given = dict(zip(ANSWERS, answers, strict=True))
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
    Check("test_hidden_formulas", 2, check_all_formulas, FUNCTIONS, HIDDEN, hidden=True),
    Check("test_hidden_answers", 2, check_answers, ANSWERS, hidden=True),
)
