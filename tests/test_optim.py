"""Mixed-precision Adam: matches torch.optim.Adam, and gives the same bits on a slice as on the whole."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from zero_core.memory import MemoryTracker
from zero_core.optim import ADAM_CHUNK, AdamConfig, AdamShard, LossScaler, has_overflow


def test_adam_matches_torch_adam_on_the_same_fp32_inputs() -> None:
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(1000, generator=generator)
    grads = [torch.randn(1000, generator=generator) for _ in range(6)]
    config = AdamConfig(lr=1e-2)
    ours = AdamShard(start.clone(), config, MemoryTracker(), "p")
    param = torch.nn.Parameter(start.clone())
    theirs = torch.optim.Adam([param], lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps)
    for step, grad in enumerate(grads, start=1):
        ours.step(grad, step)
        param.grad = grad.clone()
        theirs.step()
    torch.testing.assert_close(ours.master, param.detach(), rtol=1e-6, atol=1e-7)


def test_adam_on_slices_gives_the_same_bits_as_on_the_whole() -> None:
    generator = torch.Generator().manual_seed(1)
    start = torch.randn(1037, generator=generator)
    grads = [torch.randn(1037, generator=generator) for _ in range(3)]
    whole = AdamShard(start.clone(), AdamConfig(), MemoryTracker(), "whole")
    bounds = [0, 5, 333, 334, 1000, 1037]
    pieces = [AdamShard(start[a:b].clone(), AdamConfig(), MemoryTracker(), "piece") for a, b in pairwise(bounds)]
    for step, grad in enumerate(grads, start=1):
        whole.step(grad, step)
        for piece, (a, b) in zip(pieces, pairwise(bounds), strict=True):
            piece.step(grad[a:b], step)
    assert torch.equal(torch.cat([p.master for p in pieces]), whole.master)


def test_a_shard_longer_than_a_chunk_is_updated_everywhere_as_pieces_of_it_would_be() -> None:
    numel = 2 * ADAM_CHUNK + 123
    generator = torch.Generator().manual_seed(2)
    start = torch.randn(numel, generator=generator)
    grads = [torch.randn(numel, generator=generator) for _ in range(2)]
    whole = AdamShard(start.clone(), AdamConfig(), MemoryTracker(), "whole")
    last = AdamShard(start[-200:].clone(), AdamConfig(), MemoryTracker(), "the last 200")
    for step, grad in enumerate(grads, start=1):
        whole.step(grad, step)
        last.step(grad[-200:], step)
    assert torch.equal(whole.master[-200:], last.master)
    assert not torch.equal(whole.master[-200:], start[-200:])


def test_views_of_a_shard_update_the_shard_as_its_own_step_would() -> None:
    generator = torch.Generator().manual_seed(3)
    start = torch.randn(900, generator=generator)
    grad = torch.randn(900, generator=generator)
    whole = AdamShard(start.clone(), AdamConfig(), MemoryTracker(), "whole")
    by_views = AdamShard(start.clone(), AdamConfig(), MemoryTracker(), "by views")
    whole.step(grad, 1)
    for a, b in pairwise([0, 400, 401, 900]):
        by_views.view(a, b).step(grad[a:b], 1)
    assert torch.equal(whole.master, by_views.master) and torch.equal(whole.v, by_views.v)


def test_adam_states_are_k_equals_twelve_bytes_per_parameter_until_released() -> None:
    tracker = MemoryTracker()
    adam = AdamShard(torch.zeros(100), AdamConfig(), tracker, "p")
    assert tracker.model_state_bytes() == 12 * 100
    del adam
    assert tracker.model_state_bytes() == 0


def test_adam_refuses_a_non_fp32_master() -> None:
    with pytest.raises(ValueError, match="fp32"):
        AdamShard(torch.zeros(4, dtype=torch.float16), AdamConfig(), MemoryTracker(), "p")


def test_loss_scaler_halves_and_skips_on_overflow_and_grows_after_a_window() -> None:
    scaler = LossScaler(scale=1024.0, growth_interval=2)
    assert scaler.update(found_overflow=True) is False
    assert scaler.scale == 512.0 and scaler.skipped_steps == 1
    assert scaler.update(found_overflow=False) is True
    assert scaler.scale == 512.0
    assert scaler.update(found_overflow=False) is True
    assert scaler.scale == 1024.0


def test_bf16_uses_no_loss_scale_but_still_skips_non_finite_steps() -> None:
    scaler = LossScaler.for_precision("bf16")
    assert scaler.scale == 1.0
    assert scaler.update(found_overflow=True) is False
    assert scaler.scale == 1.0


def test_overflow_detects_inf_and_nan() -> None:
    assert has_overflow(torch.tensor([1.0, float("inf")]))
    assert has_overflow(torch.tensor([float("nan")]))
    assert not has_overflow(torch.tensor([65504.0], dtype=torch.float16))
    assert has_overflow(torch.tensor([float("inf"), float("-inf")], dtype=torch.bfloat16))
    assert not has_overflow(torch.tensor([]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_overflow_is_found_wherever_it_is(dtype: torch.dtype, bad: float) -> None:
    """One bad element among many finite ones, first, in the middle or last, of either sign."""
    for where in (0, 12_345, 99_999):
        grad = torch.randn(100_000).to(dtype)
        grad[where] = bad
        assert has_overflow(grad), (where, grad[where])
    assert not has_overflow(torch.randn(100_000).to(dtype))

