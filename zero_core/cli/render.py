"""Plain-text tables for the terminal: aligned columns, a rule under the header.

A terminal is 100 columns wide (`WIDTH`): given a `width`, a table too wide for it is cut into narrower tables
that each repeat its first `keys` columns (the stage, the configuration), and `fit` wraps prose lines, so that
every line a command prints fits; `--wide` asks for one table however wide (`width=None`).
"""

from __future__ import annotations

import textwrap

WIDTH = 100
GAP = 2


def _line(cells: list[str], widths: list[int]) -> str:
    return (" " * GAP).join(str(cell).ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()


def _parts(widths: list[int], keys: int, width: int) -> list[list[int]]:
    """Column indices of each narrower table: the key columns, then as many of the others, in order, as fit."""
    key_columns = list(range(keys))
    parts: list[list[int]] = []
    current = list(key_columns)
    for column in range(keys, len(widths)):
        candidate = current + [column]
        used = sum(widths[c] for c in candidate) + GAP * (len(candidate) - 1)
        if used > width and len(current) > keys:
            parts.append(current)
            current = key_columns + [column]
        else:
            current = candidate
    parts.append(current)
    return parts


def table(
    headers: list[str], rows: list[list[str]], title: str = "", width: int | None = None, keys: int = 1
) -> str:
    """Aligned columns under `title`. With a `width`, the title is wrapped to it and a table wider than it is cut
    into tables that each repeat the first `keys` columns, separated by a blank line."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]
    total = sum(widths) + GAP * (len(widths) - 1)
    parts = [list(range(len(widths)))] if width is None or total <= width else _parts(widths, keys, width)
    out = [fit(title, width)] if title else []
    blocks = []
    for part in parts:
        chosen = [widths[c] for c in part]
        lines = [_line([headers[c] for c in part], chosen), _line(["-" * widths[c] for c in part], chosen)]
        lines += [_line([row[c] for c in part], chosen) for row in rows]
        blocks.append("\n".join(lines))
    return "\n".join(out + ["\n\n".join(blocks)])


def fit(text: str, width: int | None = WIDTH) -> str:
    """Every line of `text` longer than `width` wrapped at spaces, its continuation indented two more spaces
    than it; `width=None` leaves the text as it is."""
    if width is None:
        return text
    lines = []
    for line in text.splitlines():
        if len(line) <= width:
            lines.append(line)
            continue
        indent = " " * (len(line) - len(line.lstrip()))
        lines += textwrap.wrap(line, width, initial_indent=indent, subsequent_indent=indent + "  ",
                               break_long_words=False, break_on_hyphens=False)
    return "\n".join(lines)


def mb(n_bytes: float) -> str:
    """Bytes as decimal megabytes, the unit the tiny model's numbers read best in."""
    return f"{n_bytes / 1e6:.3f} MB"
