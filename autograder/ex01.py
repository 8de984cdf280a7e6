"""ex01: an all-reduce built from a reduce-scatter and an all-gather, and what each collective costs.

The student writes `my_all_reduce(tensor)` (in place, sum over the ranks, any shape, any N: the buffer is
padded to a multiple of N) on `zero_core.dist`'s reduce-scatter and all-gather, which is how NCCL's ring
all-reduce works and why it costs 2(N-1)/N of the buffer per rank (ZeRO §7.1); and
`ring_bytes_sent(op, numel, element_size, world_size)`, the bytes each rank sends for a collective on a
buffer of `numel` elements padded the same way. The hidden checks' world sizes are drawn at grading time
(`draw_all_reduce_sizes`, `draw_ring_sizes`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from autograder.checks import Check, CheckFailed, graded
from autograder.harness import COLLECTIVE_TIMEOUT_S, RUN_DEADLINE_S, run_once
from autograder.integrity import REFERENCE_MODULES, answer_modules, require_own_code
from autograder.plain_data import count, listed, require, returned_values, runs_asked, well_formed
from autograder.records import decode_floats, encode_floats
from zero_core import comm, dist
from zero_core.cluster import VirtualCluster
from zero_core.context import current

ASSIGNMENT = "ex01_collectives"
ANSWER_MODULES = answer_modules()
"""Not loaded, and not loadable, where the student's code is graded (`autograder.sandbox`)."""
FORBIDDEN = REFERENCE_MODULES + ("zero_core.comm", "zero_core.ring")
CASES = (
    ((8,), torch.float32),
    ((10,), torch.float32),
    ((3, 5), torch.float32),
    ((1,), torch.float32),
    ((33,), torch.bfloat16),
    ((2, 2, 7), torch.bfloat16),
)
"""(shape, dtype) of the tensors all-reduced; most sizes do not divide by most N, so padding is needed."""
VISIBLE_WORLD_SIZES = [2, 4]
HIDDEN_CELL_WORLD_SIZES = [3, 5, 7]
HIDDEN_CELL_RING_WORLD_SIZES = [1, 3, 5, 7, 64]
"""What the solution notebook's hidden test cells call in a kernel; a grade draws its own sizes."""
OPS = ("all_reduce", "reduce_scatter", "all_gather")
ALL_REDUCE = ("my_all_reduce",)
RING_BYTES = ("ring_bytes_sent",)


def case_input(shape: tuple[int, ...], dtype: torch.dtype, case: int, rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * case + rank)
    return torch.randn(shape, generator=generator).to(dtype)


@dataclass
class CaseOutcome:
    result: torch.Tensor
    returned: object
    collectives: list[tuple[str, str, int]]


def _all_reduce_on_rank(my_all_reduce: Callable[[torch.Tensor], object]) -> list[CaseOutcome]:
    ledger = current().ledger
    outcomes = []
    for case, (shape, dtype) in enumerate(CASES):
        tensor = case_input(shape, dtype, case, dist.get_rank())
        before = len(ledger.entries)
        returned = my_all_reduce(tensor)
        collectives = [(e.op, e.dtype, e.elements) for e in ledger.entries[before:]]
        outcomes.append(CaseOutcome(tensor, returned, collectives))
    return outcomes


def _run(my_all_reduce: Callable, world_size: int) -> list[list[CaseOutcome]]:
    def make() -> list[list[CaseOutcome]]:
        cluster = VirtualCluster(world_size, timeout_s=COLLECTIVE_TIMEOUT_S)
        return cluster.run(_all_reduce_on_rank, my_all_reduce, deadline_s=RUN_DEADLINE_S)

    what = f"my_all_reduce on {world_size} ranks"
    return run_once((ASSIGNMENT, my_all_reduce, world_size), (my_all_reduce,), make, what)


def _integrity(objects: dict) -> None:
    require_own_code(objects, ALL_REDUCE + RING_BYTES, FORBIDDEN, ASSIGNMENT)


def _values(tensor: object, numel: int) -> str | None:
    """A float tensor of `numel` elements as data (exact for bf16 and fp32); None for anything else."""
    if not isinstance(tensor, torch.Tensor) or tensor.numel() != numel or not tensor.dtype.is_floating_point:
        return None
    return encode_floats(tensor)


def _read_values(encoded: object, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> torch.Tensor:
    return decode_floats(encoded, torch.Size(shape).numel(), what).view(shape).to(dtype)


def observe_all_reduce(my_all_reduce: Callable, world_sizes: list[int]) -> dict:
    """Per N: every rank's tensor after the call, what the call returned, and rank 0's collectives per case."""
    _integrity({"my_all_reduce": my_all_reduce})
    runs: dict[str, dict] = {}
    for n in world_sizes:
        try:
            outcomes = _run(my_all_reduce, n)
        except CheckFailed as failure:
            runs[str(n)] = {"failure": str(failure)}
            continue
        sizes = [torch.Size(shape).numel() for shape, _ in CASES]
        runs[str(n)] = {
            "results": [[_values(o.result, k) for o, k in zip(cases, sizes, strict=True)] for cases in outcomes],
            "returned": [[_values(o.returned, k) for o, k in zip(cases, sizes, strict=True)] for cases in outcomes],
            "collectives": [[list(c) for c in o.collectives] for o in outcomes[0]],
        }
    return {"runs": runs}


def _outcomes(observation: object, world_sizes: list[int], world_size: int) -> list[list[CaseOutcome]]:
    """The observed outcomes on `world_size` ranks, validated; CheckFailed for a run that failed, and
    `ObservationInvalid` for runs on other world sizes than `world_sizes` or data no run makes."""
    entry = runs_asked(observation, world_sizes)[str(world_size)]
    if isinstance(entry, dict) and isinstance(entry.get("failure"), str):
        raise CheckFailed(entry["failure"][:4000])
    where = f"on {world_size} ranks"
    well_formed(isinstance(entry, dict), f"the run {where}")
    results = listed(entry.get("results"), f"the results {where} (one per rank)", world_size)
    returned = listed(entry.get("returned"), f"the returned values {where} (one per rank)", world_size)
    collectives = listed(entry.get("collectives"), f"rank 0's collectives {where} (one list per case)", len(CASES))
    outcomes = []
    for rank in range(world_size):
        listed(results[rank], f"rank {rank}'s results {where} (one per case)", len(CASES))
        listed(returned[rank], f"rank {rank}'s returned values {where} (one per case)", len(CASES))
        per_case = []
        for case, (shape, dtype) in enumerate(CASES):
            what = f"rank {rank}, case {case}"
            result = _read_values(results[rank][case], shape, dtype, what)
            back = returned[rank][case]
            back = None if back is None else _read_values(back, shape, dtype, what)
            seen = listed(collectives[case], f"the collectives of case {case}") if rank == 0 else []
            per_case.append(CaseOutcome(result, back, [_collective(c, f"case {case}'s collective") for c in seen]))
        outcomes.append(per_case)
    return outcomes


def _collective(entry: object, what: str) -> tuple[str, str, int]:
    """(op, dtype, elements) as the ledger records a collective: an op and a dtype it knows, at least 0 elements."""
    well_formed(isinstance(entry, list) and len(entry) == 3, f"{what} is not (op, dtype, elements)")
    op, dtype, elements = entry
    require(op in comm.OPS, f"{what} is a {op!r:.40}, no collective the ledger records")
    well_formed(isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype), f"{what}'s dtype")
    return op, dtype, count(elements, f"{what}'s elements")


def _expected_sum(case: int, world_size: int) -> torch.Tensor:
    shape, dtype = CASES[case]
    inputs = [case_input(shape, dtype, case, r).reshape(-1) for r in range(world_size)]
    return dist.reduce_in_rank_order(inputs, dist.ReduceOp.SUM).view(shape)


def _check_values(outcomes: list[list[CaseOutcome]], world_size: int) -> None:
    for case, (shape, dtype) in enumerate(CASES):
        expected = _expected_sum(case, world_size)
        what = f"{world_size} ranks, a {str(dtype).removeprefix('torch.')} tensor of shape {tuple(shape)}"
        for rank, per_case in enumerate(outcomes):
            outcome = per_case[case]
            if torch.equal(outcome.result, expected):
                continue
            hint = ""
            if isinstance(outcome.returned, torch.Tensor) and torch.equal(outcome.returned.view(shape), expected):
                hint = " The sum was returned, but `tensor` itself must hold it (in place, like dist.all_reduce)."
            elif torch.allclose(outcome.result.float() * world_size, expected.float(), rtol=1e-2, atol=1e-3):
                hint = " It is the average: all_reduce sums (op=dist.ReduceOp.SUM)."
            delta = (outcome.result.float() - expected.float()).abs().max().item()
            raise CheckFailed(
                f"{what}: rank {rank}'s tensor after my_all_reduce differs from the sum over the ranks "
                f"(max |Δ| = {delta:.3g}; a correct all-reduce matches dist.all_reduce bit for bit).{hint}"
            )


def _check_collectives(outcomes: list[list[CaseOutcome]], world_size: int) -> None:
    for case, (shape, dtype) in enumerate(CASES):
        numel = torch.Size(shape).numel()
        padded = -(-numel // world_size) * world_size
        name = str(dtype).removeprefix("torch.")
        expected = [("reduce_scatter", name, padded), ("all_gather", name, padded)]
        seen = outcomes[0][case].collectives
        if seen != expected:
            shown = ", ".join(f"{op} of {n} {d} elements" for op, d, n in seen) or "no collective"
            raise CheckFailed(
                f"{world_size} ranks, a {name} tensor of {numel} elements: expected one reduce_scatter, then one "
                f"all_gather, each of {padded} elements (the {numel} padded to a multiple of {world_size}); "
                f"saw {shown}. That pair is the ring all-reduce: 2(N-1)/N of the buffer per rank."
            )


def judge_all_reduce(observation: object, world_sizes: list[int]) -> str:
    """my_all_reduce gives every rank the sum, in place, bit for bit as dist.all_reduce."""
    for n in world_sizes:
        _check_values(_outcomes(observation, world_sizes, n), n)
    return f"{', '.join(map(str, world_sizes))} ranks, {len(CASES)} shapes and dtypes: the exact sum, in place"


def judge_all_reduce_collectives(observation: object, world_sizes: list[int]) -> str:
    """Exactly one reduce-scatter then one all-gather of the padded buffer: the ring all-reduce's volume."""
    for n in world_sizes:
        _check_collectives(_outcomes(observation, world_sizes, n), n)
    return f"{', '.join(map(str, world_sizes))} ranks: one reduce-scatter and one all-gather of the padded buffer"


def judge_all_reduce_values_and_collectives(observation: object, world_sizes: list[int]) -> str:
    values = judge_all_reduce(observation, world_sizes)
    collectives = judge_all_reduce_collectives(observation, world_sizes).split(": ", 1)[1]
    return f"{values}; {collectives}"


check_all_reduce = graded("check_all_reduce", observe_all_reduce, judge_all_reduce)
check_all_reduce_collectives = graded("check_all_reduce_collectives", observe_all_reduce, judge_all_reduce_collectives)
check_all_reduce_values_and_collectives = graded(
    "check_all_reduce_values_and_collectives", observe_all_reduce, judge_all_reduce_values_and_collectives
)


def expected_ring_bytes(op: str, numel: int, element_size: int, world_size: int) -> int:
    padded = -(-numel // world_size) * world_size
    return comm.ring_bytes(op, padded * element_size, element_size, world_size, rank=0)[0]


def _ring_calls(world_sizes: list[int]) -> list[tuple[str, int, int, int]]:
    return [
        (op, numel, element_size, n)
        for n in world_sizes
        for op in OPS
        for numel in (1, 10, 1000, 4224, 17_440)
        for element_size in (2, 4)
    ]


def observe_ring_bytes(ring_bytes_sent: Callable, world_sizes: list[int]) -> dict:
    _integrity({"ring_bytes_sent": ring_bytes_sent})
    returned = []
    for call in _ring_calls(world_sizes):
        got = ring_bytes_sent(*call)
        returned.append(got if got is None or isinstance(got, bool | int | float) else {"repr": repr(got)[:200]})
    return {"returned": returned}


def judge_ring_bytes(observation: object, world_sizes: list[int]) -> str:
    """Bytes one rank sends on a ring, for each collective, on buffers padded to a multiple of N."""
    calls = _ring_calls(world_sizes)
    returned = returned_values(observation, "returned", len(calls))
    for (op, numel, element_size, n), got in zip(calls, returned, strict=True):
        expected = expected_ring_bytes(op, numel, element_size, n)
        if isinstance(got, bool) or not isinstance(got, int | float) or got != expected:
            shown = got["repr"] if isinstance(got, dict) and isinstance(got.get("repr"), str) else got
            chunk = -(-numel // n)
            raise CheckFailed(
                f"ring_bytes_sent({op!r}, numel={numel}, element_size={element_size}, world_size={n}) "
                f"returned {shown!r}; expected {expected}. The buffer is padded to {chunk * n} elements, "
                f"{chunk} per rank; a reduce-scatter or all-gather sends N-1 chunks per rank, an "
                "all-reduce twice that (ZeRO §7.1)."
            )
    return f"{len(calls)} cases on {', '.join(map(str, world_sizes))} ranks: the ring's bytes per rank"


check_ring_bytes = graded("check_ring_bytes", observe_ring_bytes, judge_ring_bytes)


HIDDEN_ALL_REDUCE_SIZES = range(3, 9)
HIDDEN_RING_SIZES = (range(3, 17), range(17, 129))


def draw_all_reduce_sizes(rng: random.Random) -> dict:
    """Three world sizes of 3 to 8 (3, 5 and 7 in the notebook): most pad the cases' tensors."""
    return {"world_sizes": sorted(rng.sample(HIDDEN_ALL_REDUCE_SIZES, 3))}


def draw_ring_sizes(rng: random.Random) -> dict:
    """1, three world sizes of 3 to 16 and one of 17 to 128 (1, 3, 5, 7, 64 in the notebook): 150 cases."""
    small, large = HIDDEN_RING_SIZES
    return {"world_sizes": [1, *sorted(rng.sample(small, 3)), rng.choice(large)]}


CHECKS = (
    Check("test_all_reduce", 2, check_all_reduce, ALL_REDUCE, {"world_sizes": VISIBLE_WORLD_SIZES}),
    Check(
        "test_all_reduce_collectives",
        2,
        check_all_reduce_collectives,
        ALL_REDUCE,
        {"world_sizes": VISIBLE_WORLD_SIZES},
    ),
    Check(
        "test_hidden_all_reduce",
        2,
        check_all_reduce_values_and_collectives,
        ALL_REDUCE,
        {"world_sizes": HIDDEN_CELL_WORLD_SIZES},
        hidden=True,
        draw=draw_all_reduce_sizes,
    ),
    Check("test_ring_bytes", 2, check_ring_bytes, RING_BYTES, {"world_sizes": VISIBLE_WORLD_SIZES}),
    Check(
        "test_hidden_ring_bytes",
        2,
        check_ring_bytes,
        RING_BYTES,
        {"world_sizes": HIDDEN_CELL_RING_WORLD_SIZES},
        hidden=True,
        draw=draw_ring_sizes,
    ),
)
