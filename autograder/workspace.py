"""A learner's own copy of the lessons and exercises, in `work/`, which git ignores.

Running a lesson saves its outputs into the notebook, and answering an exercise edits it. Done on the
tracked notebooks, both make `git status` dirty and the next `git pull` conflict. So `make lab` first copies
`lessons/` and `exercises/` into `work/` and opens `work/lessons/`: a learner runs and edits the copies, and
hands in `work/exercises/exNN_*/exNN_*.ipynb` (the name `check` and the graders look for).

A copy is made once and never overwritten: a file missing from `work/` is copied again, and a tracked
notebook that changed since its copy was made (after a `git pull`) is reported, with how to take the new
version, but the learner's copy stays as it is. `work/.copied.json` records each copy's source digest.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

FOLDERS = ("lessons", "exercises")
"""What a learner runs or edits; `solutions/` stays where it is, read-only in spirit."""
MANIFEST = ".copied.json"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_workspace(root: Path, work: Path) -> list[str]:
    """Copy every notebook of `root`'s lessons and exercises missing from `work`; return one line per copy
    made and per tracked notebook that changed since its copy (which is kept)."""
    manifest_path = work / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    said = []
    for folder in FOLDERS:
        for source in sorted((root / folder).rglob("*.ipynb")):
            if ".ipynb_checkpoints" in source.parts:
                continue
            name = source.relative_to(root).as_posix()
            copy = work / name
            if not copy.exists():
                copy.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, copy)
                manifest[name] = _digest(source)
                said.append(f"copied {name} to {copy}")
            elif manifest.get(name) not in (None, _digest(source)):
                said.append(
                    f"{name} changed since {copy} was made; yours is kept (to take the new one, rename or delete "
                    f"yours and run `make lab` again)"
                )
    work.mkdir(parents=True, exist_ok=True)
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return said


def main(root: Path, work: Path) -> int:
    said = make_workspace(root, work)
    copied = sum(line.startswith("copied ") for line in said)
    for line in said:
        if not line.startswith("copied "):
            print(line)
    shown = work.relative_to(root) if work.is_relative_to(root) else work
    ignored = "; git ignores it" if work.resolve() == (root / "work").resolve() else ""
    print(
        f"{shown}/ holds your copies of the lessons and exercises ({copied} copied now): run and edit these, and "
        f"hand in {shown}/exercises/<assignment>/<assignment>.ipynb{ignored}"
    )
    return 0
