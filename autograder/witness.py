"""The witness of a graded run's collectives: a thread of the grading parent, out of the student's reach.

The grading child's graded runs use `zero_core.backends.witnessed.WitnessedBackend`, which sends every
collective through a socket to this thread: each rank's arrival, the moment it waits on an `async_op`
collective, and the group's inputs, which the witness combines and sends back (so the run's data went
through here). The witness files, per run and per rank, what it saw: the op, dtype, elements and group of
each collective in the rank's order, with when it arrived and when it was waited on, read on the parent's
clock (`time.perf_counter()`, the machine's monotonic clock, which the child's marks use too).

`verify_runs` then holds every run the child reports against that record: the same collectives, in the
same order, with the same sizes, and the same schedule marks (which the stage sends in the same stream, so
the witness orders them with the collectives exactly as the rank made them), or the observation earns
nothing; the times the judge reads are the witness's. What stays the child's word: each collective's tag
and step and the code that issued it (labels the judge uses to group collectives, not to count them), and
the unnamed bytes a mark carries.

The sized run whose memory the kernel counts (`autograder.kernel_memory`) only announces when it begins:
its collectives stay in the child, and the parent gives it the child's peak resident memory from then on
(`Witness.measure`).

Nothing the child sends is unpickled or executed: frames are JSON headers and raw tensor bytes, within caps.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from autograder.checks import ObservationInvalid
from zero_core.backends.base import ReduceOp, reduce_in_rank_order
from zero_core.backends.virtual import concatenate_in_rank_order, exchange_chunks
from zero_core.backends.witnessed import read_frame, tensor_from, write_frame
from zero_core.comm import PCIE_OPS, ring_bytes

MAX_HEADER_BYTES = 1 << 16
MAX_MESSAGE_BYTES = 1 << 30
MAX_RUNS = 1000
MAX_ENTRIES = 200_000
"""Caps on what one child may make the witness hold."""
RUN_KEYS = {"world_size", "steps", "ranks", "memory", "collectives"}
"""The keys of a run in an observation (`records.run_to_data`)."""
WITNESS_KEY = "witness_run"
"""The key under which a graded run's data names its run in the witness's record."""
SIZED_RUN_KEYS = {WITNESS_KEY, "world_size", "audit_bytes"}
"""A sized run's summary (`autograder.kernel_memory`): its number here, its ranks, the audit's figures."""
UNMEASURED_KEY = "unmeasured"
"""What a sized run's entry holds where no witness measured it (a check called in a notebook's kernel)."""


@dataclass
class Witnessed:
    """One collective as the witness saw one rank take part in it."""

    op: str
    dtype: str
    elements: int
    group: tuple[int, ...]
    blocking: bool
    started_s: float
    wait_started_s: float = 0.0
    carried: bool = False


@dataclass
class WitnessedRun:
    world_size: int
    ranks: list[list[Witnessed]]
    marks: list[list[tuple[float, str, str]]]
    """Per rank, the stage's schedule marks as the witness received them: (time, event, layer)."""
    began_s: float = 0.0
    """When the child said the run begins, before its ranks build anything."""
    collectives: bool = True
    """False for the sized run whose memory the kernel counts: its collectives do not come here."""
    kernel_peak_bytes: int = 0
    """The child's largest resident memory from `began_s` to its end, as the kernel counted it
    (`Witness.measure`): the run's own memory, and whatever the child held then."""
    pending: dict[tuple[int, tuple[int, ...]], list[Witnessed]] = field(default_factory=dict)


class Witness(threading.Thread):
    """Serves one grading child over `sock` until it closes the link; `runs` is what it witnessed, and
    `problem` the first thing it refused (after which it stops answering)."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(daemon=True, name="grading-witness")
        self.sock = sock
        self.runs: list[WitnessedRun] = []
        self.problem: str | None = None
        self._entries = 0

    def run(self) -> None:
        try:
            while True:
                try:
                    header, tensors = read_frame(self.sock, MAX_HEADER_BYTES, MAX_MESSAGE_BYTES)
                except EOFError:
                    return
                received = time.perf_counter()
                reply = self.handle(header, tensors, received)
                if reply is not None:
                    write_frame(self.sock, *reply)
        except (ValueError, TypeError, KeyError, IndexError, RuntimeError, OSError) as error:
            self.problem = self.problem or f"a malformed message ({type(error).__name__}: {error})"
            try:
                write_frame(self.sock, {"error": self.problem})
            except OSError:
                pass
        finally:
            self.sock.close()

    def handle(self, header: dict, tensors: list, received: float) -> tuple[dict, list] | None:
        kind = header.get("kind")
        if kind == "run":
            world_size = header["world_size"]
            if not isinstance(world_size, int) or not 1 <= world_size <= 64 or len(self.runs) >= MAX_RUNS:
                raise ValueError(f"a run of {world_size!r} ranks")
            ranks: list = [[] for _ in range(world_size)]
            collectives = header.get("collectives", True) is not False
            marks: list = [[] for _ in range(world_size)]
            self.runs.append(WitnessedRun(world_size, ranks, marks, began_s=received, collectives=collectives))
            return None
        if not self.runs or not self.runs[-1].collectives:
            raise ValueError("a collective outside a graded run")
        run = self.runs[-1]
        if kind == "arrive":
            return self._arrive(run, header, received)
        if kind == "wait":
            entry = run.ranks[_rank(run, header["rank"])][header["index"]]
            if entry.blocking or entry.wait_started_s or not isinstance(header["index"], int):
                raise ValueError("a wait for a collective that was not an unwaited async_op one")
            entry.wait_started_s = received
            return None
        if kind == "carry":
            return self._carry(run, header, tensors)
        if kind == "mark":
            marks = run.marks[_rank(run, header["rank"])]
            if not isinstance(header["event"], str) or not isinstance(header["layer"], str) or len(marks) > MAX_ENTRIES:
                raise ValueError("a malformed schedule mark")
            marks.append((received, header["event"][:200], header["layer"][:200]))
            return None
        raise ValueError(f"a message of kind {kind!r}")

    def measure(self, peak_since: Callable[[float], int]) -> None:
        """Give every run the child's peak resident memory from its beginning on, once the child is gone:
        `peak_since(moment)` reads the samples the parent took of the kernel's count."""
        for run in self.runs:
            run.kernel_peak_bytes = peak_since(run.began_s)

    def _arrive(self, run: WitnessedRun, header: dict, received: float) -> None:
        rank = _rank(run, header["rank"])
        group = _group(run, header["group"])
        if group and rank not in group:
            raise ValueError(f"rank {rank} in a collective of group {list(group)}")
        numel = header["numel"]
        if not isinstance(numel, int) or numel < 0 or not isinstance(header["op"], str):
            raise ValueError("an arrival without an op or a size")
        self._entries += 1
        if self._entries > MAX_ENTRIES:
            raise ValueError(f"more than {MAX_ENTRIES:,} collectives")
        entry = Witnessed(header["op"], str(header["dtype"]), numel, group, bool(header["blocking"]), received)
        run.ranks[rank].append(entry)
        run.pending.setdefault((rank, group), []).append(entry)
        return None

    def _carry(self, run: WitnessedRun, header: dict, tensors: list) -> tuple[dict, list]:
        group = _group(run, header["group"])
        members = list(group) or list(range(run.world_size))
        entries = []
        for member in members:
            queue = run.pending.get((member, group))
            if not queue:
                raise ValueError(f"a collective that rank {member} never arrived at")
            entries.append(queue.pop(0))
        op = header["op"]
        if any(e.op != op for e in entries):
            raise ValueError(f"{op} carried for ranks that arrived at {[e.op for e in entries]}")
        inputs = [tensor_from(description, data) for description, data in tensors]
        if op != "barrier":
            if len(inputs) != len(members):
                raise ValueError(f"{len(inputs)} inputs for a group of {len(members)}")
            carried = len(members) if op == "all_gather" else 1  # the ledger counts an all-gather's output
            for entry, tensor in zip(entries, inputs, strict=True):
                if entry.elements != tensor.numel() * carried or entry.dtype != str(tensor.dtype).removeprefix(
                    "torch."
                ):
                    raise ValueError("inputs that are not what the ranks arrived with")
        for entry in entries:
            entry.carried = True
        return {"ok": True}, combine(op, header, inputs)


def combine(op: str, how: dict, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """What `VirtualBackend` computes for the collective, from the same functions: bit for bit the same."""
    if op == "barrier":
        return []
    if op in ("all_reduce", "reduce_scatter"):
        return [reduce_in_rank_order(inputs, ReduceOp(how["reduce"]))]
    if op == "all_gather":
        return [concatenate_in_rank_order(inputs, tuple(how["shape"]))]
    if op == "all_to_all":
        return exchange_chunks(inputs, tuple(how["shape"]))
    if op == "broadcast":
        return [inputs[how["src"]].clone()]
    raise ValueError(f"no collective {op!r}")


def _rank(run: WitnessedRun, rank: Any) -> int:
    if not isinstance(rank, int) or not 0 <= rank < run.world_size:
        raise ValueError(f"rank {rank!r} in a run of {run.world_size}")
    return rank


def _group(run: WitnessedRun, group: Any) -> tuple[int, ...]:
    if not isinstance(group, list) or not all(isinstance(r, int) and 0 <= r < run.world_size for r in group):
        raise ValueError(f"group {group!r:.100}")
    return tuple(group)


def start() -> tuple[Witness, int]:
    """A running witness and the file descriptor of the child's end of its link (the caller passes it on)."""
    parent_end, child_end = socket.socketpair()
    witness = Witness(parent_end)
    witness.start()
    return witness, child_end.detach()


# -- in the parent, before judging --------------------------------------------------------------------


def verify_runs(observation: Any, witness: Witness) -> Any:
    """`observation` with every run in it held against the witness's record, and its collectives' times
    replaced by the witness's; `ObservationInvalid` where a run was not witnessed or differs from it."""
    if witness.problem:
        raise ObservationInvalid(f"the graded run's collectives were refused by the witness ({witness.problem})")
    if isinstance(observation, dict):
        if RUN_KEYS <= observation.keys():
            return _verified(observation, witness)
        if SIZED_RUN_KEYS <= observation.keys():
            return _verified_sized(observation, witness)
        if UNMEASURED_KEY in observation:
            raise ObservationInvalid("a graded run that was not measured, where the grader measures it: no points")
        return {key: verify_runs(value, witness) for key, value in observation.items()}
    if isinstance(observation, list):
        return [verify_runs(value, witness) for value in observation]
    return observation


def _verified(run: dict, witness: Witness) -> dict:
    index = run.get(WITNESS_KEY)
    if not isinstance(index, int) or not 0 <= index < len(witness.runs):
        raise ObservationInvalid("a run whose collectives did not go through the course's witness: no points")
    seen = witness.runs[index]
    if not seen.collectives:
        raise ObservationInvalid("a run whose collectives did not go through the course's witness: no points")
    claimed = run["collectives"]
    if run["world_size"] != seen.world_size or not isinstance(claimed, list) or len(claimed) != seen.world_size:
        raise ObservationInvalid(f"a run of {run['world_size']!r} ranks where the witness saw {seen.world_size}")
    verified = []
    for rank, (entries, witnessed) in enumerate(zip(claimed, seen.ranks, strict=True)):
        if not isinstance(entries, list):
            raise ObservationInvalid(f"rank {rank}'s collectives are malformed: no points")
        collectives = [e for e in entries if not _is_copy(e)]
        if len(collectives) != len(witnessed):
            raise ObservationInvalid(
                f"rank {rank} reports {len(collectives)} collectives where the witness carried {len(witnessed)}: "
                "no points"
            )
        checked = iter(_verified_entry(entry, seen_entry, rank, position, seen.world_size)
                       for position, (entry, seen_entry) in enumerate(zip(collectives, witnessed, strict=True)))
        verified.append([entry if _is_copy(entry) else next(checked) for entry in entries])
    return {**run, "collectives": verified, "ranks": _verified_marks(run["ranks"], seen)}


def _verified_sized(run: dict, witness: Witness) -> dict:
    """A sized run's summary with the memory the kernel saw from its beginning on (`Witness.measure`). The
    child announces one sized run (its collectives do not come here); a summary naming any other run,
    whose later beginning would leave part of the sized run out of the count, earns nothing."""
    index = run.get(WITNESS_KEY)
    sized = [number for number, seen in enumerate(witness.runs) if not seen.collectives]
    if sized != [index]:
        raise ObservationInvalid("a sized run the witness did not see begin, or not once: no points")
    seen = witness.runs[index]
    if run["world_size"] != seen.world_size:
        claimed = f"{run['world_size']!r:.20}"
        raise ObservationInvalid(f"a sized run of {claimed} ranks where the witness saw {seen.world_size}")
    return {**run, "kernel_peak_bytes": seen.kernel_peak_bytes}


def _verified_marks(ranks: Any, seen: WitnessedRun) -> list:
    """The ranks' records with their schedule marks' times replaced by the witness's: the same marks, in
    the same order, or `ObservationInvalid`. (The unnamed bytes a mark carries stay the child's word.)"""
    if not isinstance(ranks, list) or len(ranks) != seen.world_size:
        raise ObservationInvalid("a run whose ranks' records are malformed: no points")
    verified = []
    for rank, (record, witnessed) in enumerate(zip(ranks, seen.marks, strict=True)):
        marks = record.get("schedule") if isinstance(record, dict) else None
        if not isinstance(marks, list) or len(marks) != len(witnessed):
            raise ObservationInvalid(
                f"rank {rank} reports {len(marks) if isinstance(marks, list) else 'no'} schedule marks where the "
                f"witness received {len(witnessed)}: no points"
            )
        rows = []
        for mark, (received, event, layer) in zip(marks, witnessed, strict=True):
            if not isinstance(mark, list) or len(mark) != 4 or mark[1:3] != [event, layer]:
                raise ObservationInvalid(f"rank {rank}'s schedule marks differ from the witness's: no points")
            rows.append([received, event, layer, mark[3]])
        verified.append({**record, "schedule": rows})
    return verified


def _is_copy(entry: Any) -> bool:
    """A host-device copy (offload's), which the ledger lists but no backend carries."""
    return isinstance(entry, list) and bool(entry) and entry[0] in PCIE_OPS


def _verified_entry(entry: Any, seen: Witnessed, rank: int, position: int, world_size: int) -> list:
    """The child's entry [op, dtype, elements, tag, step, bytes_sent, issuer, started_s, wait_started_s] with
    op, dtype, elements and ring bytes checked against the witness and its times replaced by the witness's."""
    if not isinstance(entry, list) or len(entry) != 9:
        raise ObservationInvalid(f"rank {rank}'s collective #{position} is malformed: no points")
    op, dtype, elements, tag, step, bytes_sent, issuer = entry[:7]
    element_size = _element_size(seen.dtype)
    size = len(seen.group) or world_size
    index = seen.group.index(rank) if seen.group else rank
    expected = ring_bytes(seen.op, seen.elements * element_size, element_size, size, index, 0)[0] if (
        seen.op != "broadcast") else bytes_sent
    if (op, dtype, elements) != (seen.op, seen.dtype, seen.elements) or (bytes_sent != expected) or not seen.carried:
        raise ObservationInvalid(
            f"rank {rank}'s collective #{position} is reported as {op} of {elements!r} {dtype} elements, but the "
            f"witness carried {seen.op} of {seen.elements} {seen.dtype}: no points"
        )
    return [op, dtype, elements, tag, step, bytes_sent, issuer, seen.started_s, seen.wait_started_s]


def _element_size(dtype: str) -> int:
    from zero_core.backends.witnessed import DTYPES

    return DTYPES[dtype].itemsize if dtype in DTYPES else 1
