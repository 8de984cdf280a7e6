"""ex05: memory planning with the paper's formulas: bytes per GPU, the largest model, how many GPUs.

The student writes four functions (model-state bytes per GPU, ZeRO §5 and Figure 1; the largest model
that fits, Table 2; the fewest GPUs that fit a model; elements sent per step, §7) and answers five
numeric questions. Everything is checked against `zero_core.formulas`, which the student may not use.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from autograder.checks import Check, CheckFailed, notebook_check
from autograder.integrity import REFERENCE_MODULES, require_own_code
from zero_core import formulas

ASSIGNMENT = "ex05_memory_planning"
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


def _expect(function: Callable, name: str, expected: float | None, why: str, **kwargs: object) -> None:
    got = function(**kwargs)
    if not _same(got, expected):
        raise CheckFailed(f"{_signature(name, kwargs)} returned {got!r}; expected {expected!r}: {why}")


def _model_state_bytes(model_state_bytes: Callable, psis: list[float], world_sizes: list[int]) -> int:
    count = 0
    for stage in formulas.STAGES:
        for psi in psis:
            for n in world_sizes:
                expected = formulas.model_state_bytes(stage, psi, n)
                why = f"{MEMORY_FORMULAS[stage]} bytes (ZeRO §5, Figure 1; K = 12, 2-byte parameters and gradients)"
                _expect(model_state_bytes, "model_state_bytes", expected, why, stage=stage, psi=psi, n_gpus=n)
                count += 1
    return count


def _largest_and_fewest(
    largest_model: Callable, fewest_gpus: Callable, psis: list[float], world_sizes: list[int]
) -> int:
    count = 0
    for stage in formulas.STAGES:
        for n in world_sizes:
            for memory_gb in (16, 32, 80):
                expected = formulas.largest_model_params(memory_gb * GB, n, stage)
                why = f"the Ψ with {MEMORY_FORMULAS[stage]} = {memory_gb} GB (ZeRO Table 2)"
                _expect(
                    largest_model,
                    "largest_model",
                    expected,
                    why,
                    stage=stage,
                    n_gpus=n,
                    gpu_memory_bytes=memory_gb * GB,
                )
                count += 1
        for psi in psis:
            for memory_gb in (16, 32, 80):
                expected = formulas.plan(psi, memory_gb * GB, tuple(POWERS_OF_TWO))[stage]
                why = "the first count in gpu_counts whose per-GPU model states fit, or None"
                _expect(
                    fewest_gpus,
                    "fewest_gpus",
                    expected,
                    why,
                    stage=stage,
                    psi=psi,
                    gpu_memory_bytes=memory_gb * GB,
                    gpu_counts=POWERS_OF_TWO,
                )
                count += 1
    return count


def _comm_elements(comm_elements_per_step: Callable, psis: list[float], world_sizes: list[int]) -> int:
    count = 0
    for stage in formulas.STAGES:
        for psi in psis:
            for n in world_sizes:
                expected = formulas.comm_elements(stage, psi, n)
                why = f"{COMM_FORMULAS[stage]} on a ring (ZeRO §7: 2Ψ for stages 0-2, 3Ψ for stage 3)"
                _expect(comm_elements_per_step, "comm_elements_per_step", expected, why, stage=stage, psi=psi, n_gpus=n)
                count += 1
    return count


@notebook_check
def check_model_state_bytes(model_state_bytes: Callable, psis: list[float], world_sizes: list[int]) -> str:
    _integrity({"model_state_bytes": model_state_bytes})
    count = _model_state_bytes(model_state_bytes, psis, world_sizes)
    return f"{count} cases: the model-state bytes per GPU of ZeRO §5"


@notebook_check
def check_largest_model_and_fewest_gpus(
    largest_model: Callable, fewest_gpus: Callable, psis: list[float], world_sizes: list[int]
) -> str:
    _integrity({"largest_model": largest_model, "fewest_gpus": fewest_gpus})
    count = _largest_and_fewest(largest_model, fewest_gpus, psis, world_sizes)
    return f"{count} cases: Table 2's largest models and the fewest GPUs that fit"


@notebook_check
def check_comm_elements(comm_elements_per_step: Callable, psis: list[float], world_sizes: list[int]) -> str:
    _integrity({"comm_elements_per_step": comm_elements_per_step})
    count = _comm_elements(comm_elements_per_step, psis, world_sizes)
    return f"{count} cases: the elements each GPU sends per step (ZeRO §7)"


@notebook_check
def check_all_formulas(
    model_state_bytes: Callable,
    largest_model: Callable,
    fewest_gpus: Callable,
    comm_elements_per_step: Callable,
    psis: list[float],
    world_sizes: list[int],
) -> str:
    _integrity(
        {
            "model_state_bytes": model_state_bytes,
            "largest_model": largest_model,
            "fewest_gpus": fewest_gpus,
            "comm_elements_per_step": comm_elements_per_step,
        }
    )
    count = _model_state_bytes(model_state_bytes, psis, world_sizes)
    count += _largest_and_fewest(largest_model, fewest_gpus, psis, world_sizes)
    count += _comm_elements(comm_elements_per_step, psis, world_sizes)
    return f"{count} cases on other models and GPU counts: all four formulas"


def expected_answers() -> dict[str, float]:
    """The five questions' answers, from the reference formulas."""
    stage_for_40b = next(s for s in formulas.STAGES if formulas.plan(40e9, 32 * GB, tuple(POWERS_OF_TWO))[s])
    return {
        "q1_gb_per_gpu": formulas.model_state_bytes(2, 7.5e9, 64) / GB,
        "q2_stage": stage_for_40b,
        "q2_gpus": formulas.plan(40e9, 32 * GB, tuple(POWERS_OF_TWO))[stage_for_40b],
        "q3_gpus": formulas.plan(1.5e9, 16 * GB, tuple(POWERS_OF_TWO))[1],
        "q4_gb_sent": formulas.comm_bytes(3, 7.5e9, 64) / GB,
    }


@notebook_check
def check_answers(q1_gb_per_gpu: float, q2_stage: int, q2_gpus: int, q3_gpus: int, q4_gb_sent: float) -> str:
    """Numbers within 1% (GB answers may be rounded to 0.1 GB); stages and GPU counts exactly."""
    given = dict(zip(ANSWERS, (q1_gb_per_gpu, q2_stage, q2_gpus, q3_gpus, q4_gb_sent), strict=True))
    wrong = []
    for name, expected in expected_answers().items():
        got = given[name]
        exact = isinstance(expected, int)
        try:
            ok = float(got) == expected if exact else math.isclose(float(got), expected, rel_tol=1e-2)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            wrong.append(f"{name} = {got!r} is not right")
    if wrong:
        raise CheckFailed("; ".join(wrong) + ". Compute each answer with your own functions above.")
    return "all five answers are right"


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
