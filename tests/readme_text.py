"""The README read as a user reads it: the text under a heading, and the commands of its first shell block.

Shared by the README's own tests (`test_readme.py`) and the ones that run its commands
(`test_readme_instructor.py`), so both read one block the same way.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def section(heading: str) -> str:
    """The README's text under `heading` (a whole heading line, e.g. "### Planning a run"), to the next heading
    of the same or a higher level."""
    level = heading.split(" ", 1)[0]
    text = README.read_text()
    assert f"\n{heading}\n" in text, f"the README has no {heading!r}"
    body = text.split(f"\n{heading}\n", 1)[1]
    ends = [m.start() for m in re.finditer(r"^(#{1,6}) ", body, re.MULTILINE) if len(m.group(1)) <= len(level)]
    return body[: min(ends, default=len(body))]


def shell_commands(heading: str) -> list[str]:
    """The commands of the first ```bash block under `heading`, comments dropped."""
    block = re.search(r"```bash\n(.*?)```", section(heading), re.DOTALL)
    assert block, f"{heading!r} has no ```bash block"
    commands = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    return [command for command in commands if command]
