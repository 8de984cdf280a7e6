"""Figures from outside the repository, each with its source and the line it was read from.

`zero_core/data/facts.toml` is the one home of every outside number the course uses: a value, its unit, the
source (a repository, path and commit, or a URL and section), the exact quoted line, and where the course
uses it. Constants and lessons read figures with `fact(name)`, so a figure is written once, beside its
evidence; `tests/test_facts.py` checks that each value appears in its quote.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

FACTS_FILE = Path(__file__).parent / "data" / "facts.toml"
SOURCE_KEYS = {"repository", "path", "commit", "section", "url"}


@dataclass(frozen=True)
class Fact:
    name: str
    value: float
    unit: str
    source: dict[str, str]
    quote: str
    used_in: tuple[str, ...]
    bytes: int | None = None
    """The message size a bandwidth was measured at, where it has one."""

    def cite(self) -> str:
        """Where the figure comes from, in one line: repository, path and commit, or the URL; and the section."""
        source = self.source
        where = source.get("url") or f"{source['repository']}, {source['path']} @ {source['commit'][:12]}"
        return f"{where} ({self.source['section']})"


@cache
def facts() -> dict[str, Fact]:
    """Every fact of the file, by name; a malformed entry raises, naming it."""
    data = tomllib.loads(FACTS_FILE.read_text())
    sources = {name: entry for name, entry in data.items() if set(entry) <= SOURCE_KEYS}
    loaded = {}
    for name, entry in data.items():
        if name in sources:
            continue
        missing = {"value", "unit", "source", "quote", "used_in"} - set(entry)
        if missing or entry["source"] not in sources:
            raise ValueError(f"{FACTS_FILE.name}: [{name}] lacks {sorted(missing)} or names no source it defines")
        loaded[name] = Fact(name, float(entry["value"]), entry["unit"], sources[entry["source"]], entry["quote"],
                            tuple(entry["used_in"]), entry.get("bytes"))
    return loaded


def fact(name: str) -> Fact:
    """The fact called `name`; a KeyError names the file to add it to."""
    try:
        return facts()[name]
    except KeyError:
        raise KeyError(f"no fact {name!r} in {FACTS_FILE}: add it there with its source and quote") from None
