"""The counting interconnect: every collective every rank calls, with the bytes it moves on a ring.

ZeRO's claims about communication (ZeRO §7: 2Ψ for data parallelism and ZeRO-1/2, 3Ψ for ZeRO-3) are
claims about the bytes each GPU sends per step. The ledger records them from the collectives that
actually ran, under the ring algorithm NCCL uses for large messages, so a lesson can measure "1.94Ψ at
N = 32" rather than quote "2Ψ".

The ring model itself (which bytes a rank sends and receives for each collective, NCCL's bus-bandwidth
factors) is `zero_core.ring`: pure arithmetic that the planner and `zero_core.topology` read too. This
module re-exports it, so `comm.ring_bytes` and `comm.ALL_REDUCE` still name it.

A collective in a process group (`dist.new_group`) is a ring over the group's ranks alone: N is the
group's size and r the rank's index in the group (its ranks sorted, as torch.distributed numbers them).
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from zero_core.ring import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    BARRIER,
    BROADCAST,
    D2H,
    H2D,
    OPS,
    PCIE_OPS,
    REDUCE_SCATTER,
    ring_bytes,
    ring_messages,
)
from zero_core.topology import LinkTraffic, Topology, link_bytes

if TYPE_CHECKING:
    from collections.abc import Collection

__all__ = [
    "ALL_GATHER",
    "ALL_REDUCE",
    "ALL_TO_ALL",
    "BARRIER",
    "BROADCAST",
    "D2H",
    "H2D",
    "OPS",
    "PCIE_OPS",
    "REDUCE_SCATTER",
    "CommEntry",
    "CommLedger",
    "CommSummary",
    "RankLedger",
    "alpha_beta_seconds",
    "ring_bytes",
    "ring_messages",
    "summarize",
]


class CommEntry(NamedTuple):
    """One collective as one rank saw it.

    A named tuple of plain values: every rank records one per collective, dozens per step, and a tuple
    is the cheapest immutable record to make. `started_s` is `time.perf_counter()` when the rank entered
    the collective (absolute; for timelines and traces). `seconds` is all the time the rank spent in it.
    An `async_op` collective is two intervals: its start, and the wait for it in `Work.wait()`, which
    began at `wait_started_s` and took `waited_s` of the `seconds` (zero for a blocking collective).
    Between the two the rank ran its own code: the collective was in flight, but not holding it up.
    `issuer` is "file:function" of the code that called the collective, when the rank asked for it
    (`dist.RECORD_ISSUERS`; the grader does), else empty. `group` is the global ranks of the process group
    the collective ran in (empty: every rank), whose size and this rank's index in it the ring bytes use;
    `src` is a broadcast's source, a global rank.
    """

    seq: int
    op: str
    tag: str
    dtype: str
    elements: int
    element_size: int
    bytes_sent: int
    bytes_received: int
    step: int
    phase: str
    seconds: float
    started_s: float = 0.0
    wait_started_s: float = 0.0
    waited_s: float = 0.0
    issuer: str = ""
    group: tuple[int, ...] = ()
    src: int = 0

    @property
    def elements_sent(self) -> float:
        return self.bytes_sent / self.element_size if self.element_size else 0.0


_new_entry = functools.partial(tuple.__new__, CommEntry)
"""`CommEntry` from a tuple of all its fields, without the named tuple's Python-level `__new__`: the same
object, made by every rank for every collective."""


class RankLedger:
    """The collectives of one rank, in call order. Only its own rank thread appends to it."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.entries: list[CommEntry] = []
        self._ring_bytes: dict[tuple, tuple[int, int]] = {}
        """(sent, received) by (op, bytes, element size, src, group): a rank repeats the same few dozen
        collectives every step, and on the virtual cluster every microsecond of Python a collective costs is
        paid once per rank."""

    def record(
        self,
        op: str,
        *,
        tag: str,
        dtype: str,
        full_bytes: int,
        element_size: int,
        step: int,
        phase: str,
        seconds: float,
        src: int = 0,
        started_s: float = 0.0,
        issuer: str = "",
        group: tuple[int, ...] = (),
    ) -> CommEntry:
        """`src`, a broadcast's source, and `group` (empty: every rank) are global ranks."""
        key = (op, full_bytes, element_size, src, group)
        traffic = self._ring_bytes.get(key)
        if traffic is None:
            if group:
                src_index = group.index(src) if op == BROADCAST else 0
                traffic = ring_bytes(op, full_bytes, element_size, len(group), group.index(self.rank), src_index)
            else:
                traffic = ring_bytes(op, full_bytes, element_size, self.world_size, self.rank, src)
            self._ring_bytes[key] = traffic
        entries = self.entries
        entry = _new_entry(
            (
                len(entries),
                op,
                tag,
                dtype,
                full_bytes // element_size if element_size else 0,
                element_size,
                *traffic,
                step,
                phase,
                seconds,
                started_s,
                0.0,
                0.0,
                issuer,
                group,
                src,
            )
        )
        entries.append(entry)
        return entry

    def record_wait(self, seq: int, started_s: float, seconds: float) -> None:
        """Add the wait for an `async_op` collective to the entry made when it started."""
        entry = self.entries[seq]
        self.entries[seq] = entry._replace(seconds=entry.seconds + seconds, wait_started_s=started_s, waited_s=seconds)


@dataclass
class CommSummary:
    """Traffic of one rank (or the mean rank) over a set of entries."""

    collectives: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    elements_sent: float = 0.0
    seconds: float = 0.0
    by_op: dict[str, int] = field(default_factory=dict)
    bytes_sent_by_tag: dict[str, int] = field(default_factory=dict)

    def psi_multiple(self, psi: int) -> float:
        """Elements sent per rank in multiples of Ψ, the paper's unit (ZeRO §7)."""
        return self.elements_sent / psi

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(entries: list[CommEntry]) -> CommSummary:
    """Collectives and their ring bytes; host copies (`PCIE_OPS`) count in `by_op` only (`pcie_bytes`)."""
    ops: Counter[str] = Counter()
    by_tag: defaultdict[str, int] = defaultdict(int)
    summary = CommSummary()
    for e in entries:
        ops[e.op] += 1
        if e.op in PCIE_OPS:
            continue
        summary.collectives += 1
        summary.bytes_sent += e.bytes_sent
        summary.bytes_received += e.bytes_received
        summary.elements_sent += e.elements_sent
        summary.seconds += e.seconds
        by_tag[e.tag] += e.bytes_sent
    summary.by_op = dict(ops)
    summary.bytes_sent_by_tag = dict(by_tag)
    return summary


class CommLedger:
    """All ranks' ledgers of one run: the counting interconnect's record."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.ranks = [RankLedger(r, world_size) for r in range(world_size)]

    def entries(self, rank: int, *, step: int | None = None, exclude_tags: tuple[str, ...] = ()) -> list[CommEntry]:
        return [e for e in self.ranks[rank].entries if (step is None or e.step == step) and e.tag not in exclude_tags]

    def rank_summary(self, rank: int, *, step: int | None = None, exclude_tags: tuple[str, ...] = ()) -> CommSummary:
        return summarize(self.entries(rank, step=step, exclude_tags=exclude_tags))

    def collective_seconds(self, steps: Collection[int]) -> float:
        """Seconds spent in collectives (host copies excluded) during `steps`, summed over every rank. One pass
        over the entries: a summary per rank and step reads every entry once per step, a time that grows with
        the square of the steps (5 s of rank 0's report after 3,000 steps on two processes)."""
        wanted = set(steps)
        return sum(
            e.seconds for ledger in self.ranks for e in ledger.entries if e.step in wanted and e.op not in PCIE_OPS
        )

    def mean_bytes_sent(self, *, step: int | None = None, exclude_tags: tuple[str, ...] = ()) -> float:
        """Bytes sent per rank, averaged over ranks (the paper's "per GPU" volume)."""
        total = sum(
            self.rank_summary(r, step=step, exclude_tags=exclude_tags).bytes_sent for r in range(self.world_size)
        )
        return total / self.world_size

    def mean_elements_sent(self, *, step: int | None = None, exclude_tags: tuple[str, ...] = ()) -> float:
        total = sum(
            self.rank_summary(r, step=step, exclude_tags=exclude_tags).elements_sent for r in range(self.world_size)
        )
        return total / self.world_size

    def pcie_bytes(self, rank: int, op: str, *, step: int | None = None) -> int:
        """Bytes `rank` copied over its PCIe link: `op` is "d2h" (GPU to host) or "h2d" (host to GPU)."""
        if op not in PCIE_OPS:
            raise ValueError(f"unknown host copy {op!r}; expected one of {PCIE_OPS}")
        return sum(e.elements * e.element_size for e in self.entries(rank, step=step) if e.op == op)

    def steps(self) -> list[int]:
        return sorted({e.step for ledger in self.ranks for e in ledger.entries})

    def link_traffic(
        self,
        topology: Topology,
        algorithm: str = "ring",
        *,
        step: int | None = None,
        exclude_tags: tuple[str, ...] = (),
        in_elements: bool = False,
    ) -> list[LinkTraffic]:
        """Per rank, its collectives' bytes (or elements) inside its node and across nodes.

        Recomputed from each entry's op, size, rank, group and source under `algorithm` (`zero_core.topology`):
        the ledger records what ran, the topology says which links it would take.
        """
        if topology.world_size != self.world_size:
            raise ValueError(f"the topology has {topology.world_size} ranks, the ledger {self.world_size}")
        totals = []
        for rank in range(self.world_size):
            total = LinkTraffic()
            for e in self.entries(rank, step=step, exclude_tags=exclude_tags):
                full_bytes = e.elements * e.element_size
                link = link_bytes(e.op, full_bytes, e.element_size, topology, rank, algorithm, e.src, group=e.group)
                total += link.scaled(1 / e.element_size) if in_elements else link
            totals.append(total)
        return totals


def alpha_beta_seconds(
    entries: list[CommEntry], world_size: int, bandwidth_bytes_per_s: float, latency_s: float = 0.0
) -> float:
    """Time on the wire for one rank's collectives: latency per ring step plus bytes over bandwidth.

    With latency 0 this is NCCL's bus-bandwidth model: a collective on S bytes at bus bandwidth B takes
    factor·S/B, which is exactly the ring bytes this rank sends over B. A group's collective is a ring of
    the group's size.
    """
    if bandwidth_bytes_per_s <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth_bytes_per_s} bytes/s")
    return sum(
        ring_messages(e.op, len(e.group) or world_size) * latency_s + e.bytes_sent / bandwidth_bytes_per_s
        for e in entries
    )
