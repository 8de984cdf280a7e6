"""The plan as FSDP2 code: the chosen configuration written as PyTorch's `fully_shard` calls, each knob explained.

`fsdp2_code` writes a Python module that defines `shard_model(model, blocks, device_type)`: the device mesh
(`init_device_mesh`, 2-D `("replicate", "shard")` for HSDP and for ZeRO-0's pure replication), `fully_shard`
on every block and then on the whole model with `reshard_after_forward`, a `MixedPrecisionPolicy`, an
`OffloadPolicy`, and explicit prefetching (`set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch`,
from torch 2.6, the oldest torch the course accepts). Each knob carries a comment in the ledger's terms.
Names and semantics are PyTorch's FSDP2 documentation (docs.pytorch.org, `torch.distributed.fsdp.fully_shard`:
"reshard_after_forward ... If an int, then this represents the world size to reshard to after forward", the
HSDP mesh "(replicate, shard)", `MixedPrecisionPolicy`, `CPUOffloadPolicy`) and its FSDP2 tutorial (explicit
prefetching). The text is generated here, never imported: the planner does not load torch.

How the configurations map: ZeRO-3 is `reshard_after_forward=True`; ZeRO-1/2 are `False` (FSDP2 always shards
parameters, but keeping them gathered from forward to backward sends 2Ψ per step, ZeRO-2's volume); hpZ is
`reshard_after_forward=G`, a reshard to the node; HSDP:S is a (N/S, S) mesh; ZeRO-0 an (N, 1) mesh, every
GPU a replica. qwZ and qgZ have no FSDP2 switch and are said so in the code. Offload is `CPUOffloadPolicy`,
which keeps parameters, gradients and Adam's states on the host, more than ZeRO-Offload moves.
"""

from __future__ import annotations

from dataclasses import dataclass

from zero_core.configurations import Configuration, shard_group_size
from zero_core.planner.batch import Batch

DTYPES = {"bf16": "torch.bfloat16", "fp16": "torch.float16", "fp32": None}
PREFETCH_BLOCKS = 2
"""Blocks all-gathered ahead in forward and in backward: FSDP2's implicit prefetch is one; two hides a slow
all-gather behind two blocks of compute for one more block of gather.fp16."""


@dataclass(frozen=True)
class Layout:
    """What FSDP2 is told: the mesh's shape, what to reshard to after forward, and the notes that say why."""

    mesh_shape: tuple[int, ...]
    reshard_after_forward: bool | int
    notes: tuple[str, ...]


def layout(config: Configuration, world_size: int, gpus_per_node: int) -> Layout:
    """The mesh and the reshard setting of `config` on `world_size` GPUs in nodes of `gpus_per_node`."""
    if config.hsdp:
        s = shard_group_size(config, world_size, gpus_per_node)
        return Layout((world_size // s, s), True, (
            f"HSDP: model states split over {s} GPUs (16Ψ/{s} per GPU), replicated {world_size // s} times; "
            "each gradient slice is all-reduced across the replicas",
        ))
    if config.stage == 0:
        return Layout((world_size, 1), False, (
            "ZeRO-0: a shard group of 1, every GPU a replica holding all 16Ψ; gradients are all-reduced (2Ψ)",
        ))
    notes = []
    if config.stage == 3 and config.hpz:
        reshard: bool | int = gpus_per_node
        notes.append(f"hpZ: after forward each block is resharded to the node's {gpus_per_node} GPUs (2Ψ/G of "
                     "param.fp16 kept), so backward's all-gather stays inside the node")
    elif config.stage == 3:
        reshard = True
        notes.append("ZeRO-3: each block is resharded after forward and all-gathered again in backward: 16Ψ/N "
                     "per GPU, 3Ψ per step")
    else:
        reshard = False
        notes.append(f"ZeRO-{config.stage}: FSDP2 always shards parameters; keeping each block gathered from "
                     "forward to backward skips backward's all-gather: 2Ψ per step, as ZeRO-2, with the gathered "
                     "param.fp16 held between the two")
    if config.qwz or config.qgz:
        notes.append("qwZ and qgZ (int8 weight gathers, int4 gradient all-to-all) have no FSDP2 switch: these "
                     "collectives send bf16/fp16 as ZeRO-3 does")
    return Layout((world_size,), reshard, tuple(notes))


def fsdp2_code(config: Configuration, batch: Batch, precision: str, gpus_per_node: int, label: str) -> str:
    """A Python module with `shard_model(model, blocks, device_type)`, for `config` trained on `batch`."""
    if precision not in DTYPES:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(DTYPES)}")
    plan = layout(config, batch.world_size, gpus_per_node)
    dtype = DTYPES[precision]
    two_d = len(plan.mesh_shape) == 2
    mesh_call = (
        f'init_device_mesh(device_type, {plan.mesh_shape}, mesh_dim_names=("replicate", "shard"))'
        if two_d else f"init_device_mesh(device_type, {plan.mesh_shape})"
    )
    notes = "\n".join(f"# {line}" for note in plan.notes for line in _wrap(note))
    if dtype:
        mp = f"MixedPrecisionPolicy(param_dtype={dtype}, reduce_dtype={dtype})"
        mp_note = (
            "# Mixed precision: the sharded parameters stay fp32 (they are master.fp32); each all-gather casts\n"
            f"# to {precision} (gather.fp16) and gradients are reduce-scattered in {precision} (grad.fp16), as the "
            "plan counts.\n# reduce_dtype=torch.float32 is more accurate and doubles the gradient bytes."
        )
        if precision == "fp16":
            mp_note += "\n# fp16 needs loss scaling in the training loop (torch.amp.GradScaler); FSDP2 does not scale."
    else:
        mp = "MixedPrecisionPolicy()"
        mp_note = "# fp32: parameters, gradients and collectives in fp32, 4 bytes per element on the wire."
    if config.offload:
        offload = "CPUOffloadPolicy(pin_memory=True)"
        offload_note = (
            "# Offload: sharded parameters, gradients and Adam's states live in (pinned) host memory and\n"
            "# the optimizer steps there; each block is copied to the GPU for its all-gather. ZeRO-Offload\n"
            "# keeps param.fp16 on the GPU: FSDP2 moves more over PCIe."
        )
    else:
        offload = "OffloadPolicy()"
        offload_note = "# No offload: model states stay on the GPU (OffloadPolicy() is FSDP2's no-offload default)."
    return f'''"""FSDP2 for {label} on {batch.world_size} GPUs, as `python -m zero_core plan --emit fsdp2` chose it.

Call `shard_model(model, blocks)` in every rank after `torch.distributed.init_process_group`, with `blocks` the
model's transformer blocks in forward order, then build the optimizer on `model.parameters()`. Train
{batch.micro_batch_per_gpu} sequence(s) per GPU per micro-step and {batch.gradient_accumulation_steps} micro-step(s) per
optimizer step: {batch.train_batch_size} sequences per step on all {batch.world_size} GPUs.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import {offload.split("(")[0]}, MixedPrecisionPolicy, fully_shard

WORLD_SIZE = {batch.world_size}
PREFETCH_BLOCKS = {PREFETCH_BLOCKS}
{notes}
RESHARD_AFTER_FORWARD = {plan.reshard_after_forward!r}
{mp_note}
MP_POLICY = {mp}
{offload_note}
OFFLOAD_POLICY = {offload}


def shard_model(model, blocks, device_type="cuda"):
    """`fully_shard` on each block, then on the model; explicit prefetch {PREFETCH_BLOCKS} blocks ahead."""
    if dist.get_world_size() != WORLD_SIZE:
        raise RuntimeError(f"this plan is for {{WORLD_SIZE}} ranks, the process group has {{dist.get_world_size()}}")
    mesh = {mesh_call}
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=RESHARD_AFTER_FORWARD, mp_policy=MP_POLICY,
                    offload_policy=OFFLOAD_POLICY)
    # The root holds what no block does (embeddings, final norm, head); it is used last in forward and first in
    # backward, so resharding it after forward would only gather it again at once.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=MP_POLICY, offload_policy=OFFLOAD_POLICY)
    # Explicit prefetch: each block's all-gather starts PREFETCH_BLOCKS blocks early, in forward and in backward;
    # up to PREFETCH_BLOCKS + 1 blocks of gather.fp16 are held at once.
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(list(blocks[i + 1:i + 1 + PREFETCH_BLOCKS]))
        block.set_modules_to_backward_prefetch(list(reversed(blocks[max(0, i - PREFETCH_BLOCKS):i])))
    return model
'''


def _wrap(text: str, width: int = 110) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return lines + [line]
