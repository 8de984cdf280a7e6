"""Every figure with a unit in a lesson has a source: the facts file, or the lesson's own computation.

A figure is a number written with a unit (GB, GiB/s, Gb/s, µs, TFLOP/s, tokens/s, %; a range such as
"14-23%" gives both ends). In a lesson's *markdown*, a figure is accepted when the lesson's executed outputs
print it (at the precision the text writes it, sign aside: "23% low" for a printed -22.8%), or when it is the
value, the message size or a figure of the quote of a fact the facts file says the lesson uses. In a lesson's
*code*, only the facts count: a number with a unit typed into code (`"50GB/s"`, `80 * GB`) is an outside
figure or an assumption, and both live in `zero_core/data/facts.toml`. A figure whose fact is unverified
must say so in the cell that shows it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from zero_core.facts import Fact

UNITS = {
    "GB/s": "GB/s", "GBps": "GB/s", "GiB/s": "GiB/s", "TB/s": "TB/s", "TBps": "TB/s",
    "Gb/s": "Gb/s", "Gbps": "Gb/s", "Gbit/s": "Gb/s",
    "TB": "TB", "GB": "GB", "GiB": "GiB", "MB": "MB", "MiB": "MiB", "KiB": "KiB",
    "µs": "µs", "us": "µs", "ms": "ms",
    "TFLOP/s": "TFLOP/s", "TFLOPS": "TFLOP/s", "TFlops": "TFLOP/s", "Tflops": "TFLOP/s",
    "tokens/s": "tokens/s", "%": "%",
}
_UNIT = "|".join(sorted(map(re.escape, UNITS), key=len, reverse=True))
_NUMBER = r"\d[\d,]*(?:\.\d+)?"
FIGURE = re.compile(rf"(?<![\w.:])(?:({_NUMBER})\s?(?:-|–|to)\s?)?({_NUMBER})\s?({_UNIT})(?![\w/])")
CODE_FIGURE = re.compile(rf"(?<![\w.:])({_NUMBER})\s*\*\s*({_UNIT})\b")
"""In code, `80 * GB` is a figure too."""
BINARY_SIZES = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


@dataclass(frozen=True)
class Figure:
    text: str
    value: float
    unit: str
    decimals: int

    def shown_by(self, value: float) -> bool:
        """Whether `value` (printed or on file) reads as this figure at the precision the text writes it."""
        return round(abs(value), self.decimals) == round(self.value, self.decimals)


def _figure(number: str, unit: str, text: str) -> Figure:
    number = number.replace(",", "")
    decimals = len(number.split(".")[1]) if "." in number else 0
    return Figure(text, float(number), UNITS[unit], decimals)


def figures(text: str, code: bool = False) -> list[Figure]:
    """Every figure in `text`, both ends of a range; with `code`, also `N * UNIT` products."""
    found = []
    for match in FIGURE.finditer(text):
        low, high, unit = match.groups()
        found += [_figure(n, unit, match.group(0)) for n in (low, high) if n]
    if code:
        found += [_figure(n, unit, m.group(0)) for m in CODE_FIGURE.finditer(text) for n, unit in [m.groups()]]
    return found


def fact_figures(fact: Fact) -> list[tuple[float, str]]:
    """What a fact vouches for: its value in its unit, its message size, and every figure its quote writes."""
    unit = UNITS.get(fact.unit, fact.unit)
    vouched = [(fact.value, unit)] if fact.value is not None else []
    vouched += [(float(cell), unit) for cell in fact.printed or () if cell.replace(".", "", 1).isdigit()]
    if fact.bytes:
        vouched += [(fact.bytes / size, unit) for unit, size in BINARY_SIZES.items()]
    if fact.quote:
        vouched += [(f.value, f.unit) for f in figures(fact.quote)]
    return vouched


def unsourced(cells: list[dict], lesson_facts: list[Fact]) -> list[str]:
    """The figures of a lesson (cells as in an executed notebook) that neither its facts nor its outputs give,
    and the unverified facts it shows without saying so; each as 'cell N: figure: why'."""
    vouched = [pair for fact in lesson_facts for pair in fact_figures(fact)]
    unverified = [fact for fact in lesson_facts if fact.unverified]
    printed = [(f.value, f.unit) for cell in cells for f in figures(_outputs_text(cell))]
    problems = []
    for index, cell in enumerate(cells):
        source = "".join(cell["source"])
        is_code = cell["cell_type"] == "code"
        accepted = vouched if is_code else vouched + printed
        for figure in figures(source, code=is_code):
            if not any(unit == figure.unit and figure.shown_by(value) for value, unit in accepted):
                where = "typed into code" if is_code else "neither printed by the lesson"
                problems.append(f"cell {index}: {figure.text!r}: {where} nor a fact the lesson uses")
        for fact in unverified:
            shown = [f for f in figures(source) if any(f.unit == u and f.shown_by(v) for v, u in fact_figures(fact))]
            if shown and not is_code and "unverified" not in source:
                problems.append(f"cell {index}: {shown[0].text!r} is [{fact.name}], unverified: say so in the cell")
    return problems


def _outputs_text(cell: dict) -> str:
    texts = []
    for output in cell.get("outputs", []):
        texts.append("".join(output.get("text", "")))
        for kind in ("text/plain", "text/markdown", "text/html"):
            texts.append("".join(output.get("data", {}).get(kind, "")))
    return "\n".join(texts)
