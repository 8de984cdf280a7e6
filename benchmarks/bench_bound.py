"""What bounds a stage's step time against the compute floor on this machine: the interpreter lock, or the
stage's own code, and in it, the collectives? Five measurements, ratios from one run
(`benchmarks/floor.py` defines the floor, split over two processes).

1. The floor's work (N micro-batches' forward and backward, then the Adam steps of the replicas a stage
   keeps) in two threads of one process against two processes (the floor) and against one thread. If
   threads ran it almost as fast as processes, one interpreter lock shared by the ranks would not be what
   keeps a stage from its floor.
2. Each stage with a single CPU slot (`max_running=1`: no two rank threads ever run their own code at once,
   so no lock contention and no thread switch that a slot does not ask for): its CPU seconds per step over
   the one-thread floor's. That ratio is the work the stage's own code adds (autograd Functions, memory
   bookkeeping, rendezvous), which no way of spreading the ranks over cores removes.
3. Each stage as it runs by default (`VirtualCluster`'s slots, one per core plus one): its CPU seconds per
   step over those with one slot. The same work, so what it adds is what rank threads running side by side
   cost each other: every tensor operation lets go of the interpreter lock and takes it back, and with
   several rank threads runnable, taking it back means waiting and a thread switch.
   So a stage's step on two cores is at best (one-slot CPU / floor CPU) x (this) x (the floor), when it
   keeps both cores busy.
4. What a collective costs: ZeRO-2 against the same stage with its gradients reduce-scattered in buckets
   (`BucketedZero2`, exercise ex06's answer: the same bytes in fewer, larger collectives), both with one
   CPU slot. Their collectives per rank per step, their CPU per step, and the CPU one collective fewer
   saves a rank: the work the stages' per-layer collectives add, which part 2 counts as the stage's own.
5. The interpreter lock: what no number of cores removes. Each stage trains in a child process with one CPU
   slot while py-spy (`--gil`) samples, `LOCK_SAMPLING_HZ` times a second, the Python frames of the thread
   that holds the lock. The samples inside the watched steps, over the rate, are the seconds per step some
   rank held the lock: at most one thread holds it at a time, so a step on any number of cores lasts at
   least that long. The one-core floor over it is then the most that any number of cores can speed a step
   up over the one-core floor, to set against the 16-core target (`TARGET_SPEEDUP_ON_16_CORES`). py-spy
   takes fewer samples than asked for when it falls behind, never more: if anything this undercounts the
   lock's seconds, so the true bound is lower than the one printed. The lock is held while Python code runs;
   torch lets go of it while a tensor operation computes, so compute is not in the bound. The lock's seconds
   over the two-process floor are, likewise, the least ratio to that floor any machine allows the stage's
   rank threads: set against `bench_step`'s target of 2.0x.

    python benchmarks/bench_bound.py [--world-size 32] [--steps 5] [--lock-steps 8] [--preset tiny]
                                     [--stages 0,1,2,3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from bench_step import TARGET_FLOOR_RATIO, TARGET_SPEEDUP_ON_16_CORES
from floor import FLOOR_PROCESSES, Floors, floor_work

from zero_core import dist
from zero_core.cluster import VirtualCluster, machine_cores
from zero_core.context import current
from zero_core.experiment import make_stage, run_stage
from zero_core.model import preset
from zero_core.stages import TrainConfig, Zero2
from zero_core.variants.bucketed import BucketedZero2


def floor_in_threads(config: TrainConfig, world_size: int, steps: int, stage: int, threads: int) -> float:
    """The floor's median step with its work split over `threads` threads of this process."""
    barrier = threading.Barrier(threads)
    per_worker: list[list[tuple[float, float]]] = [[] for _ in range(threads)]

    def work(worker: int) -> None:
        per_worker[worker] = floor_work(config, world_size, steps, stage, worker, threads, barrier=barrier)

    workers = [threading.Thread(target=work, args=(worker,)) for worker in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    return statistics.median(max(wall for wall, _ in step) for step in list(zip(*per_worker, strict=True))[1:])


def step_and_cpu(
    config: TrainConfig, world_size: int, steps: int, stage: int, max_running: int | None
) -> tuple[float, float]:
    """With `max_running` CPU slots (None: the cluster's default): the cluster's wall time per step and the
    process's CPU seconds per step, both over the steps between the first and the last (the audited one)."""
    marks: dict[int, float] = {}

    def on_step(step: int) -> None:
        marks[step] = time.process_time()

    report = run_stage(stage, world_size, steps, config, on_step=on_step, max_running=max_running)
    return report.typical_step_seconds, (marks[steps - 2] - marks[0]) / (steps - 2)


FENCE = "bench fence"
"""The tag of the barriers that fence the steps of parts 4 and 5; part 4 leaves them out of its count of the
stage's collectives."""


def cpu_and_collectives_per_step(
    config: TrainConfig, world_size: int, steps: int, stage_class: type
) -> tuple[float, float]:
    """`stage_class` trained with one CPU slot: process CPU seconds per step over the steps after the first,
    and rank 0's collectives per step (its ledger; the barriers that fence the steps left out)."""

    def train() -> tuple[float, float]:
        trainer = stage_class(config)
        marks = []
        for step in range(steps):
            dist.barrier(tag=FENCE)
            marks.append(time.process_time())
            trainer.train_step(step, count_activations=False)
        dist.barrier(tag=FENCE)
        marks.append(time.process_time())
        entries = current().ledger.entries
        return (marks[-1] - marks[1]) / (steps - 1), sum(e.tag != FENCE for e in entries) / steps

    return VirtualCluster(world_size, max_running=1).run(train)[0]


LOCK_SAMPLING_HZ = 200


def _steps_under_watch(trainer: object, steps: int) -> None:
    """The steps part 5 counts: py-spy's samples whose stack passes through this function."""
    for step in range(1, steps + 1):
        trainer.train_step(step, count_activations=False)


def lock_child(stage: int, world_size: int, steps: int, preset_name: str, out: str) -> None:
    """Part 5's child: train `stage` with one CPU slot, a warm-up step, then `steps` watched steps between
    two barriers, and write their wall seconds to `out` as JSON."""
    config = TrainConfig(model=preset(preset_name))
    torch.set_num_threads(1)

    def train() -> float:
        trainer = make_stage(stage, config, None, None)
        trainer.train_step(0, count_activations=False)
        dist.barrier(tag=FENCE)
        started = time.perf_counter()
        _steps_under_watch(trainer, steps)
        dist.barrier(tag=FENCE)
        return time.perf_counter() - started

    seconds = VirtualCluster(world_size, max_running=1).run(train)[0]
    Path(out).write_text(json.dumps({"seconds": seconds}))


def py_spy() -> str:
    """The py-spy next to this Python (the venv's), else the one on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    found = str(beside) if beside.exists() else shutil.which("py-spy")
    if found is None:
        raise SystemExit("part 5 needs py-spy (a pinned requirement): run `make .venv/.installed` or pip install it")
    return found


def lock_seconds_per_step(stage: int, world_size: int, steps: int, preset_name: str) -> tuple[float, float]:
    """Part 5 for one stage: (wall seconds per watched step, seconds per step some rank held the lock)."""
    with tempfile.TemporaryDirectory() as scratch:
        raw, out = Path(scratch, "samples.txt"), Path(scratch, "steps.json")
        child = [sys.executable, __file__, "--lock-child", str(stage), "--world-size", str(world_size)]
        child += ["--lock-steps", str(steps), "--preset", preset_name, "--lock-out", str(out)]
        command = [py_spy(), "record", "--gil", "--nonblocking", "--rate", str(LOCK_SAMPLING_HZ), "--format", "raw"]
        done = subprocess.run([*command, "-o", str(raw), "--", *child], capture_output=True, text=True, timeout=600)
        if done.returncode != 0 or not out.exists() or not raw.exists():
            raise SystemExit(
                f"part 5: py-spy could not sample ZeRO-{stage}'s child (exit {done.returncode}): "
                f"{(done.stderr.strip().splitlines() or ['no message'])[-1]}. On Linux py-spy needs leave to trace "
                "its child (ptrace; containers may forbid it), on macOS root."
            )
        seconds = json.loads(out.read_text())["seconds"]
        watched = f"{_steps_under_watch.__name__} ("
        samples = sum(int(line.rsplit(" ", 1)[1]) for line in raw.read_text().splitlines() if watched in line)
    return seconds / steps, samples / LOCK_SAMPLING_HZ / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lock-steps", type=int, default=8, help="part 5's watched steps per stage")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--lock-child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--lock-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.lock_child is not None:
        lock_child(args.lock_child, args.world_size, args.lock_steps, args.preset, args.lock_out)
        return
    if args.steps < 3:
        raise SystemExit("--steps must be at least 3: the first step warms up and the last is audited")
    if args.lock_steps < 1:
        raise SystemExit("--lock-steps must be at least 1")
    config = TrainConfig(model=preset(args.preset))
    cores = len(machine_cores())
    stages = [int(s) for s in args.stages.split(",")]
    torch.set_num_threads(1)
    print(f"preset {args.preset}, N = {args.world_size}, {cores} cores; floors: median step after the first")
    p = FLOOR_PROCESSES
    print(
        f"stage  1 thread  {p} threads  {p} processes  threads/processes  one-slot CPU / 1-thread floor  "
        f"{VirtualCluster(1).max_running}-slot CPU / one-slot"
    )
    floors = Floors()
    one_core_floor: dict[int, float] = {}
    floor: dict[int, float] = {}
    try:
        for stage in stages:
            one = floors.one_process(config, args.world_size, args.steps, stage)
            one_core_floor[stage] = one.seconds
            many = floors.floor(config, args.world_size, args.steps, stage)
            floor[stage] = many.seconds
            threaded = floor_in_threads(config, args.world_size, args.steps, stage, p)
            _, alone = step_and_cpu(config, args.world_size, args.steps, stage, 1)
            _, side_by_side = step_and_cpu(config, args.world_size, args.steps, stage, None)
            print(
                f"ZeRO-{stage} {one.seconds:8.3f}s {threaded:9.3f}s {many.seconds:11.3f}s "
                f"{threaded / many.seconds:17.2f}x  {alone / one.cpu_seconds:28.2f}x  {side_by_side / alone:22.2f}x"
            )
    finally:
        floors.close()
    plain = cpu_and_collectives_per_step(config, args.world_size, args.steps, Zero2)
    bucketed = cpu_and_collectives_per_step(config, args.world_size, args.steps, BucketedZero2)
    print("\nwhat a collective costs (one CPU slot)")
    print("stage               collectives/rank/step  CPU/step")
    for name, (cpu, collectives) in (("ZeRO-2", plain), ("ZeRO-2, bucketed", bucketed)):
        print(f"{name:18s}  {collectives:21.0f}  {cpu:7.3f}s")
    fewer = plain[1] - bucketed[1]
    if fewer > 0:
        saved = (plain[0] - bucketed[0]) / fewer / args.world_size
        print(f"each collective fewer saves a rank {saved * 1e6:.0f} us of CPU per step")
    print(f"\nthe interpreter lock (one CPU slot, {args.lock_steps} steps, py-spy --gil at {LOCK_SAMPLING_HZ} Hz):")
    print("no number of cores makes a step shorter than the seconds some rank thread holds the lock in it")
    print(
        f"stage   step     lock held  lock s/step  1-core floor  any cores: at most this much faster than it  "
        f"so at least this x the {p}-process floor"
    )
    for stage in stages:
        step, locked = lock_seconds_per_step(stage, args.world_size, args.lock_steps, args.preset)
        bound = one_core_floor[stage] / locked if locked > 0 else float("inf")
        verdict = "not ruled out" if bound >= TARGET_SPEEDUP_ON_16_CORES else "out of reach for rank threads"
        least = locked / floor[stage]
        reach = "within reach" if least <= TARGET_FLOOR_RATIO else "out of reach for rank threads"
        print(
            f"ZeRO-{stage}  {step:6.3f}s  {locked / step:8.0%}  {locked:10.3f}s  {one_core_floor[stage]:11.3f}s  "
            f"{bound:5.1f}x (the 16-core target, {TARGET_SPEEDUP_ON_16_CORES:.0f}x: {verdict})  "
            f"{least:5.2f}x (the {TARGET_FLOOR_RATIO}x target: {reach})"
        )


if __name__ == "__main__":
    main()
