"""The rank context: who am I, and where do my bytes and messages get counted.

Every rank (a thread on the virtual cluster, a process under torchrun) has exactly one `RankContext`.
It is the only global mutable state in `zero_core`, and it lives here, in a thread-local, so that 32
rank threads in one process never see each other's rank, random generator, memory tracker or ledger.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class RankContext:
    """What one rank knows about itself.

    `backend` moves the data of collectives (the virtual cluster's rendezvous or torch.distributed);
    `ledger` (a `zero_core.comm.RankLedger`) and `tracker` (a `zero_core.memory.MemoryTracker`) count what
    this rank sends and holds. This module is the bottom layer, which those modules read to find the
    calling rank, so it names their types without importing them. `step` and `phase` label ledger
    entries and memory events so that reports can be cut per training step and per phase.
    """

    rank: int
    world_size: int
    generator: torch.Generator
    backend: Any
    ledger: Any
    tracker: Any
    step: int = 0
    phase: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """Where the rank's tensors live: its GPU under NCCL, the CPU elsewhere (every virtual rank)."""


_local = threading.local()
_process: list[RankContext] = []
"""The context of a process that is one rank (torchrun), for threads that did not activate it: autograd
runs a GPU's backward on a thread of its own, and a ZeRO-2/3 backward calls collectives from there."""


def current() -> RankContext:
    """The calling rank's context; a clear error outside a rank."""
    ctx = getattr(_local, "ctx", None) or (_process[-1] if _process else None)
    if ctx is None:
        raise RuntimeError(
            "not inside a rank: call this from a function run by VirtualCluster.run(fn) "
            "(or under torchrun via zero_core.launch)"
        )
    return ctx


def maybe_current() -> RankContext | None:
    return getattr(_local, "ctx", None) or (_process[-1] if _process else None)


@contextmanager
def activate(ctx: RankContext, *, whole_process: bool = False) -> Iterator[RankContext]:
    """Make `ctx` the calling thread's rank context for the duration of the block; with `whole_process`,
    also the context of every thread that has none of its own (for a process that is one rank; never on
    the virtual cluster, whose threads are many ranks)."""
    previous = getattr(_local, "ctx", None)
    _local.ctx = ctx
    if whole_process:
        _process.append(ctx)
    try:
        yield ctx
    finally:
        _local.ctx = previous
        if whole_process:
            _process.remove(ctx)


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Label what this rank does inside the block ("forward", "backward", ...) in its ledger and timeline.

    When the block ends, the rank's memory tracker looks at what the phase left alive: a buffer nobody
    named that outlives the phase which made it is memory no part of the code accounts for.
    """
    ctx = current()
    previous = ctx.phase
    ctx.phase = name
    try:
        yield
    finally:
        ctx.tracker.end_phase()
        ctx.phase = previous
