"""The memory ledger against what the ranks really hold: a walk over every reachable storage.

At setup's end and at every phase boundary of a step, each rank walks everything reachable from its
stage and from the loss whose autograd graph backward runs (modules, buffers, `.grad`s, saved tensors,
autograd `ctx`s): every storage found must be named on the rank's ledger at its true size, nothing may be
untracked, no gathered parameters may be alive between phases, and the model states must equal the
paper's formula for the rank exactly. Three planted stages show that the walk catches what the issue
found: an extra full-size fp32 buffer, the layers' original modules kept, a gathered weight kept on `ctx`.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import zero_core.stages.base as stage_base
from zero_core import dist, memory
from zero_core.cluster import INTERCONNECT, RankFailed, VirtualCluster
from zero_core.context import current
from zero_core.memory import MemoryTracker
from zero_core.model import parameter_layers, preset
from zero_core.partition import unflatten
from zero_core.reachable import reachable_storages, unaccounted
from zero_core.stages import STAGES, TrainConfig, Zero1, Zero2, Zero3

MICRO = TrainConfig(model=preset("micro"))


class LedgerGap(AssertionError):
    """What a rank holds and its ledger does not say."""


def expected_model_state_bytes(stage: int, trainer: stage_base.ZeroStage) -> int:
    """This rank's model states by the paper's accounting (ZeRO §5), padding excluded: 2 + 2 + 12 bytes
    per parameter, each term for all Ψ parameters or for the rank's owned 1/N slice of every layer."""
    psi = trainer.psi
    owned = sum(layer.partition.owned_numel(trainer.rank) for layer in trainer.layers)
    param = 2 * (psi if stage < 3 else owned)
    grad = 2 * (psi if stage < 2 else owned)
    optimizer_states = 12 * (psi if stage == 0 else owned)
    return param + grad + optimizer_states


def check_ledger(stage: int, trainer: stage_base.ZeroStage, loss: torch.Tensor | None, when: str) -> None:
    """Raise `LedgerGap` if anything the rank holds is not on its ledger, as it should be."""
    tracker = trainer.tracker
    roots = [("stage", trainer)] + ([("loss", loss)] if loss is not None else [])
    reached = reachable_storages(*roots, stop=(*INTERCONNECT, MemoryTracker))
    where = f"rank {trainer.rank}, {when}"
    gaps = unaccounted(reached, tracker)
    if gaps:
        found, state = gaps[0]
        raise LedgerGap(f"{where}: {found.path} holds {found.nbytes:,} bytes, {state}")
    if tracker.current_bytes(memory.UNTRACKED):
        raise LedgerGap(f"{where}: {tracker.current_bytes(memory.UNTRACKED):,} bytes untracked")
    if tracker.current_bytes(memory.GATHER):
        raise LedgerGap(f"{where}: {tracker.current_bytes(memory.GATHER):,} bytes of gathered parameters alive")
    expected = expected_model_state_bytes(stage, trainer)
    if tracker.model_state_bytes() != expected:
        raise LedgerGap(f"{where}: model states {tracker.model_state_bytes():,} bytes, the formula {expected:,}")


_losses: dict[int, weakref.ref] = {}


@pytest.fixture
def losses_seen(monkeypatch: pytest.MonkeyPatch) -> dict[int, weakref.ref]:
    """Each thread's latest loss, weakly: the root of the autograd graph a phase boundary walks."""
    original = stage_base.loss_fn

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = original(logits, targets)
        _losses[threading.get_ident()] = weakref.ref(loss)
        return loss

    monkeypatch.setattr(stage_base, "loss_fn", loss_fn)
    _losses.clear()
    return _losses


def audited_training(stage: int, stage_cls: type, functions: dict | None, steps: int) -> list[str]:
    """Run on a rank: train under the audit, checking the ledger after setup and at every phase boundary."""
    tracker = current().tracker
    checked: list[str] = []
    with tracker.audit():
        trainer = stage_cls(MICRO, functions=functions)
        check_ledger(stage, trainer, None, "after setup")
        checked.append("setup")

        for step in range(steps):

            @contextmanager
            def boundary(phase: str, step: int = step) -> Iterator[None]:
                yield
                tracker.end_phase()
                loss_ref = _losses.get(threading.get_ident())
                check_ledger(stage, trainer, loss_ref() if loss_ref else None, f"step {step}, after {phase}")
                checked.append(f"{step}:{phase}")

            trainer.train_step(step, boundary)
            check_ledger(stage, trainer, None, f"after step {step}")
    return checked


def train_audited(world_size: int, stage: int, stage_cls: type | None = None, functions: dict | None = None):
    return VirtualCluster(world_size, timeout_s=30).run(
        audited_training, stage, stage_cls or STAGES[stage], functions, 2
    )


@pytest.mark.parametrize("world_size", [1, 2, 3, 7, 32])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_storage_a_rank_holds_is_on_its_ledger(stage: int, world_size: int, losses_seen) -> None:
    checked = train_audited(world_size, stage)
    phases = [f"{step}:{phase}" for step in range(2) for phase in ("forward", "backward", "grad_sync", "optimizer")]
    assert checked == [["setup", *phases]] * world_size


def failure(world_size: int, stage: int, stage_cls: type, functions: dict | None = None) -> str:
    with pytest.raises(RankFailed) as caught:
        train_audited(world_size, stage, stage_cls, functions)
    assert isinstance(caught.value.error, LedgerGap), caught.value.error
    return str(caught.value.error)


class KeepsASpareFp32Copy(Zero1):
    """Planted: a full-size fp32 buffer nobody registered."""

    def setup(self, model: nn.Module, initial: dict[str, torch.Tensor]) -> None:
        super().setup(model, initial)
        self.spare = torch.zeros(self.psi)


def keeps_old_modules(base: type) -> type:
    """Planted: the layers' original modules (and their fp32 weights) kept after the stage swapped them."""

    def setup(self, model: nn.Module, initial: dict[str, torch.Tensor]) -> None:
        self.original_modules = [module for _, module in parameter_layers(model)]
        base.setup(self, model, initial)

    return type(f"{base.__name__}KeepingModules", (base,), {"setup": setup})


class GatherLinearKeepingWeight(torch.autograd.Function):
    """Planted: gathers into its own registered buffer and releases it, but keeps it on ctx for backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, param_shard: torch.Tensor, shard) -> torch.Tensor:
        flat = torch.empty(shard.partition.padded_numel, dtype=shard.dtype)
        shard.tracker.register(flat, memory.GATHER, padding_elements=shard.partition.padding, label=shard.name)
        dist.all_gather_single(flat, param_shard, tag=f"param {shard.name}")
        weight, bias = unflatten(flat, shard.shapes)
        shard.tracker.release(flat)
        ctx.save_for_backward(x)
        ctx.flat, ctx.shard = flat, shard
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        weight, _ = unflatten(ctx.flat, ctx.shard.shapes)
        grad_out_2d, x_2d = grad_out.reshape(-1, grad_out.size(-1)), x.reshape(-1, x.size(-1))
        ctx.shard.reduce_scatter_gradients([grad_out_2d.T @ x_2d, grad_out_2d.sum(0)])
        return grad_out @ weight, None, None


def test_a_spare_full_size_fp32_buffer_is_found(losses_seen) -> None:
    message = failure(2, 1, KeepsASpareFp32Copy)
    assert "after setup" in message and "stage.spare" in message and f"{4 * 17440:,} bytes" in message


@pytest.mark.parametrize("base", [Zero2, Zero3])
def test_original_modules_kept_after_the_swap_are_found(base: type, losses_seen) -> None:
    message = failure(2, base.stage, keeps_old_modules(base))
    assert "after setup" in message and "stage.original_modules" in message


class LeavesTheLastLayer(Zero3):
    """Planted: setup partitions every layer but the last, whose module keeps the weights every rank shares."""

    def setup(self, model: nn.Module, initial: dict[str, torch.Tensor]) -> None:
        layers, self.layers = self.layers, self.layers[:-1]
        super().setup(model, initial)
        self.layers = layers


def test_a_parameter_setup_did_not_replace_is_an_error() -> None:
    with pytest.raises(RankFailed) as caught:
        VirtualCluster(2, timeout_s=30).run(lambda: LeavesTheLastLayer(MICRO))
    assert isinstance(caught.value.error, RuntimeError)
    assert "lm_head.weight is still the initial weight every rank shares" in str(caught.value.error)
    assert "ZeRO-3" in str(caught.value.error)


def test_a_gathered_weight_kept_on_ctx_is_found(losses_seen) -> None:
    message = failure(2, 3, Zero3, {nn.Linear: GatherLinearKeepingWeight})
    assert "step 0, after forward" in message and "gathered parameters alive" in message


def test_the_audit_counts_a_buffer_nobody_registered_until_it_is_freed() -> None:
    tracker = MemoryTracker()
    with tracker.audit():
        hidden = torch.zeros(1000)
    assert tracker.current_bytes(memory.TEMPORARY) == 4000 == tracker.current_bytes()
    tracker.end_phase()
    assert tracker.current_bytes(memory.UNTRACKED) == 4000
    del hidden
    assert tracker.current_bytes() == 0 and tracker.peak_bytes(memory.UNTRACKED) == 4000


def test_views_lists_of_views_in_place_and_out_operations_allocate_nothing() -> None:
    tracker = MemoryTracker()
    base = torch.zeros(1000)
    with tracker.audit():
        base[10:20].add_(1.0)
        base.view(10, 100).t()
        base.split(300)
        base.view(10, 100).unbind(0)
        torch.mul(base, 2.0, out=base)
    assert tracker.current_bytes() == 0


def test_a_storage_grown_by_resize_is_counted_at_its_new_size() -> None:
    tracker = MemoryTracker()
    with tracker.audit():
        buffer = torch.empty(0)
        buffer.resize_(256)
    assert tracker.current_bytes(memory.TEMPORARY) == 1024
    buffer.untyped_storage().resize_(4096)
    tracker.end_phase()
    assert tracker.current_bytes(memory.UNTRACKED) == 4096


def test_release_cannot_hide_a_live_buffer() -> None:
    tracker = MemoryTracker()
    kept = tracker.register(torch.ones(256, dtype=torch.float16), memory.GATHER)
    tracker.release(kept)
    assert tracker.current_bytes(memory.GATHER) == 512
    kept.untyped_storage().resize_(0)
    tracker.release(kept)
    assert tracker.current_bytes(memory.GATHER) == 0
