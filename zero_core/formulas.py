"""The ZeRO paper's arithmetic: model-state bytes per GPU, bytes on the wire, and Tables 1 and 2.

Every number a lesson quotes from Rajbhandari et al. (arXiv:1910.02054) is computed here, from the
formula, next to what the paper printed (read from `zero_core/data/facts.toml`, beside its quote).
Ψ (`psi`) is the parameter count, N (`n_gpus`) the data-parallel degree, K the optimizer's bytes per
parameter (12 for mixed-precision Adam: fp32 master weights, momentum and variance). Pure Python, so the
planner runs without torch. DeepSpeed's own estimators, which differ from the paper, live in
`zero_core.planner.deepspeed_estimators`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zero_core.facts import fact
from zero_core.units import GB, parse_count

STAGES = (0, 1, 2, 3)
MEMORY_FORMULAS = {0: "16Ψ", 1: "4Ψ + 12Ψ/N", 2: "2Ψ + 14Ψ/N", 3: "16Ψ/N"}
"""`model_state_bytes` of each stage as the paper writes it (ZeRO Figure 1), K = 12."""
MODEL_STATE_CATEGORIES = ("param.fp16", "grad.fp16", "master.fp32", "adam.m", "adam.v")
"""The memory tracker's names for the paper's model states (ZeRO §3.1), in the same order."""
COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
ZERO1_GRAD_SYNCS = ("reduce_scatter", "all_reduce")


def _check(stage: int, n_gpus: int) -> None:
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3 (0 is plain data parallelism), got {stage!r}")
    if n_gpus < 1:
        raise ValueError(f"the data-parallel degree must be at least 1 GPU, got n_gpus={n_gpus!r}")


def model_state_bytes(
    stage: int, psi: float, n_gpus: int, k: float = 12, param_bytes: int = 2, grad_bytes: int = 2
) -> float:
    """Bytes of model states one GPU holds (ZeRO Figure 1, §5.1-§5.3).

    Each stage partitions one more state across the N GPUs instead of replicating it:
    stage 0 (2+2+K)Ψ = 16Ψ, stage 1 (P_os) 4Ψ + KΨ/N, stage 2 (P_os+g) 2Ψ + (2+K)Ψ/N,
    stage 3 (P_os+g+p) (2+2+K)Ψ/N = 16Ψ/N.
    """
    _check(stage, n_gpus)
    replicated = (param_bytes + grad_bytes + k, param_bytes + grad_bytes, param_bytes, 0)[stage]
    partitioned = param_bytes + grad_bytes + k - replicated
    return replicated * psi + partitioned * psi / n_gpus


def model_state_breakdown(stage: int, psi: float, n_gpus: int, k: float = 12) -> dict[str, float]:
    """Per-GPU bytes of each model state (ZeRO §3.1: K = 12 is 4 + 4 + 4 for master, momentum, variance).

    Only mixed-precision Adam's K = 12 splits into known categories, so other K are refused.
    """
    _check(stage, n_gpus)
    if k != 12:
        raise ValueError(f"the breakdown knows Adam's K = 12 (4+4+4 bytes), got k={k!r}; use model_state_bytes")
    bytes_per_param = (2, 2, 4, 4, 4)
    partitioned_from_stage = (3, 2, 1, 1, 1)
    return {
        category: per_param * (psi / n_gpus if stage >= first_stage else psi)
        for category, per_param, first_stage in zip(
            MODEL_STATE_CATEGORIES, bytes_per_param, partitioned_from_stage, strict=True
        )
    }


def busbw_factor(op: str, n: int) -> float:
    """NCCL's bus-bandwidth factor (nccl-tests PERFORMANCE.md): bytes each rank moves per byte of buffer.

    all-reduce 2(n-1)/n, reduce-scatter and all-gather (n-1)/n, broadcast 1.
    """
    if op not in COLLECTIVES:
        raise ValueError(f"unknown collective {op!r}; expected one of {COLLECTIVES}")
    if op == "broadcast":
        return 1.0
    return (2 if op == "all_reduce" else 1) * (n - 1) / n


def ring_bytes_sent(op: str, full_buffer_bytes: int, n: int) -> float:
    """Bytes one rank sends for a collective on an S-byte buffer under the ring algorithm (ZeRO §7.1).

    The busbw factor times S: a ring all-reduce is a reduce-scatter then an all-gather, each rank sending
    (n-1) chunks of S/n per phase; a pipelined broadcast forwards the whole buffer. One rank sends nothing.
    """
    if n == 1:
        return 0.0
    return busbw_factor(op, n) * full_buffer_bytes


def comm_elements(
    stage: int, psi: float, n_gpus: int, exact: bool = True, zero1_grad_sync: str = "reduce_scatter"
) -> float:
    """Elements each GPU sends per training step (ZeRO §7.1, §7.2.1, §7.2.2).

    Stage 0 all-reduces gradients: 2Ψ. Stages 1 and 2 reduce-scatter gradients and all-gather updated
    parameters: Ψ + Ψ = 2Ψ, no more than data parallelism. Stage 3 all-gathers parameters in forward and
    again in backward, then reduce-scatters gradients: 3Ψ, the paper's 1.5×. `zero1_grad_sync="all_reduce"`
    models DeepSpeed's ZeRO-1, which all-reduces gradients then all-gathers parameters: 3Ψ.
    `exact=True` keeps the ring's (N-1)/N per collective (2·31/32 Ψ = 1.9375Ψ at N = 32); `exact=False`
    gives the paper's large-N counts.
    """
    _check(stage, n_gpus)
    if zero1_grad_sync not in ZERO1_GRAD_SYNCS:
        raise ValueError(f"zero1_grad_sync must be one of {ZERO1_GRAD_SYNCS}, got {zero1_grad_sync!r}")
    passes = {0: 2, 1: 2, 2: 2, 3: 3}[stage]
    if stage == 1 and zero1_grad_sync == "all_reduce":
        passes = 3
    ring_factor = (n_gpus - 1) / n_gpus if exact else 1.0
    return passes * ring_factor * psi


def comm_bytes(
    stage: int,
    psi: float,
    n_gpus: int,
    bytes_per_element: int = 2,
    exact: bool = True,
    zero1_grad_sync: str = "reduce_scatter",
) -> float:
    """Bytes each GPU sends per step: `comm_elements` × bytes per element (fp16 = 2, ZeRO §7)."""
    return comm_elements(stage, psi, n_gpus, exact, zero1_grad_sync) * bytes_per_element


def comm_seconds(
    bytes_per_gpu: float, bandwidth_bytes_per_s: float, latency_s: float = 0.0, n_messages: int = 0
) -> float:
    """Alpha-beta time of sending `bytes_per_gpu`: n_messages × latency + bytes / bandwidth.

    7.5B parameters, fp16, 50 GB/s: ZeRO-0/1/2 send 2Ψ × 2 B = 30 GB in 0.6 s, ZeRO-3 3Ψ × 2 B = 45 GB in
    0.9 s (ZeRO §7's counts, a link that is never idle).
    """
    if bandwidth_bytes_per_s <= 0:
        raise ValueError(f"bandwidth must be positive bytes per second, got {bandwidth_bytes_per_s!r}")
    return n_messages * latency_s + bytes_per_gpu / bandwidth_bytes_per_s


def activation_bytes_estimate(
    hidden: int, batch: int, seq: int, layers: int, checkpointing: bool = False, bytes_per_value: int = 2
) -> float:
    """Activation memory of a GPT-2-like transformer (ZeRO §3.2).

    The paper counts about 12 × hidden × batch × seq × layers activation values; in fp16 that is
    2 bytes each, which is how GPT-2 1.5B (hidden 1600, 48 layers) at batch 32, seq 1024 needs ~60 GB.
    With checkpointing the paper says the memory drops "by approximately the square root" (citing
    Chen et al.'s √n checkpointing, which keeps a checkpoint every √L layers): we divide by √layers,
    which gives 60.4 / √48 = 8.7 GB, the paper's "about 8 GB". Storing only each layer's fp16 input
    (2 × hidden × batch × seq × layers = 5.0 GB here) would undercount the paper's figure.
    """
    full_bytes = 12 * hidden * batch * seq * layers * bytes_per_value
    return full_bytes / math.sqrt(layers) if checkpointing else float(full_bytes)


def activation_bytes_per_layer(hidden: int, heads: int, batch: int, seq: int) -> float:
    """One transformer layer's activations kept for backward, in bytes: s·b·h·(34 + 5·a·s/h).

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", §4.1, no
    tensor or sequence parallelism): 16-bit activations and 1-byte dropout masks. 34·s·b·h are the
    layer's inputs and intermediate results (attention's Q, K, V and output, the MLP's 4h-wide ones, the
    LayerNorms'); 5·a·s²·b is attention's s × s matrix per head, kept three times over (the scores' softmax
    in 2 bytes, its dropout mask in 1, the dropped-out result in 2). The paper's 12·h·b·s per layer (§3.2)
    leaves that quadratic term out; kernels that never store the matrix (FlashAttention) leave 34·s·b·h.
    """
    return seq * batch * hidden * (34 + 5 * heads * seq / hidden)


def activation_bytes_checkpointed_per_block(hidden: int, heads: int, batch: int, seq: int, layers: int) -> float:
    """Activations with every transformer block checkpointed, as `GPTConfig.activation_checkpointing` does:
    each block's 2-byte input (2·s·b·h per layer) stays from forward to backward, and one block's full
    activations (`activation_bytes_per_layer`) come back while that block is recomputed."""
    return 2 * seq * batch * hidden * layers + activation_bytes_per_layer(hidden, heads, batch, seq)


def fits(stage: int, psi: float, n_gpus: int, gpu_memory_bytes: float, activation_bytes: float = 0) -> bool:
    """Whether model states plus `activation_bytes` fit one GPU (ZeRO §5; residual memory is §6's topic)."""
    return model_state_bytes(stage, psi, n_gpus) + activation_bytes <= gpu_memory_bytes


def largest_model_params(
    gpu_memory_bytes: float, n_gpus: int, stage: int, k: float = 12, model_parallel: int = 1
) -> float:
    """The largest Ψ whose model states fit one GPU (ZeRO Table 2); activations are not counted.

    With model parallelism of degree MP each GPU holds the states of Ψ/MP parameters, so Ψ scales by MP.
    """
    return model_parallel * gpu_memory_bytes / model_state_bytes(stage, 1.0, n_gpus, k)


def plan(
    psi: float,
    gpu_memory_bytes: float,
    gpu_counts: tuple[int, ...] = tuple(2**i for i in range(11)),
    activation_bytes: float = 0,
) -> dict[int, int | None]:
    """For each stage, the smallest GPU count in `gpu_counts` whose per-GPU memory fits Ψ, or None.

    The question Table 1's bold cells answer for 32 GB V100s (ZeRO §5, Table 1), asked of any model.
    """
    return {
        stage: next(
            (n for n in sorted(gpu_counts) if fits(stage, psi, n, gpu_memory_bytes, activation_bytes)), None
        )
        for stage in STAGES
    }


def printed_reading(exact: float, printed: str) -> str:
    """How a number printed in the paper relates to the exact one: exact, rounded, truncated or disagrees.

    The precision is the printed text's: "41.3" stands for 41.25 rounded half up, "513" for 513.5 cut off.
    A suffix (K, M, B, T) scales the printed mantissa, as in Table 2's "7.6B" and "0.5T".
    """
    mantissa = printed.rstrip("KMBT")
    scale = parse_count("1" + printed[len(mantissa):])
    value = float(mantissa) * scale
    unit = scale * 10.0 ** -(len(mantissa.split(".")[1]) if "." in mantissa else 0)
    error = exact - value
    if math.isclose(error, 0.0, abs_tol=1e-9 * unit):
        return "exact"
    tie = math.isclose(abs(error), unit / 2, rel_tol=1e-9)
    if (abs(error) < unit / 2 and not tie) or (tie and error < 0):
        return "rounded"
    if 0 < error < unit:
        return "truncated"
    return "disagrees"


@dataclass(frozen=True)
class PaperCell:
    """One number of a paper table: the exact value from the formula and the text the paper printed."""

    exact: float
    printed: str

    @property
    def reading(self) -> str:
        return printed_reading(self.exact, self.printed)


TABLE1_COLUMNS = ("P_os", "P_os+g", "P_os+g+p")
TABLE1_N_GPUS = (1, 4, 16, 64, 256, 1024)
TABLE1_MODELS = ("7.5B", "128B", "1T")


def table1_printed(model: str, n_gpus: int) -> tuple[str, ...]:
    """The paper's printed cells of Table 1's row for `model` at N_d = `n_gpus` (the facts file, with its quote)."""
    return fact(f"zero_paper_table1_{model.lower().replace('.', '_')}_nd_{n_gpus}").printed


@dataclass(frozen=True)
class Table1Row:
    """One row of ZeRO Table 1: per-GPU model-state GB for Ψ at data-parallel degree N, K = 12.

    `baseline_gb` is plain data parallelism's 16Ψ (the paper's N = 1 row); `cells` are the three
    ZeRO columns P_os, P_os+g, P_os+g+p, each with its exact GB (1e9 bytes) and the paper's text.
    """

    model: str
    psi: int
    n_gpus: int
    baseline_gb: float
    cells: tuple[PaperCell, PaperCell, PaperCell]


def table1() -> list[Table1Row]:
    """ZeRO §5, Table 1, recomputed: the 7.5B cells are rounded, the 128B and 1T cells mostly truncated."""
    rows = []
    for model in TABLE1_MODELS:
        psi = parse_count(model)
        for n_gpus in TABLE1_N_GPUS:
            cells = tuple(
                PaperCell(model_state_bytes(stage, psi, n_gpus) / GB, printed)
                for stage, printed in zip((1, 2, 3), table1_printed(model, n_gpus), strict=True)
            )
            rows.append(Table1Row(model, psi, n_gpus, model_state_bytes(0, psi, n_gpus) / GB, cells))
    return rows


TABLE2_COLUMNS = ("Baseline", "P_os", "P_os+g", "P_os+g+p")
TABLE2_MODEL_PARALLEL = (1, 2, 4, 8, 16)
TABLE2_GPU_MEMORY_BYTES = fact("v100_memory").value * GB
TABLE2_DP_GPUS = 64


@dataclass(frozen=True)
class Table2Row:
    """One row of ZeRO Table 2: the largest Ψ whose model states fit 32 GB GPUs at N_d = 64.

    The paper printed the MP = 1 row rounded to 0.1B and every later row as MP times it (7.6B × 4 =
    30.4B, while the formula gives 30.6B), so only the first row reads as rounded/truncated.
    """

    model_parallel: int
    total_gpus: int
    cells: tuple[PaperCell, PaperCell, PaperCell, PaperCell]


def table2() -> list[Table2Row]:
    """ZeRO Table 2 (its theoretical columns): baseline 2B, P_os 7.6B, P_os+g 14.4B, P_os+g+p 128B at MP 1."""
    rows = []
    for model_parallel in TABLE2_MODEL_PARALLEL:
        printed_row = fact(f"zero_paper_table2_mp_{model_parallel}").printed
        cells = tuple(
            PaperCell(
                largest_model_params(
                    TABLE2_GPU_MEMORY_BYTES, TABLE2_DP_GPUS, stage, model_parallel=model_parallel
                ),
                printed,
            )
            for stage, printed in zip(STAGES, printed_row, strict=True)
        )
        rows.append(Table2Row(model_parallel, model_parallel * TABLE2_DP_GPUS, cells))
    return rows
