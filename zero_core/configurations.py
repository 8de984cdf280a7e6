"""Beyond the paper's four stages: offload, ZeRO++ (hpZ, qwZ, qgZ) and HSDP, in closed form.

A configuration is a ZeRO stage plus what it changes: where the optimizer lives (offload), which group each
collective runs over (hpZ's node, HSDP's shard group) and how many bytes an element takes on the wire (qwZ's
int8, qgZ's int4). From that follow the model-state bytes one GPU holds (and its host, for offload) and the
bytes it sends per step inside its node and across nodes (`zero_core.topology.pass_split`);
`zero_core.planner.configuration_time` turns the same collectives into a step time. Ψ (`psi`) parameters on N GPUs
(`n_gpus`) in nodes of G (`gpus_per_node`); HSDP shares one model copy among S GPUs (`shard_group`).
Model states only, like ZeRO §5: activations and temporary buffers need room on top.

Sources. The paper's four stages: ZeRO (arXiv:1910.02054) §5, §7, via `zero_core.formulas`. Offload:
ZeRO-Offload (arXiv:2101.06840) keeps the fp16 parameters on the GPU and the gradients, fp32 master weights
and Adam states, and the Adam step, on the CPU; with stage 3 the GPU keeps its 2Ψ/N of fp16 parameters
(ZeRO-Infinity, arXiv:2104.07857, and DeepSpeed's `estimate_zero3_model_states_mem_needs`, see
`zero_core.planner.deepspeed_estimators`). ZeRO++ (arXiv:2306.10209, and DeepSpeed's blogs/zeropp): qwZ all-gathers
weights in int8 with blockwise scales (half of fp16's bytes), hpZ keeps a secondary fp16 copy of the weights
partitioned over each node so the backward all-gather stays inside it, qgZ replaces the gradient
reduce-scatter by a hierarchical int4 all-to-all; per step ZeRO-3's cross-node volume falls from 3M to 0.75M
(forward all-gather M → 0.5M, backward all-gather M → 0, gradients M → 0.25M). HSDP (PyTorch FSDP2 with a
2-D mesh; MiCS, arXiv:2205.00119): shard within a group, replicate across groups, all-reduce each gradient
shard across the replicas.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from zero_core import formulas
from zero_core.facts import fact
from zero_core.topology import RING, Topology, pass_split

FP16_BYTES = 2
QUANT_BLOCK_ELEMENTS = int(fact("quantization_block_elements").value)
"""Elements per quantization block, each with one fp32 scale: the course's choice, also the block the ZeRO++
stages quantize with (`zero_core.variants.qwz`, `qgz`). ZeRO++ quantizes blockwise (§3.1) and DeepSpeed sizes
blocks per tensor: weights in groups of at most 8000 elements that divide the shard (its `CUDAQuantizer`:
"the optimal size is 4k"; 4096 for power-of-two shards), gradients one group per row of the 2-D gradient
(`all_to_all_quant_reduce`). The scales add 4/2048 bytes per element, about 0.2% (0.1% at 4096)."""
INT8_BYTES = 1 + 4 / QUANT_BLOCK_ELEMENTS
INT4_BYTES = 0.5 + 4 / QUANT_BLOCK_ELEMENTS
PHASES = ("forward", "backward", "gradients", "after step")


@dataclass(frozen=True)
class Configuration:
    """A ZeRO stage and what it adds. `stage` decides the schedule (what is partitioned, when gradients move)."""

    name: str
    stage: int
    offload: bool = False
    hpz: bool = False
    qwz: bool = False
    qgz: bool = False
    hsdp: bool = False
    shard_group: int | None = None

    @property
    def label(self) -> str:
        if self.hsdp:
            return "HSDP, S = G" if self.shard_group is None else f"HSDP, S = {self.shard_group}"
        if self.hpz and self.qwz and self.qgz:
            return "ZeRO++ (ZeRO-3 + hpZ + qwZ + qgZ)"
        extras = [
            n for n, on in (("offload", self.offload), ("hpZ", self.hpz), ("qwZ", self.qwz), ("qgZ", self.qgz)) if on
        ]
        return " + ".join([f"ZeRO-{self.stage}", *extras])


CONFIGURATIONS = {
    c.name: c
    for c in (
        Configuration("zero0", 0),
        Configuration("zero1", 1),
        Configuration("zero2", 2),
        Configuration("zero3", 3),
        Configuration("zero2+offload", 2, offload=True),
        Configuration("zero3+offload", 3, offload=True),
        Configuration("zero3+hpz", 3, hpz=True),
        Configuration("zero3+qwz", 3, qwz=True),
        Configuration("zero3+qgz", 3, qgz=True),
        Configuration("zeropp", 3, hpz=True, qwz=True, qgz=True),
        Configuration("hsdp", 3, hsdp=True),
    )
}
PAPER_STAGES = ("zero0", "zero1", "zero2", "zero3")
STAGE_CONFIGURATIONS = {
    0: "zero0", 1: "zero1", 2: "zero2", 3: "zero3", "offload": "zero2+offload", "hsdp": "hsdp",
    "hpz": "zero3+hpz", "qwz": "zero3+qwz", "qgz": "zero3+qgz", "zeropp": "zeropp",
}
"""The configuration each stage of `zero_core.stages` runs (by number or name), for its predicted time."""
_HSDP = re.compile(r"^hsdp(?::(\d+))?$")


def parse_configurations(text: str) -> list[Configuration]:
    """"zero3,zeropp,hsdp:64" → configurations; `hsdp` shards over a node, `hsdp:S` over S GPUs."""
    found = []
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        match = _HSDP.match(part)
        if match and match.group(1):
            found.append(Configuration(part, 3, hsdp=True, shard_group=int(match.group(1))))
        elif part in CONFIGURATIONS:
            found.append(CONFIGURATIONS[part])
        else:
            raise ValueError(f"unknown configuration {part!r}; choose from {', '.join(CONFIGURATIONS)} or hsdp:S")
    if not found:
        raise ValueError(f"no configuration in {text!r}; write them like zero1,zero3,zeropp")
    return found


def shard_group_size(config: Configuration, n_gpus: int, gpus_per_node: int) -> int:
    """GPUs that share one copy of the model states: N, or HSDP's S (default: one node, S = G)."""
    if not config.hsdp:
        return n_gpus
    s = gpus_per_node if config.shard_group is None else config.shard_group
    if s < 1 or n_gpus % s or (gpus_per_node % s and s % gpus_per_node):
        raise ValueError(
            f"{config.name}: a shard group of {s} GPUs must divide N = {n_gpus} and divide or be a multiple of "
            f"G = {gpus_per_node} GPUs per node"
        )
    return s


def gpu_bytes(config: Configuration, psi: float, n_gpus: int, gpus_per_node: int) -> float:
    """Model-state bytes on one GPU.

    Paper's stages: 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N (ZeRO §5). Offload (ZeRO-Offload §4): ZeRO-2 keeps only
    the fp16 parameters, 2Ψ (DeepSpeed's estimator agrees); ZeRO-3 only its 2Ψ/N of them. hpZ: 16Ψ/N + 2Ψ/G,
    the secondary partition being the fp16 weights split over the G GPUs of a node (our count, from ZeRO++
    §3.2's description and DeepSpeed's secondary tensor of Ψ/G elements in the parameters' dtype). qwZ adds
    nothing resident. ZeRO++ = hpZ's. HSDP: 16Ψ/S.
    """
    if config.hsdp:
        return 16 * psi / shard_group_size(config, n_gpus, gpus_per_node)
    if config.offload:
        return FP16_BYTES * psi / (n_gpus if config.stage == 3 else 1)
    secondary = FP16_BYTES * psi / gpus_per_node if config.hpz else 0.0
    return formulas.model_state_bytes(config.stage, psi, n_gpus) + secondary


def host_bytes(config: Configuration, psi: float, n_gpus: int) -> float:
    """Host bytes per GPU: 14Ψ/N with offload (its fp16 gradient partition 2Ψ/N, fp32 master weights, momentum
    and variance 12Ψ/N: ZeRO-Offload §4), else 0. A node's host holds G times this."""
    return (FP16_BYTES + 12) * psi / n_gpus if config.offload else 0.0


def memory_formulas(config: Configuration) -> tuple[str, str]:
    """(GPU, host per GPU) as formulas in Ψ, N, G (GPUs per node) and S (HSDP's shard group)."""
    if config.hsdp:
        return "16Ψ/S", "0"
    if config.offload:
        return ("2Ψ/N" if config.stage == 3 else "2Ψ"), "14Ψ/N"
    paper = {0: "16Ψ", 1: "4Ψ + 12Ψ/N", 2: "2Ψ + 14Ψ/N", 3: "16Ψ/N"}[config.stage]
    return (paper + " + 2Ψ/G" if config.hpz else paper), "0"


@dataclass(frozen=True)
class Collective:
    """One collective a step runs per layer: its phase, op, group (size, and its ranks on each node it spans),
    bytes per element on the wire, and the share of the layer's parameters in its buffer."""

    phase: str
    op: str
    group_size: int
    group_per_node: int
    bytes_per_element: float
    share: float = 1.0

    @property
    def passes(self) -> int:
        """Ring passes over the buffer: an all-reduce is a reduce-scatter and an all-gather."""
        return 2 if self.op == "all_reduce" else 1


def collectives(config: Configuration, n_gpus: int, gpus_per_node: int) -> list[Collective]:
    """The collectives of one step, in the order a layer meets them.

    ZeRO-0 all-reduces gradients; ZeRO-1/2 reduce-scatter them and all-gather the updated parameters (offload
    too: the host sends each GPU its updated fp16 partition, ZeRO-Offload §4.2); ZeRO-3 all-gathers parameters
    in forward and in backward and reduce-scatters gradients (ZeRO §7). qwZ sends both all-gathers in int8;
    hpZ's backward all-gather runs over the node (in int8 too with qwZ: DeepSpeed quantizes every gather once
    quantized weights are on, as `zero_core.variants.zeropp` does); qgZ's gradients go as int4 all-to-all inside the
    node, then, each GPU holding its node's sum of a 1/G slice, as int4 all-to-all across nodes (ZeRO++ §3.3).
    HSDP runs ZeRO-3's three over its shard group, then all-reduces each 1/S gradient shard over the N/S
    replicas (FSDP2's HSDP; MiCS §3).
    """
    n, g = n_gpus, gpus_per_node
    world = (n, min(g, n))
    if config.stage == 0:
        return [Collective("gradients", "all_reduce", *world, FP16_BYTES)]
    if config.stage in (1, 2):
        return [
            Collective("gradients", "reduce_scatter", *world, FP16_BYTES),
            Collective("after step", "all_gather", *world, FP16_BYTES),
        ]
    if config.hsdp:
        s = shard_group_size(config, n, g)
        shard = (s, min(s, g))
        return [
            Collective("forward", "all_gather", *shard, FP16_BYTES),
            Collective("backward", "all_gather", *shard, FP16_BYTES),
            Collective("gradients", "reduce_scatter", *shard, FP16_BYTES),
            Collective("gradients", "all_reduce", n // s, max(1, g // s), FP16_BYTES, share=1 / s),
        ]
    weights = INT8_BYTES if config.qwz else FP16_BYTES
    backward = Collective("backward", "all_gather", *((g, g) if config.hpz else world), weights)
    if config.qgz:
        gradients = [
            Collective("gradients", "all_to_all", g, g, INT4_BYTES),
            Collective("gradients", "all_to_all", n // g, 1, INT4_BYTES, share=1 / g),
        ]
    else:
        gradients = [Collective("gradients", "reduce_scatter", *world, FP16_BYTES)]
    return [Collective("forward", "all_gather", *world, weights), backward, *gradients]


@dataclass(frozen=True)
class Cost:
    """One configuration's numbers for Ψ on N GPUs in nodes of G: bytes per GPU (means over GPUs for traffic)."""

    name: str
    label: str
    gpu_formula: str
    host_formula: str
    gpu_bytes: float
    host_bytes: float
    intra_node_bytes: float
    inter_node_bytes: float
    inter_node_bytes_max: float
    pcie_down_bytes: float
    pcie_up_bytes: float
    collectives: list[Collective] = field(repr=False)

    @property
    def network_bytes(self) -> float:
        return self.intra_node_bytes + self.inter_node_bytes


def cost(config: Configuration, psi: float, n_gpus: int, gpus_per_node: int, algorithm: str = RING) -> Cost:
    """Memory and per-step traffic of `config`. Each collective of S bytes sends what `pass_split` gives for
    one reduce-scatter or all-gather pass of S on its group (an all-to-all sends the same (n-1)/n·S), twice
    for an all-reduce. Offload adds PCIe: each GPU's fp16 gradient partition down, 2Ψ/N, and its updated fp16
    parameters up, 2Ψ/N (ZeRO-Offload §4: 4Ψ over PCIe per step on one GPU)."""
    Topology(n_gpus, gpus_per_node)
    plan = collectives(config, n_gpus, gpus_per_node)
    intra = inter = inter_max = 0.0
    for c in plan:
        split = pass_split(psi * c.share * c.bytes_per_element, Topology(c.group_size, c.group_per_node), algorithm)
        intra += c.passes * split.intra_node_mean
        inter += c.passes * split.inter_node_mean
        inter_max += c.passes * split.inter_node_max
    pcie = FP16_BYTES * psi / n_gpus if config.offload else 0.0
    gpu_formula, host_formula = memory_formulas(config)
    return Cost(
        config.name, config.label, gpu_formula, host_formula,
        gpu_bytes(config, psi, n_gpus, gpus_per_node), host_bytes(config, psi, n_gpus),
        intra, inter, inter_max, pcie, pcie, plan,
    )
