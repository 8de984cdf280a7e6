"""What the memory ledger says against what the ranks really hold, and what the audit costs per step.

Part 1 (the check of issue "memory measured, not declared"): each stage trains one step on N virtual
GPUs (micro preset); then every storage reachable from each rank's stage object is summed
(`zero_core.reachable`) and set beside the ledger's total. "unaccounted / Ψ" is the reachable bytes the
ledger does not name, in multiples of the parameter count; the stages' claim is 0.

Part 2: the audit (`MemoryTracker.audit`, a dispatch mode that sees every tensor operation) runs on a
stage's setup and on the one step a report instruments. Its cost is printed as the ratio of the cluster's
wall time per step with the audit to without it, runs of each alternating twice in one process (the
machines here are shared and noisy: only a ratio measured in one run means anything); audited twice: with
the cluster's default number of rank threads running at once, and one at a time, as `experiment` runs the
instrumented step (the audit's per-operation Python leaves the threads little to gain from a second core).
Then the cost per tensor operation on one thread: none, any Python dispatch mode (torch's share), the audit
with and without its timeline, and with the FLOP meter it carries in the instrumented step.

Part 3: the grader's runs (`autograder.harness.train`: the micro model, every step audited), ZeRO-2 and
ZeRO-3 at N = 4 and 7, with the cluster's default number of rank threads running at once and with
`harness.GRADED_RUNNING`, alternating twice: the process's CPU and wall seconds per run, the medians.

    python benchmarks/bench_memory_audit.py [--world-size 4] [--cost-world-size 32] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zero_core.cluster import INTERCONNECT, VirtualCluster
from zero_core.context import current
from zero_core.flops import FlopMeter
from zero_core.memory import UNLABELLED, MemoryTracker, StorageAudit
from zero_core.model import count_parameters, preset
from zero_core.reachable import reachable_storages, unaccounted
from zero_core.stages import STAGES, TrainConfig


def ledger_against_reachable(stage: int) -> tuple[int, int, int, int]:
    """On a rank, after one step: (ledger total, named bytes, reachable bytes, reachable bytes not named)."""
    trainer = STAGES[stage](TrainConfig(model=preset("micro")))
    trainer.train_step(0)
    tracker = current().tracker
    held = tracker.held_storages()
    named = sum(h.nbytes for h in held.values() if h.category not in UNLABELLED)
    reached = reachable_storages(("stage", trainer), stop=(*INTERCONNECT, MemoryTracker))
    reachable = sum(r.nbytes for r in reached.values())
    unnamed = sum(found.nbytes for found, _ in unaccounted(reached, tracker))
    return tracker.current_bytes(), named, reachable, unnamed


def timed_steps(stage: int, steps: int, audited: bool) -> tuple[float, float]:
    """On a rank: (start, end) of `steps` training steps after a warm-up one, with or without the audit."""
    trainer = STAGES[stage](TrainConfig())
    trainer.train_step(0, count_activations=False)
    tracker = current().tracker
    started = time.perf_counter()
    for step in range(1, steps + 1):
        with tracker.audit() if audited else nullcontext():
            trainer.train_step(step, count_activations=False)
    return started, time.perf_counter()


def cluster_step_seconds(
    stage: int, world_size: int, steps: int, audited: bool, max_running: int | None = None
) -> tuple[float, float]:
    """The cluster's (wall, CPU) seconds per step: wall from the first rank starting to the last rank
    finishing; CPU the process's over the whole run, warm-up step and setup included, divided by `steps`."""
    cpu = time.process_time()
    cluster = VirtualCluster(world_size, timeout_s=120, max_running=max_running)
    bounds = cluster.run(timed_steps, stage, steps, audited)
    cpu = time.process_time() - cpu
    return (max(end for _, end in bounds) - min(start for start, _ in bounds)) / steps, cpu / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--cost-world-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    args = parser.parse_args()

    print(f"Ledger against reachable storages after one step, micro preset, N = {args.world_size} (rank 0)")
    print(f"{'stage':8}{'ledger total (B)':>18}{'named (B)':>12}{'reachable (B)':>15}{'unaccounted / Ψ':>17}")
    psi = count_parameters(preset("micro"))
    for stage in sorted(STAGES):
        rows = VirtualCluster(args.world_size).run(ledger_against_reachable, stage)
        total, named, reachable, unnamed = rows[0]
        print(f"ZeRO-{stage:<3}{total:>18,}{named:>12,}{reachable:>15,}{unnamed / psi:>17.2f}")

    slots = VirtualCluster(1).max_running
    print(
        f"\nAudit cost: tiny preset, N = {args.cost_world_size}, {args.steps} steps a run, plain and audited "
        f"runs alternating;\n{slots} rank threads at a time (the default) or one (what a report's instrumented "
        "step runs with);\nwall seconds per step, and in brackets the process's CPU seconds per step"
    )
    print(f"{'stage':8}{'plain':>16}{'audited':>17}{'ratio':>7}{'audited, 1 at a time':>23}{'ratio':>7}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for stage in sorted(STAGES):
            runs: dict[str, list[tuple[float, float]]] = {"plain": [], "audited": [], "alone": []}
            for _ in range(2):
                runs["plain"].append(cluster_step_seconds(stage, args.cost_world_size, args.steps, False))
                runs["audited"].append(cluster_step_seconds(stage, args.cost_world_size, args.steps, True))
                runs["alone"].append(cluster_step_seconds(stage, args.cost_world_size, args.steps, True, 1))
            wall = {key: statistics.median(w for w, _ in pairs) for key, pairs in runs.items()}
            cpu = {key: statistics.median(c for _, c in pairs) for key, pairs in runs.items()}
            cells = [f"{wall[key]:.3f} s ({cpu[key]:.2f})" for key in runs]
            print(
                f"ZeRO-{stage:<3}{cells[0]:>16}{cells[1]:>17}{wall['audited'] / wall['plain']:6.2f}x"
                f"{cells[2]:>23}{wall['alone'] / wall['plain']:6.2f}x"
            )
        print("\nPer tensor operation on one thread (add, view, mm, t of 64x64 fp32, 8,000 of them), best of 3:")
        for name, mode in per_operation_modes():
            print(f"  {name:32} {microseconds_per_operation(mode):6.2f} µs")
    finally:
        torch.set_num_threads(threads)
    graded_runs(slots)


def graded_runs(default_slots: int) -> None:
    """Part 3: the grader's audited runs with the default number of rank threads at once and with the grader's."""
    from autograder import harness
    from zero_core.stages import Zero2, Zero3

    chosen = harness.GRADED_RUNNING
    print(
        f"\nGraded runs (autograder.harness.train: micro preset, {harness.STEPS} steps, every step audited): "
        f"{default_slots} rank threads at a time (the default)\nagainst {chosen} (harness.GRADED_RUNNING); CPU and "
        "wall seconds per run, median of 2 alternating"
    )
    print(f"{'stage':8}{'N':>3}{'default: CPU':>14}{'wall':>8}{f'{chosen} at a time: CPU':>21}{'wall':>8}"
          f"{'CPU x':>7}{'wall x':>8}")
    for cls in (Zero2, Zero3):
        graded = harness.graded_stage(cls, "bench")
        for world_size in (4, 7):
            runs: dict[int, list[tuple[float, float]]] = {default_slots: [], chosen: []}
            harness.train(graded, world_size)  # warm-up: the first run fills the per-operator caches
            for _ in range(2):
                for running in runs:
                    cpu, wall = time.process_time(), time.perf_counter()
                    harness.train(graded, world_size, max_running=running)
                    runs[running].append((time.process_time() - cpu, time.perf_counter() - wall))
            cpu = {key: statistics.median(c for c, _ in pairs) for key, pairs in runs.items()}
            wall = {key: statistics.median(w for _, w in pairs) for key, pairs in runs.items()}
            print(
                f"ZeRO-{cls.stage:<3}{world_size:>3}{cpu[default_slots]:>13.3f}s{wall[default_slots]:>7.3f}s"
                f"{cpu[chosen]:>20.3f}s{wall[chosen]:>7.3f}s{cpu[chosen] / cpu[default_slots]:>6.2f}x"
                f"{wall[chosen] / wall[default_slots]:>7.2f}x"
            )

class _PassThrough(TorchDispatchMode):
    """A dispatch mode that only runs each operation: what torch costs for any mode written in Python."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def per_operation_modes() -> list[tuple[str, Callable[[], AbstractContextManager]]]:
    """(name, a fresh context per timing) from no mode to the audit carrying the FLOP meter, as the last step."""

    def audit_counting() -> AbstractContextManager:
        audit = StorageAudit(MemoryTracker())
        stack = ExitStack()
        stack.enter_context(audit)
        stack.enter_context(audit.counting(FlopMeter()))
        return stack

    return [
        ("no dispatch mode", nullcontext),
        ("a pass-through dispatch mode", _PassThrough),
        ("StorageAudit, no timeline", lambda: StorageAudit(MemoryTracker(record_timeline=False))),
        ("StorageAudit", lambda: StorageAudit(MemoryTracker())),
        ("StorageAudit + FlopMeter", audit_counting),
    ]


def microseconds_per_operation(mode: Callable[[], AbstractContextManager], repeats: int = 2000) -> float:
    a, b = torch.randn(64, 64), torch.randn(64, 64)

    def operations() -> None:
        for _ in range(repeats):
            c = a + b
            c.view(-1)
            e = torch.mm(a, b)
            e.t()

    with mode():
        operations()  # first calls fill the per-operator caches (aliasing, FLOP rules)
    best = float("inf")
    for _ in range(3):
        with mode():
            started = time.perf_counter()
            operations()
            best = min(best, time.perf_counter() - started)
    return best / (4 * repeats) * 1e6


if __name__ == "__main__":
    main()
