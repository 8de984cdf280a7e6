"""`torchrun ... -m zero_core.launch`: the same ZeRO stages on a real `torch.distributed` process group.

    torchrun --nproc-per-node 4 -m zero_core.launch --stage 3 --steps 5 --preset micro

One process per rank, gloo on CPU (NCCL when every rank has its own CUDA device). Each process trains
with the stage code the virtual cluster runs, through `zero_core.dist` on a `TorchBackend`, so its
ledger and memory tracker count exactly as a virtual rank's do. Rank 0 gathers every rank's
measurements (with `torch.distributed.gather_object`, outside the ledger), builds the `StageReport`
with the virtual run's own code (`report.build_report`), and prints the same tables as
`python -m zero_core compare`; `--json` writes the same schema.

`--diverge KIND` runs, instead of training, one of the programs of `zero_core.divergent_ranks`, whose ranks call
different collectives: with `--timeout` and `--stacks-after`, what a real process group does when ranks part.

Failures end in one line per rank, never a hang: bad arguments, no torchrun environment, or a world size
the run cannot use exit with code 2; a rank that dies or stops responding makes the others exit with
code 1 within `--timeout` seconds, naming the collective they were waiting in.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as torch_dist
from tqdm import tqdm

from zero_core import dist
from zero_core.backends.faulty import FaultyBackend
from zero_core.backends.torch_distributed import (
    CollectiveFailed,
    TorchBackend,
    error_gist,
    join_process_group,
    process_context,
)
from zero_core.cli import predicted
from zero_core.cli.compare import MAX_STEPS, parse_stages, render, write_json
from zero_core.cli.errors import UsageError
from zero_core.cli.render import table
from zero_core.cluster import MAX_WORLD_SIZE
from zero_core.comm import CommLedger
from zero_core.context import activate
from zero_core.divergent_ranks import END_OF_RUN_TAG, PROGRAMS, TORCHRUN_VARIABLES
from zero_core.experiment import equivalence, run_stage, train_on_rank
from zero_core.long_lived import freeze_what_is_loaded
from zero_core.memory import TrackerSnapshot
from zero_core.model import PRESETS, count_parameters, preset
from zero_core.report import StageReport, build_report
from zero_core.stages import TrainConfig
from zero_core.stages.base import ZERO1_GRAD_SYNCS

PROG = "python -m zero_core.launch"
EXAMPLE = "torchrun --nproc-per-node 4 -m zero_core.launch --stage 3"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        sys.stderr.write(f"{PROG}: error: {message} (see --help)\n")
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--stages", "--stage", default="3", help="stage, or comma-separated stages like 0,3 (default 3)")
    p.add_argument("--steps", type=int, default=3, help="training steps per stage (default 3)")
    p.add_argument("--preset", default="tiny", help=f"model size: {', '.join(PRESETS)} (default tiny)")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp16", "fp32"], help="training precision")
    p.add_argument("--zero1-grad-sync", default="reduce_scatter", choices=ZERO1_GRAD_SYNCS)
    p.add_argument("--seed", type=int, default=0)
    predicted.add_arguments(p)
    p.add_argument(
        "--backend", default="auto", choices=["auto", "gloo", "nccl"], help="auto: NCCL if every rank has a GPU"
    )
    p.add_argument("--timeout", type=float, default=30.0, help="seconds a rank waits for the others (default 30)")
    p.add_argument("--json", metavar="PATH", help="also write every measurement as JSON (the compare schema)")
    p.add_argument("--save", metavar="PATH", help="also torch.save losses, fp32 master weights and all ledgers")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--check-virtual", action="store_true", help="rank 0 also runs N virtual ranks and compares")
    p.add_argument(
        "--stacks-after",
        type=float,
        metavar="SECONDS",
        help="if a rank is still running after SECONDS, print its threads' stacks to stderr (to see where a run hangs)",
    )
    p.add_argument(
        "--diverge",
        choices=list(PROGRAMS),
        help="instead of training, run a program whose ranks call different collectives (zero_core.divergent_ranks)",
    )
    p.add_argument("--fail-rank", type=int, default=-1, help=argparse.SUPPRESS)
    p.add_argument("--fail-at-step", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--fail-mode", default="exit", choices=["exit", "hang"], help=argparse.SUPPRESS)
    p.add_argument("--slow-report", type=float, default=0.0, help=argparse.SUPPRESS)  # rank 0 first sleeps SECONDS
    return p


@dataclass(frozen=True)
class TorchrunEnv:
    """Who this process is, as torchrun says in its environment variables."""

    rank: int
    world_size: int
    local_rank: int


def torchrun_env(environ: dict[str, str] | os._Environ) -> TorchrunEnv:
    """This process's rank and world size; a `UsageError` outside torchrun or for a world size we cannot use.

    Unusable: more than `MAX_WORLD_SIZE` processes, since every real run must be reproducible on the
    virtual cluster, which is what the real run is checked against.
    """
    missing = [name for name in TORCHRUN_VARIABLES if name not in environ]
    if missing:
        raise UsageError(f"{', '.join(missing)} not set: start me with torchrun, e.g. `{EXAMPLE}`")
    try:
        env = TorchrunEnv(int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ["LOCAL_RANK"]))
    except ValueError:
        raise UsageError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (torchrun sets them)") from None
    if not 1 <= env.world_size <= MAX_WORLD_SIZE:
        raise UsageError(
            f"world size {env.world_size} is not usable: a real run must be reproducible on the virtual cluster, "
            f"which has 1 to {MAX_WORLD_SIZE} ranks; launch fewer processes"
        )
    if not 0 <= env.rank < env.world_size:
        raise UsageError(f"RANK {env.rank} is outside 0..{env.world_size - 1}")
    return env


def check(args: argparse.Namespace, env: TorchrunEnv) -> list[int]:
    """The stages to run, after checking every argument the way `compare` does; `UsageError` otherwise."""
    if not 1 <= args.steps <= MAX_STEPS:
        raise UsageError(f"--steps must be between 1 and {MAX_STEPS}, got {args.steps}")
    if args.preset not in PRESETS:
        raise UsageError(f"unknown --preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
    if args.timeout <= 0:
        raise UsageError(f"--timeout must be positive, got {args.timeout}")
    if args.stacks_after is not None and args.stacks_after <= 0:
        raise UsageError(f"--stacks-after must be positive, got {args.stacks_after}")
    predicted.check(args)
    if args.fail_rank >= env.world_size:
        raise UsageError(f"--fail-rank {args.fail_rank} is outside 0..{env.world_size - 1}")
    for option, path in (("--json", args.json), ("--save", args.save)):
        if path and not Path(path).resolve().parent.is_dir():
            raise UsageError(f"{option}: folder {Path(path).resolve().parent} does not exist")
    return parse_stages(args.stages)


def train_stage(
    stage: int, config: TrainConfig, steps: int, backend: TorchBackend | FaultyBackend, bar: tqdm | None
) -> tuple[StageReport, list[int | None]] | None:
    """Train `stage` on this rank; rank 0 gathers every rank's measurements and returns the report, with
    each rank's CUDA allocator peak (None off CUDA)."""
    ctx = process_context(backend, seed=config.seed)
    on_cuda = ctx.device.type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    with activate(ctx, whole_process=True):
        result = train_on_rank(config, stage, steps, None, None if bar is None else lambda step: bar.update())
    cuda_peak = torch.cuda.max_memory_allocated(ctx.device) if on_cuda else None
    mine = (result, ctx.ledger, TrackerSnapshot.of(ctx.tracker), cuda_peak)
    gathered = [None] * backend.world_size if backend.rank == 0 else None
    try:
        torch_dist.gather_object(mine, gathered, dst=0)
    except RuntimeError as error:
        raise CollectiveFailed(
            f"rank {backend.rank}: gathering the ZeRO-{stage} measurements on rank 0 failed ({error_gist(error)}). "
            "Another rank has most likely died or stopped responding"
        ) from error
    if backend.rank != 0:
        return None
    ledger = CommLedger(backend.world_size)
    ledger.ranks = [ranks_ledger for _, ranks_ledger, _, _ in gathered]
    results = [ranks_result for ranks_result, _, _, _ in gathered]
    trackers = [t for _, _, t, _ in gathered]
    report = build_report(stage, backend.world_size, steps, config, ledger, trackers, results, shared_clock=False)
    return report, [peak for _, _, _, peak in gathered]


def against_cuda_allocator(reports: list[StageReport], cuda_peaks: list[list[int | None]]) -> str:
    """The tracker's peak (every storage a rank allocated) beside what CUDA's caching allocator saw.

    `torch.cuda.max_memory_allocated` also counts what the tracker leaves out on purpose: the CUDA
    context's workspaces (cuBLAS), NCCL's buffers, and the model built on the host never reaches it."""
    rows = []
    for report, peaks in zip(reports, cuda_peaks, strict=True):
        peak = max(p for p in peaks if p is not None)
        rows.append(
            [
                f"ZeRO-{report.stage}",
                f"{report.peak_bytes_max / 1e6:.3f} MB",
                f"{peak / 1e6:.3f} MB",
                f"{peak / report.peak_bytes_max:.2f}x" if report.peak_bytes_max else "-",
            ]
        )
    headers = ["stage", "tracker peak (max over ranks)", "torch.cuda.max_memory_allocated", "allocator / tracker"]
    return table(headers, rows, title="Peak memory per GPU, measured two ways")


def save_runs(path: Path, backend: TorchBackend | FaultyBackend, reports: list[StageReport]) -> None:
    """Plain tensors, lists and dicts, so that `torch.load(path)` (weights only) reads them back."""
    torch.save(
        {
            "world_size": backend.world_size,
            "backend": backend.name,
            "stages": {
                r.stage: {
                    "losses": r.losses,
                    "master_weights": r.master_weights,
                    "ledgers": [[e._asdict() for e in rank.entries] for rank in r.ledger.ranks],
                }
                for r in reports
            },
        },
        path,
    )


def run(args: argparse.Namespace, env: TorchrunEnv, stages: list[int]) -> int:
    try:
        backend: TorchBackend | FaultyBackend = join_process_group(args.backend, args.timeout, env.local_rank)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.diverge:
        with activate(process_context(backend), whole_process=True):
            PROGRAMS[args.diverge]()
            dist.barrier(tag=END_OF_RUN_TAG)
        return 0
    if env.rank == args.fail_rank:
        backend = FaultyBackend(backend, args.fail_at_step, args.fail_mode)
    model = preset(args.preset)
    config = TrainConfig(model=model, precision=args.precision, seed=args.seed, zero1_grad_sync=args.zero1_grad_sync)
    psi = count_parameters(model)
    lead = env.rank == 0
    if lead:
        devices = "CPU" if backend.name == "gloo" else "one GPU each"
        print(
            f"ZeRO on {env.world_size} processes ({backend.name}, {devices}): {args.preset} GPT, Ψ = {psi:,} "
            f"parameters, {args.precision}, {args.steps} step(s), micro-batch {model.micro_batch_size}x"
            f"{model.block_size} per process",
            flush=True,
        )
    total = len(stages) * args.steps
    quiet = args.no_progress or not lead
    with tqdm(total=total, desc="training", unit="step", disable=quiet, file=sys.stderr, leave=False) as bar:
        trained = [train_stage(stage, config, args.steps, backend, bar if lead else None) for stage in stages]
    # Every collective is done: a barrier outside the ledger, then the other ranks leave (`leave`) while rank 0
    # reports alone. They used to wait for its output in a barrier after it, under the group's timeout, which
    # a long report outlasts (`--check-virtual` trains every stage again), failing a finished run.
    torch_dist.barrier()
    if lead:
        time.sleep(args.slow_report)  # a report that outlasts --timeout, for the tests
        reports = [report for report, _ in trained]
        cuda_peaks = [peaks for _, peaks in trained]
        reference = next((r for r in reports if r.stage == 0), reports[0])
        equivalences = [equivalence(reference, r) for r in reports]
        print()
        print(render(reports, equivalences, reference), flush=True)
        compare_args = argparse.Namespace(**vars(args), world_size=env.world_size)
        nodes = predicted.prediction_topology(env.world_size, None, args.machine)
        times = predicted.rows(reports, nodes, compare_args)
        print()
        print(predicted.render(times, nodes, compare_args), flush=True)
        if any(peak is not None for peaks in cuda_peaks for peak in peaks):
            print()
            print(against_cuda_allocator(reports, cuda_peaks), flush=True)
        if args.check_virtual:
            print()
            print(against_virtual(reports, config), flush=True)
        if args.json:
            write_json(Path(args.json), compare_args, psi, reports, equivalences, predictions=times)
            print(f"\nwrote {args.json}")
        if args.save:
            save_runs(Path(args.save), backend, reports)
            print(f"\nwrote {args.save}")
    return 0


def against_virtual(reports: list[StageReport], config: TrainConfig) -> str:
    """The same stages on as many virtual ranks: how far the real run's losses, weights and ledger are."""

    def bytes_by_rank(report: StageReport) -> list[list[tuple]]:
        return [[(e.op, e.tag, e.bytes_sent, e.bytes_received) for e in r.entries] for r in report.ledger.ranks]

    rows = []
    for real in reports:
        virtual = run_stage(real.stage, real.world_size, real.steps, config)
        same = equivalence(virtual, real)
        ledgers_equal = bytes_by_rank(real) == bytes_by_rank(virtual)
        rows.append(
            [
                f"ZeRO-{real.stage}",
                f"{same.max_loss_delta:.1e}",
                f"{same.max_master_delta:.1e}",
                "yes" if same.bit_identical else "no",
                "equal" if ledgers_equal else "DIFFERENT",
            ]
        )
    headers = ["stage", "max |Δloss|", "max |Δmaster weight|", "bit-identical", "ledger bytes, rank by rank"]
    return table(headers, rows, title=f"Against {reports[0].world_size} virtual ranks (same stage, data, steps)")


def _stopped_by_torchrun(signum: int, frame: object) -> None:
    """torchrun stops every rank with SIGTERM when one of them fails (or when it is interrupted itself)."""
    rank = os.environ.get("RANK", "?")
    sys.stderr.write(f"{PROG}: rank {rank}: stopped by SIGTERM (torchrun stops the others when a rank fails)\n")
    os._exit(1)


def main(argv: list[str] | None = None, *, program: bool = False) -> int:
    """One rank's run; `program`: the process is this rank's (`python -m zero_core.launch`), so what is loaded
    stays off the cycle collector (`zero_core.long_lived`), which a caller's own process (a test) keeps."""
    args = build_parser().parse_args(argv)
    if program:
        freeze_what_is_loaded()
    try:
        env = torchrun_env(os.environ)
        stages = check(args, env)
    except UsageError as error:
        sys.stderr.write(f"{PROG}: error: {error}\n")
        return 2
    signal.signal(signal.SIGTERM, _stopped_by_torchrun)
    if args.stacks_after is not None:
        faulthandler.dump_traceback_later(args.stacks_after, file=sys.stderr)
    try:
        exit_code = run(args, env, stages)
    except UsageError as error:
        sys.stderr.write(f"{PROG}: rank {env.rank}: error: {error}\n")
        exit_code = 2
    except CollectiveFailed as error:
        message = str(error) if str(error).startswith("rank ") else f"rank {env.rank}: {error}"
        sys.stderr.write(f"{PROG}: {message}\n")
        return 1
    return exit_code


def leave(exit_code: int) -> None:
    """Exit without the interpreter's finalization and without destroying the process group, once every
    rank has passed the closing barrier (or one has failed) and every file it writes is written and closed;
    only the standard streams remain to flush.

    Tearing torch down in the process has failed a finished run in two ways, both on gloo:
    - at the interpreter's exit, in about one run in twenty, a rank aborted ("terminate called without an
      active exception": a C++ thread still joinable, with no Python frame left), and torchrun failed the run;
    - `destroy_process_group` deadlocked (torch 2.6, four processes, once in a CI run; the stacks of the
      rank left behind): it frees the group while holding the interpreter lock, and the group's destructor
      joins gloo's worker thread, which was still freeing a finished collective's tensors and waited for
      that same lock to drop their Python objects. No thread of the rank could take the lock again, so no
      bound written in Python could end the wait. A failed rank's group can hang the same way, waiting on
      a dead peer.
    The process ends here instead, and the operating system closes the group's connections.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


if __name__ == "__main__":
    leave(main(program=True))
