"""Beyond the paper's four stages: offload, ZeRO++ (hpZ, qwZ, qgZ) and HSDP, in closed form.

A configuration is a ZeRO stage plus what it changes: where the optimizer lives (offload), which group each
collective runs over (hpZ's node, HSDP's shard group) and how many bytes an element takes on the wire (qwZ's
int8, qgZ's int4). From that follow the model-state bytes one GPU holds (and its host, for offload) and the
bytes it sends per step inside its node and across nodes (`zero_core.topology.pass_split`);
`zero_core.planner.configuration_time` turns the same collectives into a step time. Ψ (`psi`) parameters on N GPUs
(`n_gpus`) in nodes of G (`gpus_per_node`); HSDP shares one model copy among S GPUs (`shard_group`).
Model states only, like ZeRO §5: activations and temporary buffers need room on top.

Every configuration's formulas are here, once (the paper's four through `zero_core.formulas`): what `table`
and `plan` count for it (`gpu_bytes`, `host_bytes`, `memory_formulas`, `cost`), and what the course's stage of
it holds and sends, which `compare` and `zero_core.report` set beside the measurements (`simulated_gpu_bytes`,
`simulated_gpu_formula`, `simulated_comm_elements`; a stage class names its configuration, `configuration`).
The two differ for offload and hpZ; `FORMULA_NOTES` says why, and both commands print it.

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
from zero_core.quantized_bytes import INT4_BYTES, INT8_BYTES, QUANT_BLOCK_ELEMENTS
from zero_core.topology import RING, Topology, pass_split

FP16_BYTES = 2
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
    return formulas.model_state_bytes(config.stage, psi, n_gpus) + secondary_bytes(config, psi, gpus_per_node)


def secondary_bytes(config: Configuration, psi: float, gpus_per_node: int, element_bytes: int = FP16_BYTES) -> float:
    """hpZ's secondary partition, the 2-byte weights split over the node's G GPUs: 2Ψ/G (0 without hpZ).
    `gpu_bytes` counts it; the course's stage holds it from forward to backward only (`FORMULA_NOTES`)."""
    return element_bytes * psi / gpus_per_node if config.hpz else 0.0


def host_bytes(config: Configuration, psi: float, n_gpus: int, element_bytes: int = FP16_BYTES) -> float:
    """Host bytes per GPU: 14Ψ/N with offload (its fp16 gradient partition 2Ψ/N, fp32 master weights, momentum
    and variance 12Ψ/N: ZeRO-Offload §4), else 0. A node's host holds G times this."""
    return (element_bytes + 12) * psi / n_gpus if config.offload else 0.0


def pcie_bytes(config: Configuration, psi: float, n_gpus: int, element_bytes: int = FP16_BYTES) -> float:
    """Bytes each GPU copies over PCIe per step each way with offload, 0 without: its gradient partition down,
    its updated parameter partition up, 2Ψ/N each (ZeRO-Offload §4.2: 4Ψ per step on one GPU)."""
    return element_bytes * psi / n_gpus if config.offload else 0.0


def memory_formulas(config: Configuration) -> tuple[str, str]:
    """(GPU, host per GPU) as formulas in Ψ, N, G (GPUs per node) and S (HSDP's shard group)."""
    if config.hsdp:
        return "16Ψ/S", "0"
    if config.offload:
        return ("2Ψ/N" if config.stage == 3 else "2Ψ"), "14Ψ/N"
    paper = formulas.MEMORY_FORMULAS[config.stage]
    return (paper + " + 2Ψ/G" if config.hpz else paper), "0"


PCIE_FORMULA = "2Ψ/N"
"""`pcie_bytes` with offload, each way."""


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
    pcie = pcie_bytes(config, psi, n_gpus)
    gpu_formula, host_formula = memory_formulas(config)
    return Cost(
        config.name, config.label, gpu_formula, host_formula,
        gpu_bytes(config, psi, n_gpus, gpus_per_node), host_bytes(config, psi, n_gpus),
        intra, inter, inter_max, pcie, pcie, plan,
    )


def simulated_gpu_bytes(
    config: Configuration, psi: float, n_gpus: int, gpus_per_node: int, element_bytes: int = FP16_BYTES
) -> float:
    """Model-state bytes one GPU of the course's stage of `config` holds after a step, in `element_bytes`
    parameters and gradients: what `compare` measures (`StageReport.formula_bytes`). `gpu_bytes` but for
    offload, whose stage also keeps ZeRO-2's 2Ψ/N gradient shard on the GPU, and hpZ, whose secondary 2Ψ/G
    is gone after backward (`FORMULA_NOTES`). HSDP's stage shards over its node: S = G."""
    _check_simulated(config)
    if config.hsdp:
        return (2 * element_bytes + 12) * psi / shard_group_size(config, n_gpus, gpus_per_node)
    if config.offload:
        return element_bytes * psi + element_bytes * psi / n_gpus
    return formulas.model_state_bytes(config.stage, psi, n_gpus, param_bytes=element_bytes, grad_bytes=element_bytes)


def simulated_gpu_formula(config: Configuration) -> str:
    """`simulated_gpu_bytes` in Ψ, N and G, hpZ's transient secondary partition in brackets."""
    _check_simulated(config)
    if config.hsdp:
        return "16Ψ/G" if config.shard_group is None else "16Ψ/S"
    if config.offload:
        return "2Ψ + 2Ψ/N"
    paper = formulas.MEMORY_FORMULAS[config.stage]
    return f"{paper} (+2Ψ/G)" if config.hpz else paper


def simulated_comm_elements(
    config: Configuration, psi: float, n_gpus: int, gpus_per_node: int, zero1_grad_sync: str = "reduce_scatter"
) -> float:
    """Elements one GPU of the course's stage sends per step, as its ledger counts them (an int8 code, a packed
    byte of two int4 codes and an fp32 scale are one element each), exactly on rings of N (ZeRO §7), with
    M = N/G nodes and B = `QUANT_BLOCK_ELEMENTS`:
    - the paper's stages: `formulas.comm_elements` (ZeRO-1 with `zero1_grad_sync`); offload is ZeRO-2's 2(N-1)/N·Ψ;
    - HSDP: ZeRO-3's three passes in a shard group of S, 3(S-1)/S·Ψ, and the all-reduce of 1/S over the
      R = N/S replicas, 2(R-1)/R·Ψ/S (the course's stage: S = G, R = M);
    - hpZ: the forward gather and the reduce-scatter over N, 2(N-1)/N·Ψ, the backward gather in the node, (G-1)/G·Ψ;
    - qwZ: two gathers of int8 codes and scales, 2(N-1)/N·Ψ·(1 + 1/B), ZeRO-3's reduce-scatter, (N-1)/N·Ψ;
    - qgZ: ZeRO-3's two gathers, 2(N-1)/N·Ψ, and its int4 all-to-alls, ((G-1)/G + (M-1)/M/G)·Ψ·(1/2 + 1/B);
    - ZeRO++: int8 gathers over N and in the node, ((N-1)/N + (G-1)/G)·Ψ·(1 + 1/B), and qgZ's all-to-alls.
    """
    _check_simulated(config)
    n, g = n_gpus, gpus_per_node
    if config.hsdp:
        s = shard_group_size(config, n, g)
        m = n // s
        return 3 * (s - 1) / s * psi + 2 * (m - 1) / m * psi / s
    if config.offload:
        return 2 * (n - 1) / n * psi
    if config.qwz and config.hpz and config.qgz:
        gathers = ((n - 1) / n + (g - 1) / g) * psi * (1 + 1 / QUANT_BLOCK_ELEMENTS)
        return gathers + _int4_all_to_all_elements(psi, n, g)
    if config.hpz:
        return 2 * (n - 1) / n * psi + (g - 1) / g * psi
    if config.qwz:
        return 2 * (n - 1) / n * psi * (1 + 1 / QUANT_BLOCK_ELEMENTS) + (n - 1) / n * psi
    if config.qgz:
        return 2 * (n - 1) / n * psi + _int4_all_to_all_elements(psi, n, g)
    return formulas.comm_elements(config.stage, psi, n, exact=True, zero1_grad_sync=zero1_grad_sync)


def _int4_all_to_all_elements(psi: float, n_gpus: int, gpus_per_node: int) -> float:
    """Ledger elements of qgZ's two all-to-alls, packed int4 bytes and fp32 scales:
    (G-1)/G·Ψ·(1/2 + 1/B) in the node and (M-1)/M·Ψ/G·(1/2 + 1/B) across."""
    g, m = gpus_per_node, n_gpus // gpus_per_node
    return ((g - 1) / g + (m - 1) / m / g) * psi * (0.5 + 1 / QUANT_BLOCK_ELEMENTS)


def _check_simulated(config: Configuration) -> None:
    if config.offload and config.stage != 2:
        raise ValueError(f"{config.name}: the course runs offload with ZeRO-2 only (zero2+offload)")


_HPZ_NOTE = "hpZ: table counts its 2Ψ/G secondary weights as resident; compare's stage frees them after backward"
FORMULA_NOTES = {
    "zero2+offload": (
        "offload: table counts 2Ψ on the GPU (ZeRO-Offload, DeepSpeed); compare's stage adds 2Ψ/N gradients"
    ),
    "zero3+hpz": _HPZ_NOTE,
    "zeropp": _HPZ_NOTE,
}
"""Why `compare` (`simulated_gpu_formula`) and `table` (`memory_formulas`) give one configuration two formulas.
The course's offload stage keeps ZeRO-2's reduce-scatter unchanged, so its gradient shard stays on the GPU
after going down to the host (`zero_core.variants.offload`); ZeRO-Offload §4 and DeepSpeed's estimator
(`zero_core.planner.deepspeed_estimators`) count the fp16 parameters alone. hpZ's secondary partition
lives from forward to backward (`zero_core.variants.hpz`); a plan must leave room for it."""


def formula_notes(names: list[str]) -> list[str]:
    """The `FORMULA_NOTES` of the configurations `names`, each note once, in order."""
    return list(dict.fromkeys(FORMULA_NOTES[name] for name in names if name in FORMULA_NOTES))
