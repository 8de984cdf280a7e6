"""Exercise ex10's answer: sharded checkpoints. Each rank saves its shards, one process joins them, any N resumes.

A ZeRO checkpoint is N files, one per rank, each holding only what that rank owns, as DeepSpeed writes its
`zero_pp_rank_{r}_mp_rank_00_optim_states.pt` files and as FSDP2's sharded state dicts hold each rank's local
shards: saving needs no communication and no rank ever holds the whole model. The files' names and what
every file must hold are `zero_core.checkpoint_files`'s. Three functions:

- `save_shards(stage, rank, directory)`: the rank writes its fp32 masters, Adam's m and v, its fp16 parameters
  where the stage partitions them (ZeRO-3), the step and the loss scale, *without padding*, with what it takes
  to put the pieces back: each layer's name, shapes and the owned range [start, end) of its flat parameters.
- `consolidate(directory)`: the full fp32 state (masters, m, v per layer, the step), read one rank file at a
  time, as DeepSpeed's `zero_to_fp32.py` (deepspeedai/DeepSpeed PR #892) rebuilds fp32 weights offline.
- `load_into(stage, state)`, `resume(stage_number, config, state)`: cut the full state again for the world size
  the run has now, as DeepSpeed's universal checkpoint (`ds_to_universal.py`) does for a different number
  of GPUs; `next_step(state)` is the data step to continue from.

The step is not optional: Adam's bias correction divides by 1 - beta^t, so masters and moments resumed with t
reset to 0 take a different, much larger first step. The padding is not harmless either: `zero_to_fp32`
writes its pieces padded and must know each parameter's padding to cut it off again (`zero3_partitioned_param_info`
and `narrow(0, 0, unpartitioned_numel)` for stage 3, an alignment to 2N it checks for stages 1 and 2), and it
sorts the rank files with `natural_keys` because a plain sort puts rank 10 before rank 2. Here every file
says which range it holds, and files are read by rank number, so neither can go wrong silently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from zero_core.checkpoint_files import STATES, rank_file, read_rank_file
from zero_core.registry import stage_class
from zero_core.stages.base import TrainConfig, ZeroStage


def owned_states(stage: ZeroStage, rank: int) -> dict[str, torch.Tensor]:
    """The fp32 master, m and v of the elements `rank` owns, every layer's range concatenated, no padding.

    ZeRO-1/2/3 keep exactly these in one flat tensor each (`stage.optimizer`): written as they are, no copy.
    ZeRO-0 keeps every element, so its owned ranges are cut out (a copy of 1/N of the states).
    """
    optimizer = stage.optimizer
    if stage.partitions_optimizer_states:
        return {"master": optimizer.master, "m": optimizer.m, "v": optimizer.v}
    pieces = {name: [] for name in STATES}
    for layer in stage.layers:
        start, end = layer.partition.owned_range(rank)
        for name in STATES:
            pieces[name].append(getattr(layer.master, name)[start:end])
    return {name: torch.cat(values) for name, values in pieces.items()}


def partitions_parameters(stage: ZeroStage) -> bool:
    """Whether each rank keeps only a shard of the fp16 parameters (ZeRO-3): then it saves that shard too.
    ZeRO-0/1/2 keep them whole on every rank, and the masters rounded give them back bit for bit."""
    shards = getattr(stage, "shards", None)
    return bool(shards) and all(shard.param is not None for shard in shards.values())


def save_shards(stage: ZeroStage, rank: int, directory: str | Path) -> Path:
    """Write rank `rank`'s shards to its own file; returns the file. No collective, no full tensor.

    `torch.save` writes a view's whole storage, which is why DeepSpeed passes its slices of flat buffers through
    `clone_tensors_for_torch_save` (deepspeed/checkpoint/utils.py) first. A padded ZeRO-3 parameter shard is
    copied to its owned elements for the same reason: padding never reaches the disk.
    """
    if rank != stage.rank:
        raise ValueError(f"rank {stage.rank} was asked to save rank {rank}'s shards; each rank saves its own")
    shards = owned_states(stage, rank)
    if partitions_parameters(stage):
        shards["param"] = torch.cat([shard.owned_param().detach() for shard in stage.shards.values()])
    checkpoint = {
        "world_size": stage.world_size,
        "rank": rank,
        "stage": stage.stage,
        "precision": stage.config.precision,
        "step": stage.adam_steps,
        "loss_scaler": {"scale": stage.scaler.scale, "good_steps": stage.scaler.good_steps,
                        "skipped_steps": stage.scaler.skipped_steps},
        "layers": [(layer.name, [list(s) for s in layer.shapes], *layer.partition.owned_range(rank))
                   for layer in stage.layers],
        "shards": shards,
    }
    Path(directory).mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, rank_file(directory, rank))
    return rank_file(directory, rank)


def consolidate(directory: str | Path) -> dict[str, Any]:
    """The full fp32 state from the rank files: {"step", "loss_scaler", "shapes", "master", "m", "v"}, the last
    four by layer name, each layer flattened (weight then bias).

    Files are read one at a time, by rank number, so the process holds the full state plus one rank's file.
    Every element must come from exactly one rank: the ranks' ranges of a layer must follow each other from 0
    to its size (a missing, repeated or reordered file, or a padded shard, is an error, not a silent shift).
    """
    first = read_rank_file(directory, 0)
    del first["shards"]  # its layout and step are what every file is checked against
    shapes = {name: [torch.Size(s) for s in layer_shapes] for name, layer_shapes, _, _ in first["layers"]}
    state = {"step": first["step"], "loss_scaler": first["loss_scaler"], "shapes": shapes}
    for name in STATES:
        state[name] = {layer: torch.empty(sum(s.numel() for s in shapes[layer])) for layer in shapes}
    filled = dict.fromkeys(shapes, 0)
    for rank in range(first["world_size"]):
        checkpoint = read_rank_file(directory, rank)
        _check_same_run(checkpoint, first, rank)
        offset = 0
        for layer, _, start, end in checkpoint["layers"]:
            if start != filled[layer]:
                raise ValueError(f"rank {rank}'s range of {layer} starts at {start}, not where rank {rank - 1}'s "
                                 f"ended ({filled[layer]}): a file is missing, repeated or out of order")
            for name in STATES:
                state[name][layer][start:end] = checkpoint["shards"][name][offset : offset + end - start]
            filled[layer], offset = end, offset + end - start
        if offset != checkpoint["shards"]["master"].numel():
            raise ValueError(f"rank {rank}'s file holds {checkpoint['shards']['master'].numel()} elements, its "
                             f"ranges {offset}: padding or another rank's elements were written")
    unfilled = [layer for layer, values in state["master"].items() if filled[layer] != values.numel()]
    if unfilled:
        raise ValueError(f"the {first['world_size']} rank files leave the end of {unfilled} unwritten")
    return state


def _check_same_run(checkpoint: dict, first: dict, rank: int) -> None:
    """Every rank file of one checkpoint says the same world size and step, and the rank its name says."""
    if checkpoint["rank"] != rank or checkpoint["world_size"] != first["world_size"]:
        raise ValueError(f"file of rank {rank} holds rank {checkpoint['rank']} of {checkpoint['world_size']}")
    if checkpoint["step"] != first["step"]:
        raise ValueError(f"rank {rank} saved step {checkpoint['step']}, rank 0 step {first['step']}: two checkpoints")


def load_into(stage: ZeroStage, state: dict[str, Any]) -> None:
    """Give the calling rank's `stage` its part of the full `state`, at the stage's own world size.

    The rank copies the master, m and v of its master range (`stage.master_range`: its 1/N under ZeRO-1/2/3,
    everything under ZeRO-0), then refreshes its fp16 parameters from the masters and publishes them as a
    training step does (ZeRO-1/2 all-gather): the parameters are the masters rounded, bit for bit.
    """
    for layer in stage.layers:
        if state["shapes"][layer.name] != layer.shapes:
            raise ValueError(f"{layer.name}: the checkpoint's shapes {state['shapes'][layer.name]} are not the "
                             f"model's {layer.shapes}")
        start, end = stage.master_range(layer)
        for name in STATES:
            getattr(layer.master, name).copy_(state[name][layer.name][start:end])
    stage.adam_steps = state["step"]
    for field, value in state["loss_scaler"].items():
        setattr(stage.scaler, field, value)
    with torch.no_grad():
        torch._foreach_copy_(stage.owned_parameters(), [layer.master.master for layer in stage.layers])
        stage.publish_parameters()


def resume(stage_number: int, config: TrainConfig, state: dict[str, Any]) -> ZeroStage:
    """A new `stage_number` stage on the calling rank, on this run's world size, holding `state`."""
    stage = stage_class(stage_number)(config)
    load_into(stage, state)
    return stage


def next_step(state: dict[str, Any]) -> int:
    """The data step to continue from: every step taken, Adam's and the ones a loss-scale overflow skipped."""
    return state["step"] + state["loss_scaler"]["skipped_steps"]
