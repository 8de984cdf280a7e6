"""Several stages trained at once, each in a worker process on its own share of the machine's cores.

The rank threads of one virtual cluster share one interpreter lock, so a single run keeps about one and a
half cores busy however many the machine has (`benchmarks/bench_step.py` measures it). The stages that
`compare` trains are independent runs of one configuration, so it can train them side by side: `jobs`
worker processes, each pinned to its own share of the cores (on Linux), each taking the next stage when it
is done with one. A stage's step times are therefore measured on its worker's share of the cores, whatever
the other workers are doing, and its losses, weights, ledger and memory are those of a run in one process:
the same code on the same seed (a test compares the two bit for bit). The workers are forked from
multiprocessing's forkserver (`worker_context`), which imports torch once per process: a later pool starts
in a fraction of the first one's time, and every worker has the environment the process had when its first
pool started.

A report comes back pickled, its memory trackers as `TrackerSnapshot`s (peaks, timeline, leftovers: what
the report's readers use). A worker whose stage raises sends the error back as text and stops; one that
dies (killed, out of memory) is noticed from its exit code. Either way `train_in_workers` stops the other
workers and raises `WorkerFailed`, naming the stage.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import signal
import threading
from collections.abc import Callable
from typing import Any

from zero_core.cluster import ClusterError, machine_cores
from zero_core.memory import TrackerSnapshot
from zero_core.report import StageReport
from zero_core.stages import TrainConfig

SMALLEST_WORLD_FOR_WORKERS = 32
"""Below this N a run takes a few seconds, and a pool's first start in a process (its forkserver importing
torch) would cost more than training the stages side by side saves."""

_POLL_S = 0.5


class WorkerFailed(ClusterError):
    """A stage's run in a worker process raised, or the worker died."""


def default_jobs(stages: int, world_size: int) -> int:
    """One worker per core, at most one per stage, from N = `SMALLEST_WORLD_FOR_WORKERS` on; else 1."""
    if world_size < SMALLEST_WORLD_FOR_WORKERS:
        return 1
    return max(1, min(stages, len(machine_cores())))


def core_shares(jobs: int) -> list[list[int]]:
    """The machine's cores cut into `jobs` contiguous shares, as even as they go (at most one per core)."""
    cores = machine_cores()
    jobs = min(jobs, len(cores))
    return [cores[i * len(cores) // jobs : (i + 1) * len(cores) // jobs] for i in range(jobs)]


def train_in_workers(
    run_stage: Callable[..., StageReport],
    stages: list[int | str],
    world_size: int,
    steps: int,
    config: TrainConfig,
    jobs: int,
    on_step: Callable[[int], None] | None = None,
    gpus_per_node: int | None = None,
) -> list[StageReport]:
    """`run_stage` for each of `stages`, `jobs` at a time in worker processes; the reports in `stages`' order.

    `run_stage` is `zero_core.experiment.run_stage`, handed in (a module-level function: a worker finds it by
    name) so that this pool does not import what it runs.

    `on_step(step)` runs here, in the calling process, after any stage's rank 0 finishes a step.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    context = worker_context()
    tasks, results = context.Queue(), context.Queue()
    for item in enumerate(stages):
        tasks.put(item)
    shares = core_shares(min(jobs, len(stages)))
    for _ in shares:
        tasks.put(None)
    run = (run_stage, world_size, steps, config, gpus_per_node)
    workers = [context.Process(target=_work, args=(share, tasks, results, run), daemon=True) for share in shares]
    for worker in workers:
        worker.start()
    reports: list[StageReport | None] = [None] * len(stages)
    running: dict[int, int] = {}
    """The stage (its index) each worker trains, by pid."""
    try:
        while any(report is None for report in reports):
            message = _next_message(results)
            _raise_if_a_worker_died(workers, running, reports, stages)
            if message is None:  # everything the workers sent is read: none of it is still on its way
                if all(worker.exitcode is not None for worker in workers):
                    missing = ", ".join(_label(stage) for stage, r in zip(stages, reports, strict=True) if r is None)
                    raise WorkerFailed(f"every worker process exited before training {missing}")
                continue
            kind, index, value = message
            if kind == "started":
                running[value] = index
            elif kind == "step":
                if on_step is not None:
                    on_step(value)
            elif kind == "report":
                reports[index] = pickle.loads(value)
            else:
                raise WorkerFailed(f"{_label(stages[index])} failed in its worker process: {value}")
    finally:
        for worker in workers:
            worker.join(timeout=_POLL_S if all(r is not None for r in reports) else 0)
            if worker.is_alive():
                worker.terminate()
                worker.join()
    return reports  # type: ignore[return-value]


def worker_context() -> Any:
    """The multiprocessing context of the course's worker processes (this pool's, the benchmarks' floors):
    the forkserver where the platform has one, else spawn. A worker is forked from a server process that
    imported torch once and has run nothing since (so it has no thread pool that a fork could copy mid-use),
    instead of being a fresh interpreter that imports torch again, for every worker of every pool."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch"])
    return context


def _next_message(results: Any) -> tuple | None:
    try:
        return results.get(timeout=_POLL_S)
    except queue.Empty:
        return None


def _raise_if_a_worker_died(
    workers: list, running: dict[int, int], reports: list[StageReport | None], stages: list[int | str]
) -> None:
    """Raise if a worker ended abnormally before handing in the stage it trained (or before starting one)."""
    for worker in workers:
        code = worker.exitcode
        if not code:  # running (None), or done with its stages (0)
            continue
        index = running.get(worker.pid)
        if index is not None and reports[index] is not None:
            continue  # it died after handing its stage in: the others train the rest
        what = f"training {_label(stages[index])}" if index is not None else "starting"
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        raise WorkerFailed(
            f"a worker process {how} while {what}"
            + (" (out of memory? a smaller --world-size or --jobs 1 needs less)" if code == -9 else "")
        )


def _label(stage: int | str) -> str:
    return f"ZeRO-{stage}" if isinstance(stage, int) else f"stage {stage!r}"


def _work(share: list[int], tasks: Any, results: Any, run: tuple) -> None:
    """A worker: pin to `share`, then train stages from `tasks` until it hands out None or one fails."""
    threading.Thread(target=_exit_with_parent, name="exit with the parent", daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the caller, which stops the workers: one message
    if share and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, share)  # the cluster sizes its CPU slots from this (`VirtualCluster`)
    run_stage, world_size, steps, config, gpus_per_node = run
    while (item := tasks.get()) is not None:
        index, stage = item
        results.put(("started", index, os.getpid()))
        try:
            report = run_stage(
                stage,
                world_size,
                steps,
                config,
                on_step=lambda step, i=index: results.put(("step", i, step)),
                gpus_per_node=gpus_per_node,
            )
        except Exception as error:  # sent back as text: not every exception survives pickling
            results.put(("error", index, f"{type(error).__name__}: {error}"))
            return
        report.trackers = [TrackerSnapshot.of(tracker) for tracker in report.trackers]
        # Pickled by value: torch would otherwise send the tensors as shared memory that this worker must keep
        # alive until the caller has read them.
        results.put(("report", index, pickle.dumps(report)))


def _exit_with_parent() -> None:
    """A worker whose parent died (killed, say) has no one to send its report to: it leaves too, at once."""
    multiprocessing.parent_process().join()
    os._exit(1)
