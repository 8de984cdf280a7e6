"""The model presets of the planner (`zero_core.planner.models`): shapes read from the facts file, Ψ from the shape."""

from __future__ import annotations

import pytest

from zero_core.facts import fact
from zero_core.planner.models import GPT, PRESETS, ModelShape, custom_shape
from zero_core.units import parse_count


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_presets_psi_is_within_5_percent_of_the_size_it_is_published_as(name: str) -> None:
    shape = PRESETS[name]
    assert shape.psi == pytest.approx(parse_count(shape.nominal), rel=0.05), (shape.psi, shape.nominal)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_number_of_a_preset_is_an_entry_of_the_facts_file(name: str) -> None:
    shape = PRESETS[name]
    values = {int(fact(entry).value) for entry in shape.facts}
    numbers = {shape.layers, shape.hidden, shape.heads, shape.vocabulary, shape.max_sequence}
    numbers |= {shape.kv_heads} if shape.kv_heads else set()
    assert numbers <= values, numbers - values
    assert shape.ffn in values or shape.ffn == 4 * shape.hidden and "megatron_ffn_multiple" in shape.facts
    assert all(any("zero_core/planner/models.py" in use for use in fact(entry).used_in) for entry in shape.facts)


def test_the_llama_formula_gives_the_parameter_counts_of_the_released_checkpoints() -> None:
    """Llama-2 7B has 6,738,415,616 parameters and Llama-3 8B 8,030,261,248 (embedding and head untied)."""
    assert PRESETS["llama-2-7b"].psi == 6_738_415_616
    assert PRESETS["llama-3-8b"].psi == 8_030_261_248


def test_grouped_query_attention_shrinks_the_key_and_value_projections() -> None:
    full = ModelShape("mha", "llama", 2, 64, 8, 128, 100, 16)
    grouped = ModelShape("gqa", "llama", 2, 64, 8, 128, 100, 16, kv_heads=2)
    assert full.block_params - grouped.block_params == 2 * 64 * 64 * (1 - 2 / 8)


def test_a_gpt_block_is_12h_squared_plus_13h_and_its_head_is_tied() -> None:
    shape = custom_shape(layers=3, hidden=10, vocabulary=50, max_sequence=8)
    assert shape.family == GPT and shape.block_params == 12 * 10**2 + 13 * 10
    assert shape.psi == 50 * 10 + 8 * 10 + 3 * (12 * 100 + 130) + 2 * 10


def test_a_shape_with_no_layers_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="layers 0"):
        custom_shape(layers=0, hidden=10, vocabulary=50, max_sequence=8)
