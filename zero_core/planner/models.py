"""The shapes of models people train, so the planner answers for a real model rather than a bare Ψ.

ZeRO's memory needs only Ψ (16Ψ bytes of model states), but a step's time needs the shape: how many layers
the schedule gathers and reduces one by one, how wide they are, the vocabulary of the embedding and head,
the sequence that sets attention's FLOPs. A `ModelShape` is that shape, and Ψ follows from it:

    Llama (untied embedding and head, RMSNorm, SwiGLU, grouped-query attention, no biases):
        Ψ = 2·V·h + L·(2h² + 2h²·kv/heads + 3·h·ffn + 2h) + h
    GPT (GPT-2 and GPT-3: tied embedding and head, learned positions, LayerNorm, biases):
        Ψ = V·h + S·h + L·(4h² + 4h + 2·h·ffn + ffn + h + 4h) + 2h     (12h² + 13h per block at ffn = 4h)

with L layers, hidden size h, vocabulary V, maximum sequence S, FFN width ffn, and kv key-value heads of
`heads` query heads (kv = heads without grouped-query attention). Every number of a preset is an entry of
`zero_core/data/facts.toml` with its source and the line it was read from; `PRESETS` lists the models whose
shape could be sourced there (the ZeRO paper gives its 7.5B, 128B and 1T as Ψ only, so they are not here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zero_core.facts import fact

LLAMA, GPT = "llama", "gpt"


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's shape; `psi` is the parameter count it implies (see the module docstring)."""

    name: str
    family: str
    """LLAMA or GPT: which parameter formula applies."""
    layers: int
    hidden: int
    heads: int | None
    ffn: int
    vocabulary: int
    max_sequence: int
    kv_heads: int | None = None
    """Key-value heads under grouped-query attention; None: as many as query heads."""
    nominal: str = ""
    """The size the model is published as ("13B"); empty for a shape given on the command line."""
    sources: tuple[tuple[str, str], ...] = ()
    """(field, entry of the facts file) for each number of a preset; GPT-3's FFN width has two entries."""

    def __post_init__(self) -> None:
        if self.family not in (LLAMA, GPT):
            raise ValueError(f"model {self.name!r}: family must be {LLAMA!r} or {GPT!r}, got {self.family!r}")
        sizes = {"layers": self.layers, "hidden": self.hidden, "ffn": self.ffn, "vocabulary": self.vocabulary,
                 "max_sequence": self.max_sequence}
        bad = [f"{key} {value}" for key, value in sizes.items() if value < 1]
        if bad:
            raise ValueError(f"model {self.name!r}: {', '.join(bad)}: each must be at least 1")

    @property
    def facts(self) -> tuple[str, ...]:
        """The facts file's entries its numbers come from, each once."""
        return tuple(dict.fromkeys(entry for _, entry in self.sources))

    @property
    def block_params(self) -> int:
        """Parameters of one transformer block."""
        h, ffn = self.hidden, self.ffn
        if self.family == GPT:
            return 4 * h * h + 4 * h + 2 * h * ffn + ffn + h + 4 * h
        kv_fraction = (self.kv_heads or self.heads or 1) / (self.heads or 1)
        return round(2 * h * h + 2 * h * h * kv_fraction) + 3 * h * ffn + 2 * h

    @property
    def embedding_params(self) -> int:
        """The input embedding (and, for GPT, the learned positions and the head tied to it)."""
        if self.family == GPT:
            return self.vocabulary * self.hidden + self.max_sequence * self.hidden
        return self.vocabulary * self.hidden

    @property
    def head_params(self) -> int:
        """The final norm and the output head (GPT ties its head to the embedding: the norm alone)."""
        if self.family == GPT:
            return 2 * self.hidden
        return self.vocabulary * self.hidden + self.hidden

    @property
    def psi(self) -> int:
        """Ψ, the parameter count: embedding + layers · block + head."""
        return self.embedding_params + self.layers * self.block_params + self.head_params

    def to_dict(self) -> dict:
        return {
            "name": self.name, "family": self.family, "layers": self.layers, "hidden": self.hidden,
            "heads": self.heads, "kv_heads": self.kv_heads, "ffn": self.ffn, "vocabulary": self.vocabulary,
            "max_sequence": self.max_sequence, "psi": self.psi, "nominal": self.nominal, "facts": list(self.facts),
        }


def _preset(name: str, family: str, nominal: str, **fields: str | tuple[str, ...]) -> ModelShape:
    """A preset whose every number is read from the facts file: each of `fields` names its entry, or the entries
    whose product it is (GPT-3's FFN width: Megatron-LM's default multiple of the hidden size)."""
    named = {key: (entries,) if isinstance(entries, str) else entries for key, entries in fields.items()}
    values = {key: int(math.prod(fact(entry).value for entry in entries)) for key, entries in named.items()}
    sources = tuple((key, entry) for key, entries in named.items() for entry in entries)
    return ModelShape(name, family, nominal=nominal, sources=sources, **values)


PRESETS = {
    shape.name: shape
    for shape in (
        _preset("llama-2-7b", LLAMA, "7B", layers="llama2_7b_layers", hidden="litgpt_default_hidden",
                heads="litgpt_default_heads", ffn="llama2_7b_ffn", vocabulary="llama2_vocabulary",
                max_sequence="llama2_max_sequence"),
        _preset("llama-2-13b", LLAMA, "13B", layers="llama2_13b_layers", hidden="llama2_13b_hidden",
                heads="llama2_13b_heads", ffn="llama2_13b_ffn", vocabulary="llama2_vocabulary",
                max_sequence="llama2_max_sequence"),
        _preset("llama-2-70b", LLAMA, "70B", layers="llama2_70b_layers", hidden="llama2_34b_70b_hidden",
                heads="llama2_34b_70b_heads", kv_heads="llama2_34b_70b_kv_heads", ffn="llama2_70b_ffn",
                vocabulary="llama2_vocabulary", max_sequence="llama2_max_sequence"),
        _preset("llama-3-8b", LLAMA, "8B", layers="llama3_8b_layers", hidden="litgpt_default_hidden",
                heads="llama3_8b_heads", kv_heads="llama3_8b_kv_heads", ffn="llama3_8b_ffn",
                vocabulary="llama3_vocabulary", max_sequence="llama3_max_sequence"),
        _preset("llama-3-70b", LLAMA, "70B", layers="llama3_70b_layers", hidden="llama3_70b_hidden",
                heads="llama3_70b_heads", kv_heads="llama3_70b_kv_heads", ffn="llama3_70b_ffn",
                vocabulary="llama3_vocabulary", max_sequence="llama3_max_sequence"),
        _preset("llama-3.1-405b", LLAMA, "405B", layers="llama3_1_405b_layers", hidden="llama3_1_405b_hidden",
                heads="llama3_1_405b_heads", kv_heads="llama3_1_405b_kv_heads", ffn="llama3_1_405b_ffn",
                vocabulary="llama3_vocabulary", max_sequence="llama3_1_405b_max_sequence"),
        _preset("gpt-3-175b", GPT, "175B", layers="gpt3_175b_layers", hidden="gpt3_175b_hidden",
                heads="gpt3_175b_heads", ffn=("megatron_ffn_multiple", "gpt3_175b_hidden"),
                vocabulary="gpt2_vocabulary", max_sequence="gpt3_175b_max_sequence"),
    )
}
"""The presets `--model NAME` takes, by name."""


def custom_shape(layers: int, hidden: int, vocabulary: int, max_sequence: int) -> ModelShape:
    """A GPT (GPT-2/GPT-3 blocks, FFN 4h) of the given shape: what `--layers L --hidden H` describe."""
    return ModelShape("custom", GPT, layers, hidden, None, 4 * hidden, vocabulary, max_sequence)
