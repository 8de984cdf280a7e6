"""`--machine list`: every machine preset the step times are predicted for, its figures and their sources.

A preset is a handful of figures (peak FLOP/s, the fraction of it a step achieves, GPUs per node, the links'
bandwidths, the host's memory), each an entry of the facts file with its source and the line it was read
from, or marked as the course's assumption. The list prints them per preset, with every source, so that a
user picks a machine knowing what each one claims and where the claim comes from.
"""

from __future__ import annotations

import argparse
import re
import textwrap
from collections.abc import Callable
from typing import Any

from zero_core.facts import Fact, facts
from zero_core.planner.time_model import MACHINES, PRESET_FIGURES, Machine

LIST = "list"
WIDTH = 100
_USED_IN = re.compile(r"planner/time_model\.py \((\w+)(?:\.(\w+))?\)")


def preset_facts(short_name: str) -> list[tuple[str, Fact]]:
    """(the figure it sets, the fact) for every fact a preset's figures come from: its own, then those of
    the preset it is made from for the figures it does not set itself."""
    own: dict[str, list[tuple[str, Fact]]] = {}
    for fact in facts().values():
        for used in fact.used_in:
            match = _USED_IN.search(used)
            if match and match.group(1) in PRESET_FIGURES[short_name]:
                own.setdefault(match.group(1), []).append((match.group(2) or "the preset", fact))
    chosen: list[tuple[str, Fact]] = []
    for variable in PRESET_FIGURES[short_name]:
        taken = {figure for figure, _ in chosen}
        chosen += [(figure, fact) for figure, fact in own.get(variable, []) if figure not in taken]
    return chosen


def describe(short_name: str, machine: Machine) -> str:
    """One preset: its name, its figures in the units vendors print, and a line per source."""
    figures = (
        f"{machine.peak_tflops:g} TFLOP/s peak x {machine.achieved_fraction:g} achieved; {machine.gpus_per_node} GPUs "
        f"per node; in a node {machine.intra_node_bandwidth / 1e9:g} GB/s per GPU, across nodes "
        f"{machine.inter_node_bandwidth / 1e9:g} GB/s per GPU; HBM {machine.hbm_bandwidth / 1e12:g} TB/s; PCIe "
        f"{machine.pcie_bandwidth / 1e9:.3g} GB/s each way; host {machine.host_memory_bytes / 1e12:g} TB per node"
    )
    lines = [f"{short_name}: {machine.name}", *textwrap.wrap(figures, WIDTH, initial_indent="  ",
                                                             subsequent_indent="  ")]
    for figure, fact in preset_facts(short_name):
        text = f"{figure.replace('_', ' ')}: {fact.name} = {fact.value:g} {fact.unit}, {fact.cite()}"
        lines += textwrap.wrap(text, WIDTH, initial_indent="    ", subsequent_indent="      ")
    return "\n".join(lines)


def machines_text() -> str:
    """Every preset, in the order `--machine` lists them."""
    return "\n\n".join(describe(name, MACHINES[name]) for name in sorted(MACHINES))


class PresetChoice(argparse.Action):
    """`OPTION NAME` (one of `names`) or `OPTION list`, which prints `describe_all()` and exits: `--machine`
    here, `--model` in `zero_core.cli.model_choice`."""

    def __init__(self, option_strings: list[str], dest: str, names: list[str], describe_all: Callable[[], str],
                 **options: Any) -> None:
        super().__init__(option_strings, dest, **options)
        self.names, self.describe_all = names, describe_all

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, value: Any, given: Any = None) -> None:
        option = self.option_strings[0]
        if value == LIST:
            print(self.describe_all())
            parser.exit(0)
        if value not in self.names:
            parser.error(f"argument {option}: no preset {value!r}; choose one of {', '.join(self.names)} "
                         f"({option} {LIST} describes them)")
        setattr(namespace, self.dest, value)


def machine_argument(parser: argparse.ArgumentParser, help_text: str, **options: Any) -> None:
    """Add `--machine` to `parser`: a preset's short name, or `list`."""
    parser.add_argument(
        "--machine", action=PresetChoice, names=sorted(MACHINES), describe_all=machines_text,
        metavar="{" + ",".join([*sorted(MACHINES), LIST]) + "}",
        help=f"{help_text}; `list` describes every preset and its sources", **options
    )
