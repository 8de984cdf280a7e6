"""What a backend must do: move the data of the six collectives `zero_core.dist` offers, nothing else.

A collective in a process group carries the group's global ranks in `call.group` (empty: every rank); its
`src` and chunk indices are the rank's index in the group, and AVG divides by the group's size.

`zero_core.dist` checks every call on the calling rank and records it in the rank's ledger; the rank's
backend only moves the bytes. Two backends implement this interface: `VirtualBackend` (the virtual
cluster's rendezvous, one thread per rank) and `TorchBackend` (a real `torch.distributed` process
group, one process per rank, under torchrun). Reports from either have one schema because everything
they count is counted in `dist`, above the backend.

The contract both keep: reductions accumulate in fp32 (fp64 stays fp64) whatever the tensor's dtype,
and `ReduceOp.AVG` is the fp32 sum divided by N once, then cast back to the tensor's dtype.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass
class CollectiveCall:
    """What a rank asked for: ranks must agree on everything here except `tag`, `seq` and `blocking`.

    `group` is the sorted global ranks of the process group the collective runs in, empty for every rank.
    `blocking`: the rank waits for the result at once (not `async_op`), so the virtual cluster can hand it
    over in the same turn of its lock as the arrival (`VirtualCluster.exchange`).
    `VirtualCluster.arrive` stamps `seq`, the call's position in the rank's sequence of collectives in
    that group: each group numbers its own, as each torch.distributed process group does.
    """

    op: str
    dtype: str
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    reduce_op: str = ""
    src: int = -1
    tag: str = ""
    seq: int = -1
    group: tuple[int, ...] = ()
    blocking: bool = False

    def signature(self) -> tuple:
        return (self.op, self.dtype, self.input_shape, self.output_shape, self.reduce_op, self.src)

    def describe(self) -> str:
        parts = [f"{self.op} #{self.seq}"]
        if self.tag:
            parts.append(f"tag={self.tag!r}")
        if self.op != "barrier":
            parts.append(f"{self.dtype} {list(self.input_shape)}")
            if self.output_shape != self.input_shape:
                parts.append(f"-> {list(self.output_shape)}")
        if self.reduce_op:
            parts.append(f"op={self.reduce_op}")
        if self.src >= 0:
            parts.append(f"src={self.src}")
        if self.group:
            parts.append(f"in group {list(self.group)}")
        return " ".join(parts)


class ReduceOp(enum.Enum):
    """How a reduction combines the ranks' values (the names of `torch.distributed.ReduceOp`)."""

    SUM = "sum"
    AVG = "avg"
    MAX = "max"
    MIN = "min"


Finish = Callable[[], Any]
"""Completes a started collective on this rank: blocks until the result is in the output tensor."""


class Backend(Protocol):
    """Moves one rank's data in a collective. Arguments are already checked; `call` describes the collective.

    Every method starts this rank's part and returns its `Finish`. `zero_core.dist` calls it at once for
    a blocking collective, or when the caller waits on the `Work` of an `async_op=True` one: until then
    the rank runs on, and must leave the input and output tensors alone.
    """

    name: str
    rank: int
    world_size: int

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, call: CollectiveCall) -> Finish: ...

    def reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, call: CollectiveCall
    ) -> Finish: ...

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, call: CollectiveCall) -> Finish: ...

    def broadcast(self, tensor: torch.Tensor, src: int, call: CollectiveCall) -> Finish: ...

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, call: CollectiveCall) -> Finish: ...

    def barrier(self, call: CollectiveCall) -> Finish: ...

    def new_group(self, ranks: tuple[int, ...]) -> None:
        """Every rank calls this for every group, in the same order (a real process group is made here)."""


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype reductions of `dtype` accumulate in: fp32 for every float but fp64; integers stay themselves."""
    if not dtype.is_floating_point:
        return dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


def divide_by_world_size(total: torch.Tensor, world_size: int) -> torch.Tensor:
    """The AVG of a SUM: one division by N, in place for floats, floor division for integers."""
    if total.is_floating_point():
        return total.div_(world_size)
    return total.div(world_size, rounding_mode="floor")


def reduce_in_rank_order(inputs: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """Combine equal-shaped tensors elementwise, in rank order, accumulating in fp32 (fp64 stays fp64).

    Elementwise adds in a fixed order: slicing the inputs first gives bit-identical slices of the result.
    """
    acc_dtype = accumulation_dtype(inputs[0].dtype)
    acc = inputs[0].to(acc_dtype, copy=True)
    for tensor in inputs[1:]:
        if op in (ReduceOp.SUM, ReduceOp.AVG):
            acc.add_(tensor)
        elif op == ReduceOp.MAX:
            torch.maximum(acc, tensor.to(acc_dtype), out=acc)
        else:
            torch.minimum(acc, tensor.to(acc_dtype), out=acc)
    if op == ReduceOp.AVG:
        acc = divide_by_world_size(acc, len(inputs))
    return acc.to(inputs[0].dtype)
