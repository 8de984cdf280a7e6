"""The memory the kernel saw: the memory audit's figure cross-checked with the grading child's resident memory.

The memory checks read the audit of live torch storages (`zero_core.memory`), as the grading child reports
it. Memory held outside torch's storages (a NumPy copy, a Python list, `bytes`) is invisible to the audit, and
the audit's figures are the child's word. So the visible memory check of every stage exercise also trains
the stage once more, with the student's code, on a model sized so that a few full copies of its parameters
(`copy_bytes`, 2Ψ in bf16: 54 MiB each) stand clear of the noise in a process's resident memory
(`SIZED_CONFIG`, `SIZED_WORLD_SIZE` ranks, one step). The grading parent reads the kernel's count of the
child's resident memory from that run's beginning, which the child announces to the witness
(`autograder.witness`, whose clock the samples share), to the child's end (`child_process.RssSampler`):
nothing in the child can lower it. The sized run's collectives stay in the child (through the witness
they would cost more than the run); its verdict is about memory only. A fresh child that trains the
reference stage the same way, walled like the student's, gives the figure to compare with
(`reference_figures`, once per exercise and machine: `autograder.reference_store` keeps it).

The verdict (`judge`): the kernel's excess over the reference, less what the audit itself saw in excess (up
to one copy: beyond that the audit's own memory rules speak), must stay within `ALLOWED_COPIES` copies of
the parameters (109 MiB). Measured on this course's 2-core machine, with the grading children's fixed
malloc threshold (`sandbox.CHILD_ENVIRONMENT`) and 16 tokens a micro-batch (4 since 2026-12-07, not measured
so since; the walled gradings of the tests, every stage solution and the seven correct fixtures the nbgrader
round trip hands in, have kept their memory checks since): the seven stage solutions and the ten correct
fixtures written unusually (`tests/fixtures/correct`) ran from 21 MiB below to 37 MiB above their reference
children; the fixture that keeps every gathered layer as a NumPy array
(`tests/fixtures/wrong/ex07_keeps_every_layer_gathered_outside_torch.patch`) 227 MiB above. What it does
not see: a copy smaller than the margin, or one kept only on world sizes other than the sized run's.
`benchmarks/bench_grading.py` prints what the run costs: the sized run in the grading child, and the
reference child, started once per exercise on a machine (`autograder.reference_store` keeps its figures).
"""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import cache
from typing import Any

import torch

from autograder import recorded
from autograder.checks import CheckFailed
from autograder.plain_data import count, well_formed
from autograder.records import Run
from autograder.witness import SIZED_RUN_KEYS, UNMEASURED_KEY, WITNESS_KEY
from zero_core.model import GPT, GPTConfig
from zero_core.stages import TrainConfig

SIZED_MODEL = GPTConfig(vocab_size=64, block_size=4, n_layer=4, n_head=4, n_embd=768, micro_batch_size=1)
"""28.5M parameters in 4 blocks: a full copy in bf16 is 54 MiB. Four tokens a micro-batch: the run is there for
its parameters' memory, and its arithmetic grows with the tokens. On a CPU without native bf16 arithmetic
(AVX2 only), torch multiplies a bf16 matrix by a weight that is not transposed (the backward's `grad @
weight`) through a slow path whose time grows with the rows: with 16 tokens that one product took 12 of the
reference child's 22 CPU seconds (py-spy, `python -m autograder check` of the ex08 solution)."""
SIZED_CONFIG = TrainConfig(model=SIZED_MODEL)
"""bf16, as the memory checks' runs (`harness.CONFIG`)."""
SIZED_WORLD_SIZE = 4
SIZED_STEPS = 1
MiB = 2**20


@cache
def parameter_count() -> int:
    """Ψ of the sized model, counted on a copy built for the count and dropped at once (114 MB for a moment,
    its draws from a forked RNG). Not on torch's meta device, whose initialisers import torch's compiler stack:
    about 1 s of CPU in every grading parent that judged a memory check. Not through `build_model` either,
    whose cached template would keep the 114 MB for the rest of the process."""
    with torch.random.fork_rng(devices=[]):
        return sum(p.numel() for p in GPT(SIZED_MODEL).parameters())


ALLOWED_COPIES = 2
"""How many full bf16 copies of the parameters the kernel may see beyond the reference, unexplained: the
peak of the same run spreads by about one copy between processes (the ranks' transient buffers overlap
more or less), and a stage that keeps every layer gathered on each rank holds `SIZED_WORLD_SIZE` copies."""


def copy_bytes() -> int:
    """One full copy of the sized model's parameters in bf16."""
    return 2 * parameter_count()


# -- in the process that runs the student's code ----------------------------------------------------------


def observe(make_run: Callable[[], Run], witnessed: bool) -> dict[str, Any]:
    """The sized run's summary: its number in the witness's record, its ranks, and per rank the sum of the
    audit's peaks by category. Where no witness measures it (a check called in a notebook), it is not made."""
    if not witnessed:
        return {UNMEASURED_KEY: "the kernel's count is taken when the grader grades the notebook"}
    run = make_run()
    audit = [sum(rank.peaks.values()) for rank in run.memory]
    return {WITNESS_KEY: run.witness_run, "world_size": run.world_size, "audit_bytes": audit}


# -- in the process that decides ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Figures:
    """What a sized run held: the kernel's peak for the whole child from the run's beginning, and the sum
    over ranks of what the audit saw."""

    kernel_bytes: int
    audit_bytes: int


def measured(entry: Any) -> Figures | None:
    """The figures of a sized run's entry as the witness left them (`witness.verify_runs`); None for one a
    notebook's kernel did not measure; `ObservationInvalid` for anything else."""
    if isinstance(entry, dict) and set(entry) == {UNMEASURED_KEY}:
        return None
    well_formed(isinstance(entry, dict) and SIZED_RUN_KEYS | {"kernel_peak_bytes"} == set(entry), "the sized run")
    well_formed(entry["world_size"] == SIZED_WORLD_SIZE, "the sized run's world size")
    audit = entry["audit_bytes"]
    well_formed(isinstance(audit, list) and len(audit) == SIZED_WORLD_SIZE, "the sized run's audit")
    kernel = count(entry["kernel_peak_bytes"], "the sized run's kernel figure", low=1, high=2**40)
    return Figures(kernel, sum(count(a, "the sized run's audit", high=2**40) for a in audit))


def judge(student: Figures | None, reference: Callable[[], Figures]) -> str:
    """A clause for the memory check's verdict; `CheckFailed` when the kernel saw more than `ALLOWED_COPIES`
    copies of the parameters beyond the reference that the audit does not account for."""
    if student is None or recorded.replaying():
        return "the kernel's count of the memory is compared with the reference's when the notebook is graded"
    expected = reference()
    copy = copy_bytes()
    kernel_excess = student.kernel_bytes - expected.kernel_bytes
    audit_excess = student.audit_bytes - expected.audit_bytes
    unexplained = kernel_excess - min(max(audit_excess, 0), copy)
    figures = (
        f"on {SIZED_WORLD_SIZE} ranks training a {parameter_count() / 1e6:.1f}M-parameter model, the kernel "
        f"counted {student.kernel_bytes / MiB:,.0f} MiB for the grading process against the reference's "
        f"{expected.kernel_bytes / MiB:,.0f} MiB; the audit of torch storages saw {audit_excess / MiB:+,.0f} MiB"
    )
    if unexplained > ALLOWED_COPIES * copy:
        raise CheckFailed(
            f"memory the audit cannot see: {figures}. {unexplained / MiB:,.0f} MiB more than the reference is held "
            f"outside torch's storages (more than {ALLOWED_COPIES} copies of the parameters, "
            f"{ALLOWED_COPIES * copy / MiB:,.0f} MiB). Keep no "
            "copy of a buffer in another form (`.tolist()`, `.numpy()`, `bytes`): hold tensors, and release them."
        )
    return f"and the kernel agrees: {figures}"


REFERENCE_BOOT = (
    "import sys; sys.path.insert(0, sys.argv[1]); from autograder.kernel_memory import reference_main; "
    "sys.exit(reference_main(sys.argv[2:]))"
)


@cache
def reference_figures(assignment: str) -> Figures:
    """The kernel's figures of the reference stage of `assignment` on this machine (`measure_reference`):
    once per process, and kept in the reference store (`autograder.reference_store`) for the next."""
    from autograder import reference_store, walls
    from autograder.sandbox import Limits

    walled = not isinstance(walls.available(), str)
    key = (assignment, platform.node(), walled, Limits().memory_bytes)
    return reference_store.kept("kernel", key, lambda: measure_reference(assignment), asdict,
                                lambda data: Figures(**data))


def measure_reference(assignment: str) -> Figures:
    """The sized run of the reference stage of `assignment`, in a fresh child made as the grading child is
    (walled where this machine builds walls, its memory limited, its collectives through a witness),
    measured the same way."""
    from autograder import walls, witness
    from autograder.child_process import run_child
    from autograder.sandbox import CHILD_ENVIRONMENT, ROOT, WALLED_ENVIRONMENT, Limits

    results_read, results_write = os.pipe()
    seen, witness_fd = witness.start()
    command = [sys.executable, "-I", "-c", REFERENCE_BOOT, str(ROOT), assignment, str(results_write),
               str(Limits().memory_bytes), str(witness_fd)]
    seccomp_fd, env = -1, dict(os.environ, **CHILD_ENVIRONMENT)
    built = walls.available()
    if not isinstance(built, str):
        command, seccomp_fd = built.wrap(command, walls.course_files(excluded=()), dict(WALLED_ENVIRONMENT))
        env = None
    passed = tuple(fd for fd in (witness_fd, seccomp_fd) if fd >= 0)
    run = run_child(command, env, Limits().time_s, (results_read, results_write), passed)
    seen.join(timeout=10)
    seen.measure(run.peak_since)
    if run.returncode != 0:
        raise RuntimeError(f"the reference's sized run of {assignment} failed: {run.stderr_tail}")
    figures = measured(witness.verify_runs(json.loads(run.results), seen))
    assert figures is not None
    return figures


def reference_main(argv: list[str]) -> int:
    """The reference child: train the reference stage of an exercise on the sized model, as a grading child
    trains the student's, and write the run's summary to the results pipe."""
    assignment, results_fd, memory_bytes, witness_fd = argv
    from autograder import harness
    from autograder.sandbox import limit_resources
    from autograder.submission import exercise_module, load_graders
    from zero_core.backends.witnessed import connect

    limit_resources(int(memory_bytes))
    harness.use_witness(connect(int(witness_fd)))
    load_graders([assignment])
    exercise = exercise_module(assignment).EXERCISE
    summary = observe(lambda: exercise.sized_run(exercise.reference_stage, None), witnessed=True)
    os.write(int(results_fd), json.dumps(summary).encode())
    return 0
