"""What a graded training run leaves behind, as plain data that can cross from the child to the parent.

A stage exercise's check trains the reference loop with the student's piece plugged in (`harness.train`)
in the process that runs student code; the verdict is made in a process that never does. Between the
two travels a `Run`: per rank the losses, fp32 master shards and the gradients Adam was given; what the
rank's memory audit saw (peaks, the buffers it named per step, what each phase left alive); and the
collectives its ledger recorded. `run_to_data` writes it as JSON-ready data (float tensors as base64 of
their little-endian bytes: exact, NaN included, a fifth of the size of decimal text) and `run_from_data`
reads it back, refusing anything that is not what `run_to_data` makes for a run of that size (wrong
counts, layers, lengths, categories or types) and anything no run can make (a negative or an impossibly
large byte count, a time that is not a finite number, marks that go back in time): `ObservationInvalid`,
"the observation cannot be true". `require_course_records` holds a run to what the course's own code
records in every run, as the reference run shows it.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Any

import torch

from autograder.plain_data import (
    ADDRESS_SPACE_BYTES,
    count,
    is_int,
    is_number,
    listed,
    require,
    seconds,
    well_formed,
)
from zero_core import comm, memory, schedule
from zero_core.comm import CommLedger
from zero_core.memory import Leftover, MemoryTracker
from zero_core.partition import FlatPartition
from zero_core.schedule import Mark

REGISTERED_CATEGORIES = (memory.GATHER, memory.GRAD_BUCKET)
"""The categories whose registrations, buffer by buffer, the memory checks compare."""


@dataclass
class RankRecord:
    """What one rank did in a run."""

    losses: list[float] = field(default_factory=list)
    master: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    adam_grads: dict[tuple[str, int], torch.Tensor] = field(default_factory=dict)
    stray_grads: set[str] = field(default_factory=set)
    largest_fp32: dict[str, tuple[int, str]] = field(default_factory=dict)
    schedule: list[Mark] = field(default_factory=list)
    """The moments the stage marked (`zero_core.schedule`), on the clock of the collectives' times."""


@dataclass
class RankMemory:
    """What one rank's memory audit saw: peaks by category, the named buffers, the leftovers of phases."""

    peaks: dict[str, int]
    registrations: list[tuple[str, int, int]]
    """(category, step, bytes) of each buffer named `gather.fp16` or `grad.bucket`, in order."""
    leftovers: list[Leftover]

    @classmethod
    def of(cls, tracker: MemoryTracker) -> RankMemory:
        registrations = [
            (e.category, e.step, e.delta_bytes)
            for e in tracker.timeline
            if e.category in REGISTERED_CATEGORIES and e.delta_bytes > 0
        ]
        return cls(tracker.peak_by_category(), registrations, list(tracker.leftovers))

    def peak_bytes(self, category: str) -> int:
        return self.peaks[category]


@dataclass(frozen=True)
class Collective:
    """One collective of a rank's ledger, as the communication checks compare it."""

    op: str
    dtype: str
    elements: int
    tag: str
    step: int
    bytes_sent: int
    issuer: str
    """"file:function" of the code that called it (`zero_core.dist.RECORD_ISSUERS`)."""
    started_s: float = 0.0
    """When the rank entered it (`time.perf_counter()`, the clock of `RankRecord.schedule`)."""
    wait_started_s: float = 0.0
    """For an `async_op` collective, when the rank began waiting for it; 0.0 for a blocking one."""


@dataclass
class Run:
    """A finished run: per-rank records, memory observations and collectives."""

    world_size: int
    steps: int
    ranks: list[RankRecord]
    memory: list[RankMemory]
    collectives: list[list[Collective]]
    partitions: dict[str, FlatPartition]
    witness_run: int = -1
    """In the grading child, the number of this run in the witness's record (`autograder.witness`)."""

    @classmethod
    def of(
        cls,
        world_size: int,
        steps: int,
        ranks: list[RankRecord],
        trackers: list[MemoryTracker],
        ledger: CommLedger,
        partitions: dict[str, FlatPartition],
    ) -> Run:
        collectives = [
            [
                Collective(
                    e.op, e.dtype, e.elements, e.tag, e.step, e.bytes_sent, e.issuer, e.started_s, e.wait_started_s
                )
                for e in ledger.entries(rank)
            ]
            for rank in range(world_size)
        ]
        return cls(world_size, steps, ranks, [RankMemory.of(t) for t in trackers], collectives, partitions)

    def entries(self, rank: int, step: int, exclude_tag: str) -> list[Collective]:
        return [c for c in self.collectives[rank] if c.step == step and c.tag != exclude_tag]

    def master_weights(self) -> dict[str, torch.Tensor]:
        pieces: dict[str, dict[int, torch.Tensor]] = {}
        for record in self.ranks:
            for name, (start, values) in record.master.items():
                if values.numel():
                    pieces.setdefault(name, {})[start] = values
        return {name: torch.cat([by_start[s] for s in sorted(by_start)]) for name, by_start in pieces.items()}

    def averaged_gradient(self, layer: str, step: int) -> torch.Tensor | None:
        """The layer's full averaged gradient at `step`, stitched from what the ranks gave Adam."""
        pieces = []
        for rank, record in enumerate(self.ranks):
            start, end = self.partitions[layer].owned_range(rank)
            grad = record.adam_grads.get((layer, step))
            if end > start:
                if grad is None:
                    return None
                pieces.append(grad)
        return torch.cat(pieces)


# -- to data, in the child ---------------------------------------------------------------------------


def encode_floats(tensor: torch.Tensor) -> str:
    """A float tensor as base64 of its values in fp32, little-endian: exact for bf16, fp16 and fp32."""
    return base64.b64encode(tensor.detach().to(torch.float32).contiguous().numpy().tobytes()).decode("ascii")


def run_to_data(run: Run) -> dict[str, Any]:
    witnessed = {"witness_run": run.witness_run} if run.witness_run >= 0 else {}
    return {
        **witnessed,
        "world_size": run.world_size,
        "steps": run.steps,
        "ranks": [
            {
                "losses": list(record.losses),
                "master": {name: [start, encode_floats(values)] for name, (start, values) in record.master.items()},
                "adam_grads": [[layer, step, encode_floats(grad)] for (layer, step), grad in record.adam_grads.items()],
                "stray_grads": sorted(record.stray_grads),
                "largest_fp32": {layer: [numel, where] for layer, (numel, where) in record.largest_fp32.items()},
                "schedule": [list(m) for m in record.schedule],
            }
            for record in run.ranks
        ],
        "memory": [
            {
                "peaks": dict(rank_memory.peaks),
                "registrations": [list(r) for r in rank_memory.registrations],
                "leftovers": [list(leftover) for leftover in rank_memory.leftovers],
            }
            for rank_memory in run.memory
        ],
        "collectives": [
            [
                [c.op, c.dtype, c.elements, c.tag, c.step, c.bytes_sent, c.issuer, c.started_s, c.wait_started_s]
                for c in entries
            ]
            for entries in run.collectives
        ],
    }


# -- from data, in the parent: nothing but what run_to_data makes, nothing a run cannot make -------------

COURSE_REGISTERED = (*memory.MODEL_STATES, memory.ACTIVATIONS)
"""What the stage registers itself, before or around the student's code: the model states, and the loss."""
MARKED_EVENTS = (schedule.GRADIENTS_READY, schedule.NEEDS_PARAMETERS)


def element_size(dtype: Any, what: str) -> int:
    """Bytes per element of a dtype as the ledger names it ("bfloat16")."""
    value = getattr(torch, dtype, None) if isinstance(dtype, str) and dtype.isidentifier() else None
    well_formed(isinstance(value, torch.dtype), f"{what}'s dtype {dtype!r:.40} is no torch dtype")
    return value.itemsize


def decode_floats(value: Any, numel: int, what: str) -> torch.Tensor:
    """The fp32 tensor of `numel` values that `encode_floats` wrote; `ObservationInvalid` for anything else."""
    well_formed(isinstance(value, str), f"{what} is not encoded values")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        well_formed(False, f"{what} is not base64")
    well_formed(len(raw) == 4 * numel, f"{what} holds {len(raw) // 4} values, not {numel}")
    return torch.frombuffer(bytearray(raw), dtype=torch.float32) if numel else torch.zeros(0)


def _rank_record(data: Any, rank: int, steps: int, partitions: dict[str, FlatPartition]) -> RankRecord:
    what = f"rank {rank}"
    well_formed(isinstance(data, dict), f"{what} is not a record")
    losses = listed(data.get("losses"), f"{what}'s losses", steps)
    well_formed(all(is_number(v) for v in losses), f"{what}'s losses are not numbers")
    record = RankRecord(losses=[float(v) for v in losses])
    master = data.get("master")
    well_formed(isinstance(master, dict) and set(master) <= set(partitions), f"{what}'s master layers")
    for name, entry in master.items():
        start, end = partitions[name].owned_range(rank)
        well_formed(isinstance(entry, list) and len(entry) == 2 and entry[0] == start, f"{what}'s {name} shard offset")
        record.master[name] = (start, decode_floats(entry[1], end - start, f"{what}'s {name} master"))
    for entry in listed(data.get("adam_grads"), f"{what}'s Adam gradients"):
        well_formed(isinstance(entry, list) and len(entry) == 3, f"{what}'s Adam gradient entry")
        layer, step, values = entry
        well_formed(layer in partitions and is_int(step) and 0 <= step < steps, f"{what}'s Adam gradient key")
        require((layer, step) not in record.adam_grads, f"{what} gave Adam two gradients of {layer} at step {step}")
        numel = _numel_of(values)
        require(
            numel <= partitions[layer].padded_numel,
            f"{what} gave Adam a gradient of {numel:,} elements for {layer}, more than the whole layer's "
            f"{partitions[layer].padded_numel:,}",
        )
        record.adam_grads[(layer, step)] = decode_floats(values, numel, f"{what}'s {layer} gradient")
    stray = listed(data.get("stray_grads"), f"{what}'s stray gradients")
    well_formed(all(layer in partitions for layer in stray) and stray == sorted(set(stray)), f"{what}'s stray layers")
    record.stray_grads = set(stray)
    largest = data.get("largest_fp32")
    well_formed(isinstance(largest, dict) and set(largest) <= set(partitions), f"{what}'s largest fp32 tensors")
    for layer, entry in largest.items():
        well_formed(isinstance(entry, list) and len(entry) == 2 and isinstance(entry[1], str), f"{what}'s fp32 {layer}")
        numel = count(entry[0], f"{what}'s largest fp32 tensor of {layer} (elements)", high=ADDRESS_SPACE_BYTES // 4)
        record.largest_fp32[layer] = (numel, entry[1])
    for entry in listed(data.get("schedule"), f"{what}'s schedule"):
        well_formed(
            isinstance(entry, list) and len(entry) == 4 and entry[1] in MARKED_EVENTS and entry[2] in partitions,
            f"{what}'s schedule mark",
        )
        at = seconds(entry[0], f"{what}'s schedule mark")
        require(not record.schedule or at >= record.schedule[-1][0], f"{what}'s schedule marks go back in time")
        record.schedule.append((at, entry[1], entry[2], count(entry[3], f"{what}'s unnamed bytes at a mark")))
    return record


def _numel_of(encoded: Any) -> int:
    """Elements of an encoded fp32 tensor whose length the record does not fix (a gradient Adam was given)."""
    well_formed(isinstance(encoded, str) and len(encoded) % 4 == 0, "an encoded gradient")
    return (len(encoded) // 4 * 3 - encoded.count("=")) // 4


def _rank_memory(data: Any, rank: int, steps: int) -> RankMemory:
    what = f"rank {rank}'s"
    well_formed(isinstance(data, dict), f"{what} memory")
    peaks = data.get("peaks")
    well_formed(isinstance(peaks, dict) and set(peaks) == set(memory.CATEGORIES), f"{what} peaks by category")
    peaks = {category: count(value, f"{what} peak of {category} (bytes)") for category, value in peaks.items()}
    registrations = []
    for entry in listed(data.get("registrations"), f"{what} registrations"):
        well_formed(
            isinstance(entry, list) and len(entry) == 3 and entry[0] in REGISTERED_CATEGORIES,
            f"{what} registration",
        )
        step = count(entry[1], f"{what} step of a registration", high=steps - 1)
        registrations.append((entry[0], step, count(entry[2], f"{what} registered {entry[0]} (bytes)", low=1)))
    leftovers = []
    for entry in listed(data.get("leftovers"), f"{what} leftovers"):
        well_formed(
            isinstance(entry, list)
            and len(entry) == 5
            and isinstance(entry[1], str)
            and entry[2] in memory.LEFTOVER_CATEGORIES
            and isinstance(entry[3], str),
            f"{what} leftover",
        )
        step = count(entry[0], f"{what} step of a leftover", high=steps - 1)
        nbytes = count(entry[4], f"{what} leftover of {entry[2]} (bytes)", low=1)
        leftovers.append(Leftover(step, entry[1], entry[2], entry[3], nbytes))
    return RankMemory(peaks, registrations, leftovers)


def _collective(entry: Any, what: str, steps: int) -> Collective:
    well_formed(
        isinstance(entry, list)
        and len(entry) == 9
        and entry[0] in (*comm.OPS, *comm.PCIE_OPS)
        and all(isinstance(entry[i], str) for i in (3, 6)),
        what,
    )
    op, dtype, _, tag, _, _, issuer, _, _ = entry
    size = element_size(dtype, what)
    elements = count(entry[2], f"{what}'s elements")
    step = count(entry[4], f"{what}'s step", high=steps - 1)
    most = 0 if op in (comm.BARRIER, *comm.PCIE_OPS) else 2 * elements * size
    bytes_sent = count(entry[5], f"{what}'s bytes sent ({op} of {elements:,} {dtype} elements)", high=most)
    started = seconds(entry[7], f"{what}'s start")
    waited = seconds(entry[8], f"{what}'s wait")
    require(waited == 0 or waited >= started, f"{what} was waited for before it started")
    return Collective(op, dtype, elements, tag, step, bytes_sent, issuer, started, waited)


def _collectives(data: Any, rank: int, steps: int) -> list[Collective]:
    entries: list[Collective] = []
    for entry in listed(data, f"rank {rank}'s collectives"):
        entries.append(_collective(entry, f"rank {rank}'s collective {len(entries)}", steps))
        require(
            len(entries) == 1 or entries[-1].started_s >= entries[-2].started_s,
            f"rank {rank}'s collectives are not in the order it started them",
        )
    return entries


def run_from_data(data: Any, world_size: int, steps: int, partitions: dict[str, FlatPartition]) -> Run:
    """The `Run` that `run_to_data` wrote for `world_size` ranks and `steps` steps; `ObservationInvalid` if
    the data is anything else, or anything no run makes. The sizes and layers come from the caller, never
    from the data."""
    well_formed(isinstance(data, dict), "not a run")
    require(
        data.get("world_size") == world_size and data.get("steps") == steps,
        f"a run of {data.get('world_size')!r:.20} ranks and {data.get('steps')!r:.20} steps, where the check "
        f"asked for {world_size} and {steps}",
    )
    ranks = listed(data.get("ranks"), "ranks", world_size)
    rank_memory = listed(data.get("memory"), "memory", world_size)
    collectives = listed(data.get("collectives"), "collectives", world_size)
    return Run(
        world_size,
        steps,
        [_rank_record(r, rank, steps, partitions) for rank, r in enumerate(ranks)],
        [_rank_memory(m, rank, steps) for rank, m in enumerate(rank_memory)],
        [_collectives(c, rank, steps) for rank, c in enumerate(collectives)],
        partitions,
    )


def require_course_records(run: Run, reference: Run) -> None:
    """What the course's own code records in every run, whatever the student's piece does, is there as in
    the reference run: a peak above zero for each category the stage registers itself (the model states,
    the loss) where the reference has one, and the moments the stage marks, the same events of the same
    layers in the same order. A run without them was not made by the course's stage."""
    for rank in range(run.world_size):
        for category in COURSE_REGISTERED:
            want, got = reference.memory[rank].peaks[category], run.memory[rank].peaks[category]
            require(
                got > 0 or want == 0,
                f"rank {rank}'s peak of {category} is {got:,} bytes, yet the stage itself registers {want:,}",
            )
        marks, expected = ([m[1:3] for m in r.ranks[rank].schedule] for r in (run, reference))
        require(
            marks == expected,
            f"rank {rank}'s schedule has {len(marks)} marks, not the {len(expected)} the stage makes in this order",
        )
