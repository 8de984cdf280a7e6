"""The plain data a grading child writes, held to the shapes and sizes a run can produce: no tensors, no torch.

A check's observation crosses from the process that runs student code to the one that decides as JSON. Before a
judge reads a value, it must be what the course's own code would write (a list of the right length, an integer a
run could count, a finite number of seconds), else `ObservationInvalid`: "the observation cannot be true".
`autograder.records` reads whole training runs with these; a formula exercise's judge (ex05) reads its returned
values with them alone, so its grading parent never loads torch.
"""

from __future__ import annotations

import math
from typing import Any

from autograder.checks import impossible

MAX_ITEMS = 100_000
"""More entries than any run of the graded model makes in a list: a guard against a flood of data."""
ADDRESS_SPACE_BYTES = 4096 * 2**20
"""A grading child's address space (`sandbox.Limits.memory_bytes`, a test keeps them equal): no buffer, peak
or collective of its runs is larger."""


def require(condition: bool, what: str) -> None:
    """`ObservationInvalid` ("the observation cannot be true: `what`") unless `condition`."""
    if not condition:
        raise impossible(what)


def well_formed(condition: bool, what: str) -> None:
    """`require` for the shape of the data: "malformed data (`what`)" unless `condition`."""
    require(condition, f"malformed data ({what})")


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def count(value: Any, what: str, low: int = 0, high: int = ADDRESS_SPACE_BYTES) -> int:
    """An integer a run could have counted (bytes, elements, a step): between `low` and `high`."""
    require(is_int(value), f"{what} is {value!r:.40}, not an integer")
    require(low <= value <= high, f"{what} is {value:,}; a run's is between {low:,} and {high:,}")
    return int(value)


def seconds(value: Any, what: str) -> float:
    require(is_number(value) and math.isfinite(value), f"{what} is {value!r:.40}, not a finite number of seconds")
    return float(value)


def listed(value: Any, what: str, length: int | None = None) -> list:
    well_formed(isinstance(value, list) and len(value) <= MAX_ITEMS, f"{what} is not a list")
    well_formed(length is None or len(value) == length, f"{what} has {len(value)} entries, not {length}")
    return value


def runs_asked(observation: Any, world_sizes: list[int]) -> dict[str, Any]:
    """{"N": what was observed on N ranks} of an observation {"runs": ...}: exactly the world sizes the
    check asked for, none missing, none other."""
    runs = observation.get("runs") if isinstance(observation, dict) else None
    well_formed(isinstance(runs, dict), "no runs")
    require(
        set(runs) == {str(n) for n in world_sizes},
        f"runs on {', '.join(runs)[:80]} ranks; the check asked for {', '.join(map(str, world_sizes))}",
    )
    return runs


def returned_values(observation: Any, key: str, calls: int) -> list:
    """The values a student's function returned, one per call, as `checks`' observers write them: a number,
    None, or {"repr": text} for anything else. A list of another length, or other data, cannot be true."""
    values = observation.get(key) if isinstance(observation, dict) else None
    well_formed(isinstance(values, list), f"no list of {key} values")
    well_formed(len(values) == calls, f"{len(values)} {key} values for {calls} calls")
    for index, value in enumerate(values):
        shown = value is None or is_number(value) or isinstance(value, bool)
        shown = shown or (isinstance(value, dict) and set(value) == {"repr"} and isinstance(value["repr"], str))
        well_formed(shown, f"{key} value {index} is {value!r:.40}, which no call's value is written as")
    return values
