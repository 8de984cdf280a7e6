"""Keep Python's cycle collector off what a process loads once and keeps for good: torch, the course, the grader.

Importing torch and the course leaves well over a hundred thousand objects that Python's cycle collector tracks
(`len(gc.get_objects())` after `import torch`). None of them ever becomes garbage, yet every full collection
walks all of them again, and a training run or a grading makes enough short-lived objects to start many full
collections. `gc.freeze()` moves every object alive at the call into a generation the collector never walks;
what is made later is collected exactly as before, so no tensor a rank frees outlives its last reference any
longer than it did (the memory ledger and the audits see the same). The process's exit skips them too.

A program calls `freeze_what_is_loaded()` once, after its imports and before its work: the course's command
lines (`python -m zero_core`, `zero_core.launch`), the grader's parent and its child (before the student's
cells), the reference child. A library never calls it, nor does code that runs inside someone else's process
(nbgrader's, a test worker): objects alive there are theirs to collect. `VirtualCluster.run` freezes what is
older than a run only while the run lasts and unfreezes everything after it (`cluster._older_objects_frozen`),
so a program's freeze holds until its first run on the virtual cluster.
"""

from __future__ import annotations

import gc


def freeze_what_is_loaded() -> None:
    """Exempt every object alive now from the cycle collector's later passes (`gc.freeze`), once per process:
    a second call, after work has begun, would exempt that work's garbage too, which then stays for good."""
    if gc.get_freeze_count() == 0:
        gc.freeze()
