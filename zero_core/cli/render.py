"""Plain-text tables for the terminal: aligned columns, a rule under the header."""

from __future__ import annotations


def table(headers: list[str], rows: list[list[str]], title: str = "") -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        return "  ".join(str(cell).ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()

    out = [title] if title else []
    out += [line(headers), line(["-" * w for w in widths])]
    out += [line(row) for row in rows]
    return "\n".join(out)


def mb(n_bytes: float) -> str:
    """Bytes as decimal megabytes, the unit the tiny model's numbers read best in."""
    return f"{n_bytes / 1e6:.3f} MB"
