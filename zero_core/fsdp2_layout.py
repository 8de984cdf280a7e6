"""Ask FSDP2 itself how it shards the micro GPT: real processes, one training step, each rank's own report.

Lesson 8 works out, from PyTorch's documentation and source, which elements of every parameter each rank holds
under FSDP2 (`torch.chunk` along dim 0, each shard padded to the size of chunk 0). This module checks that
reading against FSDP2 itself. It starts `world_size` processes on gloo (FSDP2 runs on the CPU with gloo from
torch 2.9 on), applies `fully_shard` to the micro GPT layer by layer, as `benchmarks/crosscheck_pytorch.py`
does, trains one step, and has every rank report three runs:

- "reshard": `fully_shard(..., reshard_after_forward=True)`, FSDP2's ZeRO-3;
- "keep": `reshard_after_forward=False`, its ZeRO-2-like mode;
- "hsdp": `True` on a 2 x (world_size / 2) mesh, sharded inside a group and replicated across the two groups.

Each run's report is a dict of
- "shards": every parameter's local shape and `DTensor` placement, by parameter name;
- "held": the elements the rank holds of parameters, gradients and Adam states after the step, and how many
  parameter elements were unsharded between forward and backward;
- "calls": every collective FSDP2 called in the step, as [op, elements, bytes per element, group size, rank
  in the group]. FSDP2 calls `all_gather_single`, `reduce_scatter_single` and, for HSDP, `all_reduce`
  through `torch.distributed` (`_fsdp_collectives.py`), so wrapping those three sees them all.

    python -m zero_core.fsdp2_layout [--world-size 4]    # prints one report per rank, as a JSON list

`measure(world_size)` returns the same list to Python; that is what the lesson calls. The ranks are plain
subprocesses that meet through a file (no torchrun, no port to pick), so a notebook cell can start them, and
each prints its report as one line of JSON on its standard output. Nothing in `zero_core` imports this
module: it is the lesson's instrument, not part of the stages.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from zero_core.backends.torch_distributed import ALL_GATHER, REDUCE_SCATTER
from zero_core.launch import leave
from zero_core.model import build_model, loss_fn, micro_batch, parameter_layers, preset

MODULE = "zero_core.fsdp2_layout"
PRESET = "micro"
RUNS = ("reshard", "keep", "hsdp")
"""The three runs every rank reports, in the order it trains them."""

COUNTED = (
    ("all_gather", ALL_GATHER.__name__, "output_tensor"),
    ("reduce_scatter", REDUCE_SCATTER.__name__, "input"),
    ("all_reduce", "all_reduce", "tensor"),
)
"""What is counted: the collective, the `torch.distributed` function FSDP2 calls for it (`all_gather_single`
and `reduce_scatter_single` in torch 2.13), and the argument whose size is the collective's: the gathered
output, the reduce-scattered input, the all-reduced tensor."""


def counted(op: str, function: Callable[..., Any], buffer: str, calls: list[list]) -> Callable[..., Any]:
    """`function`, which also appends [op, elements, bytes per element, group size, rank in group] to `calls`."""
    signature = inspect.signature(function)

    def call(*args: Any, **kwargs: Any) -> Any:
        arguments = signature.bind(*args, **kwargs).arguments
        tensor, group = arguments[buffer], arguments.get("group")
        calls.append(
            [op, tensor.numel(), tensor.element_size(), torch_dist.get_world_size(group), torch_dist.get_rank(group)]
        )
        return function(*args, **kwargs)

    return call


@contextmanager
def counting_collectives() -> Iterator[list[list]]:
    """Inside the block, every collective of `COUNTED` called through `torch.distributed` is listed (yielded)."""
    calls: list[list] = []
    originals = {name: getattr(torch_dist, name) for _, name, _ in COUNTED}
    for op, name, buffer in COUNTED:
        setattr(torch_dist, name, counted(op, originals[name], buffer, calls))
    try:
        yield calls
    finally:
        for name, function in originals.items():
            setattr(torch_dist, name, function)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`: a `DTensor`'s local shard, any other tensor whole."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def sharded_gpt(mesh: DeviceMesh, reshard_after_forward: bool) -> torch.nn.Module:
    """The micro GPT with `fully_shard` on every parameter layer and then on the whole model."""
    model = build_model(preset(PRESET))
    for _, module in parameter_layers(model):
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def train_one_step(mesh: DeviceMesh, reshard_after_forward: bool) -> dict[str, Any]:
    """One forward, backward and Adam step of the sharded GPT: its shards, what it holds, the collectives."""
    model = sharded_gpt(mesh, reshard_after_forward)
    shards = {name: [list(local(p).shape), str(p.placements)] for name, p in model.named_parameters()}
    optimizer = torch.optim.Adam(model.parameters())
    inputs, targets = micro_batch(preset(PRESET), torch_dist.get_rank(), 0)
    with counting_collectives() as calls:
        loss = loss_fn(model(inputs), targets)
        unsharded_after_forward = sum(p.numel() for p in model.parameters() if not isinstance(p, DTensor))
        loss.backward()
        optimizer.step()
    adam_states = [state[key] for state in optimizer.state.values() for key in ("exp_avg", "exp_avg_sq")]
    held = {
        "param": sum(local(p).numel() for p in model.parameters()),
        "grad": sum(local(p.grad).numel() for p in model.parameters()),
        "unsharded after forward": unsharded_after_forward,
        "adam.m + adam.v": sum(local(state).numel() for state in adam_states),
    }
    return {"shards": shards, "held": held, "calls": calls}


def report_rank(world_size: int) -> dict[str, dict[str, Any]]:
    """This rank's report of the three runs (`RUNS`), on a flat mesh and on a 2 x (world_size / 2) one."""
    flat = init_device_mesh("cpu", (world_size,))
    hybrid = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    return {
        "reshard": train_one_step(flat, reshard_after_forward=True),
        "keep": train_one_step(flat, reshard_after_forward=False),
        "hsdp": train_one_step(hybrid, reshard_after_forward=True),
    }


def run_rank(rank: int, world_size: int, rendezvous: str) -> None:
    """One process of `measure`: join the gloo group through the `rendezvous` file, print the report as JSON."""
    torch.set_num_threads(1)  # the ranks share the machine's cores
    # FSDP2 warns that a Linear returns a view, in case a caller modifies it in place; the GPT never does.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module")
    torch_dist.init_process_group(
        "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    print(json.dumps(report_rank(world_size)))
    leave(0)  # as zero_core.launch ends a rank: destroying a gloo group can hang or abort a finished process


def check_world_size(world_size: int) -> None:
    """`ValueError` unless HSDP's 2 x (world_size / 2) mesh exists: the world size must be even, 2 or more."""
    if world_size < 2 or world_size % 2:
        raise ValueError(f"the world size must be even and at least 2 (HSDP runs on 2 x N/2), got {world_size}")


def measure(world_size: int = 4, timeout_s: float = 180.0) -> list[dict[str, dict[str, Any]]]:
    """Run `world_size` ranks (`python -m zero_core.fsdp2_layout --rank R ...`); every rank's report, in rank order.

    A rank that fails raises `RuntimeError` with its standard error.
    """
    check_world_size(world_size)
    root = str(Path(__file__).resolve().parents[1])  # first on the ranks' path: they import this copy of zero_core
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
    with tempfile.TemporaryDirectory() as folder:
        rendezvous = os.path.join(folder, "rendezvous")
        ranks = [
            subprocess.Popen(
                [sys.executable, "-m", MODULE, "--rank", str(rank)]
                + ["--world-size", str(world_size), "--rendezvous", rendezvous],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for rank in range(world_size)
        ]
        try:
            outputs = [process.communicate(timeout=timeout_s) for process in ranks]
        finally:
            for process in ranks:
                if process.poll() is None:  # only after a timeout: stop the ranks still running
                    process.kill()
                    process.wait()
    for rank, (process, (_, errors)) in enumerate(zip(ranks, outputs, strict=True)):
        if process.returncode:
            raise RuntimeError(f"rank {rank} of the FSDP2 run failed:\n{errors}")
    return [json.loads(out) for out, _ in outputs]


def main(argv: list[str] | None = None) -> None:
    """Print every rank's report as JSON; with `--rank`, be that rank (what `measure` starts)."""
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4, help="processes to start (even; default 4)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # set by `measure` for each process it starts
    parser.add_argument("--rendezvous", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        run_rank(args.rank, args.world_size, args.rendezvous)
        return
    try:
        check_world_size(args.world_size)
    except ValueError as error:
        parser.error(str(error))
    print(json.dumps(measure(args.world_size), indent=1))


if __name__ == "__main__":
    main()
