"""The rank's view of the cluster, shaped like `torch.distributed` (torch 2.13) so student code transfers.

    from zero_core import dist
    dist.reduce_scatter_single(shard, full, op=dist.ReduceOp.AVG, tag="grad blocks.0.mlp.fc")

The functions take the same arguments as their `torch.distributed` namesakes, plus an optional `tag=`
that labels the call in the ledger. Every call is checked on the calling rank before it blocks (a bad
shape raises `ValueError` naming the rank and the shapes at once), then moved by the rank's backend,
then recorded in the rank's ledger with its ring bytes (see `zero_core.comm`). With `async_op=True` a
call returns a `Work` without waiting for the other ranks, as in `torch.distributed`; `work.wait()`
puts the result in the output:

    work = dist.reduce_scatter_single(shard, bucket, op=dist.ReduceOp.AVG, async_op=True)
    ...  # compute on; leave `shard` and `bucket` alone
    work.wait()

The backend is the rank's: the virtual cluster's rendezvous (`zero_core.backends.virtual`) for a rank
thread, a `torch.distributed` process group (`zero_core.backends.torch_distributed`) for a process under
`zero_core.launch`. Checks and ledger live here, above the backend, so both count alike.

Process groups work as in `torch.distributed`: every rank calls `new_group(ranks)` with the same list, in
the same order, and passes the handle as `group=` to collectives that only the group's ranks call:

    node = dist.new_group([0, 1, 2, 3])        # on every rank, members or not
    if dist.get_rank() in node.ranks:
        dist.all_gather_single(full, shard, group=node)

Inside a group, `get_rank(group)` is the rank's index among the group's sorted ranks, `get_world_size(group)`
the group's size, shapes are checked against that size, results are combined in group order, a broadcast's
`src` is a global rank (`group_src` the index in the group), and the ledger entry records the group and its
ring bytes over the group's ranks alone.

Reductions accumulate in fp32 whatever the input dtype, then cast back (on NCCL, in the input's dtype);
on the virtual cluster in rank order 0, 1, ..., N-1. That makes them deterministic, and makes an
all-reduce followed by taking a slice bit-for-bit equal to a reduce-scatter: the property that lets
every ZeRO stage train to the same weights.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from zero_core import call_sites, comm
from zero_core.backends.base import CollectiveCall, Finish, ReduceOp, reduce_in_rank_order
from zero_core.comm import RankLedger
from zero_core.context import RankContext, current, maybe_current

__all__ = [
    "ProcessGroup",
    "ReduceOp",
    "Work",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "copy_to_device",
    "copy_to_host",
    "get_rank",
    "get_world_size",
    "is_initialized",
    "new_group",
    "reduce_in_rank_order",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
]


class Work:
    """A collective started with `async_op=True`: `wait()` completes it on this rank, as in `torch.distributed`.

    Until `wait()` returns, the output holds nothing yet and the input must stay as it is. The ledger
    entry is made when the collective starts, so that it keeps its place in the rank's sequence, and
    `wait()` adds its own interval to it (`CommEntry.waited_s`): the time the rank was held up, not the
    time the collective was in flight.
    """

    def __init__(self, finish: Finish, ledger: RankLedger, entry_index: int) -> None:
        self._finish: Finish | None = finish
        self._ledger = ledger
        self._entry_index = entry_index

    def wait(self, timeout: Any = None) -> bool:
        if self._finish is not None:
            started = time.perf_counter()
            self._finish()
            self._finish = None
            self._ledger.record_wait(self._entry_index, started, time.perf_counter() - started)
        return True

    def is_completed(self) -> bool:
        return self._finish is None


@dataclass(frozen=True)
class ProcessGroup:
    """A subset of the ranks that run collectives among themselves: `ranks` are global ranks, sorted (the
    order torch.distributed numbers a group's ranks in). Made by `new_group`; pass it as `group=`."""

    ranks: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.ranks)

    def __str__(self) -> str:
        return f"group {list(self.ranks)}"


def is_initialized() -> bool:
    """True inside a rank (a virtual-cluster thread or a process under zero_core.launch)."""
    return maybe_current() is not None


def new_group(ranks: Any = None, **torch_options: Any) -> ProcessGroup:
    """A process group of `ranks` (every rank when None). Every rank must call it, members or not, with the
    same ranks and in the same order, as `torch.distributed.new_group` requires: under torchrun the
    backend makes a real process group here. `torch_options` (timeout, backend, ...) are accepted and ignored."""
    ctx = current()
    members = tuple(sorted(range(ctx.world_size) if ranks is None else (int(r) for r in ranks)))
    if not members or len(set(members)) != len(members) or not 0 <= members[0] <= members[-1] < ctx.world_size:
        raise ValueError(f"rank {ctx.rank}: new_group needs distinct ranks in 0..{ctx.world_size - 1}, got {ranks!r}")
    group = ProcessGroup(members)
    ctx.backend.new_group(members)
    return group


def _members(ctx: RankContext, group: Any, op: str) -> tuple[int, ...]:
    """The global ranks of `group` (empty: every rank); the calling rank must be one of them."""
    if group is None or (isinstance(group, ProcessGroup) and group.size == ctx.world_size):
        return ()
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"rank {ctx.rank}: {op} takes a group made by zero_core.dist.new_group, got {group!r}")
    if ctx.rank not in group.ranks:
        raise ValueError(
            f"rank {ctx.rank}: {op} in {group}, which rank {ctx.rank} is not in; only the group's ranks "
            "call its collectives (guard the call with `if dist.get_rank() in group.ranks`)"
        )
    return group.ranks


def get_rank(group: Any = None) -> int:
    """This rank's index in `group` (its global rank without one); -1 outside the group, as in torch."""
    ctx = current()
    if group is None:
        return ctx.rank
    return group.ranks.index(ctx.rank) if ctx.rank in group.ranks else -1


def get_world_size(group: Any = None) -> int:
    """The number of ranks in `group` (every rank without one)."""
    return current().world_size if group is None else group.size


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


RECORD_ISSUERS = "record_issuers"
"""With `current().extra[RECORD_ISSUERS] = True`, every collective's ledger entry names the code that called
it: the grader's evidence of whether a student's layer's collective came from the student's code or from
the reference's (`CommEntry.issuer`). Off elsewhere: it costs a walk up the stack per collective."""


def _issuer() -> str:
    """"file:function" of the innermost caller outside the collectives' own implementation."""
    frame = call_sites.outside_implementation(sys._getframe(2))
    return f"{frame.f_code.co_filename}:{frame.f_code.co_name}" if frame is not None else ""


def _run(
    ctx: RankContext,
    op: str,
    tag: str | None,
    call: CollectiveCall,
    start: Callable[[Any], Finish],
    full_bytes: int,
    element_size: int,
    async_op: bool,
    src: int = 0,
) -> Work | None:
    """`start(backend)` starts moving the data; the ledger records the collective with its ring bytes and
    the time this rank spent in it. A blocking call finishes here; an `async_op` one when its Work is waited on.
    """
    started = time.perf_counter()
    finish = start(ctx.backend)
    if not async_op:
        finish()
    entry = ctx.ledger.record(
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
        issuer=_issuer() if ctx.extra.get(RECORD_ISSUERS) else "",
        group=call.group,
    )
    return Work(finish, ctx.ledger, entry.seq) if async_op else None


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def all_reduce(
    tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None, async_op: bool = False, *, tag: str | None = None
) -> Work | None:
    """Every rank ends with the reduction of all ranks' `tensor` (in place)."""
    _check_tensor("tensor", "all_reduce", tensor)
    ctx = current()
    members = _members(ctx, group, "all_reduce")
    reduce_op = _reduce_op(op)
    shape = tuple(tensor.shape)
    call = CollectiveCall(
        "all_reduce",
        _dtype_name(tensor),
        shape,
        shape,
        reduce_op.name,
        tag=tag or "",
        group=members,
        blocking=not async_op,
    )
    return _run(
        ctx,
        comm.ALL_REDUCE,
        tag,
        call,
        lambda backend: backend.all_reduce(tensor, reduce_op, call),
        tensor.numel() * tensor.element_size(),
        tensor.element_size(),
        async_op,
    )


def reduce_scatter_single(
    output: torch.Tensor,
    input: torch.Tensor,
    op: Any = ReduceOp.SUM,
    group: Any = None,
    async_op: bool = False,
    *,
    tag: str | None = None,
) -> Work | None:
    """Rank r's `output` becomes chunk r of the reduction of all ranks' `input` (N equal chunks; in a group,
    chunk i of the group's reduction goes to its rank i)."""
    _check_tensor("output", "reduce_scatter", output)
    _check_tensor("input", "reduce_scatter", input)
    ctx = current()
    members = _members(ctx, group, "reduce_scatter")
    rank, world_size = ctx.rank, len(members) or ctx.world_size
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
        "reduce_scatter",
        _dtype_name(input),
        tuple(input.shape),
        tuple(output.shape),
        reduce_op.name,
        tag=tag or "",
        group=members,
        blocking=not async_op,
    )
    return _run(
        ctx,
        comm.REDUCE_SCATTER,
        tag,
        call,
        lambda backend: backend.reduce_scatter(output, input, reduce_op, call),
        input.numel() * input.element_size(),
        input.element_size(),
        async_op,
    )


def all_gather_single(
    output_tensor: torch.Tensor,
    input_tensor: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
    *,
    tag: str | None = None,
) -> Work | None:
    """Every rank's `output_tensor` becomes all ranks' `input_tensor`s concatenated in rank order (group order)."""
    _check_tensor("output_tensor", "all_gather", output_tensor)
    _check_tensor("input_tensor", "all_gather", input_tensor)
    ctx = current()
    members = _members(ctx, group, "all_gather")
    rank, world_size = ctx.rank, len(members) or ctx.world_size
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
        "all_gather",
        _dtype_name(input_tensor),
        tuple(input_tensor.shape),
        tuple(output_tensor.shape),
        tag=tag or "",
        group=members,
        blocking=not async_op,
    )
    return _run(
        ctx,
        comm.ALL_GATHER,
        tag,
        call,
        lambda backend: backend.all_gather(output_tensor, input_tensor, call),
        output_tensor.numel() * output_tensor.element_size(),
        output_tensor.element_size(),
        async_op,
    )


def all_to_all_single(
    output: torch.Tensor,
    input: torch.Tensor,
    group: Any = None,
    async_op: bool = False,
    *,
    tag: str | None = None,
) -> Work | None:
    """`input` cut into N equal chunks along dim 0: chunk j goes to rank j (in a group, to its rank j), and
    rank r's `output` is the ranks' chunk r in rank order. Equal splits only (torch's default)."""
    _check_tensor("output", "all_to_all", output)
    _check_tensor("input", "all_to_all", input)
    ctx = current()
    members = _members(ctx, group, "all_to_all")
    rank, world_size = ctx.rank, len(members) or ctx.world_size
    if input.dtype != output.dtype:
        raise ValueError(
            f"rank {rank}: all_to_all input {list(input.shape)} is {input.dtype} but output "
            f"{list(output.shape)} is {output.dtype}; use one dtype"
        )
    if input.shape != output.shape or input.dim() == 0 or input.shape[0] % world_size:
        raise ValueError(
            f"rank {rank}: all_to_all input {list(input.shape)} and output {list(output.shape)} must have one "
            f"shape whose first dimension the world_size ({world_size}) divides: pad dim 0 to a multiple of it"
        )
    call = CollectiveCall(
        "all_to_all",
        _dtype_name(input),
        tuple(input.shape),
        tuple(output.shape),
        tag=tag or "",
        group=members,
        blocking=not async_op,
    )
    return _run(
        ctx,
        comm.ALL_TO_ALL,
        tag,
        call,
        lambda backend: backend.all_to_all(output, input, call),
        input.numel() * input.element_size(),
        input.element_size(),
        async_op,
    )


def broadcast(
    tensor: torch.Tensor,
    src: int | None = None,
    group: Any = None,
    async_op: bool = False,
    group_src: int | None = None,
    *,
    tag: str | None = None,
) -> Work | None:
    """Every rank's `tensor` becomes rank `src`'s (in place). `src` is a global rank; `group_src` names the
    source by its index in `group` instead."""
    _check_tensor("tensor", "broadcast", tensor)
    ctx = current()
    members = _members(ctx, group, "broadcast")
    ranks = members or range(ctx.world_size)
    given = src if src is not None else group_src
    in_group = group_src is not None and src is None and 0 <= group_src < len(ranks)
    source = ranks[group_src] if in_group else src
    if source is None or source not in ranks:
        where = f"one of {list(members)}" if members else f"0..{ctx.world_size - 1}"
        raise ValueError(f"rank {ctx.rank}: broadcast needs src in {where}, got {given}")
    shape = tuple(tensor.shape)
    call = CollectiveCall(
        "broadcast", _dtype_name(tensor), shape, shape, src=source, tag=tag or "", group=members, blocking=not async_op
    )
    return _run(
        ctx,
        comm.BROADCAST,
        tag,
        call,
        lambda backend: backend.broadcast(tensor, ranks.index(source), call),
        tensor.numel() * tensor.element_size(),
        tensor.element_size(),
        async_op,
        src=source,
    )


def barrier(
    group: Any = None, async_op: bool = False, device_ids: Any = None, timeout: Any = None, *, tag: str | None = None
) -> Work | None:
    """Wait until every rank (of `group`) has reached this point."""
    ctx = current()
    call = CollectiveCall(
        "barrier", "", (), (), tag=tag or "", group=_members(ctx, group, "barrier"), blocking=not async_op
    )
    return _run(ctx, comm.BARRIER, tag, call, lambda backend: backend.barrier(call), 0, 1, async_op)


reduce_scatter_tensor = reduce_scatter_single
all_gather_into_tensor = all_gather_single


def _copy(op: str, destinations: list[torch.Tensor], sources: list[torch.Tensor], tag: str | None) -> None:
    if len(destinations) != len(sources) or any(d.shape != s.shape for d, s in zip(destinations, sources, strict=True)):
        raise ValueError(
            f"rank {get_rank()}: {op} copies {[list(s.shape) for s in sources]} into "
            f"{[list(d.shape) for d in destinations]}; give one destination of the same shape per source"
        )
    ctx = current()
    started = time.perf_counter()
    torch._foreach_copy_(destinations, sources)
    element_size = destinations[0].element_size() if destinations else 1
    ctx.ledger.record(
        op,
        tag=tag or op,
        dtype=_dtype_name(destinations[0]) if destinations else "",
        full_bytes=sum(d.numel() for d in destinations) * element_size,
        element_size=element_size,
        step=ctx.step,
        phase=ctx.phase,
        seconds=time.perf_counter() - started,
        started_s=started,
    )


def copy_to_host(
    host: torch.Tensor | list[torch.Tensor], device: torch.Tensor | list[torch.Tensor], *, tag: str | None = None
) -> None:
    """Copy GPU tensors into host tensors (in the destination's dtype), recorded as one "d2h" on the ledger.

    Not a torch.distributed call: ZeRO-Offload's PCIe traffic (its §4.2), counted like a collective so the
    ledger holds every byte a rank moves. It puts no bytes on the network (`comm.PCIE_OPS`).
    """
    _copy(comm.D2H, *(list(t) if isinstance(t, list) else [t] for t in (host, device)), tag)


def copy_to_device(
    device: torch.Tensor | list[torch.Tensor], host: torch.Tensor | list[torch.Tensor], *, tag: str | None = None
) -> None:
    """Copy host tensors into GPU tensors (in the destination's dtype), recorded as one "h2d" on the ledger."""
    _copy(comm.H2D, *(list(t) if isinstance(t, list) else [t] for t in (device, host)), tag)
