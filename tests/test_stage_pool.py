"""Stages trained side by side in worker processes (`zero_core.stage_pool`, `compare --jobs`): the same
training, ledger and memory as in one process, and a clear error when a worker's stage fails or the worker
dies."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys

import psutil
import pytest
import torch

from zero_core.cli import main
from zero_core.cluster import VirtualCluster, machine_cores
from zero_core.experiment import compare_stages
from zero_core.memory import TrackerSnapshot
from zero_core.model import preset
from zero_core.stage_pool import SMALLEST_WORLD_FOR_WORKERS, WorkerFailed, core_shares, default_jobs
from zero_core.stages import TrainConfig

CONFIG = TrainConfig(model=preset("micro"))
STAGES: list[int | str] = [0, 3, "hpz"]
STEPS = 2


def pool_workers(parent: psutil.Process) -> list[psutil.Process]:
    """The stage pool's workers that `parent` started: forked by multiprocessing's forkserver (the server is
    `parent`'s child, the workers are its children), or spawned (`spawn_main`) where there is no forkserver."""
    workers = []
    for process in parent.children(recursive=True):
        try:
            command = " ".join(process.cmdline())
            if "spawn_main" in command or ("forkserver" in command and process.ppid() != parent.pid):
                workers.append(process)
        except psutil.NoSuchProcess:
            continue
    return workers


def _untimed(entries: list) -> list[tuple]:
    """Ledger entries or timeline events without their clock fields, which no two runs share."""
    clocks = {"seconds", "started_s", "wait_started_s", "waited_s", "time_s"}
    return [tuple(v for k, v in entry._asdict().items() if k not in clocks) for entry in entries]


def test_workers_train_and_measure_exactly_what_one_process_does() -> None:
    alone = compare_stages(STAGES, 4, STEPS, CONFIG, gpus_per_node=2)
    steps: list[int] = []
    pooled = compare_stages(STAGES, 4, STEPS, CONFIG, gpus_per_node=2, jobs=2, on_step=steps.append)

    assert sorted(steps) == sorted(list(range(STEPS)) * len(STAGES)), "every stage's steps reach on_step here"
    assert [r.stage for r in pooled] == STAGES
    for one, other in zip(alone, pooled, strict=True):
        assert one.losses == other.losses
        assert one.master_weights.keys() == other.master_weights.keys()
        for name, weights in one.master_weights.items():
            assert torch.equal(weights, other.master_weights[name]), name
        for rank in range(4):
            assert _untimed(one.ledger.ranks[rank].entries) == _untimed(other.ledger.ranks[rank].entries)
            assert isinstance(other.trackers[rank], TrackerSnapshot)
            assert _untimed(one.trackers[rank].timeline) == _untimed(other.trackers[rank].timeline)
            assert one.trackers[rank].leftovers == other.trackers[rank].leftovers
        assert one.peak_bytes_by_category_max == other.peak_bytes_by_category_max
        assert one.model_state_bytes_by_category_max == other.model_state_bytes_by_category_max
        assert one.untracked_bytes_max == other.untracked_bytes_max == 0
        assert one.flops_per_step_mean == other.flops_per_step_mean


def test_a_stage_that_raises_in_a_worker_names_the_stage_and_the_error() -> None:
    too_small = TrainConfig(model=dataclasses.replace(preset("micro"), vocab_size=10))
    with pytest.raises(WorkerFailed, match=r"ZeRO-\d failed in its worker process: .*vocab_size 10 is smaller"):
        compare_stages([0, 3], 2, 1, too_small, jobs=2)


def test_a_worker_killed_mid_stage_is_reported_and_the_others_are_stopped() -> None:
    """SIGKILL, as the kernel's out-of-memory killer sends it: the worker cannot say anything itself."""
    workers: list[psutil.Process] = []

    def kill_one_worker(step: int) -> None:
        if not workers:
            workers.extend(pool_workers(psutil.Process()))
            training = next(w for w in workers if w.num_threads() > 4)  # its 4 rank threads are up
            os.kill(training.pid, signal.SIGKILL)

    # The first step reported is one worker's; the one killed may be the other, still before its first report
    # on a loaded machine: the pool then says "while starting". Either way it must name the signal and the cause.
    with pytest.raises(WorkerFailed, match=r"was killed by signal 9 while (training|starting) .*out of memory\?"):
        compare_stages([0, 3], 4, 40, CONFIG, jobs=2, on_step=kill_one_worker)
    assert len(workers) == 2
    assert not any(worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE for worker in workers)


def test_workers_leave_when_the_process_that_started_them_is_killed() -> None:
    """No orphan goes on training for nobody: a worker watches its parent and exits with it, also when
    multiprocessing's forkserver, not the parent, forked it (`stage_pool.worker_context`)."""
    script = (
        "from zero_core.experiment import compare_stages\n"
        "from zero_core.model import preset\n"
        "from zero_core.stages import TrainConfig\n"
        "compare_stages([0, 3], 4, 10_000, TrainConfig(model=preset('micro')), jobs=2,\n"
        "               on_step=lambda step: print('step', step, flush=True))\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    # The server's listening socket: its folder (`pymp-...` in the temporary folder) is the killed parent's to
    # remove, and a parent killed by SIGKILL never does; the test removes it instead.
    sockets: list[str] = []
    try:
        assert parent.stdout is not None and parent.stdout.readline().startswith("step")
        workers = pool_workers(psutil.Process(parent.pid))
        assert len(workers) == 2
        if "forkserver" in multiprocessing.get_all_start_methods():  # forked by the server, which imported torch
            assert all(worker.ppid() != parent.pid for worker in workers), "the workers were not forked"
            server = psutil.Process(workers[0].ppid())
            sockets = [c.laddr for c in server.net_connections(kind="unix") if "/pymp-" in c.laddr]
    finally:
        parent.kill()
        parent.wait()
    _, alive = psutil.wait_procs(workers, timeout=15)
    for socket in sockets:
        shutil.rmtree(os.path.dirname(socket), ignore_errors=True)
    assert not alive, f"{len(alive)} worker(s) still running 15 s after their parent was killed"


def test_jobs_default_to_one_per_core_from_the_smallest_world_that_repays_a_worker() -> None:
    cores = len(machine_cores())
    assert default_jobs(4, SMALLEST_WORLD_FOR_WORKERS - 1) == 1
    assert default_jobs(4, SMALLEST_WORLD_FOR_WORKERS) == min(4, cores)
    assert default_jobs(1, 256) == 1
    shares = core_shares(cores + 3)
    assert len(shares) == cores and sorted(c for share in shares for c in share) == machine_cores()


def test_compare_jobs_says_how_stages_ran_and_records_it(tmp_path, capsys) -> None:
    out = tmp_path / "compare.json"
    argv = ["compare", "--world-size", "2", "--steps", "1", "--stages", "0,2", "--preset", "micro"]
    assert main([*argv, "--no-progress", "--jobs", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Training 2 stages 2 at a time, each in its own process" in text
    data = json.loads(out.read_text())
    assert data["jobs"] == 2 and all(e["bit_identical"] for e in data["equivalence"])

    assert main([*argv, "--jobs", "0"]) == 2
    assert "--jobs must be at least 1, got 0" in capsys.readouterr().err


def test_a_machine_without_cpu_affinity_uses_every_core(monkeypatch) -> None:
    """macOS has no sched_getaffinity: the cluster's CPU slots and compare's workers count os.cpu_count()."""
    monkeypatch.delattr(os, "sched_getaffinity")
    assert machine_cores() == list(range(os.cpu_count() or 1))
    assert VirtualCluster(2).max_running == len(machine_cores()) + 1
    assert default_jobs(4, 256) == min(4, os.cpu_count() or 1)
