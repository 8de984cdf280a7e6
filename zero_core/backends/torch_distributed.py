"""The real backend: collectives of a `torch.distributed` process group, one process per rank (torchrun).

The same stage code that runs on the virtual cluster runs here unchanged: `zero_core.dist` checks each
call and records it in the ledger exactly as on the virtual cluster (ring bytes of the logical dtype),
and this backend moves the data with `torch.distributed`, under the names the installed torch has
(`REDUCE_SCATTER`, `ALL_GATHER`): `reduce_scatter_single`/`all_gather_single` from torch 2.13, where
the older `reduce_scatter_tensor`/`all_gather_into_tensor` warn with a FutureWarning, and those older
names before it (torch 2.6 to 2.12 have only them).

Three decisions keep the real backend's arithmetic the virtual cluster's, on any torch release:
- `ReduceOp.AVG` is always a SUM followed by one division by N. Gloo in torch 2.7-2.8 silently summed
  when asked to average in a reduce-scatter, and some backends reject AVG outright; SUM exists
  everywhere, and "fp32 sum, one division, one cast" is exactly what the virtual cluster computes.
- On gloo, fp16 and bf16 reductions travel as fp32: the sum accumulates in fp32 as the virtual cluster's
  does (gloo would add in the 2-byte dtype, rounding at every rank), and builds of gloo without 2-byte
  reductions work too. The ledger still records the 2-byte bytes the algorithm moves: the course counts
  what ZeRO sends, not this CPU transport's detour. All-gathers and broadcasts move the tensor as is.
- On NCCL, reductions travel in their own dtype (bandwidth is the point on GPUs, as in DeepSpeed and
  FSDP), so agreement with the virtual cluster is within the dtype's rounding there. The rank's context
  names its GPU (`RankContext.device`) and the stages keep every buffer there, so a collective moves
  the stage's own tensors: nothing is staged through the host.

A process group of `zero_core.dist.new_group` is a `torch.distributed.new_group` of the same ranks, made
when every rank asks for it (as torch requires), on the data plane's backend; a collective in it runs there,
and AVG divides by the group's size.

Gloo adds in its own order (ring segments, not rank order), so with N > 2 an fp32 sum can differ from
the virtual cluster's in the last bit; with N = 2 a sum is one addition, and addition commutes.

The backend's own arithmetic (the upcast, AVG's division, the copies back) runs outside any dispatch
mode, as the virtual cluster's reductions do: it is the interconnect's work, not the rank's FLOPs. A
collective that fails (a peer died, or did not arrive within the process group's timeout) raises
`CollectiveFailed` naming this rank and the collective, instead of torch's transport error.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as torch_dist
from torch.utils._python_dispatch import _disable_current_modes as _interconnect

from zero_core.backends.base import CollectiveCall, Finish, ReduceOp, accumulation_dtype, divide_by_world_size
from zero_core.comm import RankLedger
from zero_core.context import RankContext
from zero_core.memory import MemoryTracker

REDUCE_SCATTER: Callable[..., Any] = (
    getattr(torch_dist, "reduce_scatter_single", None) or torch_dist.reduce_scatter_tensor
)
"""The flat reduce-scatter of this torch: `reduce_scatter_single` (2.13+) or `reduce_scatter_tensor`."""
ALL_GATHER: Callable[..., Any] = getattr(torch_dist, "all_gather_single", None) or torch_dist.all_gather_into_tensor
"""The flat all-gather of this torch: `all_gather_single` (2.13+) or `all_gather_into_tensor`."""

TORCH_OPS = {
    ReduceOp.SUM: torch_dist.ReduceOp.SUM,
    ReduceOp.AVG: torch_dist.ReduceOp.SUM,
    ReduceOp.MAX: torch_dist.ReduceOp.MAX,
    ReduceOp.MIN: torch_dist.ReduceOp.MIN,
}
"""What each of our reductions asks the process group for: AVG is a SUM, divided afterwards."""


def upcasts_reductions(backend_name: str) -> bool:
    """Whether fp16/bf16 reductions travel as fp32: on gloo (and other CPU transports) yes, on NCCL no."""
    return backend_name != "nccl"


def wire_dtype(dtype: torch.dtype, *, reduction: bool, upcast: bool) -> torch.dtype:
    """The dtype a tensor travels in: its accumulation dtype for an upcast reduction, its own otherwise."""
    return accumulation_dtype(dtype) if reduction and upcast else dtype


class CollectiveFailed(RuntimeError):
    """A collective of the real process group failed: a peer died or did not arrive in time."""


class TorchBackend:
    """This process's side of a `torch.distributed` process group (`group=None`: the default group)."""

    def __init__(
        self,
        group: Any = None,
        *,
        device: torch.device | None = None,
        upcast_reductions: bool | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        if not torch_dist.is_initialized():
            raise RuntimeError("TorchBackend needs an initialised process group: call init_process_group first")
        self.group = group
        self.name = str(torch_dist.get_backend(group))
        self.rank = torch_dist.get_rank(group)
        self.world_size = torch_dist.get_world_size(group)
        self.device = device or torch.device("cpu")
        self.upcast_reductions = upcasts_reductions(self.name) if upcast_reductions is None else upcast_reductions
        self._next_seq = 0
        self._groups: dict[tuple[int, ...], Any] = {}
        self._timeout = timeout

    def new_group(self, ranks: tuple[int, ...]) -> None:
        """Make the torch.distributed group of `ranks` (every rank calls this, members or not, in one order)."""
        if ranks not in self._groups:
            options = {} if self._timeout is None else {"timeout": self._timeout}
            self._groups[ranks] = torch_dist.new_group(list(ranks), backend=self.name, **options)

    def _group(self, call: CollectiveCall) -> Any:
        return self._groups[call.group] if call.group else self.group

    def _size(self, call: CollectiveCall) -> int:
        return len(call.group) or self.world_size

    def wire_dtype(self, dtype: torch.dtype, *, reduction: bool) -> torch.dtype:
        return wire_dtype(dtype, reduction=reduction, upcast=self.upcast_reductions)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, call: CollectiveCall) -> Finish:
        with _interconnect():
            wire = tensor.to(self.device, self.wire_dtype(tensor.dtype, reduction=True))
            work = self._start(call, torch_dist.all_reduce, wire, op=TORCH_OPS[op], group=self._group(call))
        return self._finisher(call, work, tensor, wire, op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, call: CollectiveCall) -> Finish:
        with _interconnect():
            dtype = self.wire_dtype(input.dtype, reduction=True)
            wire_in = input.reshape(-1).to(self.device, dtype)
            wire_out = output.reshape(-1).to(self.device, dtype)
            work = self._start(call, REDUCE_SCATTER, wire_out, wire_in, op=TORCH_OPS[op], group=self._group(call))
        return self._finisher(call, work, output.view(-1), wire_out, op)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, call: CollectiveCall) -> Finish:
        with _interconnect():
            wire_out = output.reshape(-1).to(self.device)
            work = self._start(
                call, ALL_GATHER, wire_out, input.reshape(-1).to(self.device), group=self._group(call)
            )
        return self._finisher(call, work, output.view(-1), wire_out, None)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, call: CollectiveCall) -> Finish:
        """`torch.distributed.all_to_all_single` with equal splits (gloo and NCCL both have it); moves the
        tensor as is, like an all-gather."""
        with _interconnect():
            wire_out = output.reshape(-1).to(self.device)
            work = self._start(
                call, torch_dist.all_to_all_single, wire_out, input.reshape(-1).to(self.device), group=self._group(call)
            )
        return self._finisher(call, work, output.view(-1), wire_out, None)

    def broadcast(self, tensor: torch.Tensor, src: int, call: CollectiveCall) -> Finish:
        with _interconnect():
            wire = tensor.to(self.device)
            work = self._start(call, torch_dist.broadcast, wire, group=self._group(call), group_src=src)
        return self._finisher(call, work, tensor, wire, None)

    def barrier(self, call: CollectiveCall) -> Finish:
        device_ids = [self.device.index] if self.name == "nccl" else None
        work = self._start(call, torch_dist.barrier, group=self._group(call), device_ids=device_ids)
        return lambda: self._wait(call, work)

    def _finisher(
        self, call: CollectiveCall, work: Any, tensor: torch.Tensor, wire: torch.Tensor, op: ReduceOp | None
    ) -> Finish:
        """Wait for the process group, then AVG's division and the result back into the caller's tensor
        (one cast, as on the virtual cluster)."""

        def finish() -> None:
            self._wait(call, work)
            with _interconnect():
                result = divide_by_world_size(wire, self._size(call)) if op == ReduceOp.AVG else wire
                if result.data_ptr() != tensor.data_ptr() or (result.dtype, result.device) != (
                    tensor.dtype,
                    tensor.device,
                ):
                    tensor.copy_(result)

        return finish

    def _start(self, call: CollectiveCall, collective: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Start one torch.distributed collective (`async_op=True`); a transport failure becomes `CollectiveFailed`."""
        call.seq = self._next_seq
        self._next_seq += 1
        try:
            return collective(*args, async_op=True, **kwargs)
        except RuntimeError as error:
            raise self._failed(call, error) from error

    def _wait(self, call: CollectiveCall, work: Any) -> None:
        try:
            work.wait()
        except RuntimeError as error:
            raise self._failed(call, error) from error

    def _failed(self, call: CollectiveCall, error: RuntimeError) -> CollectiveFailed:
        return CollectiveFailed(
            f"rank {self.rank}: {call.describe()} failed in the {self.name} process group "
            f"({error_gist(error)}). Another rank has most likely died or stopped responding; "
            "its own error, if any, is above"
        )


def error_gist(error: BaseException) -> str:
    """The gist of a transport error: no source location, no advice paragraph."""
    text = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip())
    return text.split(". ")[0].splitlines()[0] if text else type(error).__name__


def join_process_group(backend: str = "auto", timeout_s: float = 30.0, local_rank: int = 0) -> TorchBackend:
    """Join torchrun's process group (gloo: the control plane) and pick the data plane, NCCL or gloo.

    `backend="auto"` picks NCCL when every rank has a CUDA device of its own (`LOCAL_RANK` below the node's
    device count), gloo otherwise. Every rank must pick the same, so the ranks first agree, over gloo, on
    whether all of them have a GPU. `backend="nccl"` without one raises `ValueError`; a group the ranks
    cannot form within `timeout_s` (a rank never started) raises `CollectiveFailed`.
    """
    timeout = timedelta(seconds=timeout_s)
    has_gpu = torch.cuda.is_available() and local_rank < torch.cuda.device_count()
    every_rank_has_gpu = torch.tensor([int(has_gpu)])
    started = time.monotonic()
    try:
        torch_dist.init_process_group("gloo", timeout=timeout)
        torch_dist.all_reduce(every_rank_has_gpu, op=torch_dist.ReduceOp.MIN)
    except RuntimeError as error:
        if time.monotonic() - started < timeout_s / 2:  # not a wait that ran out: say what failed, not how long
            port, address = os.environ.get("MASTER_PORT"), os.environ.get("MASTER_ADDR")
            raise CollectiveFailed(
                f"could not join the process group ({error_gist(error)}); is MASTER_PORT {port} free, and "
                f"MASTER_ADDR {address} this machine or one it can reach?"
            ) from error
        raise CollectiveFailed(
            f"could not join the process group within {timeout_s:g} s ({error_gist(error)}); did every rank start?"
        ) from error
    if backend == "nccl" and not every_rank_has_gpu.item():
        raise ValueError(
            "--backend nccl needs one CUDA device per process, and some rank has none (more processes on a node "
            "than GPUs, or no CUDA): launch one process per GPU, or use --backend gloo"
        )
    if backend == "gloo" or not every_rank_has_gpu.item():
        return TorchBackend(timeout=timeout)
    torch.cuda.set_device(local_rank)
    group = torch_dist.new_group(backend="nccl", timeout=timeout)
    return TorchBackend(group, device=torch.device("cuda", local_rank), timeout=timeout)


def process_context(backend: TorchBackend, *, seed: int = 0, record_timeline: bool = True) -> RankContext:
    """This process's rank context over `backend`: its generator is seeded as `VirtualCluster` seeds rank r."""
    rank, world_size = backend.rank, backend.world_size
    return RankContext(
        rank=rank,
        world_size=world_size,
        generator=torch.Generator().manual_seed(seed * 1_000_003 + rank),
        backend=backend,
        ledger=RankLedger(rank, world_size),
        tracker=MemoryTracker(rank, record_timeline=record_timeline),
        device=backend.device,
    )
