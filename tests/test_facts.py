"""The facts file (`zero_core/data/facts.toml`, `zero_core.facts`): every outside figure with its source and the
line it was read from, and the constants and lessons that read it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from zero_core import facts
from zero_core.planner import time_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", sorted(facts.facts()))
def test_every_value_stands_in_its_quote(name: str) -> None:
    fact = facts.fact(name)
    if fact.assumption:
        assert not fact.source and len(fact.assumption) > 20, f"[{name}]: an assumption says why, and has no source"
        return
    assert fact.source.get("url") or len(fact.source.get("commit", "")) == 40, f"[{name}]: a URL or a full commit"
    assert fact.source.get("section"), f"[{name}]: the section of the source"
    if fact.unverified:
        assert len(fact.unverified) > 20, f"[{name}]: say why the source could not be opened"
        return
    quote = fact.quote.replace(",", "").replace("_", "")
    if fact.printed:
        for written in fact.printed:
            assert written in quote, f"[{name}] {written} is not in its quote: {fact.quote!r}"
        return
    exponent = math.floor(math.log10(abs(fact.value))) if fact.value else 0
    written = {f"{fact.value:g}", f"{fact.value / 10**exponent:g}e{exponent}"}  # 5e8, as code writes 500,000,000
    assert any(w in quote for w in written), f"[{name}] {fact.value:g} is not in its quote: {fact.quote!r}"


def test_an_entry_needs_exactly_one_kind_of_evidence(tmp_path, monkeypatch) -> None:
    """A figure with neither a quote, an unverified note nor an assumption is refused, naming it."""
    broken = tmp_path / "facts.toml"
    broken.write_text('[paper]\nurl = "https://arxiv.org/abs/1910.02054"\nsection = "§10"\n\n'
                      '[from_memory]\nvalue = 38\nunit = "TFLOP/s"\nsource = "paper"\nused_in = []\n')
    monkeypatch.setattr(facts, "FACTS_FILE", broken)
    facts.facts.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"\[from_memory\] needs exactly one of quote, unverified, assumption"):
            facts.facts()
    finally:
        facts.facts.cache_clear()


@pytest.mark.parametrize("name", sorted(facts.facts()))
def test_every_place_a_fact_is_used_reads_the_facts_file(name: str) -> None:
    for place in facts.fact(name).used_in:
        path = ROOT / place.split(" ", 1)[0]
        assert path.exists(), f"[{name}] is used in {place}, which does not exist"
        assert "fact(" in path.read_text(), f"{path.name} uses [{name}] without reading it from the facts file"


def test_a_missing_fact_names_the_file_to_add_it_to() -> None:
    with pytest.raises(KeyError, match="facts.toml"):
        facts.fact("h200_all_reduce_busbw_3KiB")


def test_the_nvlink_latency_is_the_fit_to_the_smallest_measured_all_reduce() -> None:
    smallest = facts.fact("h200_all_reduce_busbw_32KiB")
    machine = time_model.H100_800G.with_(intra_node_bandwidth=facts.fact("nvlink4_unidirectional_spec").value * 1e9)
    predicted = time_model.predicted_busbw(machine, "all_reduce", smallest.bytes, 8)
    assert predicted == pytest.approx(smallest.value * 1e9, rel=1e-9)
    assert 2e-6 < time_model.NVLINK_ALPHA_S < 4e-6


def test_lesson_9_carries_none_of_the_figures_its_source_does_not_contain() -> None:
    """The bus bandwidths an earlier version quoted appear nowhere in the source's history."""
    text = (ROOT / "lessons" / "09_time_and_overlap.ipynb").read_text()
    for unsourced in ("3.20", "72.45", "242.45", "442.27", "480.70"):
        assert unsourced not in text
