"""Keep Python's cycle collector off what a process loads once and keeps for good: torch, the course, the grader.

Importing torch and the course leaves well over a hundred thousand objects that Python's cycle collector tracks
(`len(gc.get_objects())` after `import torch`). None of them ever becomes garbage, yet every full collection
walks all of them again, and a training run or a grading makes enough short-lived objects to start many full
collections. `gc.freeze()` moves every object alive at the call into a generation the collector never walks;
what is made later is collected exactly as before, so no tensor a rank frees outlives its last reference any
longer than it did (the memory ledger and the audits see the same). The process's exit skips them too.

A program calls `freeze_what_is_loaded()` once, after its imports and before its work: the course's command
lines (`python -m zero_core`, `zero_core.launch`), the grader's parent and its child (before the student's
cells), nbgrader's grading step, the test workers. A library never calls it: objects alive in someone else's
program are theirs to collect.
"""

from __future__ import annotations

import gc


def freeze_what_is_loaded() -> None:
    """Exempt every object alive now from the cycle collector's later passes (`gc.freeze`), once per process:
    a second call, after work has begun, would exempt that work's garbage too, which then stays for good."""
    if gc.get_freeze_count() == 0:
        gc.freeze()
