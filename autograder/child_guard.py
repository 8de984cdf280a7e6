"""A tripwire in the grading child: an audit hook (PEP 578) that refuses what a submission should not ask for.

Installed in the child after the grader's own imports and before the first solution cell runs, the hook
refuses:

- starting any process (`subprocess`, `os.system`, `os.exec*`, `os.spawn*`, `os.posix_spawn`, `os.fork`);
- signalling any process but the child itself (`os.kill`, `os.killpg`, a group included);
- loading or calling native code through `ctypes`;
- reading the course's answers and other students' work (`solutions/`, `tests/`, `.git`, `out/`, the
  gradebook: `HIDDEN`, and the paths the grader names in `AUTOGRADER_PROTECTED`), and writing anything
  inside the course checkout or there.

It is a tripwire, not a wall: code in the same interpreter can reach the hook through `gc`, and a foreign
function library other than `ctypes` raises none of its events. The walls are the operating system's
(`autograder.walls`); without them (`--no-walls`) this hook is all that is left, and grades say so.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = ("solutions", "tests", ".git", "out", "gradebook.db")
"""What the student's code may not read in the course checkout: answers, hidden tests, other students' work."""

PROCESS_EVENTS = frozenset(
    {
        "subprocess.Popen",
        "os.system",
        "os.exec",
        "os.spawn",
        "os.posix_spawn",
        "os.fork",
        "os.forkpty",
        "pty.spawn",
    }
)
NATIVE_EVENTS = frozenset({"ctypes.dlopen", "ctypes.dlsym", "ctypes.call_function", "ctypes.cdata"})
SIGNAL_EVENTS = frozenset({"os.kill", "os.killpg"})
WRITE_EVENTS = frozenset(
    {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate", "shutil.rmtree"}
)
LISTING_EVENTS = frozenset({"os.listdir", "os.scandir", "glob.glob"})
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


class GradingRefused(PermissionError):
    """What the student's code asked for is not allowed while it is graded."""


def _path(value: object) -> Path | None:
    if isinstance(value, int) or value is None:
        return None
    try:
        return Path(os.fsdecode(os.fspath(value))).resolve()
    except (TypeError, ValueError, OSError):
        return None


def _inside(path: Path, folders: Iterable[Path]) -> bool:
    return any(path == folder or folder in path.parents for folder in folders)


PROTECTED_VARIABLE = "AUTOGRADER_PROTECTED"
"""The environment variable through which the grader names more paths to hide (its grades and feedback)."""


def protected_paths() -> list[Path]:
    return [Path(p).resolve() for p in os.environ.get(PROTECTED_VARIABLE, "").split(os.pathsep) if p]


def install(root: Path = ROOT) -> None:
    """Refuse, from now on, what the module docstring lists (in this process, for good), and the paths the
    grader names in `AUTOGRADER_PROTECTED` as hidden ones."""
    hidden = [(root / name).resolve() for name in HIDDEN] + protected_paths()
    root = root.resolve()
    me = os.getpid()

    def refuse(what: str) -> None:
        raise GradingRefused(f"not allowed while grading: {what}")

    def hook(event: str, args: tuple) -> None:
        if event in PROCESS_EVENTS:
            refuse(f"starting a process ({event})")
        elif event in NATIVE_EVENTS:
            refuse(f"native code through ctypes ({event})")
        elif event in SIGNAL_EVENTS:
            if args and args[0] != me:
                refuse(f"signalling process {args[0]} ({event})")
        elif event == "open":
            path = _path(args[0])
            if path is None:
                return
            mode, flags = args[1] or "r", args[2] or 0
            writes = any(c in str(mode) for c in "wax+") or bool(flags & WRITE_FLAGS)
            if _inside(path, hidden):
                refuse(f"reading {path} (the course's answers and other students' work are not yours)")
            if writes and _inside(path, [root, *hidden]):
                refuse(f"writing {path} inside the course or the grades")
        elif event in LISTING_EVENTS or event in WRITE_EVENTS:
            path = _path(args[0]) if args else None
            if path is not None and _inside(path, hidden):
                refuse(f"{event} of {path}")
            if event in WRITE_EVENTS and path is not None and _inside(path, [root]):
                refuse(f"{event} inside the course")

    sys.addaudithook(hook)
