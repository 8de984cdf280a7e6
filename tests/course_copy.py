"""A copy of the course to run the README's `make` commands in, and `make lab` started there.

The copy shares the repository's virtual environment through a symbolic link. Its install recipe
(`pyproject.toml`, `constraints.txt`: what the Makefile's install stamp depends on) is dated before that
environment's install stamp, so `make` in the copy never reinstalls the package: an editable install made
from the copy would point the shared environment at a folder the test then deletes, and every later
`import zero_core` would fail.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


def git_ignored() -> tuple[str, ...]:
    """The patterns of the course's .gitignore, as `shutil.ignore_patterns` takes them (anchors and trailing
    slashes dropped): what a fresh clone does not have, the venvs of the torch edge jobs (5 to 11 GB each)
    and the instructor's secret included."""
    lines = (line.strip() for line in (ROOT / ".gitignore").read_text().splitlines())
    return tuple(line.strip("/") for line in lines if line and not line.startswith("#"))


LEFT_OUT = (".git", *git_ignored())
INSTALL_RECIPE = tuple(re.search(r"^\$\(STAMP\):(.*)$", (ROOT / "Makefile").read_text(), re.M).group(1).split())
"""What the Makefile's install stamp depends on, read from its rule."""
LAB_URL = re.compile(r"(http://127\.0\.0\.1:\d+)(/lab\S*)\?token=(\w+)")
PRINTED: dict[str, str] = {}
"""What the last `started_lab` read: the printed URL's path, and the server's PATH (its terminals')."""


def copy_course(destination: Path) -> Path:
    """The course's files as a fresh clone has them (nothing git ignores: no venv, students' work or secret;
    no history) at `destination`, sharing the venv."""
    shutil.copytree(ROOT, destination, ignore=shutil.ignore_patterns(*LEFT_OUT), copy_function=shutil.copy2)
    (destination / ".venv").symlink_to(ROOT / ".venv")
    stamp = (ROOT / ".venv" / ".installed").stat().st_mtime
    for recipe in INSTALL_RECIPE:
        if (ROOT / recipe).stat().st_mtime > stamp:
            raise RuntimeError(f"{recipe} changed after the venv was installed: run `make .venv/.installed` first")
        os.utime(destination / recipe, (stamp - 1, stamp - 1))
    return destination


@contextmanager
def started_lab(folder: Path) -> Iterator[tuple[str, str]]:
    """(base URL, token) of `make lab` run in `folder`, read from what it prints; stopped afterwards.

    JupyterLab keeps its settings and its workspace (the tabs a user left open) in the user's home: the lab here
    keeps them beside `folder` instead, so that a test neither changes what the user's own lab opens nor starts
    with the tabs an earlier run left (they restored a second notebook, and its kernel, into every later run)."""
    user_state = folder.parent / f"{folder.name}-lab-user-state"
    environment = {
        **os.environ,
        "JUPYTERLAB_SETTINGS_DIR": str(user_state / "settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(user_state / "workspaces"),
    }
    server = subprocess.Popen(
        ["make", "lab"], cwd=folder, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )
    try:
        deadline, found = time.monotonic() + 120, None
        while found is None and time.monotonic() < deadline:
            line = server.stdout.readline()
            if not line and server.poll() is not None:
                break
            found = LAB_URL.search(line)
        assert found, "make lab printed no URL"
        PRINTED["path"] = found.group(2)
        servers = [p for p in psutil.Process(server.pid).children(recursive=True) if "jupyter" in " ".join(p.cmdline())]
        PRINTED["PATH"] = servers[-1].environ().get("PATH", "") if servers else ""  # the server, not its shell
        yield found.group(1), found.group(3)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)
