"""Compare a student's run with the reference run and say what differs, where, and what to look at.

The reference stages train bit for bit alike (every reduction adds in rank order in fp32, Adam is made
of elementwise IEEE operations). A student's piece need not: another correct formulation rounds
otherwise, so training is judged within the rounding the single-device fp32 oracle measures
(`Tolerance`), and the first place it goes beyond that is the clue. Memory and communication are
compared exactly: bytes and collectives have no rounding.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

import autograder
import zero_core
from autograder.checks import CheckFailed
from autograder.harness import layer_shapes
from autograder.integrity import verdict
from autograder.records import Collective, Run
from zero_core.memory import UNTRACKED, Leftover
from zero_core.stages.base import OVERFLOW_TAG

MAX_LISTED = 4
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Tolerance:
    """How far a correct submission may land from the reference: rounding, measured, not guessed.

    The reference stage trains in bf16; the single-device oracle (`zero_core.oracle`) trains the same model
    on the same global batch in fp32. How far the reference is from the oracle is how much rounding this
    training carries; a correct formulation that rounds differently (SUM then a division, another order
    of operations) lands that close to the reference too. `MARGIN` times that distance is accepted, for
    the losses, the fp32 master weights, and each layer's averaged gradient given to Adam (the gradient
    catches what Adam's scale invariance hides: a sum instead of a mean moves the weights almost not at
    all)."""

    loss: float
    master: float
    grad: dict[str, float]

    MARGIN = 4.0
    FLOOR = 1e-7


def tolerance_from_oracle(
    reference: Run, oracle_losses: list[float], oracle_weights: dict, oracle_grads: dict
) -> Tolerance:
    """`Tolerance` from the reference run and the fp32 single-device oracle of the same training."""
    loss = max(
        abs(sum(r.losses[step] for r in reference.ranks) / reference.world_size - oracle_loss)
        for step, oracle_loss in enumerate(oracle_losses)
    )
    masters = reference.master_weights()
    master = max((masters[layer] - oracle_weights[layer]).abs().max().item() for layer in reference.partitions)
    grad = {
        layer: max(
            (reference.averaged_gradient(layer, step) - oracle_grads[layer, step]).abs().max().item()
            for step in range(reference.steps)
        )
        for layer in reference.partitions
    }
    scale = lambda distance: Tolerance.MARGIN * distance + Tolerance.FLOOR  # noqa: E731
    return Tolerance(scale(loss), scale(master), {layer: scale(d) for layer, d in grad.items()})


def _deltas(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """|got - want| elementwise, infinite where either is not a number."""
    return (got - want).abs().nan_to_num(nan=float("inf"))


def _max_delta(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(_deltas(got, want).max().item())


def _first_loss_difference(run: Run, reference: Run, tolerance: Tolerance) -> tuple[int, str] | None:
    """(step, description) of the first loss beyond the tolerance, in step then rank order."""
    for step in range(run.steps):
        for rank in range(run.world_size):
            got, want = run.ranks[rank].losses[step], reference.ranks[rank].losses[step]
            if not abs(got - want) <= tolerance.loss:
                return step, f"rank {rank}'s loss at step {step} is {got!r}, the reference's {want!r}"
    return None


def _first_master_difference(run: Run, reference: Run, tolerance: Tolerance) -> str | None:
    got, want = run.master_weights(), reference.master_weights()
    for layer, partition in run.partitions.items():
        if layer not in got:
            return f"no rank returned master weights for layer {layer}"
        if got[layer].shape != want[layer].shape:
            return f"layer {layer}: {got[layer].numel()} master values, expected {want[layer].numel()}"
        delta = _deltas(got[layer], want[layer])
        if delta.max().item() <= tolerance.master:
            continue
        wrong = torch.nonzero(delta > tolerance.master).flatten().tolist()
        shards = sorted({int(i) // partition.chunk_numel for i in wrong})
        return (
            f"after {run.steps} steps, the first layer whose fp32 master weights differ: {layer} "
            f"(max |Δ| = {delta.max().item():.3g}, "
            f"in shard(s) {shards[:8]}{'...' if len(shards) > 8 else ''}, shard r being rank r's)"
        )
    return None


def _diagnose_gradients(
    run: Run, reference: Run, tolerance: Tolerance, gradient: str = "averaged gradient"
) -> str | None:
    """The first (step, layer, rank) whose gradient given to Adam is beyond the tolerance, explained;
    `gradient` is what the message calls the value compared (ex08's is the clipped gradient)."""
    n = run.world_size
    for step in range(run.steps):
        for layer, partition in run.partitions.items():
            full = reference.averaged_gradient(layer, step)
            if full is None:
                continue
            close = tolerance.grad[layer]
            for rank, record in enumerate(run.ranks):
                start, end = partition.owned_range(rank)
                if end == start:
                    continue
                where = f"step {step}, layer {layer}, rank {rank}"
                got = record.adam_grads.get((layer, step))
                if got is None:
                    return f"{where}: Adam was never given a gradient (call adam.step once per layer per step)"
                want = full[start:end]
                if got.shape != want.shape:
                    return (
                        f"{where}: Adam was given a gradient of {got.numel()} elements; rank {rank} owns "
                        f"{end - start} (elements [{start}, {end}) of the flat layer: partition.owned_range(rank))"
                    )
                if got.dtype != torch.float32:
                    return f"{where}: Adam was given a {got.dtype} gradient; give it fp32 (grad.float())"
                if _max_delta(got, want) <= close:
                    continue
                for other in range(n):
                    lo, hi = partition.owned_range(other)
                    if other != rank and hi - lo == got.numel() and _max_delta(got, full[lo:hi]) <= close:
                        return (
                            f"rank {rank} kept shard {other} of layer {layer} (step {step}); expected shard "
                            f"{rank}: rank r owns elements [r·chunk, (r+1)·chunk) with chunk = "
                            f"{partition.chunk_numel}"
                        )
                if n > 1 and _max_delta(got, want * n) <= close * n:
                    return (
                        f"{where}: the gradient is {n}x the reference's average: the ranks' gradients were "
                        "summed, not averaged (op=dist.ReduceOp.AVG)"
                    )
                later = (
                    " (step 0's matched: what differs shows only once the parameters have been updated: an update "
                    "that does not reach every rank, or a forward that ignores a parameter which starts at zero)"
                    if step
                    else ""
                )
                return (
                    f"{where}: the {gradient} differs from the reference's by {_max_delta(got, want):.3g}, "
                    f"beyond rounding ({close:.2g}){later}"
                )
    return None


def compare_training(
    run: Run, reference: Run, what: str, tolerance: Tolerance, gradient: str = "averaged gradient"
) -> None:
    """Losses of every rank and step, the averaged gradient each rank gives Adam, and the fp32 master
    weights must be the reference's up to rounding (`Tolerance`): any correct formulation passes. `gradient`
    is what the messages call the gradient given to Adam (the "clipped gradient" where the stage clips)."""
    loss = _first_loss_difference(run, reference, tolerance)
    master = _first_master_difference(run, reference, tolerance)
    diagnosis = None if loss and loss[0] == 0 else _diagnose_gradients(run, reference, tolerance, gradient)
    if loss is None and master is None and diagnosis is None:
        return
    lines = [
        f"{what}: training differs from the reference beyond rounding (what a correct implementation may differ "
        f"by, measured against the fp32 single-device oracle: losses {tolerance.loss:.2g}, master weights "
        f"{tolerance.master:.2g})."
    ]
    lines += [f"  {text}" for text in (loss and loss[1], master) if text]
    if loss and loss[0] == 0:
        lines.append("  diagnosis: the loss differs at step 0, before any update: the forward pass differs")
    elif diagnosis:
        lines.append(f"  diagnosis: {diagnosis}")
    else:
        lines.append(
            "  diagnosis: every gradient given to Adam was right: look at how the updated values get back "
            "into the parameters"
        )
    raise CheckFailed("\n".join(lines))


MAX_PIECES = 8
"""`misplaced_elements` explains a gradient made of at most this many runs of the reference's elements."""
MAX_STARTS = 64
"""Where a run may start: the first this many places that hold the value (padding zeros repeat)."""


@dataclass(frozen=True)
class Misplaced:
    """A rank's gradient of a layer whose values are the reference's, taken from other places: `pieces` are
    (layer, start, end) of the reference's padded flat gradients, in the order the rank's gradient holds them."""

    step: int
    layer: str
    rank: int
    pieces: tuple[tuple[str, int, int], ...]

    def describe(self) -> str:
        listed = ", ".join(f"elements [{start:,}, {end:,}) of {layer}" for layer, start, end in self.pieces[:3])
        more = f" and {len(self.pieces) - 3} more run(s)" if len(self.pieces) > 3 else ""
        return (
            f"at step {self.step}, what rank {self.rank} gave Adam for {self.layer} is the reference's averaged "
            f"gradient {listed}{more}: values that belong elsewhere"
        )


def misplaced_elements(run: Run, reference: Run, tolerance: Tolerance, step: int = 0) -> Misplaced | None:
    """The first (layer, rank) of `step` whose gradient given to Adam is beyond the tolerance, if it is made of
    a few runs of the reference's gradient elements (any layer's, its padding as zeros) taken from elsewhere:
    a layout that puts elements where the reference does not. None if that gradient is anything else."""
    close = max(tolerance.grad.values())
    pool, owners = [], []
    for layer, partition in reference.partitions.items():
        full = reference.averaged_gradient(layer, step)
        if full is None:
            return None
        pool.append(torch.cat([full, full.new_zeros(partition.padded_numel - full.numel())]))
        owners.append((layer, partition.padded_numel))
    flat = torch.cat(pool).double()
    for layer, partition in run.partitions.items():
        want = reference.averaged_gradient(layer, step)
        for rank, record in enumerate(run.ranks):
            start, end = partition.owned_range(rank)
            got = record.adam_grads.get((layer, step))
            if end == start or got is None or want is None or got.numel() != end - start:
                continue
            if _max_delta(got, want[start:end]) <= tolerance.grad[layer]:
                continue
            pieces = _runs_of(got.double(), flat, close)
            if pieces is None:
                return None
            return Misplaced(step, layer, rank, tuple(p for piece in pieces for p in _located(piece, owners)))
    return None


def _runs_of(got: torch.Tensor, pool: torch.Tensor, close: float) -> list[tuple[int, int]] | None:
    """`got` as consecutive runs [start, end) of `pool` (each value within `close`), longest first at each
    place; None if some value is nowhere in `pool` or it takes more than `MAX_PIECES` runs."""
    pieces: list[tuple[int, int]] = []
    i = 0
    while i < got.numel():
        starts = torch.nonzero((pool - got[i]).abs() <= close).flatten()[:MAX_STARTS].tolist()
        best = (0, 0)
        for start in starts:
            length = min(got.numel() - i, pool.numel() - start)
            off = (pool[start : start + length] - got[i : i + length]).abs() > close
            matched = int(torch.nonzero(off).flatten()[0]) if bool(off.any()) else length
            best = max(best, (matched, start))
        if best[0] == 0 or len(pieces) == MAX_PIECES:
            return None
        pieces.append((best[1], best[1] + best[0]))
        i += best[0]
    return pieces


def _located(piece: tuple[int, int], owners: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """A run [start, end) of the pool as (layer, start, end) of each layer it covers, in order."""
    start, end = piece
    located = []
    for layer, numel in owners:
        if start < numel and end > 0:
            located.append((layer, max(start, 0), min(end, numel)))
        start, end = start - numel, end - numel
    return located


def bit_identical(run: Run, reference: Run) -> bool:
    """Whether the run reproduced the reference exactly (the lessons' demonstration, not a requirement)."""
    got, want = run.master_weights(), reference.master_weights()
    return all(
        a.losses == b.losses for a, b in zip(run.ranks, reference.ranks, strict=True)
    ) and all(torch.equal(got[layer], want[layer]) for layer in want if layer in got)


def check_no_stray_gradients(run: Run, what: str) -> None:
    """ZeRO-2/3: backward returns None for the parameters, so autograd never stores a full `.grad`."""
    for rank, record in enumerate(run.ranks):
        if record.stray_grads:
            layers = sorted(record.stray_grads)
            raise CheckFailed(
                f"{what}: on rank {rank}, autograd stored a full-size .grad for layer(s) {layers[:MAX_LISTED]}: "
                "backward returned a gradient for the parameters. After reduce-scattering it, return None "
                "for them: under ZeRO-2/3 no rank keeps a full gradient."
            )


def registrations(run: Run, rank: int, category: str, step: int) -> list[int]:
    """Sizes (bytes, padding excluded) of the buffers registered under `category` during `step`."""
    return sorted(
        nbytes
        for registered, registered_step, nbytes in run.memory[rank].registrations
        if registered == category and registered_step == step
    )


def compare_peaks(run: Run, reference: Run, category: str, what: str, advice: str) -> None:
    for rank in range(run.world_size):
        got, want = run.memory[rank].peak_bytes(category), reference.memory[rank].peak_bytes(category)
        if got > want:
            raise CheckFailed(
                f"{what}: rank {rank}'s peak of {category} is {got:,} bytes, the reference's {want:,}. {advice}"
            )


def compare_registrations(run: Run, reference: Run, category: str, what: str, advice: str) -> None:
    """The buffers registered under `category` (count and sizes) must be the reference's, step by step."""
    for step in range(run.steps):
        for rank in range(run.world_size):
            got = registrations(run, rank, category, step)
            want = registrations(reference, rank, category, step)
            if got == want:
                continue
            sizes = ""
            if len(got) == len(want):
                sizes = " The sizes differ: is padding registered as padding (padding_elements=...)?"
            raise CheckFailed(
                f"{what}: at step {step}, rank {rank} registered {len(got)} buffer(s) as {category} "
                f"({sum(got):,} bytes); the reference registers {len(want)} ({sum(want):,} bytes).{sizes} {advice}"
            )


SCALAR_BYTES = 8
"""A storage this small (one number) left alive after a phase is not held against a submission."""


def describe_size(nbytes: int) -> str:
    """What a buffer of `nbytes` could be: the graded model's parameters whose size it has, in 2 or 4 bytes."""
    matches = []
    for element_bytes, dtype in ((2, "bf16"), (4, "fp32")):
        for layer, shapes in layer_shapes().items():
            sizes = {name: shape.numel() for name, shape in shapes.items()}
            sizes["weight and bias"] = sum(sizes.values())
            matches += [f"{layer}'s {name} in {dtype}" for name, n in sizes.items() if n * element_bytes == nbytes]
    if not matches:
        return ""
    more = f" (or {len(matches) - 1} other layer(s) of that size)" if len(matches) > 1 else ""
    return f", the size of {matches[0]}{more}"


def _held_after(run: Run, category: str) -> tuple[int, Leftover] | None:
    """(rank, largest storage) of `category`, larger than a scalar, at the first end of a training step's
    phase (forward, backward, gradient sync, optimizer) where a rank held any, ranks in order."""
    for rank, rank_memory in enumerate(run.memory):
        ends: dict[tuple[int, str], list[Leftover]] = {}
        for leftover in rank_memory.leftovers:
            if leftover.category == category and leftover.phase != "setup" and leftover.nbytes > SCALAR_BYTES:
                ends.setdefault((leftover.step, leftover.phase), []).append(leftover)
        if ends:
            return rank, max(next(iter(ends.values())), key=lambda leftover: leftover.nbytes)
    return None


def _after(leftover: Leftover) -> str:
    kind = "pass" if leftover.phase in ("forward", "backward") else "phase"
    return f"after the {leftover.phase} {kind} of step {leftover.step}"


def check_released(run: Run, category: str, what: str, advice: str) -> None:
    """Nothing of `category` alive between phases, whoever keeps it alive: the memory audit counts a buffer
    until it is freed, not until the code says it is done."""
    found = _held_after(run, category)
    if found is not None:
        rank, leftover = found
        name = f" ({leftover.label})" if leftover.label else describe_size(leftover.nbytes)
        raise CheckFailed(
            f"{what}: {_after(leftover)}, rank {rank} still held {leftover.nbytes:,} bytes of {category}{name}. "
            f"{advice}"
        )


def check_nothing_left_behind(run: Run, what: str) -> None:
    """No buffer the code made outlives the pass that made it unless the stage names it (a parameter, a
    gradient shard, an activation saved for backward): wherever it is kept (ctx, a list, a closure, a
    global, another view of its storage), the audit sees that its storage is still alive."""
    found = _held_after(run, UNTRACKED)
    if found is not None:
        rank, leftover = found
        raise CheckFailed(
            f"{what}: {_after(leftover)}, rank {rank} still held a buffer of {leftover.nbytes:,} bytes that no "
            f"memory category names (made by {leftover.label}{describe_size(leftover.nbytes)}). Something keeps a "
            "reference to it (an attribute of ctx or shard, a list, a global, a view): under ZeRO no full-size "
            "gradient or parameter outlives its layer."
        )


def _key(entry: Collective) -> tuple[str, str, int]:
    return entry.op, entry.dtype, entry.elements


def _describe(keys: Counter, entries: list[Collective]) -> str:
    """'2x all_gather of 64 bfloat16 elements (tags ...)', largest first."""
    parts = []
    for op, dtype, elements in sorted(keys, key=lambda k: -k[2]):
        tags = sorted({e.tag for e in entries if _key(e) == (op, dtype, elements)})
        count = keys[(op, dtype, elements)]
        parts.append(f"{count}x {op} of {elements:,} {dtype} elements (tags: {', '.join(tags[:3])})")
    more = f"; and {len(parts) - MAX_LISTED} more sizes" if len(parts) > MAX_LISTED else ""
    return "; ".join(parts[:MAX_LISTED]) + more


REFERENCE_CODE_DIRS = tuple(str(Path(module.__file__).parent) + os.sep for module in (zero_core, autograder))


def check_own_collectives(run: Run, allowed_tags: set[str], exercise: str) -> None:
    """Every collective the course's own code issued in the student's run carries one of `allowed_tags`:
    those of the layers the student does not write (and the loss scaler's flag). A student layer's
    collective issued there means the submission called the reference's (its shard's collectives,
    however reached) instead of writing its own: 0 points for the exercise."""
    found = [
        f"rank {rank}, step {c.step}: the {c.op} tagged {c.tag!r} was issued by the course's "
        f"{c.issuer.removeprefix(str(ROOT) + os.sep)}, not by your code"
        for rank, entries in enumerate(run.collectives)
        for c in entries
        if c.issuer.startswith(REFERENCE_CODE_DIRS) and c.tag not in allowed_tags
    ]
    if found:
        raise CheckFailed(verdict(found[:MAX_LISTED], exercise))


def compare_collectives(run: Run, reference: Run, what: str) -> None:
    """The same collectives (op, dtype, size) as the reference, step by step, so the same bytes on the wire."""
    for step in range(run.steps):
        for rank in range(run.world_size):
            entries = run.entries(rank, step, exclude_tag=OVERFLOW_TAG)
            expected = reference.entries(rank, step, exclude_tag=OVERFLOW_TAG)
            got, want = Counter(map(_key, entries)), Counter(map(_key, expected))
            if got == want:
                continue
            sent = sum(e.bytes_sent for e in entries)
            sent_ref = sum(e.bytes_sent for e in expected)
            ops = ", ".join(f"{count} {op}" for op, count in sorted(Counter(e.op for e in expected).items()))
            lines = [
                f"{what}: rank {rank}'s collectives at step {step} differ from the reference's ({ops}).",
                f"  bytes sent: {sent:,}, the reference's {sent_ref:,}"
                + (f" ({sent / sent_ref:.2f}x)" if sent_ref else ""),
            ]
            if want - got:
                lines.append(f"  missing: {_describe(want - got, expected)}")
            if got - want:
                lines.append(f"  unexpected: {_describe(got - want, entries)}")
            raise CheckFailed("\n".join(lines))


GRAD_BUCKET_ADVICE = (
    "Register each layer's gradient bucket right after packing it: shard.tracker.register(bucket, "
    "memory.GRAD_BUCKET, padding_elements=shard.partition.padding), and release it after the reduce-scatter."
)
ACTIVATIONS_ADVICE = "Save only what the reference saves for backward (the layer's input), not the weights."
GRAD_ADVICE = "A full-size gradient was registered as grad.fp16: only the 1/N shard (shard.grad) may be."
