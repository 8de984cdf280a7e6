"""The per-layer collectives of ZeRO-2 and ZeRO-3: reduce-scatter a layer's gradient, gather its parameters.

Under ZeRO-2 and ZeRO-3 no rank ever holds the whole model's gradient: each layer's gradient is computed
in backward, packed into one transient bucket, reduce-scattered (mean) so that rank r keeps only its
shard, and the bucket is freed (ZeRO §5.2). Under ZeRO-3 a layer's full parameters exist only between
an all-gather right before the layer runs and a release right after (ZeRO §5.3). `LayerShard` holds one
rank's shards of one layer and does exactly these collectives, registering every buffer it allocates.

A layer's reduce-scatter does not hold backward up: it starts with `async_op=True` and is waited for
just before the next layer's bucket is packed (`InFlightReduceScatter`), so the rank computes the next
layer's gradients meanwhile, as DeepSpeed's `overlap_comm` does. Under ZeRO-3 that next layer first
gathers its parameters, a collective every rank reaches only after starting the reduce-scatter, so on
the virtual cluster the wait finds it complete and a reduce-scatter costs no meeting of its own.

The gathered parameters live in one flat tensor per layer whose memory exists only between gather and
release: release shrinks its storage to nothing and the next gather grows it back, as FSDP2 does with
its unsharded parameters (`alloc_storage` / `free_storage` in `torch.distributed.fsdp`). The tensor and
its weight and bias views are made once, so a gather costs no new tensors, only the memory.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from zero_core import dist, memory
from zero_core.partition import unflatten
from zero_core.stages.base import Layer, layer_tag


class InFlightReduceScatter:
    """A stage's one gradient reduce-scatter in flight, and the bucket it reads until it completes.

    With `overlap=False` every reduce-scatter completes before `start` returns, as a blocking call would:
    the grader runs the reference that way, so that its buckets live exactly as long as those of a
    student's Function, which waits at once.
    """

    def __init__(self, tracker: memory.MemoryTracker, *, overlap: bool = True) -> None:
        self.tracker = tracker
        self.overlap = overlap
        self.work: dist.Work | None = None
        self.bucket: torch.Tensor | None = None

    def start(self, output: torch.Tensor, bucket: torch.Tensor, tag: str) -> None:
        """Start reduce-scattering (mean) `bucket` into `output`; the previous one must be waited for."""
        if self.work is not None:
            raise RuntimeError("a reduce-scatter is still in flight: wait() for it before starting the next")
        self.work = dist.reduce_scatter_single(output, bucket, op=dist.ReduceOp.AVG, async_op=True, tag=tag)
        self.bucket = bucket
        if not self.overlap:
            self.wait()

    def wait(self) -> None:
        """Complete the reduce-scatter in flight, if any, and free its bucket."""
        if self.work is not None:
            self.work.wait()
            self.tracker.release(self.bucket)
            self.work = self.bucket = None


class LayerShard:
    """Rank r's part of one parameter layer: its gradient shard (and, under ZeRO-3, its parameter shard)."""

    def __init__(
        self,
        layer: Layer,
        rank: int,
        tracker: memory.MemoryTracker,
        dtype: torch.dtype,
        in_flight: InFlightReduceScatter,
        device: torch.device | str = "cpu",
    ) -> None:
        self.name = layer.name
        self.shapes = layer.shapes
        self.partition = layer.partition
        self.rank = rank
        self.tracker = tracker
        self.dtype = dtype
        """The training precision: the exercises tell students' Functions to read it from the shard."""
        chunk = layer.partition.chunk_numel
        self.grad = tracker.register(
            torch.zeros(chunk, dtype=dtype, device=device),
            memory.GRAD,
            padding_elements=layer.partition.padding_of(rank),
            label=layer.name,
        )
        self.param: torch.Tensor | None = None
        self.gathered = torch.empty(layer.partition.padded_numel, dtype=dtype, device=device)
        self.gathered_views = unflatten(self.gathered, layer.shapes)
        self.gathered_bytes = self.gathered.untyped_storage().nbytes()
        self.gathered.untyped_storage().resize_(0)  # no memory until ZeRO-3 gathers the parameters
        self.grad_tag = layer_tag("grad", layer.name)
        self.param_tag = layer_tag("param", layer.name)
        self.in_flight = in_flight

    def owned_grad(self) -> torch.Tensor:
        """The averaged gradient of the elements this rank updates: its shard without the padding."""
        return self.grad[: self.partition.owned_numel(self.rank)]

    def owned_param(self) -> torch.Tensor:
        """Under ZeRO-3, the parameters of the elements this rank updates: its shard without the padding."""
        return self.param[: self.partition.owned_numel(self.rank)]

    def reduce_scatter_gradients(self, grads: list[torch.Tensor]) -> None:
        """Start averaging this layer's local gradients over the ranks into this rank's shard, `grad`.

        The stage waits for it before the next layer's, and after backward (`sync_gradients`).
        """
        self.in_flight.wait()  # the previous layer's bucket is freed before this one exists: one at a time
        bucket = self.tracker.register(
            self.partition.pack(grads), memory.GRAD_BUCKET, padding_elements=self.partition.padding, label=self.name
        )
        self.in_flight.start(self.grad, bucket, self.grad_tag)

    def gather_parameters(self) -> list[torch.Tensor]:
        """All-gather the full parameters (ZeRO-3); returns the weight (and bias) until `release_parameters`."""
        self.allocate_gathered(self.gathered, self.gathered_bytes, self.partition.padding)
        dist.all_gather_single(self.gathered, self.param, tag=self.param_tag)
        return self.gathered_views

    def allocate_gathered(self, buffer: torch.Tensor, nbytes: int, padding: int) -> None:
        """Give a gather's `buffer` its `nbytes` back (`release_parameters` took them) and register them as
        gathered parameters, `padding` elements of them padding. Still allocated: gathered twice, an error."""
        storage = buffer.untyped_storage()
        if storage.nbytes():
            raise RuntimeError(f"{self.name}: parameters gathered twice; release them before gathering again")
        storage.resize_(nbytes)
        self.tracker.register(buffer, memory.GATHER, padding_elements=padding, label=self.name)

    def release_parameters(self) -> None:
        """Forget the gathered parameters and free their memory: from here on only the shard exists."""
        self.gathered.untyped_storage().resize_(0)
        self.tracker.release(self.gathered)


class FunctionLayer(nn.Module):
    """A parameter layer whose forward is a stage's autograd Function: `function(x, *params, shard, *extra)`."""

    def __init__(
        self, function: type[torch.autograd.Function], params: list[nn.Parameter], shard: LayerShard, *extra: object
    ) -> None:
        super().__init__()
        self.function = function
        self.params = nn.ParameterList(params)
        self.param_tuple = tuple(params)
        """The same parameters as a plain tuple: unpacking a ParameterList costs ~3 us a call, this ~0.1 us."""
        self.shard = shard
        self.extra = extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function.apply(x, *self.param_tuple, self.shard, *self.extra)


def swap_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Replace the submodule called `name` (e.g. "blocks.0.mlp.fc") by `new`."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
