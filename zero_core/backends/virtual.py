"""The virtual cluster's backend: a collective is a rendezvous of rank threads, combined once in rank order.

Each rank thread hands its input to `VirtualCluster.arrive`; the last rank to arrive combines all the
inputs once (a sum in rank order 0, 1, ..., N-1 with fp32 accumulation, or a concatenation), and every
rank copies out its part of the result: at once in a blocking collective (`VirtualCluster.exchange`),
when its `Work` is waited on in an `async_op=True` one (`VirtualCluster.result`). Summing in one fixed
order is what makes an all-reduce followed by taking a slice bit-for-bit equal to a reduce-scatter, so
that every ZeRO stage trains to the same weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from zero_core.backends.base import CollectiveCall, Finish, ReduceOp, reduce_in_rank_order


class Rendezvous(Protocol):
    """What a rank's backend needs of the virtual cluster (`zero_core.cluster.VirtualCluster`): its size and
    the meeting point of the ranks' collectives. Named here so that the backend does not import the cluster,
    which imports the backend."""

    world_size: int

    def arrive(self, rank: int, call: CollectiveCall, payload: Any, combine: Callable[[list[Any]], Any]) -> Any: ...

    def exchange(self, rank: int, call: CollectiveCall, payload: Any, combine: Callable[[list[Any]], Any]) -> Any: ...

    def result(self, rank: int, meeting: Any) -> Any: ...


def concatenate_in_rank_order(inputs: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """The ranks' inputs end to end, viewed as `shape`. They are contiguous and of one shape, so joining
    them along dim 0 lays out exactly the flattened inputs one after another (0-d inputs are stacked)."""
    joined = torch.stack(inputs) if inputs[0].dim() == 0 else torch.cat(inputs)
    return joined.view(shape)


def reduce_into_chunks(inputs: list[torch.Tensor], op: ReduceOp, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """The reduction cut into the ranks' N equal chunks, each viewed as `shape`: chunk r is rank r's."""
    return list(reduce_in_rank_order(inputs, op).view(len(inputs), *shape).unbind(0))


def exchange_chunks(inputs: list[torch.Tensor], shape: tuple[int, ...]) -> list[torch.Tensor]:
    """All-to-all: rank i's output is every rank's chunk i, in rank order, viewed as `shape`."""
    n = len(inputs)
    chunks = torch.stack([t.reshape(n, -1) for t in inputs])  # [sender, receiver, chunk]
    return list(chunks.transpose(0, 1).contiguous().view(n, *shape).unbind(0))


class VirtualBackend:
    """Rank `rank`'s side of a `VirtualCluster`'s rendezvous.

    The rank that completes a collective shapes the result once (gathered into the output's shape, or
    reduced and cut into per-rank chunks), so that each rank takes its part with a single copy: with 32
    rank threads, every tensor call a rank makes also costs it a turn at the interpreter lock, which
    takes longer than a small copy itself.
    """

    name = "virtual"

    def __init__(self, cluster: Rendezvous, rank: int) -> None:
        self.cluster = cluster
        self.rank = rank
        self.world_size = cluster.world_size

    def new_group(self, ranks: tuple[int, ...]) -> None:
        """Nothing to set up: the cluster's rendezvous meets a group's ranks by `call.group`."""

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, call: CollectiveCall) -> Finish:
        return self._meet(call, tensor, lambda inputs: reduce_in_rank_order(inputs, op), tensor.copy_)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, call: CollectiveCall) -> Finish:
        index = call.group.index(self.rank) if call.group else self.rank
        return self._meet(
            call,
            input,
            lambda inputs: reduce_into_chunks(inputs, op, call.output_shape),
            lambda chunks: output.copy_(chunks[index]),
        )

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, call: CollectiveCall) -> Finish:
        return self._meet(
            call, input, lambda inputs: concatenate_in_rank_order(inputs, call.output_shape), output.copy_
        )

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, call: CollectiveCall) -> Finish:
        index = call.group.index(self.rank) if call.group else self.rank
        return self._meet(
            call,
            input,
            lambda inputs: exchange_chunks(inputs, call.output_shape),
            lambda chunks: output.copy_(chunks[index]),
        )

    def broadcast(self, tensor: torch.Tensor, src: int, call: CollectiveCall) -> Finish:
        """`src` is the source's index in the group (its rank without one)."""
        return self._meet(call, tensor, lambda inputs: inputs[src].clone(), tensor.copy_)

    def barrier(self, call: CollectiveCall) -> Finish:
        return self._meet(call, None, _nothing, _nothing)

    def _meet(
        self, call: CollectiveCall, payload: Any, combine: Callable[[list], Any], take: Callable[[Any], Any]
    ) -> Finish:
        """Hand `payload` to the rendezvous; `take(result)` puts this rank's part of the result in place.

        A blocking call (`call.blocking`) arrives and waits in one turn of the cluster's lock
        (`VirtualCluster.exchange`), takes its part, and returns a `Finish` with nothing left to do; an
        `async_op` one takes its part when its `Work` is waited on.
        """
        if call.blocking:
            take(self.cluster.exchange(self.rank, call, payload, combine))
            return _nothing
        meeting = self.cluster.arrive(self.rank, call, payload, combine)
        return lambda: take(self.cluster.result(self.rank, meeting))


def _nothing(*_: Any) -> None:
    """A barrier's combine and take, and the `Finish` of a blocking collective that is already done."""
