"""The rank's view of the cluster, shaped like `torch.distributed` (torch 2.13) so student code transfers.

    from zero_core import dist
    dist.reduce_scatter_single(shard, full, op=dist.ReduceOp.AVG, tag="grad blocks.0.mlp.fc")

The functions take the same arguments as their `torch.distributed` namesakes, plus an optional `tag=`
that labels the call in the ledger. Every call is checked on the calling rank before it blocks (a bad
shape raises `ValueError` naming the rank and the shapes at once), then moved by the rank's backend,
then recorded in the rank's ledger with its ring bytes (see `zero_core.comm`).

Reductions accumulate in fp32, in rank order 0, 1, ..., N-1, whatever the input dtype, then cast back.
That makes them deterministic, and makes an all-reduce followed by taking a slice bit-for-bit equal to a
reduce-scatter: the property that lets every ZeRO stage train to the same weights.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import torch

from zero_core import comm
from zero_core.cluster import CollectiveCall
from zero_core.context import current, maybe_current


class ReduceOp(enum.Enum):
    """How a reduction combines the ranks' values (the names of `torch.distributed.ReduceOp`)."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"


class Work:
    """A finished collective, for code written with `async_op=True` (the virtual cluster is synchronous)."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def is_initialized() -> bool:
    """True inside a rank (a virtual-cluster thread or a process under zero_core.launch)."""
    return maybe_current() is not None


def get_rank(group: Any = None) -> int:
    return current().rank


def get_world_size(group: Any = None) -> int:
    return current().world_size


def _reduce_op(op: Any) -> ReduceOp:
    if isinstance(op, ReduceOp):
        return op
    name = getattr(op, "name", None) or str(op).rsplit(".", 1)[-1].split(":")[0]
    try:
        return ReduceOp[name.upper()]
    except KeyError:
        raise ValueError(f"unsupported reduce op {op!r}; use one of {[o.name for o in ReduceOp]}") from None


def _check_tensor(name: str, op: str, tensor: Any) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"rank {get_rank()}: {op} expects a torch.Tensor for {name}, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"rank {get_rank()}: {op} needs a contiguous {name}; call .contiguous() first")


def reduce_in_rank_order(inputs: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """Combine equal-shaped tensors elementwise, in rank order, accumulating in fp32 (fp64 stays fp64).

    Elementwise adds in a fixed order: slicing the inputs first gives bit-identical slices of the result.
    """
    acc_dtype = torch.float64 if inputs[0].dtype == torch.float64 else torch.float32
    if not inputs[0].is_floating_point():
        acc_dtype = inputs[0].dtype
    acc = inputs[0].to(acc_dtype, copy=True)
    for tensor in inputs[1:]:
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            acc.add_(tensor)
        elif op == ReduceOp.MAX:
            torch.maximum(acc, tensor.to(acc_dtype), out=acc)
        else:
            torch.minimum(acc, tensor.to(acc_dtype), out=acc)
    if op == ReduceOp.AVG:
        acc = acc.div_(len(inputs)) if acc.is_floating_point() else acc.div(len(inputs), rounding_mode="floor")
    return acc.to(inputs[0].dtype)


def _run(
    op: str,
    tag: str | None,
    call: CollectiveCall,
    payload: Any,
    combine: Any,
    full_bytes: int,
    element_size: int,
    src: int = 0,
) -> Any:
    ctx = current()
    started = time.perf_counter()
    result = ctx.backend.exchange(ctx.rank, call, payload, combine)
    ctx.ledger.record(
        op,
        tag=tag or op,
        dtype=call.dtype,
        full_bytes=full_bytes,
        element_size=element_size,
        step=ctx.step,
        phase=ctx.phase,
        seconds=time.perf_counter() - started,
        src=src,
        started_s=started,
    )
    return result


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, *, tag: str | None = None
) -> Work | None:
    """Every rank ends with the reduction of all ranks' `tensor` (in place)."""
    _check_tensor("tensor", "all_reduce", tensor)
    reduce_op = _reduce_op(op)
    shape = tuple(tensor.shape)
    call = CollectiveCall("all_reduce", _dtype_name(tensor), shape, shape, reduce_op.name, tag=tag or "")
    result = _run(
        comm.ALL_REDUCE,
        tag,
        call,
        tensor,
        lambda inputs: reduce_in_rank_order(inputs, reduce_op),
        tensor.numel() * tensor.element_size(),
        tensor.element_size(),
    )
    tensor.copy_(result)
    return Work() if async_op else None


def reduce_scatter_single(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    *,
    tag: str | None = None,
) -> Work | None:
    """Rank r's `output` becomes chunk r of the reduction of all ranks' `input` (N equal chunks)."""
    _check_tensor("output", "reduce_scatter", output)
    _check_tensor("input", "reduce_scatter", input)
    rank, world_size = get_rank(), get_world_size()
    if input.dtype != output.dtype:
        raise ValueError(
            f"rank {rank}: reduce_scatter input {list(input.shape)} is {input.dtype} but output "
            f"{list(output.shape)} is {output.dtype}; use one dtype"
        )
    if input.numel() != output.numel() * world_size:
        raise ValueError(
            f"rank {rank}: reduce_scatter input {list(input.shape)} ({input.numel()} elements) must have "
            f"world_size ({world_size}) x output {list(output.shape)} ({output.numel()}) elements; "
            "pad the input to a multiple of the world size"
        )
    reduce_op = _reduce_op(op)
    call = CollectiveCall(
        "reduce_scatter", _dtype_name(input), tuple(input.shape), tuple(output.shape), reduce_op.name, tag=tag or ""
    )
    result = _run(
        comm.REDUCE_SCATTER,
        tag,
        call,
        input,
        lambda inputs: reduce_in_rank_order([t.reshape(-1) for t in inputs], reduce_op),
        input.numel() * input.element_size(),
        input.element_size(),
    )
    n = output.numel()
    output.copy_(result[rank * n : (rank + 1) * n].view(output.shape))
    return Work() if async_op else None


def all_gather_single(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
    *,
    tag: str | None = None,
) -> Work | None:
    """Every rank's `output_tensor` becomes all ranks' `input_tensor`s concatenated in rank order."""
    _check_tensor("output_tensor", "all_gather", output_tensor)
    _check_tensor("input_tensor", "all_gather", input_tensor)
    rank, world_size = get_rank(), get_world_size()
    if input_tensor.dtype != output_tensor.dtype:
        raise ValueError(
            f"rank {rank}: all_gather input {list(input_tensor.shape)} is {input_tensor.dtype} but output "
            f"{list(output_tensor.shape)} is {output_tensor.dtype}; use one dtype"
        )
    if output_tensor.numel() != input_tensor.numel() * world_size:
        raise ValueError(
            f"rank {rank}: all_gather output {list(output_tensor.shape)} ({output_tensor.numel()} elements) must "
            f"have world_size ({world_size}) x input {list(input_tensor.shape)} ({input_tensor.numel()}) elements"
        )
    call = CollectiveCall(
        "all_gather", _dtype_name(input_tensor), tuple(input_tensor.shape), tuple(output_tensor.shape), tag=tag or ""
    )
    result = _run(
        comm.ALL_GATHER,
        tag,
        call,
        input_tensor,
        lambda inputs: torch.cat([t.reshape(-1) for t in inputs]),
        output_tensor.numel() * output_tensor.element_size(),
        output_tensor.element_size(),
    )
    output_tensor.copy_(result.view(output_tensor.shape))
    return Work() if async_op else None


def broadcast(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Any = None,
    async_op: bool = False,
    group_src: int | None = None,
    *,
    tag: str | None = None,
) -> Work | None:
    """Every rank's `tensor` becomes rank `src`'s (in place)."""
    _check_tensor("tensor", "broadcast", tensor)
    source = src if src is not None else group_src
    world_size = get_world_size()
    if source is None or not 0 <= source < world_size:
        raise ValueError(f"rank {get_rank()}: broadcast needs src in 0..{world_size - 1}, got {source}")
    shape = tuple(tensor.shape)
    call = CollectiveCall("broadcast", _dtype_name(tensor), shape, shape, src=source, tag=tag or "")
    result = _run(
        comm.BROADCAST,
        tag,
        call,
        tensor,
        lambda inputs: inputs[source].clone(),
        tensor.numel() * tensor.element_size(),
        tensor.element_size(),
        src=source,
    )
    tensor.copy_(result)
    return Work() if async_op else None


def barrier(
    group: Any = None, async_op: bool = False, device_ids: Any = None, timeout: Any = None, *, tag: str | None = None
) -> Work | None:
    """Wait until every rank has reached this point."""
    call = CollectiveCall("barrier", "", (), (), tag=tag or "")
    _run(comm.BARRIER, tag, call, None, lambda inputs: None, 0, 1)
    return Work() if async_op else None


reduce_scatter_tensor = reduce_scatter_single
all_gather_into_tensor = all_gather_single
