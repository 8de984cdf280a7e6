"""The text of a submission in tests/fixtures, whether its file holds it whole or as a patch.

Most wrong answers are the plain correct answer of their cell (`tests/fixtures/plain/`) with one mistake, so
`wrong/` keeps them as patches: a `.patch` file is the fixture's header as it is, the `# --- cell ---` line,
then a unified diff whose `---` line names the base (a path under tests/fixtures) and whose hunks count the
lines of that file. The answer's cell is the base's cell with the hunks applied. A hunk applies only where
its header says and only if every line it keeps or removes is there as written (no offset, no fuzz);
otherwise `PatchError` names the fixture, the hunk and the line that differs. See tests/fixtures/wrong/README.md.
"""

from __future__ import annotations

import re
import sysconfig
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
ROOT = FIXTURES.parent.parent
CELL_MARKER = "# --- cell ---\n"
HUNK_HEADER = re.compile(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(ValueError):
    """A patched fixture does not apply to its base: the message names the fixture, the hunk and what differs."""


def wrong_fixtures() -> list[Path]:
    """Every wrong answer of tests/fixtures/wrong, patched or whole, in the order of their names."""
    folder = FIXTURES / "wrong"
    return sorted([*folder.glob("*.patch"), *folder.glob("*.py")], key=lambda path: path.stem)


def read_fixture(path: Path) -> tuple[dict, str]:
    """(the names its header sets, the source of its cell) of a fixture, its paths filled in (`with_paths`).
    A cell that is not valid Python is kept in the fixture as a string, `CELL_SOURCE`: that string."""
    header, source = with_paths(fixture_text(path)).split(CELL_MARKER, 1)
    meta: dict = {}
    exec(header, meta)
    if "CELL_SOURCE" in source:
        namespace: dict = {}
        exec(source, namespace)
        source = namespace["CELL_SOURCE"]
    return meta, source


def with_paths(text: str) -> str:
    """A fixture's text with the paths a student learns from a traceback filled in: `{COURSE_ROOT}` (the
    course checkout) and `{SITE_PACKAGES}` (the grader's venv's packages)."""
    return text.replace("{COURSE_ROOT}", str(ROOT)).replace("{SITE_PACKAGES}", sysconfig.get_paths()["purelib"])


def fixture_text(path: Path) -> str:
    """The fixture's text as one whole file would hold it: its header, the cell marker, its cell."""
    text = path.read_text()
    if path.suffix != ".patch":
        return text
    if CELL_MARKER not in text:
        raise PatchError(f"{path.name}: no `{CELL_MARKER.strip()}` line between the header and the diff")
    header, diff = text.split(CELL_MARKER, 1)
    return header + CELL_MARKER + patched_cell(path.name, diff)


def patched_cell(name: str, diff: str) -> str:
    """The cell that `diff` (the part of the patch `name` after the cell marker) makes of its base's."""
    lines = diff.splitlines(keepends=True)
    if len(lines) < 3 or not lines[0].startswith("--- ") or not lines[1].startswith("+++ "):
        raise PatchError(f"{name}: the diff must begin with a `--- BASE` line, a `+++` line and a hunk")
    base_name = lines[0][4:].split("\t")[0].strip()
    base_path = FIXTURES / base_name
    if not base_path.is_file():
        raise PatchError(f"{name}: its base {base_name} is not a file under {FIXTURES}")
    patched = "".join(apply_hunks(name, base_name, base_path.read_text().splitlines(keepends=True), lines[2:]))
    if CELL_MARKER not in patched:
        raise PatchError(f"{name}: the patched {base_name} has no `{CELL_MARKER.strip()}` line left")
    return patched.split(CELL_MARKER, 1)[1]


def apply_hunks(name: str, base_name: str, base: list[str], hunks: list[str]) -> list[str]:
    """`base`'s lines with each hunk of `hunks` applied exactly where its header says."""
    patched: list[str] = []
    at = 0
    index = 0
    number = 0
    while index < len(hunks):
        header = hunks[index].rstrip("\n")
        match = HUNK_HEADER.match(header)
        if match is None:
            raise PatchError(f"{name}: line {index + 3} of the diff, {header!r}, is not a hunk's `@@ -a,b +c,d @@`")
        number += 1
        where = f"{name}, hunk {number} ({header})"
        old_start, old_count = int(match[1]), int(match[2] or 1)
        new_count = int(match[4] or 1)
        start = old_start - 1 if old_count else old_start
        if start < at:
            raise PatchError(f"{where}: starts at line {old_start} of {base_name}, before the previous hunk ends")
        patched += base[at:start]
        at = start
        old_seen = new_seen = 0
        index += 1
        while old_seen < old_count or new_seen < new_count:
            if index == len(hunks) or hunks[index].startswith("@@"):
                raise PatchError(f"{where}: ends after {old_seen} old and {new_seen} new lines of its header's counts")
            line = hunks[index]
            kind, text = (" ", line) if line == "\n" else (line[0], line[1:])  # a blank line kept, its space trimmed
            if kind not in " -+":
                raise PatchError(f"{where}: {line!r} is not a line kept (' '), removed ('-') or added ('+')")
            if kind in " -":
                found = base[at] if at < len(base) else "the end of the file"
                if found != text:
                    raise PatchError(f"{where}: line {at + 1} of {base_name} is {found!r}, the patch expects {text!r}")
                at += 1
                old_seen += 1
            if kind in " +":
                patched.append(text)
                new_seen += 1
            index += 1
    return patched + base[at:]
