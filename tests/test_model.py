"""The tiny GPT and its data: deterministic, shipped with the package, and the size the course says."""

from __future__ import annotations

import pytest
import torch

from zero_core.model import (
    PRESETS,
    build_model,
    corpus,
    count_parameters,
    global_batch,
    initial_values,
    micro_batch,
    parameter_layers,
    preset,
)


def test_default_model_has_about_six_hundred_thousand_parameters() -> None:
    assert 550_000 < count_parameters(preset("tiny")) < 700_000


def test_a_preset_of_about_ten_million_parameters_exists_for_scaling_runs() -> None:
    assert 9_000_000 < count_parameters(PRESETS["small"]) < 12_000_000


def test_unknown_preset_names_the_choices() -> None:
    with pytest.raises(ValueError, match="tiny"):
        preset("huge")


def test_every_parameter_lives_in_a_linear_embedding_or_layernorm_with_affine_weights() -> None:
    model = build_model(preset("micro"))
    owned = sum(p.numel() for _, m in parameter_layers(model) for p in m.parameters())
    assert owned == sum(p.numel() for p in model.parameters())
    norms = [m for _, m in parameter_layers(model) if isinstance(m, torch.nn.LayerNorm)]
    assert norms and all(m.weight is not None and m.bias is not None for m in norms)


def test_build_model_is_deterministic_and_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a, b = build_model(preset("micro"), seed=3), build_model(preset("micro"), seed=3)
    assert torch.equal(torch.random.get_rng_state(), before)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("stage", [0, 1, 2, 3, "hsdp", "offload"])
def test_training_leaves_the_shared_initial_values_as_they_were(stage: int | str) -> None:
    """Every rank of every stage starts from the same per-layer values, made once per process: a stage that
    wrote into them would change the start of every later run in the process."""
    from zero_core.experiment import run_stage
    from zero_core.stages import TrainConfig

    config = TrainConfig(model=preset("micro"), seed=11)
    shared = initial_values(config.model, config.seed)
    run_stage(stage, 4, 2, config, gpus_per_node=2)
    assert initial_values(config.model, config.seed) is shared
    with pytest.raises(TypeError):
        shared["wte"] = torch.zeros(1)  # type: ignore[index]
    model = build_model(config.model, config.seed)
    for name, module in parameter_layers(model):
        assert torch.equal(shared[name], torch.cat([p.detach().reshape(-1) for p in module.parameters()])), name


def test_micro_batches_depend_on_rank_and_step_only() -> None:
    config = preset("micro")
    x1, y1 = micro_batch(config, rank=2, step=5)
    x2, _ = micro_batch(config, rank=2, step=5)
    x3, _ = micro_batch(config, rank=3, step=5)
    assert torch.equal(x1, x2) and not torch.equal(x1, x3)
    assert torch.equal(x1[:, 1:], y1[:, :-1]), "targets are the inputs shifted by one character"


def test_global_batch_is_the_ranks_micro_batches_in_rank_order() -> None:
    config = preset("micro")
    inputs, _ = global_batch(config, world_size=3, step=1)
    assert torch.equal(inputs[config.micro_batch_size : 2 * config.micro_batch_size], micro_batch(config, 1, 1)[0])


def test_the_corpus_ships_with_the_package_and_fits_the_vocabulary() -> None:
    ids, alphabet = corpus()
    assert ids.numel() > 5000
    assert len(alphabet) <= preset("tiny").vocab_size
