"""Keep a grading child away from the course and from everything outside it: Linux namespaces.

Where `unshare` may create namespaces (as root, or as a user where unprivileged user namespaces are
enabled), the child runs as process 1 of a PID namespace of its own: it sees no other process, so it
cannot signal the grader, and when it exits the kernel kills every process it left behind, including
those that started a session of their own. In a mount namespace the course checkout is read-only and
its solutions, tests, git history, submissions and gradebook are replaced by empty mounts; a network
namespace leaves it only a loopback device that is down. Nothing of this reaches the grader's own view.

Elsewhere (macOS, containers that forbid namespaces) `namespaced` returns None and the child runs with
the grader's permissions; `autograder.child_guard`'s audit hooks are then the only layer left.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = ("solutions", "tests", ".git", "out", "gradebook.db")
"""What a grading child may not read in the course checkout: answers, hidden tests, other students' work."""

_SETUP = r"""
set -e
root="$1"; shift
mount --bind "$root" "$root"
mount -o remount,bind,ro "$root"
while [ "$1" != "--" ]; do
    if [ -d "$1" ]; then
        mount -t tmpfs -o size=16k,mode=0555 tmpfs "$1"
    elif [ -e "$1" ]; then
        mount --bind /dev/null "$1"
    fi
    shift
done
shift
exec "$@"
"""
_NAMESPACES = ("--pid", "--fork", "--kill-child", "--mount-proc", "--net", "--mount")


def _wrapper(root: Path, hidden: list[Path], user_namespace: bool) -> list[str]:
    unshare = shutil.which("unshare") or "unshare"
    user = ["--user", "--map-root-user"] if user_namespace else []
    return [unshare, *user, *_NAMESPACES, "sh", "-c", _SETUP, "sh", str(root), *map(str, hidden), "--"]


def module_files(names: tuple[str, ...]) -> tuple[Path, ...]:
    """Where the modules `names` are read from, without importing them: each module's source, and the
    compiled copies in its `__pycache__` (any Python version's); a package's whole folder."""
    files: list[Path] = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        origin = Path(spec.origin).resolve()
        if spec.submodule_search_locations:
            files.append(origin.parent)
            continue
        files.append(origin)
        files += sorted((origin.parent / "__pycache__").glob(f"{origin.stem}.*.pyc"))
    return tuple(files)


@cache
def _usable(root: Path, hidden: tuple[Path, ...]) -> bool | None:
    """Can the namespaces be made here: as we are (True), inside a user namespace (False), or not (None)?"""
    if shutil.which("unshare") is None:
        return None
    for user_namespace in (False, True):
        try:
            probe = subprocess.run(
                [*_wrapper(root, list(hidden), user_namespace), "true"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=20,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return user_namespace
    return None


def namespaced(command: list[str], root: Path = ROOT, protected: tuple[Path, ...] = ()) -> list[str] | None:
    """`command` wrapped to run isolated from `root`'s hidden parts and the `protected` paths (the grades
    file, the feedback folder), from other processes and the network; None where this machine cannot make
    the namespaces. A protected path that does not exist yet is left to the audit hook."""
    hidden = tuple(root / name for name in HIDDEN) + tuple(p for p in protected if p.exists())
    user_namespace = _usable(root, hidden)
    if user_namespace is None:
        return None
    return [*_wrapper(root, list(hidden), user_namespace), *command]
