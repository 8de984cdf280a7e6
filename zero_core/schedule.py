"""A rank's schedule: the moments its layers needed something, to set beside the ledger's collectives.

The ledger says when each collective started and, for an `async_op` one, when the rank began waiting for
it (`CommEntry.started_s`, `wait_started_s`). That alone cannot tell whether a collective *overlapped*
computation, or whether a gather came *before* its layer needed it: for that the course's own code marks
the moments that matter, such as "the gradients of layer L exist" (`GRADIENTS_READY`, ZeRO-2's backward) or
"layer L is about to compute" (`NEEDS_PARAMETERS`, ZeRO-3). Marks cost nothing unless a run asks for them
(`record`), as the grader does; they are made by the stage's code, never by the code being judged.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from zero_core import memory
from zero_core.context import current, maybe_current

SCHEDULE = "schedule"
"""The key, in `RankContext.extra`, of the list of marks a rank records."""
GRADIENTS_READY = "gradients ready"
"""A layer's local gradients exist (its backward computed them) and are handed on to be reduced."""
NEEDS_PARAMETERS = "needs parameters"
"""A layer is about to compute (forward or backward) and needs its full parameters now."""

Mark = tuple[float, str, str, int]
"""(time.perf_counter() seconds, event, layer, unnamed bytes): on the same clock as the ledger's `started_s`.
The unnamed bytes are what the rank's memory audit saw alive at that moment that nobody registered
(`memory.TEMPORARY` and `memory.UNTRACKED`): a gradient kept from one layer to the next shows up there."""


def mark(event: str, layer: str) -> None:
    """Record that `event` happened to `layer` now, if the calling rank records its schedule."""
    ctx = maybe_current()
    marks = ctx.extra.get(SCHEDULE) if ctx is not None else None
    if marks is not None:
        unnamed = ctx.tracker.current_bytes(memory.TEMPORARY) + ctx.tracker.current_bytes(memory.UNTRACKED)
        marks.append((time.perf_counter(), event, layer, unnamed))
        witnessed = getattr(ctx.backend, "mark", None)  # a graded run's backend tells its witness too
        if witnessed is not None:
            witnessed(event, layer)


@contextmanager
def record() -> Iterator[list[Mark]]:
    """Record the calling rank's marks for the duration of the block, into the list it yields."""
    extra = current().extra
    marks: list[Mark] = []
    previous = extra.get(SCHEDULE)
    extra[SCHEDULE] = marks
    try:
        yield marks
    finally:
        extra[SCHEDULE] = previous
