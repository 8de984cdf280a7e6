"""What a graded training run leaves behind, as plain data that can cross from the child to the parent.

A stage exercise's check trains the reference loop with the student's piece plugged in (`harness.train`)
in the process that runs student code; the verdict is made in a process that never does. Between the
two travels a `Run`: per rank the losses, fp32 master shards and the gradients Adam was given; what the
rank's memory audit saw (peaks, the buffers it named per step, what each phase left alive); and the
collectives its ledger recorded. `run_to_data` writes it as JSON-ready data (float tensors as base64 of
their little-endian bytes: exact, NaN included, a fifth of the size of decimal text) and `run_from_data`
reads it back, refusing anything that is not what `run_to_data` makes for a run of that size: wrong
counts, layers, lengths, categories or types raise `ObservationInvalid`.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from typing import Any

import torch

from autograder.checks import ObservationInvalid
from zero_core import memory
from zero_core.comm import CommLedger
from zero_core.memory import Leftover, MemoryTracker
from zero_core.partition import FlatPartition
from zero_core.schedule import Mark

REGISTERED_CATEGORIES = (memory.GATHER, memory.GRAD_BUCKET)
"""The categories whose registrations, buffer by buffer, the memory checks compare."""
MAX_ITEMS = 100_000
"""More entries than any run of the graded model makes in a list: a guard against a flood of data."""


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


# -- from data, in the parent: nothing but what run_to_data makes --------------------------------------


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise ObservationInvalid(f"the grading process returned malformed data ({what}): no points")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _list(value: Any, what: str, length: int | None = None) -> list:
    _require(isinstance(value, list) and len(value) <= MAX_ITEMS, f"{what} is not a list")
    _require(length is None or len(value) == length, f"{what} has {len(value)} entries, not {length}")
    return value


def decode_floats(value: Any, numel: int, what: str) -> torch.Tensor:
    """The fp32 tensor of `numel` values that `encode_floats` wrote; `ObservationInvalid` for anything else."""
    _require(isinstance(value, str), f"{what} is not encoded values")
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        _require(False, f"{what} is not base64")
    _require(len(raw) == 4 * numel, f"{what} holds {len(raw) // 4} values, not {numel}")
    return torch.frombuffer(bytearray(raw), dtype=torch.float32) if numel else torch.zeros(0)


def _rank_record(data: Any, rank: int, steps: int, partitions: dict[str, FlatPartition]) -> RankRecord:
    what = f"rank {rank}"
    _require(isinstance(data, dict), f"{what} is not a record")
    losses = _list(data.get("losses"), f"{what}'s losses", steps)
    _require(all(_is_number(v) for v in losses), f"{what}'s losses are not numbers")
    record = RankRecord(losses=[float(v) for v in losses])
    master = data.get("master")
    _require(isinstance(master, dict) and set(master) <= set(partitions), f"{what}'s master layers")
    for name, entry in master.items():
        start, end = partitions[name].owned_range(rank)
        _require(isinstance(entry, list) and len(entry) == 2 and entry[0] == start, f"{what}'s {name} shard offset")
        record.master[name] = (start, decode_floats(entry[1], end - start, f"{what}'s {name} master"))
    for entry in _list(data.get("adam_grads"), f"{what}'s Adam gradients"):
        _require(isinstance(entry, list) and len(entry) == 3, f"{what}'s Adam gradient entry")
        layer, step, values = entry
        _require(layer in partitions and _is_int(step) and 0 <= step < steps, f"{what}'s Adam gradient key")
        record.adam_grads[(layer, step)] = decode_floats(values, _numel_of(values), f"{what}'s {layer} gradient")
    stray = _list(data.get("stray_grads"), f"{what}'s stray gradients")
    _require(all(layer in partitions for layer in stray), f"{what}'s stray gradient layers")
    record.stray_grads = set(stray)
    largest = data.get("largest_fp32")
    _require(isinstance(largest, dict) and set(largest) <= set(partitions), f"{what}'s largest fp32 tensors")
    for layer, entry in largest.items():
        _require(
            isinstance(entry, list) and len(entry) == 2 and _is_int(entry[0]) and isinstance(entry[1], str),
            f"{what}'s largest fp32 tensor of {layer}",
        )
        record.largest_fp32[layer] = (entry[0], entry[1])
    for entry in _list(data.get("schedule"), f"{what}'s schedule"):
        _require(
            isinstance(entry, list)
            and len(entry) == 4
            and _is_number(entry[0])
            and isinstance(entry[1], str)
            and entry[2] in partitions
            and _is_int(entry[3]),
            f"{what}'s schedule mark",
        )
        record.schedule.append((float(entry[0]), entry[1], entry[2], entry[3]))
    return record


def _numel_of(encoded: Any) -> int:
    """Elements of an encoded fp32 tensor whose length the record does not fix (a gradient Adam was given)."""
    _require(isinstance(encoded, str) and len(encoded) % 4 == 0, "an encoded gradient")
    return (len(encoded) // 4 * 3 - encoded.count("=")) // 4


def _rank_memory(data: Any, rank: int, steps: int) -> RankMemory:
    what = f"rank {rank}'s memory"
    _require(isinstance(data, dict), what)
    peaks = data.get("peaks")
    _require(
        isinstance(peaks, dict) and set(peaks) == set(memory.CATEGORIES) and all(_is_int(v) for v in peaks.values()),
        f"{what} peaks",
    )
    registrations = []
    for entry in _list(data.get("registrations"), f"{what} registrations"):
        _require(
            isinstance(entry, list)
            and len(entry) == 3
            and entry[0] in REGISTERED_CATEGORIES
            and _is_int(entry[1])
            and 0 <= entry[1] < steps
            and _is_int(entry[2]),
            f"{what} registration",
        )
        registrations.append((entry[0], entry[1], entry[2]))
    leftovers = []
    for entry in _list(data.get("leftovers"), f"{what} leftovers"):
        _require(
            isinstance(entry, list)
            and len(entry) == 5
            and _is_int(entry[0])
            and isinstance(entry[1], str)
            and entry[2] in memory.LEFTOVER_CATEGORIES
            and isinstance(entry[3], str)
            and _is_int(entry[4]),
            f"{what} leftover",
        )
        leftovers.append(Leftover(*entry))
    return RankMemory(peaks, registrations, leftovers)


def _collectives(data: Any, rank: int, steps: int) -> list[Collective]:
    entries = []
    for entry in _list(data, f"rank {rank}'s collectives"):
        _require(
            isinstance(entry, list)
            and len(entry) == 9
            and isinstance(entry[0], str)
            and isinstance(entry[1], str)
            and _is_int(entry[2])
            and isinstance(entry[3], str)
            and _is_int(entry[4])
            and 0 <= entry[4] < steps
            and _is_int(entry[5])
            and isinstance(entry[6], str)
            and _is_number(entry[7])
            and _is_number(entry[8]),
            f"rank {rank}'s collective",
        )
        entries.append(Collective(*entry[:7], float(entry[7]), float(entry[8])))
    return entries


def run_from_data(data: Any, world_size: int, steps: int, partitions: dict[str, FlatPartition]) -> Run:
    """The `Run` that `run_to_data` wrote for `world_size` ranks and `steps` steps; `ObservationInvalid` if
    the data is anything else. The sizes and layers come from the caller, never from the data."""
    _require(isinstance(data, dict), "not a run")
    _require(data.get("world_size") == world_size and data.get("steps") == steps, "the run's size")
    ranks = _list(data.get("ranks"), "ranks", world_size)
    rank_memory = _list(data.get("memory"), "memory", world_size)
    collectives = _list(data.get("collectives"), "collectives", world_size)
    return Run(
        world_size,
        steps,
        [_rank_record(r, rank, steps, partitions) for rank, r in enumerate(ranks)],
        [_rank_memory(m, rank, steps) for rank, m in enumerate(rank_memory)],
        [_collectives(c, rank, steps) for rank, c in enumerate(collectives)],
        partitions,
    )
