"""What the judges read of the reference code, recorded once for a student release and read back there.

A judge compares the student's runs with reference runs it makes itself, from the course's answer modules.
A class's students get a release without those modules (`autograder.student_release`), so what the
visible checks' judges need of them is recorded when the release is built, by grading the solution
notebook's visible checks in the instructor's copy: the reference runs, the single-device oracle's
trajectories, the formulas' values. The release holds them as data in `RECORD_FILE` (numbers and
base64-encoded fp32 values, no code), and its judges read them back instead of running the references.
Every recorded figure is one the student's own visible checks would print anyway on a failure.

Outside a student release, `RECORD_FILE` does not exist and `outcome` computes, or reads what an earlier
grading process on this machine computed (`autograder.reference_store`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from autograder import reference_store
from autograder.checks import CheckFailed

if TYPE_CHECKING:  # only the oracle's tensors need torch: a formula exercise's grader never loads it
    import torch

ROOT = Path(__file__).resolve().parents[1]
RECORD_FILE = ROOT / "autograder" / "recorded_references.json"
"""Only in a student release: what the visible checks' judges read instead of running the answers."""

T = TypeVar("T")
COMPUTED_IN_PLACE = frozenset({"formula", "stage"})
"""Kinds of outcome cheaper to compute than to read back from the reference store: a formula's value, a number."""
_book: dict[str, Any] | None = None


def replaying() -> bool:
    """Whether this is a student release, whose judges read recorded references."""
    return RECORD_FILE.exists()


@cache
def _recorded() -> dict[str, Any]:
    data = json.loads(RECORD_FILE.read_text())
    if not isinstance(data, dict):
        raise RuntimeError(f"{RECORD_FILE} is not a record of references; rebuild the release")
    return data


def outcome(
    kind: str, key: Hashable, make: Callable[[], T], encode: Callable[[T], Any], decode: Callable[[Any], T]
) -> T:
    """`make()`, recorded under (`kind`, `key`) while a release is being built; in a release, the recorded
    value, or `CheckFailed` naming what only the instructor's grading has."""
    name = f"{kind}:{key!r}"
    if replaying():
        recorded = _recorded()
        if name not in recorded:
            raise CheckFailed(
                f"this check needs a reference ({kind}) that a student release does not hold: it runs when your "
                "instructor grades the notebook"
            )
        return decode(recorded[name])
    value = make() if kind in COMPUTED_IN_PLACE else reference_store.kept(kind, key, make, encode, decode)
    if _book is not None:
        _book[name] = encode(value)
    return value


@contextmanager
def recording() -> Iterator[dict[str, Any]]:
    """Record every `outcome` computed inside the block into the dict it yields."""
    global _book
    previous, _book = _book, {}
    try:
        yield _book
    finally:
        _book = previous


def identity(value: T) -> T:
    return value


def tensor_to_data(tensor: torch.Tensor) -> dict[str, Any]:
    """A float tensor as its shape and its values in fp32 (exact for bf16, fp16 and fp32)."""
    from autograder.records import encode_floats

    return {"shape": list(tensor.shape), "values": encode_floats(tensor)}


def tensor_from_data(data: dict[str, Any]) -> torch.Tensor:
    from autograder.records import decode_floats

    shape = [int(size) for size in data["shape"]]
    numel = 1
    for size in shape:
        numel *= size
    return decode_floats(data["values"], numel, "a recorded tensor").reshape(shape)


Oracle = tuple[list[float], dict[str, "torch.Tensor"], dict[tuple[str, int], "torch.Tensor"]]
"""The single-device oracle's losses, final fp32 weights and per-(layer, step) gradients."""


def oracle_to_data(oracle: Oracle) -> dict[str, Any]:
    losses, weights, gradients = oracle
    return {
        "losses": list(losses),
        "weights": {name: tensor_to_data(value) for name, value in weights.items()},
        "gradients": [[layer, step, tensor_to_data(value)] for (layer, step), value in gradients.items()],
    }


def oracle_from_data(data: dict[str, Any]) -> Oracle:
    weights = {name: tensor_from_data(value) for name, value in data["weights"].items()}
    gradients = {(layer, step): tensor_from_data(value) for layer, step, value in data["gradients"]}
    return [float(loss) for loss in data["losses"]], weights, gradients
