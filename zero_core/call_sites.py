"""Where a rank called a collective from: the first lines of its stack outside the collectives' own code.

When ranks take different paths (a rank skips a layer, returns early, loops once more), the virtual
cluster stops them at once with `CollectiveMismatch`, `CollectiveDeadlock` or `CollectiveTimeout`. Each
rank still waiting is then blocked inside its collective, so its thread's stack (`sys._current_frames`)
leads from the rendezvous back to the line of the student's or the stage's code that called it: the
messages name that line for every waiting rank. It is read only when a failure is diagnosed, so a
collective that completes pays nothing for it. `zero_core.dist` names a collective's issuer the same way
when the grader asks it to (`dist.RECORD_ISSUERS`).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from types import FrameType

_PACKAGE = Path(__file__).parent
IMPLEMENTATION = (
    str(_PACKAGE / "dist.py"),
    str(_PACKAGE / "cluster.py"),
    str(_PACKAGE / "cpu_turns.py"),
    str(_PACKAGE / "backends"),
    threading.__file__,
)
"""The files a collective passes through on its way to the rendezvous and back: never a call site."""
CALLERS_SHOWN = 2
"""Frames named per call site, innermost first: a stage's helper (`LayerShard.gather_parameters`) and the
code that called it (a student's autograd Function)."""
_ROOT = str(_PACKAGE.parent) + "/"


def outside_implementation(frame: FrameType | None) -> FrameType | None:
    """The innermost frame, from `frame` outwards, that is not in the collectives' implementation."""
    while frame is not None and frame.f_code.co_filename.startswith(IMPLEMENTATION):
        frame = frame.f_back
    return frame


def describe(frame: FrameType | None) -> str:
    """ "zero_core/stages/sharding.py:118 in gather_parameters <- zero_core/answers/ex04.py:24 in forward":
    the first `CALLERS_SHOWN` frames outside the implementation, innermost first ("" when there are none)."""
    parts = []
    while (frame := outside_implementation(frame)) is not None and len(parts) < CALLERS_SHOWN:
        path = frame.f_code.co_filename.removeprefix(_ROOT)
        parts.append(f"{path}:{frame.f_lineno} in {frame.f_code.co_name}")
        frame = frame.f_back
    return " <- ".join(parts)


def of_thread(ident: int) -> str:
    """Where the thread `ident` is now, seen from outside the collectives: its call site while it waits in one."""
    return describe(sys._current_frames().get(ident))
