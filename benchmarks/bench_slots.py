"""How many rank threads should run at once on this machine? Each stage at N = 32 with 1, 2, 3, ... CPU slots.

A `VirtualCluster` lets at most `max_running` rank threads run their own code at a time (its CPU slots;
by default one per core, plus one). More slots let one rank compute while another waits for the
interpreter lock; too many trade that lock back and forth at every tensor operation, and every trade
costs CPU. Where the best count lies depends on the machine's cores and how fast it hands the lock
over, so this measures it: per stage and slot count, the cluster's step time and the process's CPU
seconds per step (the steps between the first and the audited last), in one run, with the default's
column marked and each stage's fastest count named. Also each run's peak RSS: ranks that run at once hold
their activations at once, and glibc gives threads that contend for its heap arenas of their own (up to 8
per core; `MALLOC_ARENA_MAX` sets it), so slots cost memory too.

    python benchmarks/bench_slots.py [--world-size 32] [--steps 5] [--preset tiny] [--stages 0,1,2,3]
                                     [--slots 1,2,3,5,9,17]
"""

from __future__ import annotations

import argparse

import torch
from bench_bound import step_and_cpu
from bench_step import high_water_rss_bytes, reset_peak_rss

from zero_core.cluster import VirtualCluster, machine_cores
from zero_core.model import preset
from zero_core.stages import TrainConfig


def slots_run(config: TrainConfig, world_size: int, steps: int, stage: int, slots: int) -> tuple[float, float, int]:
    """One run with `slots` CPU slots: its step time, CPU seconds per step and peak RSS."""
    reset_peak_rss()
    seconds, cpu = step_and_cpu(config, world_size, steps, stage, slots)
    return seconds, cpu, high_water_rss_bytes()


def main() -> None:
    default = VirtualCluster(1).max_running
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--stages", default="0,1,2,3")
    parser.add_argument("--slots", default="1,2,3,5,9,17", help="slot counts to try (the default is added)")
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3: the first step warms up and the last is audited")
    try:
        stages = [int(s) for s in args.stages.split(",")]
        counts = sorted({int(s) for s in args.slots.split(",")} | {default})
    except ValueError:
        parser.error("--stages and --slots take numbers separated by commas")
    counts = [k for k in counts if 1 <= k <= args.world_size]
    config = TrainConfig(model=preset(args.preset))
    torch.set_num_threads(1)
    print(
        f"preset {args.preset}, N = {args.world_size}, {len(machine_cores())} cores; per slot count, the step time, "
        f"the CPU seconds per step and the run's peak RSS (* the default, {default} slots)"
    )
    print("stage   " + "  ".join(f"{f'{k} slots' + ('*' if k == default else ''):>24s}" for k in counts) + "  fastest")
    for stage in stages:
        measured = {k: slots_run(config, args.world_size, args.steps, stage, k) for k in counts}
        fastest = min(counts, key=lambda k: measured[k][0])
        cells = "  ".join(f"{step:7.3f}s {cpu:5.2f}cpu {rss / 1e6:4.0f}MB" for step, cpu, rss in measured.values())
        print(
            f"ZeRO-{stage}  {cells}  {fastest} slots "
            f"(the default takes {measured[default][0] / measured[fastest][0]:.2f}x its time)"
        )


if __name__ == "__main__":
    main()
