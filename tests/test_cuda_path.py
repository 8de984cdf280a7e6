"""The path a GPU cluster takes: one process per rank, every buffer on the rank's device, nothing staged
through the host. Where a CUDA device is at hand (`bash benchmarks/gpu_check.sh`) the NCCL cases run;
on the CPU the same code runs with gloo and the CPU as the device, so only the device itself is left out.

- In this process, a one-rank process group (`join_process_group`, `process_context`, the context active
  for the whole process as `zero_core.launch` makes it): every stage trains, every storage a rank holds
  is on its device, and the stages agree with each other and with a virtual rank on the CPU.
- `torchrun -m zero_core.launch --backend nccl`: every stage, and the CUDA allocator's peak beside the
  tracker's.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as torch_dist
from test_launch import free_port

from zero_core.backends.torch_distributed import TorchBackend, join_process_group, process_context
from zero_core.cluster import INTERCONNECT
from zero_core.context import activate
from zero_core.experiment import run_stage
from zero_core.memory import MemoryTracker
from zero_core.model import preset
from zero_core.reachable import reachable_storages
from zero_core.stages import STAGES, TrainConfig

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
CONFIG = TrainConfig(model=preset("micro"))
STEPS = 2


@pytest.fixture(params=["gloo", pytest.param("nccl", marks=needs_cuda)])
def one_rank(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[TorchBackend]:
    """This process as a world of one rank, as torchrun would start it."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    backend = join_process_group(request.param, timeout_s=60)
    try:
        yield backend
    finally:
        torch_dist.destroy_process_group()


def train(stage: int, backend: TorchBackend) -> tuple[set[str], list[float], dict]:
    """Train `stage` as `zero_core.launch` does; (devices of what the rank holds, losses, fp32 masters)."""
    ctx = process_context(backend, seed=CONFIG.seed)
    with activate(ctx, whole_process=True):
        trainer = STAGES[stage](CONFIG)
        losses = [trainer.train_step(step) for step in range(STEPS)]
        reached = reachable_storages(("stage", trainer), stop=(*INTERCONNECT, MemoryTracker))
        return {found.device for found in reached.values() if found.nbytes}, losses, trainer.master_shards()


def test_every_stage_keeps_every_buffer_on_the_ranks_device_and_trains_as_on_the_cpu(one_rank) -> None:
    device = one_rank.device.type
    virtual = run_stage(3, 1, STEPS, CONFIG)
    trained = {stage: train(stage, one_rank) for stage in STAGES}
    for stage, (devices, losses, masters) in trained.items():
        assert devices == {device}, f"ZeRO-{stage} holds storages on {devices}, not only on {device}"
        assert all(m.device.type == "cpu" for _, m in masters.values()), "master_shards are host copies"
        tolerance = 0.0 if device == "cpu" else 2e-2
        assert max(abs(a - b) for a, b in zip(losses, virtual.losses, strict=True)) <= tolerance, (stage, losses)
    _, zero0_losses, zero0_masters = trained[0]
    for stage in (1, 2, 3):
        _, losses, masters = trained[stage]
        loss_delta = max(abs(a - b) for a, b in zip(losses, zero0_losses, strict=True))
        master_delta = max((m - zero0_masters[name][1]).abs().max().item() for name, (_, m) in masters.items())
        print(f"{device}: ZeRO-{stage} against ZeRO-0: max |Δloss| {loss_delta:.1e}, max |Δmaster| {master_delta:.1e}")
        # The stages run the same kernels in the same order, on the CPU and (measured on an H200, torch 2.11) on
        # a GPU alike: bit for bit.
        assert loss_delta == 0.0, f"ZeRO-{stage} on {device}: losses {losses} vs {zero0_losses}"
        assert master_delta == 0.0, f"ZeRO-{stage} on {device}: masters differ by {master_delta}"


@needs_cuda
def test_nccl_launch_trains_every_stage_and_reports_the_allocators_peak() -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "-m", "zero_core.launch",
        "--backend", "nccl", "--preset", "micro", "--stages", "0,1,2,3", "--steps", "3", "--no-progress",
        "--check-virtual",
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(nccl, one GPU each)" in done.stdout
    assert "torch.cuda.max_memory_allocated" in done.stdout
    print(done.stdout)
