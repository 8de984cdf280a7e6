"""Our ZeRO stages against PyTorch's own: the same model, data and Adam, on real gloo processes, in fp32.

    python benchmarks/crosscheck_pytorch.py [--world-size 4] [--steps 5] [--preset micro]
    torchrun --nproc-per-node 4 benchmarks/crosscheck_pytorch.py [--steps 5]

Pairs (ZeRO §5 and what PyTorch ships for each idea):
  ZeRO-0  DDP + torch.optim.Adam                          plain data parallelism
  ZeRO-1  DDP + ZeroRedundancyOptimizer(Adam)             optimizer states partitioned (whole parameters)
  ZeRO-2  fully_shard(reshard_after_forward=False)        + gradients (FSDP2, SHARD_GRAD_OP)
  ZeRO-3  fully_shard(reshard_after_forward=True)         + parameters (FSDP2, FULL_SHARD)

Gradients are compared after the first backward, before any update: Adam's first step is scale
invariant (m/√v = g/|g|), so comparing weights after one step would hide a gradient averaged with the
wrong factor. Weights are compared after `--steps` steps. Both differences are per layer (weight and bias
flattened together), norm-wise relative, the largest layer's shown: the convention of the oracle test.
The only expected differences are rounding order: gloo's summation, DDP's and FSDP's averaging, and
torch's Adam against ours (same formula, other operation order). The attention key bias, whose exact
gradient is zero, amplifies them most: Adam turns its rounding-noise gradient into steps.

Memory, where FSDP's own accounting applies (`FSDPMemTracker`, after the first step): its sharded
parameter, sharded gradient and optimizer-state bytes per rank beside our tracker's `param.fp16`,
`grad.fp16` and `adam.m` + `adam.v`; FSDP's optimizer state also holds torch Adam's `step` counter, 4
bytes per parameter tensor. (In fp32 precision our stages also keep an fp32 master copy, which torch's
Adam does not need: the paper's mixed-precision layout, at 4 bytes per parameter.) For DDP and
ZeroRedundancyOptimizer, the Adam states each rank's (local) optimizer holds, against ours: ZeRO-1
splits every layer evenly, ZeroRedundancyOptimizer assigns whole parameters greedily, so its ranks differ.
Nothing is asserted: the script prints the two tables.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from zero_core import memory  # noqa: E402
from zero_core.backends.torch_distributed import TorchBackend, process_context  # noqa: E402
from zero_core.cli.render import table  # noqa: E402
from zero_core.context import activate  # noqa: E402
from zero_core.model import build_model, loss_fn, micro_batch, parameter_layers, preset  # noqa: E402
from zero_core.partition import flatten  # noqa: E402
from zero_core.report import assemble_master_weights  # noqa: E402
from zero_core.stages import STAGES, TrainConfig  # noqa: E402

COUNTERPARTS = {
    0: "DDP + torch.optim.Adam",
    1: "DDP + ZeroRedundancyOptimizer(Adam)",
    2: "fully_shard(reshard_after_forward=False)",
    3: "fully_shard(reshard_after_forward=True)",
}
Layers = dict[str, torch.Tensor]


def ours(stage: int, config: TrainConfig, steps: int) -> tuple[Layers, Layers, dict[str, int]]:
    """Our stage on the real process group: full averaged gradients of step 0, final weights, bytes held."""
    ctx = process_context(TorchBackend(), seed=config.seed)
    first: dict[str, tuple[int, torch.Tensor]] = {}
    with activate(ctx):
        trainer = STAGES[stage](config)
        owned_gradients = trainer.owned_gradients

        def recording() -> list[torch.Tensor]:
            grads = owned_gradients()
            for layer, grad in zip(trainer.layers, grads, strict=True):
                first.setdefault(layer.name, (trainer.master_range(layer)[0], grad.float().clone()))
            return grads

        trainer.owned_gradients = recording
        trainer.train_step(0)
        held = ctx.tracker.current_by_category()
        for step in range(1, steps):
            trainer.train_step(step)
        shards = trainer.master_shards()
    everyone: list = [None] * trainer.world_size
    torch_dist.all_gather_object(everyone, (first, shards))
    grads = assemble_master_weights([f for f, _ in everyone])
    return grads, assemble_master_weights([s for _, s in everyone]), held


def by_layer(model: torch.nn.Module, of: str) -> Layers:
    """Each parameter layer's full weights (`of="param"`) or gradients, flattened weight then bias."""

    def full(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        return tensor.detach().float()

    return {
        name: flatten([full(p if of == "param" else p.grad) for p in module.parameters()])
        for name, module in parameter_layers(model)
    }


def adam_kwargs(config: TrainConfig) -> dict:
    """Our Adam's hyperparameters, for torch.optim.Adam."""
    a = config.adam
    return {"lr": a.lr, "betas": (a.beta1, a.beta2), "eps": a.eps}


def theirs(stage: int, config: TrainConfig, steps: int) -> tuple[Layers, Layers, dict[str, int]]:
    """PyTorch's counterpart: gradients of step 0, final weights, and its own per-rank byte counts."""
    rank, world_size = torch_dist.get_rank(), torch_dist.get_world_size()
    model = build_model(config.model, config.seed)
    if stage <= 1:
        trained = DistributedDataParallel(model)
        if stage == 0:
            optimizer = torch.optim.Adam(model.parameters(), **adam_kwargs(config))
        else:
            optimizer = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.Adam, **adam_kwargs(config)
            )
    else:
        mesh = init_device_mesh("cpu", (world_size,))
        for _, module in parameter_layers(model):
            fully_shard(module, mesh=mesh, reshard_after_forward=stage == 3)
        trained = fully_shard(model, mesh=mesh, reshard_after_forward=stage == 3)
        optimizer = torch.optim.Adam(model.parameters(), **adam_kwargs(config))
    held: dict[str, int] = {}
    for step in range(steps):
        inputs, targets = micro_batch(config.model, rank, step, config.seed)
        tracker = FSDPMemTracker(trained, optimizer) if step == 0 and stage >= 2 else None
        if tracker is not None:
            tracker.track_inputs((inputs, targets))
            tracker.__enter__()
        loss_fn(trained(inputs), targets).backward()
        if step == 0:
            grads = by_layer(model, "grad")
        optimizer.step()
        if tracker is not None:
            tracker.__exit__(None, None, None)
            snapshot = tracker.get_tracker_snapshot("current")[torch.device("cpu")]
            held = {k: snapshot.get(k, 0) for k in ("Sharded Param", "Sharded Grad", "OptState")}
        elif step == 0:
            states = (optimizer.optim if stage == 1 else optimizer).state.values()
            held = {"OptState": sum(s[k].nbytes for s in states for k in ("exp_avg", "exp_avg_sq"))}
        optimizer.zero_grad()
    return grads, by_layer(model, "param"), held


def worst_relative(mine: Layers, reference: Layers) -> str:
    """The largest per-layer norm-wise relative difference, and the layer it is in."""
    errors = {name: ((mine[name] - ref).norm() / ref.norm()).item() for name, ref in reference.items()}
    name = max(errors, key=errors.get)
    return f"{errors[name]:.1e} ({name})" if errors[name] else "0 (every layer)"


def without_key_bias(layers: Layers, n_embd: int) -> Layers:
    """The layers with each attention key bias cut out: its exact gradient is zero, so Adam steps on noise.

    A qkv layer is flattened as its (3C, C) weight then its 3C bias, whose middle third is the key bias.
    """
    start = 3 * n_embd * n_embd + n_embd

    def cut(name: str, flat: torch.Tensor) -> torch.Tensor:
        return torch.cat([flat[:start], flat[start + n_embd :]]) if name.endswith("attn.qkv") else flat

    return {name: cut(name, flat) for name, flat in layers.items()}


def crosscheck(preset_name: str, steps: int, stages: list[int]) -> None:
    """Every rank runs this; rank 0 prints."""
    torch.set_num_threads(1)
    # FSDP2 warns that a Linear returns a view, in case a caller modifies it in place; the GPT never does.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")
    rank, world_size = torch_dist.get_rank(), torch_dist.get_world_size()
    config = TrainConfig(model=preset(preset_name), precision="fp32")
    rows, memory_rows = [], []
    for stage in stages:
        our_grads, our_weights, our_held = ours(stage, config, steps)
        their_grads, their_weights, their_held = theirs(stage, config, steps)
        n_embd = config.model.n_embd
        aside = worst_relative(without_key_bias(our_weights, n_embd), without_key_bias(their_weights, n_embd))
        rows.append(
            [
                f"ZeRO-{stage}",
                COUNTERPARTS[stage],
                worst_relative(our_grads, their_grads),
                worst_relative(our_weights, their_weights),
                aside,
            ]
        )
        pairs = [("adam.m + adam.v", our_held[memory.ADAM_M] + our_held[memory.ADAM_V], "OptState")]
        if stage >= 2:
            pairs.insert(0, ("grad.fp16", our_held[memory.GRAD], "Sharded Grad"))
        if stage == 3:
            pairs.insert(0, ("param.fp16", our_held[memory.PARAM], "Sharded Param"))
        measured: list = [None] * world_size
        torch_dist.all_gather_object(measured, [(mine, their_held[key]) for _, mine, key in pairs])
        for i, (ours_name, _, their_name) in enumerate(pairs):
            mine = [m[i][0] for m in measured]
            them = [m[i][1] for m in measured]
            memory_rows.append(
                [
                    f"ZeRO-{stage}",
                    f"{ours_name} vs {their_name}",
                    bytes_range(mine),
                    bytes_range(them),
                    f"{sum(mine) / sum(them):.4f}",
                ]
            )
    if rank == 0:
        print(f"{preset_name} GPT, fp32, {world_size} gloo processes, {steps} steps; per-layer relative differences")
        headers = [
            "stage",
            "PyTorch counterpart",
            "max rel grad diff, step 0 (layer)",
            f"max rel weight diff after {steps} steps (layer)",
            "same, attention key bias aside",
        ]
        print(table(headers, rows, title="Ours against PyTorch"))
        print()
        headers = ["stage", "bytes per rank", "ours (min..max)", "PyTorch (min..max)", "ours/PyTorch (sum)"]
        print(
            table(
                headers,
                memory_rows,
                title="Memory per rank after step 0 (FSDPMemTracker; ZeroRedundancyOptimizer's local Adam states)",
            )
        )


def bytes_range(values: list[int]) -> str:
    low, high = min(values), max(values)
    return f"{low:,}" if low == high else f"{low:,}..{high:,}"


def _spawned(rank: int, world_size: int, store: str, args: argparse.Namespace) -> None:
    torch_dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
    )
    try:
        crosscheck(args.preset, args.steps, args.stages)
    finally:
        torch_dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4, help="processes to spawn (ignored under torchrun)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--preset", default="micro")
    parser.add_argument("--stages", type=lambda text: [int(s) for s in text.split(",")], default=[0, 1, 2, 3])
    args = parser.parse_args()
    if "RANK" in os.environ:
        torch_dist.init_process_group("gloo", timeout=timedelta(seconds=120))
        try:
            crosscheck(args.preset, args.steps, args.stages)
        finally:
            torch_dist.destroy_process_group()
        return
    store = Path(os.environ.get("TMPDIR", "/tmp")) / f"crosscheck-{os.getpid()}.store"
    try:
        mp.spawn(_spawned, args=(args.world_size, str(store), args), nprocs=args.world_size, join=True)
    finally:
        store.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
