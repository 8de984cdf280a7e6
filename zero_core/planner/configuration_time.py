"""Predicted step time of a configuration (`zero_core.configurations`) on a machine (`planner.time_model`).

The same two-stream schedule as `time_model.predict_step`, driven by the configuration's collectives: the
forward and backward all-gathers are prefetched `prefetch_depth` layers ahead, gradient collectives run per
layer during backward from ZeRO-2 on (after backward for ZeRO-0/1), the optimizer waits for every gradient,
and "after step" all-gathers follow it. For the paper's four stages this is `predict_step`, to the rounding.

A collective over a group with k ranks on each node it spans takes `time_model.collective_seconds` on that
machine with k GPUs per node: NVLink when the group stays in a node, min(NVLink, k × one GPU's NIC) across
nodes, so HSDP's replica all-reduce (one GPU per node) runs at one NIC. An all-to-all costs what an
all-gather of the same buffer costs (N-1 steps, (N-1)/N of it sent).

Offload adds a third stream, PCIe: each layer's fp16 gradient partition goes down as soon as its gradient
collectives finish (ZeRO-Offload overlaps this with backward), the host's Adam runs on the node's DRAM
bandwidth shared by its G GPUs (`ADAM_BYTES_PER_PARAM` bytes per parameter, as on the GPU: a lower bound on
its time, measured CPU Adam is slower), then the updated fp16 partition comes back up before the all-gather.

Part of the planner (`zero_core.planner`): `compare`, `table` and `plan` time configurations at sizes the
simulator never runs, from the closed forms of `zero_core.configurations` alone.
"""

from __future__ import annotations

import math
from dataclasses import replace

from zero_core.configurations import (
    FP16_BYTES,
    PHASES,
    Collective,
    Configuration,
    collectives,
    shard_group_size,
)
from zero_core.facts import fact
from zero_core.planner.models import ModelShape
from zero_core.planner.time_model import (
    ADAM_BYTES_PER_PARAM,
    Layer,
    Machine,
    StepPrediction,
    Streams,
    collective_seconds,
    layers_from_report,
    transformer_layers,
)

DEFAULT_LAYERS = int(fact("planner_default_layers").value)
DEFAULT_SEQ_LEN = int(fact("planner_default_sequence").value)
DEFAULT_VOCAB = int(fact("planner_default_vocabulary").value)
"""The shape a step time assumes when only Ψ is given: assumptions, each with its reason in the facts file."""


def model_layers(
    psi: float, tokens: int, n_layers: int = DEFAULT_LAYERS, seq_len: int = DEFAULT_SEQ_LEN, vocab: int = DEFAULT_VOCAB
) -> list[Layer]:
    """A GPT of exactly Ψ parameters for the schedule: `n_layers` equal blocks, embedding and head of V·h each,
    h from 12·L·h² + 2·V·h = Ψ (the 12h² block of `gpt_block_params`); the blocks take what the embeddings
    leave, so the layers sum to Ψ. Sequences of `min(seq_len, tokens)`."""
    if n_layers < 1 or tokens < 1:
        raise ValueError(f"a model needs at least one layer and one token, got {n_layers} layers, {tokens} tokens")
    hidden = gpt_hidden(psi, n_layers, vocab)
    block_params = max(1.0, (psi - 2 * vocab * hidden) / n_layers)
    return transformer_layers(n_layers, block_params, hidden, min(seq_len, tokens), vocab, tokens)


def gpt_hidden(psi: float, n_layers: int = DEFAULT_LAYERS, vocab: int = DEFAULT_VOCAB) -> int:
    """The hidden size h of a GPT of Ψ parameters in `n_layers` blocks: the root of 12·L·h² + 2·V·h = Ψ."""
    return max(1, round((-2 * vocab + math.sqrt(4 * vocab**2 + 48 * n_layers * psi)) / (24 * n_layers)))


def shape_layers(shape: ModelShape, tokens: int, seq_len: int | None = None) -> list[Layer]:
    """The schedule of a real model (`zero_core.planner.models`): its embedding, its blocks and its head, each
    with the parameters its shape gives it (they sum to its Ψ), for sequences of `min(seq_len, tokens)`
    (default: the model's longest)."""
    if tokens < 1:
        raise ValueError(f"a step needs at least one token, got {tokens}")
    seq = min(seq_len or shape.max_sequence, tokens)
    embedding, *blocks, head = transformer_layers(
        shape.layers, shape.block_params, shape.hidden, seq, shape.vocabulary, tokens
    )
    return [replace(embedding, params=shape.embedding_params), *blocks, replace(head, params=shape.head_params)]


def group_seconds(machine: Machine, c: Collective, layer_params: float) -> float:
    """α-β time of one collective on a layer's buffer, on the group's own share of each node's links."""
    op = "all_gather" if c.op == "all_to_all" else c.op
    group_machine = machine.with_(gpus_per_node=c.group_per_node)
    return collective_seconds(group_machine, op, layer_params * c.share * c.bytes_per_element, c.group_size)


def predict(
    config: Configuration,
    layers: list[Layer],
    machine: Machine,
    n_gpus: int,
    gpus_per_node: int | None = None,
    *,
    prefetch_depth: int = 1,
) -> StepPrediction:
    """One step of `config` on N GPUs of `machine` (nodes of `gpus_per_node`, default the machine's)."""
    g = gpus_per_node or machine.gpus_per_node
    machine = machine.with_(gpus_per_node=g)
    if prefetch_depth < 0:
        raise ValueError(f"prefetch_depth must be 0 or more layers, got {prefetch_depth}")
    if config.offload and not (machine.pcie_bandwidth and machine.host_memory_bandwidth):
        raise ValueError(f"{config.name} on {machine.name}: the machine has no PCIe or host memory bandwidth")
    plan = collectives(config, n_gpus, g)
    by_phase = {phase: [c for c in plan if c.phase == phase] for phase in PHASES}
    s, count, k = Streams(("compute", "comm", "pcie")), len(layers), prefetch_depth

    def comm(phase: str, i: int, ready: float, when: str = "") -> float:
        done = ready
        for c in by_phase[phase]:
            name = f"{c.op} {layers[i].name}{when}"
            done = s.run("comm", c.op, name, group_seconds(machine, c, layers[i].params), done)
        return done

    def compute(kind: str, i: int, flops: float, ready: float) -> float:
        return s.run("compute", kind, f"{kind} {layers[i].name}", flops / machine.flops_per_s, ready)

    def offload_gradient(i: int, ready: float) -> None:
        if config.offload:
            seconds = FP16_BYTES * layers[i].params / n_gpus / machine.pcie_bandwidth
            s.run("pcie", "pcie", f"gradient partition {layers[i].name} to host", seconds, ready)

    gathers = bool(by_phase["forward"])
    first = range(min(k + 1, count)) if gathers else range(0)
    gathered = {i: comm("forward", i, 0.0, " (fwd)") for i in first}
    for i in range(count):
        done = compute("forward", i, layers[i].forward_flops, gathered.get(i, 0.0))
        if gathers and i + k + 1 < count:
            gathered[i + k + 1] = comm("forward", i + k + 1, done, " (fwd)")
    order = list(reversed(range(count)))
    forward_end = s.free["compute"]
    first = range(min(k + 1, count)) if gathers else range(0)
    gathered = {j: comm("backward", order[j], forward_end, " (bwd)") for j in first}
    for j, i in enumerate(order):
        done = compute("backward", i, layers[i].backward_flops, gathered.get(j, 0.0))
        if gathers and j + k + 1 < count:
            gathered[j + k + 1] = comm("backward", order[j + k + 1], done, " (bwd)")
        if config.stage >= 2:
            offload_gradient(i, comm("gradients", i, done))
    backward_end = s.free["compute"]
    if config.stage < 2:
        for i in order:
            offload_gradient(i, comm("gradients", i, backward_end))
    psi = sum(layer.params for layer in layers)
    if config.offload:
        optimizer_s = ADAM_BYTES_PER_PARAM * psi / n_gpus * g / machine.host_memory_bandwidth
    else:
        sharers = shard_group_size(config, n_gpus, g) if config.stage else 1
        optimizer_s = ADAM_BYTES_PER_PARAM * psi / sharers / machine.hbm_bandwidth
    optimizer_end = s.run("compute", "optimizer", "optimizer step", optimizer_s, max(s.free.values()))
    if config.offload:
        up_s = FP16_BYTES * psi / n_gpus / machine.pcie_bandwidth
        optimizer_end = s.run("pcie", "pcie", "updated parameters from host", up_s, optimizer_end)
    for i in range(count):
        comm("after step", i, optimizer_end)
    busy = {stream: sum(iv.end_s - iv.start_s for iv in s.intervals if iv.stream == stream) for stream in s.free}
    return StepPrediction(
        config.stage, n_gpus, machine.name, max(s.free.values()), busy["compute"], busy["comm"], optimizer_s,
        s.intervals,
    )


def predict_report(
    report,
    config: Configuration,
    machine: Machine,
    gpus_per_node: int | None = None,
    *,
    psi: float | None = None,
    tokens: int | None = None,
    prefetch_depth: int = 1,
) -> StepPrediction:
    """A measured run's step on `machine`: `config`, its stage's configuration (`report.stage_configuration`),
    on the run's N and nodes of `gpus_per_node` (default one node of N), for the run's own layers and FLOPs
    (`time_model.layers_from_report`) or, with `psi` and `tokens`, for a GPT of Ψ = `psi` at `tokens` per GPU
    (`model_layers`): what the same schedule would cost where the messages are not all latency."""
    if psi is None:
        layers = layers_from_report(report)
    elif tokens is None:
        raise ValueError("a model of psi parameters needs its tokens per GPU too")
    else:
        layers = model_layers(psi, tokens)
    n = report.world_size
    return predict(config, layers, machine, n, gpus_per_node or n, prefetch_depth=prefetch_depth)
