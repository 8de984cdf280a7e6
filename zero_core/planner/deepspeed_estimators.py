"""DeepSpeed's own memory estimators, re-implemented line for line so a lesson can set them beside the paper.

DeepSpeed ships `estimate_zero2_model_states_mem_needs` (deepspeed/runtime/zero/stage_1_and_2.py) and
`estimate_zero3_model_states_mem_needs` (deepspeed/runtime/zero/stage3.py); the arithmetic below is
theirs, read at deepspeedai/DeepSpeed commits 02aa38c3 (stage_1_and_2.py) and 007cca6a (stage3.py),
including the `int(...)` truncations. Like the paper's Table 1 they count model states only, never
activations or temporary buffers (deepspeedai/DeepSpeed#4093), and they return bytes that DeepSpeed's
printout divides by 2**30 and labels "GB".

Part of the planner (`zero_core.planner`): `table` sets these beside the paper's formulas for models that
never run here, so the module imports nothing of the course.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeepSpeedEstimate:
    """Bytes of model states per CPU (one node's host memory) and per GPU, as DeepSpeed estimates them.

    `largest_layer_bytes` is ZeRO-3's allowance for the one layer it gathers at a time (0 for ZeRO-2).
    """

    cpu_bytes: int
    gpu_bytes: int
    largest_layer_bytes: int = 0


def estimate_zero2_model_states_mem_needs(
    total_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    additional_buffer_factor: float = 1.5,
) -> DeepSpeedEstimate:
    """DeepSpeed's ZeRO-2 estimate: without offload the GPU holds 2P + 18P/N bytes.

    The paper's ZeRO-2 is 2Ψ + 14Ψ/N (ZeRO §5.2). DeepSpeed's source comment itemizes its 18 as fp16
    gradients 2 + fp32 gradients 4 + fp32 master parameters 4 + Adam momentum and variance 8: it keeps an
    fp32 copy of its gradient partition, 4P/N more than the paper. Older releases (microsoft/DeepSpeed at
    cde57d29) computed 4P + 16P/N. With `cpu_offload` (ZeRO-Offload) only the fp16 parameters stay on the GPU.
    """
    total_gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu_mem = 2 * total_params
        cpu_mem = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu_mem = 2 * total_params + int(18 * total_params / total_gpus)
        cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return DeepSpeedEstimate(cpu_bytes=int(cpu_mem), gpu_bytes=int(gpu_mem))


def estimate_zero3_model_states_mem_needs(
    total_params: int,
    largest_layer_params: int,
    num_gpus_per_node: int = 1,
    num_nodes: int = 1,
    cpu_offload: bool = True,
    cpu_offload_params: bool = True,
    zero_init: bool = True,
    additional_buffer_factor: float = 1.5,
) -> DeepSpeedEstimate:
    """DeepSpeed's ZeRO-3 estimate: without offload the GPU holds 4L + 18P/N bytes (L = largest layer).

    The paper's ZeRO-3 is 16Ψ/N (ZeRO §5.3). DeepSpeed partitions 18 bytes per parameter (its source does
    not itemize them; 2 more than the paper, like ZeRO-2's fp32 gradient partition is 4 more) and adds
    4 bytes per parameter of the largest layer, the one layer it materializes at a time. Offloading the
    optimizer leaves 2P/N of fp16 parameters on the GPU; offloading parameters too leaves only the layer.
    `zero_init` (building the model already partitioned) spares the CPU a full copy per GPU.
    """
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            if zero_init:
                cpu_mem = total_params * 18 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 18 * gpus_factor) * additional_buffer_factor
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            if zero_init:
                cpu_mem = total_params * 16 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 16 * gpus_factor) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return DeepSpeedEstimate(
        cpu_bytes=int(cpu_mem), gpu_bytes=int(gpu_mem), largest_layer_bytes=largest_layer_memory
    )
