"""The report's instrumented step and the ranks' model building: cheap at large N, every number unchanged.

A report's last step is audited and FLOP-counted by one dispatch mode (`StorageAudit.counting`); these
tests hold it to what two stacked modes (the audit, and a `FlopMeter` of its own) see, and the meter to
torch's own FLOP formulas. `build_model` copies a model initialised once per process; the tests pin its
values to GPT-2 initialisation drawn from the seed's own generator, and the copy to the rank's audit.
"""

from __future__ import annotations

import subprocess
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from zero_core import memory
from zero_core.flops import ELEMENTWISE, FlopMeter
from zero_core.memory import MemoryTracker, StorageAudit
from zero_core.model import GPTConfig, build_model, count_parameters, loss_fn, micro_batch, parameter_layers, preset

MICRO = preset("micro")


def train_a_little(model: nn.Module) -> None:
    """Forward, backward, an elementwise update and a convolution (an operator with list arguments)."""
    inputs, targets = micro_batch(MICRO, rank=0, step=0)
    loss_fn(model(inputs), targets).backward()
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(p.grad.mul(0.1).div(p.grad.abs().add(1.0).sqrt()))
    F.conv1d(torch.ones(1, 2, 8), torch.ones(3, 2, 3), stride=[2], padding=[1])


def audited(combined: bool) -> tuple[int, list[tuple], dict[str, int], int]:
    """(FLOPs, ledger events, peaks by category, peak) of `train_a_little` on a fresh model and tracker."""
    model = build_model(MICRO)
    tracker = MemoryTracker()
    with StorageAudit(tracker) as audit:
        with audit.counting(FlopMeter()) if combined else FlopMeter() as meter:
            train_a_little(model)
    events = [(e.category, e.delta_bytes, e.total_bytes, e.label) for e in tracker.timeline]
    return meter.flops, events, tracker.peak_by_category(), tracker.peak_bytes()


def test_one_mode_that_audits_and_counts_measures_what_two_stacked_modes_do() -> None:
    flops, events, peaks, peak = audited(combined=True)
    assert flops > 0 and events and peak > 0
    assert (flops, events, peaks, peak) == audited(combined=False)


class ComparedToTorch(TorchDispatchMode):
    """Per operation: (operator, what `FlopMeter.count` says, torch's formula or one per elementwise output)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[object, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        meter = FlopMeter()
        meter.count(func, args, kwargs, out)
        packet = func._overloadpacket
        if packet in flop_registry:
            expected = flop_registry[packet](*args, **kwargs, out_val=out)
        elif packet in ELEMENTWISE and isinstance(out, torch.Tensor) and out.is_floating_point():
            expected = out.numel()
        else:
            expected = 0
        self.seen.append((func, meter.flops, expected))
        return out


def test_flop_meter_counts_each_operation_with_torch_s_formula_or_one_per_elementwise_output() -> None:
    model = build_model(MICRO)
    with ComparedToTorch() as compared:
        train_a_little(model)
    matmuls = {func._overloadpacket for func, _, expected in compared.seen if expected and func not in ELEMENTWISE}
    assert {torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.convolution} <= matmuls
    assert [(func, counted) for func, counted, _ in compared.seen] == [(func, e) for func, _, e in compared.seen]


def test_build_model_is_gpt2_initialisation_drawn_from_the_seed_s_own_generator() -> None:
    for config, seed in ((MICRO, 0), (MICRO, 3), (preset("tiny"), 0)):
        model = build_model(config, seed)
        generator = torch.Generator().manual_seed(seed)
        for _, module in parameter_layers(model):
            if isinstance(module, nn.LayerNorm):
                assert torch.equal(module.weight, torch.ones_like(module.weight))
                assert torch.equal(module.bias, torch.zeros_like(module.bias))
            else:
                drawn = torch.empty_like(module.weight).normal_(0.0, config.init_std, generator=generator)
                assert torch.equal(module.weight, drawn)
                if getattr(module, "bias", None) is not None:
                    assert torch.equal(module.bias, torch.zeros_like(module.bias))


def test_every_model_built_has_parameters_of_its_own() -> None:
    first, second = build_model(MICRO), build_model(MICRO)
    with torch.no_grad():
        for p in first.parameters():
            p.add_(1.0)
    storages = {p.untyped_storage().data_ptr() for p in first.parameters()}
    assert storages.isdisjoint(p.untyped_storage().data_ptr() for p in second.parameters())
    for fresh, untouched in zip(build_model(MICRO).parameters(), second.parameters(), strict=True):
        assert torch.equal(fresh, untouched)


def test_every_model_built_is_a_whole_module_of_its_own() -> None:
    """A hook on one rank's model or a module swapped into it (as ZeRO-2/3 swap in their layers) stays there."""
    first, second = build_model(MICRO), build_model(MICRO)
    first.lm_head.register_forward_hook(lambda *_: None)
    first.blocks[0].mlp.fc = torch.nn.Identity()
    assert not second.lm_head._forward_hooks and isinstance(second.blocks[0].mlp.fc, torch.nn.Linear)
    names = [name for name, _ in build_model(MICRO).named_parameters()]
    assert [name for name, _ in second.named_parameters()] == names
    assert second.training and all(p.requires_grad for p in second.parameters())


def test_a_rank_s_audit_counts_the_model_it_builds_and_nothing_else() -> None:
    config = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16, micro_batch_size=1)
    tracker = MemoryTracker()
    with tracker.audit():
        model = build_model(config, seed=11)  # the first of this configuration: its template is made here too
    assert tracker.current_bytes() == tracker.current_bytes(memory.TEMPORARY) == 4 * count_parameters(config)
    del model


def test_the_audit_and_the_flop_meter_never_import_torch_s_compiler() -> None:
    """torch wraps a dispatch mode in a compiler guard unless it opts out; the guard imports torch._dynamo
    (seconds, once per process) and costs every operation a few microseconds more."""
    script = (
        "import sys, torch\n"
        "from zero_core.flops import FlopMeter\n"
        "from zero_core.memory import MemoryTracker, StorageAudit\n"
        "with StorageAudit(MemoryTracker()) as audit, audit.counting(FlopMeter()):\n"
        "    torch.ones(4, 4) @ torch.ones(4, 4)\n"
        "with FlopMeter():\n"
        "    torch.ones(2) + 1\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
