"""Figures from outside the repository, each with its source and the line it was read from.

`zero_core/data/facts.toml` is the one home of every number the course does not compute: a value, its unit,
where the course uses it (or, for a row of a paper's table, the row's cells as printed), and one of three kinds of
evidence:

- a **quote**: the exact line of an openable source (a repository, path and commit, or a URL and section);
- **unverified**: the source (often a paper) could not be opened from the machines the course is built on, so
  the figure is shown with that warning wherever it appears;
- an **assumption**: a figure the course chooses (an example link, a latency no source measures), with why.

Constants and lessons read figures with `fact(name)`, so a figure is written once, beside its evidence;
`tests/test_facts.py` checks that each quoted value appears in its quote, and the lesson tests check that
every figure with a unit in a lesson is either one of these or computed by the lesson itself.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

FACTS_FILE = Path(__file__).parent / "data" / "facts.toml"
SOURCE_KEYS = {"repository", "path", "commit", "section", "url"}
EVIDENCE_KEYS = ("quote", "unverified", "assumption")


@dataclass(frozen=True)
class Fact:
    name: str
    value: float | None
    """The figure; None for a table row, whose cells are `printed`."""
    unit: str
    source: dict[str, str]
    """Where the figure comes from; empty for an assumption."""
    used_in: tuple[str, ...]
    quote: str | None = None
    """The exact line of the source that carries the value."""
    unverified: str | None = None
    """Why the source could not be opened here (the figure is shown with this warning)."""
    assumption: str | None = None
    """Why the course chooses this figure (no source claims it)."""
    bytes: int | None = None
    """The message size a bandwidth was measured at, where it has one."""
    printed: tuple[str, ...] | None = None
    """A table row's cells exactly as the source prints them ("52.5", "0.5T"), for the rows of paper tables."""

    def cite(self) -> str:
        """Where the figure comes from, in one line: repository, path and commit, or the URL, and the section;
        for an unverified figure, that it is unverified; for an assumption, that it is one."""
        if self.assumption:
            return f"an assumption of the course: {self.assumption}"
        source = self.source
        where = source.get("url") or f"{source['repository']}, {source['path']} @ {source['commit'][:12]}"
        cited = f"{where} ({source['section']})"
        return f"{cited}, unverified here: {self.unverified}" if self.unverified else cited


def _load(name: str, entry: dict, sources: dict[str, dict]) -> Fact:
    evidence = [key for key in EVIDENCE_KEYS if key in entry]
    missing = {"value" if "printed" not in entry else "printed", "unit", "used_in"} - set(entry)
    problem = None
    if missing:
        problem = f"lacks {sorted(missing)}"
    elif len(evidence) != 1:
        problem = f"needs exactly one of {', '.join(EVIDENCE_KEYS)}, has {evidence or 'none'}"
    elif evidence != ["assumption"] and entry.get("source") not in sources:
        problem = f"names no source this file defines ({entry.get('source')!r})"
    if problem:
        raise ValueError(f"{FACTS_FILE.name}: [{name}] {problem}")
    value = float(entry["value"]) if "value" in entry else None
    printed = tuple(entry["printed"]) if "printed" in entry else None
    return Fact(
        name, value, entry["unit"], sources.get(entry.get("source"), {}), tuple(entry["used_in"]),
        entry.get("quote"), entry.get("unverified"), entry.get("assumption"), entry.get("bytes"), printed,
    )


@cache
def facts() -> dict[str, Fact]:
    """Every fact of the file, by name; a malformed entry raises, naming it."""
    data = tomllib.loads(FACTS_FILE.read_text())
    sources = {name: entry for name, entry in data.items() if set(entry) <= SOURCE_KEYS}
    return {name: _load(name, entry, sources) for name, entry in data.items() if name not in sources}


def fact(name: str) -> Fact:
    """The fact called `name`; a KeyError names the file to add it to."""
    try:
        return facts()[name]
    except KeyError:
        raise KeyError(f"no fact {name!r} in {FACTS_FILE}: add it there with its source and quote") from None
