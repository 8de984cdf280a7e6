"""How long a ZeRO step takes on a real machine: compute and communication on two streams, overlapped as
each stage's schedule allows.

A step is a per-layer schedule. Compute runs layer after layer on one stream; collectives run one after
another on a second stream, each waiting for what it depends on. The stages differ only in those
dependencies (ZeRO §5, §7): ZeRO-0 all-reduces every gradient after backward (the course's ZeRO-0 does;
DDP overlaps buckets with backward), ZeRO-1 reduce-scatters them after backward, ZeRO-2 reduce-scatters
each layer's gradient while the layers before it still run backward (§5.2), ZeRO-3 all-gathers each layer's
parameters `prefetch_depth` layers ahead in forward and again in backward (§5.3, §7.2.2). The optimizer
step waits for every gradient and overlaps nothing; ZeRO-1 and ZeRO-2 then all-gather the updated
parameters. Step time = when both streams are done; exposed communication = step time - compute time.

A collective's time is the α-β model with NCCL's bus-bandwidth factors (nccl-tests PERFORMANCE.md):
ring: steps·α + factor·S/B, with 2(N-1) steps for all-reduce and N-1 otherwise; tree (all-reduce only,
NCCL's double binary tree): 2⌈log2 N⌉ steps, same bandwidth term. Within a node B is the NVLink bus
bandwidth. Across nodes NCCL builds one ring per NIC and each ring leaves every node once, so the NICs of a
node carry the whole bus bandwidth: B = min(intra-node B, gpus_per_node × per-GPU NIC bandwidth), and a
step pays the inter-node latency. Collectives never share the link (one comm stream): a simplification.

Part of the planner (`zero_core.planner`): it answers for machines the course never runs, so it reads only
formulas and machine facts. A real run's layers come in as its report (`layers_from_report`), read by
attribute, never by importing the simulator.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from zero_core.facts import fact
from zero_core.formulas import busbw_factor
from zero_core.ring import PCIE_OPS

if TYPE_CHECKING:
    from matplotlib.figure import Figure

GBPS = 1e9 / 8
"""Bytes per second in one Gb/s (network links are sold in bits)."""
ADAM_BYTES_PER_PARAM = 28
"""HBM traffic of one mixed-precision Adam update: read and write fp32 master, m, v (24 B), read the fp16
gradient and write the fp16 parameter (4 B). The step is memory-bound, so its time is bytes / HBM bandwidth."""
KIND_COLORS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "optimizer": "#8172B3",
    "all_gather": "#55A868",
    "reduce_scatter": "#C44E52",
    "all_reduce": "#937860",
}


@dataclass(frozen=True)
class Machine:
    """A GPU cluster as the time model sees it. Bandwidths in bytes/s, latencies in seconds.

    `intra_node_bandwidth` is the bus bandwidth one GPU reaches inside a node (nccl-tests' busbw, a
    unidirectional figure); `inter_node_bandwidth` is one GPU's share of its node's network links.
    For offload (`zero_core.planner.configuration_time`): `pcie_bandwidth` is one GPU's host link, one direction;
    `host_memory_bandwidth` and `host_memory_bytes` are the node's CPU DRAM, shared by its GPUs (0: unknown).
    """

    name: str
    peak_tflops: float
    achieved_fraction: float
    gpus_per_node: int
    intra_node_bandwidth: float
    intra_node_latency_s: float
    inter_node_bandwidth: float
    inter_node_latency_s: float
    hbm_bandwidth: float
    algorithm: str = "ring"
    pcie_bandwidth: float = 0.0
    host_memory_bandwidth: float = 0.0
    host_memory_bytes: float = 0.0

    def __post_init__(self) -> None:
        if self.algorithm not in ("ring", "tree"):
            raise ValueError(f"Machine {self.name!r}: algorithm must be 'ring' or 'tree', got {self.algorithm!r}")
        if not 0 < self.achieved_fraction <= 1:
            raise ValueError(f"Machine {self.name!r}: achieved_fraction must be in (0, 1], is {self.achieved_fraction}")

    @property
    def flops_per_s(self) -> float:
        """Achieved FLOP/s of one GPU: peak × achieved fraction."""
        return self.peak_tflops * 1e12 * self.achieved_fraction

    def bus_bandwidth(self, n_gpus: int) -> float:
        """B for a collective on `n_gpus`: NVLink inside a node, the node's NICs as soon as it spans nodes."""
        if n_gpus <= self.gpus_per_node:
            return self.intra_node_bandwidth
        return min(self.intra_node_bandwidth, self.gpus_per_node * self.inter_node_bandwidth)

    def latency_s(self, n_gpus: int) -> float:
        """α of one step: the slowest hop of the ring, an inter-node one once it spans nodes."""
        return self.intra_node_latency_s if n_gpus <= self.gpus_per_node else self.inter_node_latency_s

    def with_(self, **changes) -> Machine:
        return replace(self, **changes)


def ring_alpha(busbw: float, full_bytes: float, n_gpus: int, bus_bandwidth: float) -> float:
    """The per-step α with which a ring all-reduce of `full_bytes` on `n_gpus` GPUs at bus bandwidth B shows
    the measured `busbw`: time = 2(N-1)/N·S/busbw = 2(N-1)·α + 2(N-1)/N·S/B, solved for α."""
    factor = 2 * (n_gpus - 1) / n_gpus
    return (factor * full_bytes / busbw - factor * full_bytes / bus_bandwidth) / (2 * (n_gpus - 1))


_SMALLEST = fact("h200_all_reduce_busbw_32KiB")
NVLINK_ALPHA_S = ring_alpha(_SMALLEST.value * 1e9, _SMALLEST.bytes, 8, fact("nvlink4_unidirectional_spec").value * 1e9)
"""Per-step latency inside a node: fitted to the smallest all-reduce of an 8×H200 node (32 KiB, 1.44 GB/s
busbw, `zero_core/data/facts.toml`) with B the NVLink 4 spec, 450 GB/s; about 2.8 µs. Assumed for the other
presets' NVLink too (no source measures theirs here). NCCL runs that size as a ring with its LL protocol, as
the model does; lesson 9 shows the model's error at the larger sizes, where NCCL switches algorithm."""
NETWORK_ALPHA_S = fact("network_step_latency").value / 1e6
"""Per-step latency across nodes: an assumption (no source here), visible only for messages under ~1 MB."""
def _value(name: str) -> float:
    """A figure of `zero_core/data/facts.toml`, where its source and the line it was read from stand beside it."""
    return fact(name).value


def _pcie_x16(lane_rate: str) -> float:
    """One direction of a x16 link, bytes/s: lane rate (Mb/s) × 128/130 line code × 16 lanes / 8 bits."""
    return _value(lane_rate) * 1e6 * 128 / 130 * 16 / 8


PCIE3_X16, PCIE4_X16, PCIE5_X16 = (_pcie_x16(f"pcie{g}_lane_rate") for g in (3, 4, 5))
"""A GPU's x16 host link, one direction, at the PCIe 3.0 / 4.0 / 5.0 signalling rates (8, 16, 32 GT/s per
lane, 128b/130b): the ceiling (15.75, 31.5, 63 GB/s), not a measurement. Host figures per preset: each node's two
CPU sockets × DDR channels × transfer rate × 8 bytes (DGX-2: Xeon 8168, 6 × DDR4-2666; A100: the DGX A100's EPYC
7742, 8 × DDR4-3200, assumed for the blog's cluster too; H100: the DGX H100's Xeon 8480C, 8 × DDR5-4800, PCIe 5.0,
2 TB), also a ceiling. Every figure is an entry of the facts file, named below."""

DGX2_V100 = Machine(
    "ZeRO paper cluster: DGX-2, 16×V100, 800 Gb/s per node",
    peak_tflops=_value("v100_fp16_tensor_peak_tflops"),
    achieved_fraction=round(_value("zero_paper_turing_nlg_tflops") / _value("v100_fp16_tensor_peak_tflops"), 2),
    gpus_per_node=16,
    intra_node_bandwidth=_value("nvlink2_v100_unidirectional") * 1e9, intra_node_latency_s=NVLINK_ALPHA_S,
    inter_node_bandwidth=_value("zero_paper_internode_bandwidth") * GBPS / 16, inter_node_latency_s=NETWORK_ALPHA_S,
    hbm_bandwidth=_value("v100_hbm_bandwidth") * 1e9, pcie_bandwidth=PCIE3_X16,
    host_memory_bandwidth=2 * _value("xeon_skylake_memory_channels") * _value("xeon_skylake_ddr4_rate") * 1e6 * 8,
    host_memory_bytes=_value("dgx2_host_memory") * 1e12,
)
"""ZeRO §10.1: 25 DGX-2 nodes of 16 V100 with 800 Gbps inter-node bandwidth (read here as per node); §10.2:
NVSwitch 300 GB/s per link (read here as both directions: NVLink 2's 150 GB/s one way); V100 125 TFLOP/s fp16;
HBM 900 GB/s. The achieved fraction, 0.33, is Turing-NLG's sustained 41.4 TFLOP/s per GPU (§10.6) over that peak."""
A100_400G = Machine(
    "A100 80GB ×8 per node, 400 Gb/s per node",
    peak_tflops=_value("a100_bf16_peak_tflops"), achieved_fraction=_value("fsdp_7b_mfu_a100"), gpus_per_node=8,
    intra_node_bandwidth=_value("nvlink3_unidirectional") * 1e9, intra_node_latency_s=NVLINK_ALPHA_S,
    inter_node_bandwidth=_value("fsdp_a100_internode") * GBPS / 8, inter_node_latency_s=NETWORK_ALPHA_S,
    hbm_bandwidth=_value("a100_80gb_hbm_bandwidth") * 1e12, pcie_bandwidth=PCIE4_X16,
    host_memory_bandwidth=2 * _value("epyc_rome_socket_memory_bandwidth") * 1e9,
    host_memory_bytes=_value("dgx_a100_80gb_host_memory") * 1e12,
)
"""The A100 cluster of "Maximizing training throughput using PyTorch FSDP" (PyTorch blog, 2024-03-13):
128 A100 80GB, 400 Gbps inter-node (read here as per node), 312 TFLOP/s bf16, 2.0 TB/s HBM; its 7B run's
0.57 MFU = HFU is the achieved fraction. NVLink 3: 600 GB/s both ways, 300 GB/s busbw. Host: a DGX A100's."""
H100_800G = Machine(
    "H100 80GB ×8 per node, 800 Gb/s per node",
    peak_tflops=_value("h100_bf16_peak_tflops"), achieved_fraction=_value("fsdp_7b_mfu_h100"), gpus_per_node=8,
    intra_node_bandwidth=_value("nvlink4_unidirectional_spec") * 1e9, intra_node_latency_s=NVLINK_ALPHA_S,
    inter_node_bandwidth=_value("fsdp_h100_internode") * GBPS / 8, inter_node_latency_s=NETWORK_ALPHA_S,
    hbm_bandwidth=_value("h100_hbm_bandwidth") * 1e12, pcie_bandwidth=PCIE5_X16,
    host_memory_bandwidth=2 * _value("xeon_8480_memory_channels") * _value("xeon_4th_gen_ddr5_rate") * 1e6 * 8,
    host_memory_bytes=_value("dgx_h100_host_memory") * 1e12,
)
"""The H100 cluster of the same PyTorch blog post: 96 H100 80GB, 800 Gbps inter-node, 989 TFLOP/s bf16,
3.35 TB/s HBM, the 7B run's 0.37 MFU = HFU. NVLink 4: 900 GB/s both ways, 450 GB/s busbw. Host: a DGX H100's."""
DGX_A100 = A100_400G.with_(
    name="DGX A100: 8×A100, 8×200 Gb/s HDR InfiniBand",
    inter_node_bandwidth=_value("dgx_a100_compute_nic_rate") * GBPS,
    achieved_fraction=_value("dgx_a100_achieved_fraction"),
)
"""NVIDIA DGX A100: one 200 Gb/s HDR InfiniBand NIC per GPU; its achieved fraction (0.5) is an assumption."""
DGX_H100 = H100_800G.with_(
    name="DGX H100: 8×H100, 8×400 Gb/s NDR InfiniBand",
    inter_node_bandwidth=_value("dgx_h100_compute_nic_rate") * GBPS,
    achieved_fraction=_value("dgx_h100_achieved_fraction"),
)
"""NVIDIA DGX H100: one 400 Gb/s NDR NIC per GPU; its achieved fraction (0.4) is an assumption."""
PRESETS = {m.name: m for m in (DGX2_V100, A100_400G, H100_800G, DGX_A100, DGX_H100)}
MACHINES = {
    "dgx2-v100": DGX2_V100, "a100-400g": A100_400G, "h100-800g": H100_800G, "dgx-a100": DGX_A100, "dgx-h100": DGX_H100,
}
"""The presets by the short names the command line takes (`--machine dgx-h100`)."""
PRESET_FIGURES = {
    "dgx2-v100": ("DGX2_V100",), "a100-400g": ("A100_400G",), "h100-800g": ("H100_800G",),
    "dgx-a100": ("DGX_A100", "A100_400G"), "dgx-h100": ("DGX_H100", "H100_800G"),
}
"""The names each preset's figures are filed under in the facts file's `used_in` ("time_model.py
(DGX_A100.inter_node_bandwidth)"): its own, then those of the preset it is made from (`with_`), which its own
override field by field. `--machine list` reads its sources through them (`zero_core.cli.machines`)."""


def collective_seconds(machine: Machine, op: str, full_bytes: float, n_gpus: int) -> float:
    """α-β time of one collective on an S-byte buffer: steps·α + busbw_factor·S / B (nccl-tests' busbw).

    Ring: 2(N-1) steps for all-reduce, N-1 for reduce-scatter and all-gather. Tree (all-reduce only; other
    collectives stay on rings, as in NCCL): 2⌈log2 N⌉ steps, the same bandwidth term.
    """
    if n_gpus <= 1 or full_bytes == 0:
        return 0.0
    if machine.algorithm == "tree" and op == "all_reduce":
        steps = 2 * math.ceil(math.log2(n_gpus))
    else:
        steps = (2 if op == "all_reduce" else 1) * (n_gpus - 1)
    return steps * machine.latency_s(n_gpus) + busbw_factor(op, n_gpus) * full_bytes / machine.bus_bandwidth(n_gpus)


def predicted_busbw(machine: Machine, op: str, full_bytes: float, n_gpus: int) -> float:
    """The bus bandwidth nccl-tests would print for this collective: busbw_factor·S / time."""
    return busbw_factor(op, n_gpus) * full_bytes / collective_seconds(machine, op, full_bytes, n_gpus)


@dataclass(frozen=True)
class Layer:
    """One unit the schedule gathers and reduces at once: its parameter count and its FLOPs per step."""

    name: str
    params: float
    forward_flops: float
    backward_flops: float


def gpt_block_params(hidden: int) -> float:
    """12h² per GPT-2 block (attention 4h², MLP 8h²), the count behind ZeRO Table 4's model sizes."""
    return 12 * hidden**2


def llama_block_params(hidden: int, ffn: int, heads: int, kv_heads: int) -> float:
    """Q and O h² each, K and V h²·kv/heads each, SwiGLU MLP 3·h·ffn (norms omitted)."""
    return 2 * hidden**2 + 2 * hidden**2 * kv_heads / heads + 3 * hidden * ffn


def transformer_layers(
    n_layers: int, block_params: float, hidden: int, seq_len: int, vocab: int, tokens: int, recompute: bool = False
) -> list[Layer]:
    """An analytic schedule: embedding, `n_layers` blocks, LM head, for `tokens` tokens on one GPU.

    FLOPs are the 6Ψ-per-token rule plus attention (PaLM, Chowdhery et al. 2022, App. B): forward
    2·params + 4·hidden·seq_len per token and block, backward twice forward. `recompute` (activation
    checkpointing) runs each block's forward again in backward. The embedding is a lookup: no FLOPs.
    """
    block_forward = (2 * block_params + 4 * hidden * seq_len) * tokens
    block_backward = 2 * block_forward + (block_forward if recompute else 0)
    head_forward = 2 * vocab * hidden * tokens
    blocks = [Layer(f"block {i}", block_params, block_forward, block_backward) for i in range(n_layers)]
    head = Layer("lm_head", vocab * hidden, head_forward, 2 * head_forward)
    return [Layer("embedding", vocab * hidden, 0, 0), *blocks, head]


def layers_from_report(report) -> list[Layer]:
    """The layers of a real run: each layer's parameter count from the ledger's collectives of the last step
    (the largest buffer any network collective of the layer carried: the whole padded layer, in every stage),
    and the run's measured forward and backward FLOPs (`StageReport.flops_per_step_mean`) split by parameter
    share (an approximation: attention scores have no parameters)."""
    step = report.steps - 1
    params: dict[str, int] = {}
    for entry in report.ledger.entries(0, step=step):
        kind, _, rest = entry.tag.partition(" ")
        name = rest.split(" ")[0]  # "param lm_head node", "grad wte across replicas": the layer is the 2nd word
        if kind in ("grad", "param") and name and entry.op not in PCIE_OPS:
            params[name] = max(params.get(name, 0), entry.elements)  # a 1/S replica all-reduce is not the layer
    total = sum(params.values())
    fwd, bwd = report.flops_per_step_mean["forward"], report.flops_per_step_mean["backward"]
    return [Layer(name, p, fwd * p / total, bwd * p / total) for name, p in params.items()]


@dataclass(frozen=True)
class Interval:
    stream: str
    kind: str
    name: str
    start_s: float
    end_s: float


@dataclass
class StepPrediction:
    """One predicted step: its time, the compute and communication inside it, and every interval."""

    stage: int
    world_size: int
    machine: str
    step_s: float
    compute_s: float
    comm_s: float
    optimizer_s: float
    intervals: list[Interval] = field(repr=False)

    @property
    def exposed_comm_s(self) -> float:
        """Time the compute stream waited for communication: step time - compute time."""
        return self.step_s - self.compute_s


class Streams:
    """Streams that each run one interval at a time, in the order they are given work (compute, comm, ...)."""

    def __init__(self, names: tuple[str, ...] = ("compute", "comm")) -> None:
        self.free = dict.fromkeys(names, 0.0)
        self.intervals: list[Interval] = []

    def run(self, stream: str, kind: str, name: str, seconds: float, ready: float = 0.0) -> float:
        start = max(self.free[stream], ready)
        self.free[stream] = start + seconds
        self.intervals.append(Interval(stream, kind, name, start, start + seconds))
        return start + seconds


def predict_step(
    stage: int,
    layers: list[Layer],
    machine: Machine,
    n_gpus: int,
    *,
    prefetch_depth: int = 1,
    bytes_per_element: int = 2,
) -> StepPrediction:
    """Schedule one step of ZeRO-`stage` on two streams; see the module docstring for the dependencies."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if prefetch_depth < 0:
        raise ValueError(f"prefetch_depth must be 0 or more layers, got {prefetch_depth}")
    s, count, k = Streams(), len(layers), prefetch_depth

    def comm(op: str, i: int, ready: float, when: str = "") -> float:
        seconds = collective_seconds(machine, op, layers[i].params * bytes_per_element, n_gpus)
        return s.run("comm", op, f"{op} {layers[i].name}{when}", seconds, ready)

    def compute(kind: str, i: int, flops: float, ready: float) -> float:
        return s.run("compute", kind, f"{kind} {layers[i].name}", flops / machine.flops_per_s, ready)

    first = range(min(k + 1, count)) if stage == 3 else range(0)
    gathered = {i: comm("all_gather", i, 0.0, " (fwd)") for i in first}
    for i in range(count):
        done = compute("forward", i, layers[i].forward_flops, gathered.get(i, 0.0))
        if stage == 3 and i + k + 1 < count:
            gathered[i + k + 1] = comm("all_gather", i + k + 1, done, " (fwd)")
    order = list(reversed(range(count)))
    forward_end = s.free["compute"]
    first = range(min(k + 1, count)) if stage == 3 else range(0)
    gathered = {j: comm("all_gather", order[j], forward_end, " (bwd)") for j in first}
    for j, i in enumerate(order):
        done = compute("backward", i, layers[i].backward_flops, gathered.get(j, 0.0))
        if stage == 3 and j + k + 1 < count:
            gathered[j + k + 1] = comm("all_gather", order[j + k + 1], done, " (bwd)")
        if stage >= 2:
            comm("reduce_scatter", i, done)
    backward_end = s.free["compute"]
    if stage in (0, 1):
        for i in order:
            comm("all_reduce" if stage == 0 else "reduce_scatter", i, backward_end)
    psi = sum(layer.params for layer in layers)
    optimizer_s = ADAM_BYTES_PER_PARAM * (psi if stage == 0 else psi / n_gpus) / machine.hbm_bandwidth
    optimizer_end = s.run("compute", "optimizer", "optimizer step", optimizer_s, max(s.free.values()))
    if stage in (1, 2):
        for i in range(count):
            comm("all_gather", i, optimizer_end)
    busy = {stream: sum(iv.end_s - iv.start_s for iv in s.intervals if iv.stream == stream) for stream in s.free}
    return StepPrediction(
        stage, n_gpus, machine.name, max(s.free.values()), busy["compute"], busy["comm"], optimizer_s, s.intervals
    )


def tokens_per_s(prediction: StepPrediction, tokens: int) -> float:
    """Tokens one GPU trains per second."""
    return tokens / prediction.step_s


def break_even_tokens(
    stage: int,
    layers_for: Callable[[int], list[Layer]],
    machine: Machine,
    n_gpus: int,
    max_exposed_fraction: float = 0.05,
    **kwargs,
) -> int:
    """Fewest tokens per GPU at which exposed communication is at most `max_exposed_fraction` of the step.

    `layers_for(tokens)` builds the schedule for a token count. Compute grows with tokens and communication
    does not, so the exposed fraction falls as tokens grow; found by doubling, then bisection.
    """

    def hidden(tokens: int) -> bool:
        p = predict_step(stage, layers_for(tokens), machine, n_gpus, **kwargs)
        return p.exposed_comm_s <= max_exposed_fraction * p.step_s

    high = 1
    while not hidden(high):
        high *= 2
        if high > 2**40:
            raise ValueError(f"ZeRO-{stage} on {machine.name}: communication never hides below 2^40 tokens per GPU")
    low = high // 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if hidden(middle) else (middle, high)
    return high


def zero3_comm_bound_gpus(
    layers: list[Layer], machine: Machine, max_gpus: int = 2**20, **kwargs
) -> int | None:
    """Smallest power-of-two N at which ZeRO-3's communication takes longer than its compute (None: never
    up to `max_gpus`). Per-GPU bytes stay 3Ψ, but a ring's N-1 latency steps per collective grow with N."""
    n = 2
    while n <= max_gpus:
        p = predict_step(3, layers, machine, n, **kwargs)
        if p.comm_s >= p.compute_s:
            return n
        n *= 2
    return None


def chrome_trace(predictions: list[StepPrediction]) -> dict:
    """The predicted intervals as a Chrome/Perfetto trace (see zero_core.trace): one process per stage,
    lanes "compute" (tid 0) and "comm" (tid 1), complete events with ts and dur in microseconds."""
    events = []
    for p in predictions:
        events.append({"name": "process_name", "ph": "M", "pid": p.stage, "tid": 0,
                       "args": {"name": f"ZeRO-{p.stage} predicted, N = {p.world_size}, {p.machine}"}})
        for tid, lane in enumerate(("compute", "comm")):
            events.append({"name": "thread_name", "ph": "M", "pid": p.stage, "tid": tid, "args": {"name": lane}})
        for iv in p.intervals:
            if iv.end_s > iv.start_s:
                events.append({"name": iv.name, "cat": iv.kind, "ph": "X", "pid": p.stage,
                               "tid": 0 if iv.stream == "compute" else 1, "ts": round(iv.start_s * 1e6, 3),
                               "dur": round((iv.end_s - iv.start_s) * 1e6, 3), "args": {"kind": iv.kind}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(predictions: list[StepPrediction], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(predictions)))
    return path


def timeline_figure(predictions: list[StepPrediction]) -> Figure:
    """One row pair (compute, comm) per prediction, intervals coloured by kind, on a shared time axis."""
    from matplotlib.figure import Figure  # imported here: the launcher and the CLI import this module
    fig = Figure(figsize=(10, 1.1 + 1.0 * len(predictions)), layout="constrained")
    ax = fig.add_subplot()
    labels, ticks = [], []
    for row, p in enumerate(predictions):
        for lane, stream in enumerate(("compute", "comm")):
            y = -(row * 3 + lane)
            bars = [(iv.start_s * 1e3, (iv.end_s - iv.start_s) * 1e3) for iv in p.intervals if iv.stream == stream]
            colors = [KIND_COLORS[iv.kind] for iv in p.intervals if iv.stream == stream]
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=colors, edgecolor="white", linewidth=0.3)
            labels.append(f"ZeRO-{p.stage} {stream}")
            ticks.append(y)
    ax.set_yticks(ticks, labels)
    ax.set_xlabel("time in the step (ms)")
    ax.set_title(f"Predicted step timeline, N = {predictions[0].world_size}, {predictions[0].machine}")
    handles = [ax.bar(0, 0, color=c, label=k) for k, c in KIND_COLORS.items()]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=6, fontsize="small")
    return fig
