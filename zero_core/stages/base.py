"""What every ZeRO stage shares: the training step, the loss scale, and the fp32 master-weight update.

All four stages run the same algorithm (ZeRO §5: "ZeRO-DP ... retains the computational granularity
and communication volume of DP"): forward, backward, average the gradients over the ranks, one Adam step
on fp32 master weights, fp16 parameters refreshed from them. A stage subclass decides only where the
bytes live, by implementing these methods:

- `setup(model)`: register the buffers this rank keeps and swap in the stage's layers;
- `sync_gradients()`: the collectives after backward (ZeRO-2/3 reduce inside backward instead);
- `owned_gradients()`: for each layer, the averaged gradient of the elements this rank updates;
- `owned_parameters()`: for each layer, the fp16 parameters those elements' updates are written to;
- `publish_parameters()`: make the updated fp16 parameters available (ZeRO-1/2 all-gather them);
- `zero_gradients()`: clear the gradients for the next step.

The model's parameter layers (`model.parameter_layers`) are the unit of partitioning: each layer's
weight and bias are flattened together and split by a `FlatPartition`. `ReplicatedStage` is the
`setup` ZeRO-0 and ZeRO-1 share: full parameters and gradients on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from zero_core import dist, memory, registry
from zero_core.context import current, phase
from zero_core.model import GPTConfig, initial_values, loss_fn, micro_batch, model_skeleton, parameter_layers
from zero_core.optim import AdamConfig, AdamShard, LossScaler, has_overflow, precision_dtype
from zero_core.partition import FlatPartition, flatten, unflatten

ZERO1_GRAD_SYNCS = ("reduce_scatter", "all_reduce")


def _unmeasured(phase_name: str) -> AbstractContextManager:
    return nullcontext()


def function_extras(module: nn.Module) -> tuple:
    """What a layer's Function needs besides its input, parameters and shard (LayerNorm's eps)."""
    return (module.eps,) if isinstance(module, nn.LayerNorm) else ()


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run, identical for every stage."""

    model: GPTConfig = field(default_factory=GPTConfig)
    precision: str = "bf16"
    adam: AdamConfig = field(default_factory=AdamConfig)
    seed: int = 0
    init_loss_scale: float = 2.0**16
    zero1_grad_sync: str = "reduce_scatter"

    def __post_init__(self) -> None:
        precision_dtype(self.precision)
        if self.zero1_grad_sync not in ZERO1_GRAD_SYNCS:
            raise ValueError(f"zero1_grad_sync must be one of {ZERO1_GRAD_SYNCS}, got {self.zero1_grad_sync!r}")


@dataclass
class Layer:
    """One parameter layer as a stage sees it: its name, parameter shapes and partition over the ranks.

    It keeps the layer's kind and the few constants its Function needs, never the module itself: the
    module's original fp32 weights would stay alive through it after a stage has put its own buffers in
    their place (4Ψ bytes on every rank that no formula counts).
    """

    name: str
    kind: type[nn.Module]
    extra: tuple
    """What the layer's Function takes besides input, parameters and shard (LayerNorm's eps)."""
    shapes: list[torch.Size]
    partition: FlatPartition
    master: AdamShard | None = None
    master_slice: slice = field(default_factory=lambda: slice(0, 0))
    """Where the layer's master range sits in the rank's optimizer state (every layer's, concatenated)."""

    @property
    def numel(self) -> int:
        return self.partition.numel


def _check_nothing_shared(model: nn.Module, shared: set[int], label: str) -> None:
    """Raise if `model` still holds a parameter in one of the `shared` storages (by address) after setup."""
    for name, param in model.named_parameters():
        if param.untyped_storage().data_ptr() in shared:
            raise RuntimeError(
                f"{label}: after setup, parameter {name} is still the initial weight every rank shares; "
                "setup must replace each parameter layer's parameters with buffers of the rank's own"
            )


OVERFLOW_TAG = "overflow flag"
"""The tag of the loss scaler's one-element all-reduce: a few bytes per step that are not model traffic."""


def layer_tag(what: str, layer: str) -> str:
    """The ledger tag of a layer's gradient ("grad") or parameter ("param") collective, in every stage: how
    reports and the grader tell the layers' collectives apart."""
    return f"{what} {layer}"


class ZeroStage:
    """The training loop every stage runs; subclasses say where parameters, gradients and states live."""

    stage: int = -1
    label = "?"
    """How tables and figures name the stage: "ZeRO-2", "ZeRO++ hpZ"."""
    partitioned = "?"
    """What it partitions, in a few words ("+ gradients"), for tables."""
    configuration = "?"
    """The configuration it runs ("zero2", "zero3+hpz"): its formulas are `zero_core.configurations`'."""
    partitions_optimizer_states = True
    pads_buffers = True
    """Whether the communicated buffers are padded to a multiple of N (reduce-scatter and all-gather need it)."""
    FUNCTIONS: dict[type[nn.Module], type[torch.autograd.Function] | registry.Answer] = {}
    """The autograd Function each kind of parameter layer runs through (ZeRO-2/3; plain autograd otherwise).

    A Function an exercise asks for is named by the registry (`registry.answer("ex03", ...)`) and imported
    only when a stage really runs it, so the grader can train a stage with a student's Function without the
    reference one ever being loaded (`registry.resolve`)."""

    def __init__(
        self, config: TrainConfig, functions: dict[type[nn.Module], type[torch.autograd.Function]] | None = None
    ) -> None:
        """`functions` replaces some of the stage's layer Functions (how exercises plug in students' code)."""
        ctx = current()
        self.config = config
        self.functions = {kind: registry.resolve(f) for kind, f in {**self.FUNCTIONS, **(functions or {})}.items()}
        self.rank, self.world_size = ctx.rank, ctx.world_size
        self.device = ctx.device
        """Where every buffer of the stage lives (the rank's GPU under NCCL): the model is built on the CPU,
        from the seed, and its values copied there."""
        self.tracker = ctx.tracker
        self.dtype = precision_dtype(config.precision)
        self.scaler = LossScaler.for_precision(config.precision, config.init_loss_scale)
        self.adam_steps = 0
        with phase("setup"):
            self._build(config, ctx.world_size)

    def _build(self, config: TrainConfig, world_size: int) -> None:
        """The model, the fp32 masters and the stage's buffers. Everything made here and not named by the
        end of it shows up as untracked memory.

        The model starts as a skeleton holding the process's shared initial weights (`model_skeleton`),
        and `setup` must replace every one of its parameters by the rank's own buffers; one it leaves
        shared would be memory no rank's audit sees, so that is an error.
        """
        model = model_skeleton(config.model, config.seed)
        self.layers = [
            Layer(
                name,
                type(module),
                function_extras(module),
                [p.shape for p in module.parameters()],
                FlatPartition(sum(p.numel() for p in module.parameters()), world_size),
            )
            for name, module in parameter_layers(model)
        ]
        initial = initial_values(config.model, config.seed)
        masters, offset = [], 0
        for layer in self.layers:
            start, end = self.master_range(layer)
            masters.append(initial[layer.name][start:end])
            layer.master_slice = slice(offset, offset + end - start)
            offset += end - start
        self.optimizer = AdamShard(
            flatten(masters).to(self.device), config.adam, self.tracker, "every layer's master range"
        )
        for layer in self.layers:
            layer.master = self.optimizer.view(layer.master_slice.start, layer.master_slice.stop)
        shared = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.setup(model, initial)
        _check_nothing_shared(model, shared, self.label)
        self.model = model

    @property
    def psi(self) -> int:
        """Ψ, the model's parameter count."""
        return sum(layer.numel for layer in self.layers)

    def communicated_numel(self, layer: Layer) -> int:
        """Elements of the layer's buffers that go through collectives: padded unless the stage needs no padding."""
        return layer.partition.padded_numel if self.pads_buffers else layer.numel

    def master_range(self, layer: Layer) -> tuple[int, int]:
        """[start, end) of the layer's flat parameters whose fp32 master this rank keeps and updates."""
        if self.partitions_optimizer_states:
            return layer.partition.owned_range(self.rank)
        return 0, layer.numel

    # -- what a stage implements ---------------------------------------------------------------------

    def setup(self, model: nn.Module, initial: Mapping[str, torch.Tensor]) -> None:
        raise NotImplementedError

    def sync_gradients(self) -> None:
        """Collectives after backward. ZeRO-2/3 reduce inside backward and do nothing here."""

    def owned_gradients(self) -> list[torch.Tensor]:
        """Per layer, the averaged, still loss-scaled gradient of the master range (low precision)."""
        raise NotImplementedError

    def owned_parameters(self) -> list[torch.Tensor]:
        """Per layer, the rank's low-precision parameters of the master range: where the update goes."""
        raise NotImplementedError

    def publish_parameters(self) -> None:
        """Collectives after the update (ZeRO-1/2 all-gather the parameters; ZeRO-0/3 need none)."""

    def zero_gradients(self) -> None:
        raise NotImplementedError

    # -- the step, the same for every stage ----------------------------------------------------------

    def found_overflow(self, grad: torch.Tensor) -> bool:
        """Did any rank's gradient overflow? No rank sees every gradient, so the verdict is an all-reduce."""
        flag = torch.tensor([float(has_overflow(grad))], device=grad.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, tag=OVERFLOW_TAG)
        return bool(flag.item())

    def optimizer_step(self) -> bool:
        """Unscale, check for overflow, update the fp32 masters, refresh the parameters. True if taken.

        The layers' master ranges are updated in one Adam step over their concatenation: Adam is
        elementwise, so this gives every element the bits a step per layer would, in a dozen tensor
        operations per rank instead of a dozen per layer.
        """
        grad = torch.cat(self.owned_gradients())
        scale = self.scaler.scale
        if not self.scaler.update(self.found_overflow(grad)):
            self.zero_gradients()
            return False
        self.adam_steps += 1
        self.update_masters(grad.float().div_(scale))
        # One call copies every layer's fp32 masters into its parameters, rounding them to their dtype, as
        # torch.optim's foreach mode does. On the virtual cluster every tensor call can cost a rank its
        # turn at the interpreter lock, so one call beats one per layer.
        torch._foreach_copy_(self.owned_parameters(), [layer.master.master for layer in self.layers])
        self.zero_gradients()
        self.publish_parameters()
        return True

    def update_masters(self, grad: torch.Tensor) -> None:
        """One Adam step of every layer's master range, given their unscaled fp32 gradients concatenated."""
        self.optimizer.step(grad, self.adam_steps)

    def train_step(
        self,
        step: int,
        measure: Callable[[str], AbstractContextManager] = _unmeasured,
        count_activations: bool = True,
    ) -> float:
        """One full training step; returns this rank's (unscaled) micro-batch loss.

        Each phase runs inside `measure(phase_name)`, which an experiment uses to time and count it.
        `count_activations` registers every tensor autograd saves with the memory tracker; it costs a
        Python call per saved tensor, so an experiment counts them on the step it measures.
        """
        ctx = current()
        ctx.step = self.tracker.step = step
        inputs, targets = (t.to(self.device) for t in micro_batch(self.config.model, self.rank, step, self.config.seed))
        with self.tracker.count_activations() if count_activations else nullcontext():
            with phase("forward"), measure("forward"):
                loss = self.tracker.register(loss_fn(self.model(inputs), targets), memory.ACTIVATIONS, label="loss")
            with phase("backward"), measure("backward"):
                (loss * self.scaler.scale).backward()
        with phase("grad_sync"), measure("grad_sync"):
            self.sync_gradients()
        with phase("optimizer"), measure("optimizer"), torch.no_grad():
            self.optimizer_step()
        return loss.item()

    def master_shards(self) -> dict[str, tuple[int, torch.Tensor]]:
        """Per layer: (start offset, fp32 master values this rank keeps), for checking against others."""
        return {
            layer.name: (self.master_range(layer)[0], layer.master.master.to("cpu", copy=True)) for layer in self.layers
        }

    def master_gradients(self, grad: torch.Tensor) -> dict[str, torch.Tensor]:
        """`grad` (every layer's master range, concatenated) split back into one piece per layer."""
        return {layer.name: grad[layer.master_slice] for layer in self.layers}

    # -- helpers the stages share --------------------------------------------------------------------

    def new_buffer(self, values: torch.Tensor, category: str, layer: Layer) -> torch.Tensor:
        """A new flat low-precision buffer holding `values`, registered under `category`.

        If the stage `pads_buffers`, zeros follow up to a multiple of N, as reduce-scatter and all-gather
        need; the tracker counts those zeros as padding, not as model state.
        """
        if not self.pads_buffers:
            return self.tracker.register(values.to(self.device, self.dtype, copy=True), category, label=layer.name)
        flat = layer.partition.pad(values.to(self.device, self.dtype))
        return self.tracker.register(flat, category, padding_elements=layer.partition.padding, label=layer.name)

    def owned_slice(self, flat: torch.Tensor, layer: Layer) -> torch.Tensor:
        """The rank's real (unpadded) elements of a full padded flat buffer of `layer`."""
        start, end = layer.partition.owned_range(self.rank)
        return flat[start:end]

    def chunk(self, flat: torch.Tensor, layer: Layer) -> torch.Tensor:
        """The rank's padded chunk of a full padded flat buffer of `layer`: input of an all-gather."""
        size = layer.partition.chunk_numel
        return flat[self.rank * size : (self.rank + 1) * size]


class ReplicatedStage(ZeroStage):
    """ZeRO-0 and ZeRO-1: every rank keeps the full fp16 parameters and gradients of every layer.

    `params[name]` and `grads[name]` are one flat buffer per layer. The layer's own parameters become
    views of the parameter buffer and their `.grad`s views of the gradient buffer, so plain autograd
    accumulates straight into the buffer the stage communicates. The two stages differ in how they
    reduce the gradients and which slice each rank updates.
    """

    def setup(self, model: nn.Module, initial: Mapping[str, torch.Tensor]) -> None:
        self.params: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}
        for layer in self.layers:
            flat_param = self.new_buffer(initial[layer.name], memory.PARAM, layer)
            flat_grad = self.new_buffer(torch.zeros(layer.numel), memory.GRAD, layer)
            module = model.get_submodule(layer.name)
            names = [name for name, _ in module.named_parameters(recurse=False)]
            for name, param_view, grad_view in zip(
                names, unflatten(flat_param, layer.shapes), unflatten(flat_grad, layer.shapes), strict=True
            ):
                param = nn.Parameter(param_view)
                param.grad = grad_view
                setattr(module, name, param)
            self.params[layer.name], self.grads[layer.name] = flat_param, flat_grad

    def owned_gradients(self) -> list[torch.Tensor]:
        """This rank's slice of each layer's gradient (ZeRO-1; ZeRO-0 owns everything)."""
        return [self.owned_slice(self.grads[layer.name], layer) for layer in self.layers]

    def owned_parameters(self) -> list[torch.Tensor]:
        return [self.owned_slice(self.params[layer.name], layer) for layer in self.layers]

    def zero_gradients(self) -> None:
        torch._foreach_zero_(list(self.grads.values()))
