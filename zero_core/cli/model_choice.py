"""Which model `table` and `plan` answer for: `--params`, a preset (`--model NAME`) or a shape of one's own.

Memory needs only Ψ; a predicted step also needs the model's shape (layers, hidden size, vocabulary,
sequence). `--model NAME` takes a preset of `zero_core.planner.models`, every number of it sourced in the facts
file, and Ψ from its shape; `--layers L --hidden H` describe a GPT of one's own (`--vocab`, `--seq-len` too);
`--params` alone keeps the planner's assumed depth, vocabulary and sequence and derives the hidden size from Ψ.
Whatever was assumed is printed with the answer (`assumptions`) and written to the JSON, so that a reader
sees what the numbers rest on. `--model list` prints the presets, their shapes and sources.
"""

from __future__ import annotations

import argparse
import re
import textwrap
from dataclasses import dataclass
from typing import Any

from zero_core.cli.errors import UsageError
from zero_core.cli.machines import LIST, PresetChoice, preset_facts
from zero_core.facts import fact
from zero_core.planner import configuration_time
from zero_core.planner.models import PRESETS, ModelShape, custom_shape
from zero_core.planner.time_model import MACHINES, Layer
from zero_core.units import format_count, parse_count

WIDTH = 100
AGREEMENT = 0.05
"""How far `--params` may be from a shape's Ψ and still name the same model (Llama-2 7B has 6.74B)."""


def _positive(text: str) -> int:
    if not re.fullmatch(r"\s*\d+\s*", text) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, like 4096; got {text!r}")
    return int(text)


def _count(text: str) -> int:
    try:
        return parse_count(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def presets_text() -> str:
    """Every preset: its shape, its Ψ against the size it is published as, and the source of each number."""
    blocks = []
    for shape in PRESETS.values():
        lines = [f"{shape.name}: Ψ = {format_count(shape.psi)} from its shape (published as {shape.nominal})"]
        lines += textwrap.wrap(shape_text(shape), WIDTH, initial_indent="  ", subsequent_indent="  ")
        by_source: dict[str, list[str]] = {}
        for field, name in shape.sources:
            entry = fact(name)
            by_source.setdefault(entry.cite(), []).append(f"{field.replace('_', ' ')} {entry.value:g}")
        for cited, figures in by_source.items():
            text = f"{', '.join(figures)}: {cited}"
            lines += textwrap.wrap(text, WIDTH, initial_indent="    ", subsequent_indent="      ")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def add_arguments(p: argparse.ArgumentParser, example: str) -> None:
    """--params, --model and the shape flags, shared by `table` and `plan`."""
    p.add_argument("--params", type=_count, help=f"parameters Ψ, like {example} (or give --model)")
    p.add_argument(
        "--model", action=PresetChoice, names=list(PRESETS), describe_all=presets_text, metavar="NAME",
        help=f"a model preset: {', '.join(PRESETS)}; Ψ from its shape; `list` describes them and their sources",
    )
    p.add_argument("--layers", type=_positive, help="transformer blocks (with --hidden: a GPT of this shape)")
    p.add_argument("--hidden", type=_positive, help="hidden size (needs --layers)")
    p.add_argument(
        "--vocab", type=_positive, help=f"vocabulary (default {configuration_time.DEFAULT_VOCAB:,}, assumed)"
    )
    p.add_argument(
        "--seq-len", type=_positive,
        help=f"tokens per sequence (default: the model's longest, else {configuration_time.DEFAULT_SEQ_LEN:,})",
    )


@dataclass(frozen=True)
class PlannedModel:
    """The model an answer is for: Ψ, the shape when one is known, and what the step time assumes."""

    psi: int
    shape: ModelShape | None
    layers: int
    hidden: int
    vocabulary: int
    sequence: int
    assumed: tuple[str, ...]
    """Which of layers, hidden, vocabulary and sequence are the planner's assumptions (or derived from Ψ)."""

    def schedule(self, tokens: int) -> list[Layer]:
        """The layers the time model schedules for `tokens` tokens per GPU."""
        if self.shape is not None:
            return configuration_time.shape_layers(self.shape, tokens, self.sequence)
        return configuration_time.model_layers(self.psi, tokens, self.layers, self.sequence, self.vocabulary)

    def to_dict(self) -> dict[str, Any]:
        return {
            "psi": self.psi,
            "preset": self.shape.name if self.shape and self.shape.nominal else None,
            "shape": self.shape.to_dict() if self.shape else None,
            "layers": self.layers,
            "hidden": self.hidden,
            "vocabulary": self.vocabulary,
            "sequence": self.sequence,
            "assumed": list(self.assumed),
        }


def resolve(args: argparse.Namespace) -> PlannedModel:
    """The model `args` ask for (`planned_model` of their values)."""
    return planned_model(args.params, args.model, args.layers, args.hidden, args.vocab, args.seq_len)


def planned_model(
    params: int | None = None,
    model: str | None = None,
    layers: int | None = None,
    hidden: int | None = None,
    vocab: int | None = None,
    seq_len: int | None = None,
) -> PlannedModel:
    """The model of `--params`, `--model`, `--layers`, `--hidden`, `--vocab` and `--seq-len`, given as values;
    contradictory or missing input is a UsageError that says what to give."""
    if model:
        if model not in PRESETS:
            raise UsageError(f"--model: no preset {model!r}; the presets are {', '.join(PRESETS)}")
        given = [flag for flag, value in (("--layers", layers), ("--hidden", hidden), ("--vocab", vocab)) if value]
        if given:
            raise UsageError(f"--model {model} fixes its shape: drop {', '.join(given)}, or --model to give a "
                             "shape of your own")
        return _from_shape(PRESETS[model], params, seq_len, assumed=())
    if hidden and not layers:
        raise UsageError("--hidden needs --layers (a GPT of that shape), or give --params alone")
    if layers and hidden:
        vocabulary = vocab or configuration_time.DEFAULT_VOCAB
        sequence = seq_len or configuration_time.DEFAULT_SEQ_LEN
        assumed = tuple(name for name, value in (("vocabulary", vocab), ("sequence", seq_len)) if not value)
        return _from_shape(custom_shape(layers, hidden, vocabulary, sequence), params, seq_len, assumed)
    if params is None:
        raise UsageError(f"give --params PSI, --model NAME (--model {LIST} names them) or --layers and --hidden")
    if params < 1:
        raise UsageError(f"argument --params: a model needs at least one parameter, got {params}")
    depth = layers or configuration_time.DEFAULT_LAYERS
    vocabulary = vocab or configuration_time.DEFAULT_VOCAB
    sequence = seq_len or configuration_time.DEFAULT_SEQ_LEN
    assumed = ("hidden",) + tuple(
        name for name, value in (("layers", layers), ("vocabulary", vocab), ("sequence", seq_len)) if not value
    )
    return PlannedModel(params, None, depth, configuration_time.gpt_hidden(params, depth, vocabulary), vocabulary,
                        sequence, assumed)


def _from_shape(shape: ModelShape, params: int | None, seq_len: int | None, assumed: tuple[str, ...]) -> PlannedModel:
    if params is not None and abs(params / shape.psi - 1) > AGREEMENT:
        named = f"--model {shape.name}" if shape.nominal else f"--layers {shape.layers} --hidden {shape.hidden}"
        raise UsageError(f"--params {format_count(params)} disagrees with {named}, whose shape has "
                         f"Ψ = {format_count(shape.psi)}: give one or the other")
    sequence = seq_len or shape.max_sequence
    return PlannedModel(shape.psi, shape, shape.layers, shape.hidden, shape.vocabulary, sequence, assumed)


def model_arguments(planned: PlannedModel) -> list[str]:
    """The options that name `planned` on the command line: `--model` (and `--seq-len` when it is not the model's
    longest), a shape's `--layers --hidden --vocab --seq-len`, or `--params` with what it was given beside."""
    shape = planned.shape
    if shape is not None and shape.nominal:
        longest = planned.sequence == shape.max_sequence
        return ["--model", shape.name, *([] if longest else ["--seq-len", str(planned.sequence)])]
    given = {"layers": ["--layers", str(planned.layers)], "vocabulary": ["--vocab", str(planned.vocabulary)],
             "sequence": ["--seq-len", str(planned.sequence)]}
    if shape is not None:
        given.pop("layers")
        named = ["--layers", str(shape.layers), "--hidden", str(shape.hidden)]
    else:
        psi = format_count(planned.psi)
        named = ["--params", psi if parse_count(psi) == planned.psi else str(planned.psi)]
    return named + [arg for name, args in given.items() if name not in planned.assumed for arg in args]


def shape_text(shape: ModelShape) -> str:
    """"80 layers, hidden 8,192, 64 heads (8 key-value), FFN 28,672, vocabulary 32,000, sequences up to 4,096"."""
    heads = f"{shape.heads} heads" + (f" ({shape.kv_heads} key-value)" if shape.kv_heads else "")
    parts = [f"{shape.layers} layers", f"hidden {shape.hidden:,}", *([heads] if shape.heads else []),
             f"FFN {shape.ffn:,}", f"vocabulary {shape.vocabulary:,}", f"sequences up to {shape.max_sequence:,}"]
    return ", ".join(parts)


def model_text(planned: PlannedModel) -> str:
    """The model line(s) of an answer: Ψ, where it comes from, and the shape."""
    shape = planned.shape
    if shape is None:
        text = f"Model: Ψ = {format_count(planned.psi)} (--params; no shape: --model or --layers/--hidden give one)"
    elif shape.nominal:
        text = (f"Model: {shape.name}, Ψ = {format_count(planned.psi)} from its shape (published as {shape.nominal}; "
                f"--model list gives the sources): {shape_text(shape)}")
    else:
        text = f"Model: a GPT of Ψ = {format_count(planned.psi)} from --layers and --hidden: {shape_text(shape)}"
    return "\n".join(textwrap.wrap(text, WIDTH, subsequent_indent="  "))


def assumptions(
    planned: PlannedModel, tokens: int, machine_name: str, checkpointing: str | None = None
) -> dict[str, Any]:
    """What a predicted step time rests on, for the JSON."""
    machine = MACHINES[machine_name]
    fraction = [f for figure, f in preset_facts(machine_name) if figure == "achieved_fraction"]
    return {
        "layers": planned.layers,
        "hidden": planned.hidden,
        "vocabulary": planned.vocabulary,
        "sequence": min(planned.sequence, tokens),
        "tokens_per_gpu": tokens,
        "assumed": list(planned.assumed),
        "machine": machine_name,
        "achieved_fraction": machine.achieved_fraction,
        "achieved_fraction_assumed": bool(fraction and fraction[0].assumption),
        "peak_tflops": machine.peak_tflops,
        "activations_counted": checkpointing is not None,
        "checkpointing": checkpointing,
    }


def assumptions_text(planned: PlannedModel, tokens: int, machine_name: str, checkpointing: str | None = None) -> str:
    """The step time's assumptions in a few lines: shape, sequence, tokens, the machine's achieved fraction, and
    the checkpointing whose recomputation the step includes (None: activations not counted)."""
    a = assumptions(planned, tokens, machine_name, checkpointing)

    def mark(name: str, text: str) -> str:
        why = "derived from Ψ" if name == "hidden" else "assumed"
        return f"{text} ({why})" if name in planned.assumed else text

    sequence = f"sequences of {a['sequence']:,} tokens"
    if planned.sequence > tokens:
        sequence += f" (the model's {planned.sequence:,}, cut to the tokens per GPU)"
    parts = [
        mark("layers", f"{a['layers']} layers"), mark("hidden", f"hidden {a['hidden']:,}"),
        mark("vocabulary", f"vocabulary {a['vocabulary']:,}"), mark("sequence", sequence),
        f"{tokens:,} tokens per GPU per step (--tokens-per-gpu)",
        f"{machine_name} reaches {a['achieved_fraction']:g} of its {a['peak_tflops']:g} TFLOP/s peak"
        + (" (the course's assumption)" if a["achieved_fraction_assumed"] else " (from a measured run)"),
        f"{checkpointing} activation checkpointing (--checkpointing), its recomputation timed"
        if checkpointing else "activations are not counted",
    ]
    text = "Step time assumes: " + "; ".join(parts) + "."
    return "\n".join(textwrap.wrap(text, WIDTH, subsequent_indent="  "))
