"""The judges' references kept on disk, so that every grading process on this machine makes each one once.

A judge compares a student's runs with reference runs, the single-device oracle's trajectories and the
kernel's count of a reference child's memory (`recorded.outcome`, `kernel_memory.reference_figures`). They
depend only on the course's code, torch, the drawn hidden parameters and, for the kernel's figure, the
machine: never on a student. A grading process keeps them in memory (`harness.run_once`), but each new
process made them again: every `make grade`, every notebook nbgrader's `make autograde` hands the grader,
every worker of the test suite, about 48 core-seconds for the ten assignments plus a reference child of
3-4 s per stage exercise (`benchmarks/bench_grading.py`).

The store keeps them as data (the encodings `autograder.recorded` already writes for a student release: no
code, no pickle), one file per reference, in a folder named by a fingerprint of everything they depend on
(`fingerprint`) and by the secret: a changed course file or another torch starts an empty folder, and the
folders of older fingerprints are removed. It is the instructor's, like the secret it sits beside
(`location`): mode 0700, outside the walls (they bind the course's packages only; `location` refuses a folder
inside them) and on the audit hook's protected list where there are no walls (`sandbox.grade_notebook`): its
entries carry the hidden checks' drawn parameters. Every file is signed with the grading secret (HMAC-SHA256
over the fingerprint, the reference's name and its data): a file that does not verify (tampered with, or signed
under an earlier secret) is never read, only made again and replaced. Without a secret file (a student's copy
of the course) there is no store: everything is made in the process, as before.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import platform
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Hashable
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

from autograder.checks import grading_secret, secret_path
from autograder.walls import COURSE_PACKAGES

ROOT = Path(__file__).resolve().parents[1]
STORE_VARIABLE = "AUTOGRADER_REFERENCE_STORE"
"""An environment variable naming the store's folder (the test suite shares one between its workers)."""
STORE_NAME = ".grading-references"
"""The store's folder by default: beside the secret file (the course's root, where `.gitignore` names it)."""

T = TypeVar("T")


def location() -> Path:
    """The store's folder: `STORE_VARIABLE`'s, else `STORE_NAME` beside the secret file."""
    named = os.environ.get(STORE_VARIABLE)
    folder = Path(named) if named else secret_path().parent / STORE_NAME
    folder = folder.resolve()
    if any(folder.is_relative_to(ROOT / package) for package in COURSE_PACKAGES):
        raise ValueError(f"{STORE_VARIABLE} names {folder}, inside the course's code, which the grading child may "
                         f"read: name a folder outside {', '.join(COURSE_PACKAGES)}")
    return folder


@cache
def fingerprint() -> str:
    """SHA-256 of what a reference depends on: every file of the course's packages (the reference stages, the
    harness, the training data: path and bytes, compiled copies left out), and torch's, Python's and the
    machine's versions."""
    import torch

    digest = hashlib.sha256(f"{torch.__version__}|{sys.version}|{platform.machine()}".encode())
    for package in COURSE_PACKAGES:
        for path in sorted((ROOT / package).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(f"\0{path.relative_to(ROOT)}\0".encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


def _secret() -> bytes | None:
    """The grading secret, or None where there is no secret file (no store then)."""
    if not secret_path().is_file():
        return None
    return grading_secret()


def _folder(secret: bytes) -> Path | None:
    """The folder of this fingerprint and secret, made if need be (mode 0700; other fingerprints' folders
    removed, other secrets' kept: the tests grade under several); None where the store's folder is not this
    user's alone (another user's, or one others may enter)."""
    root = location()
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = root.stat()
    except OSError:
        return None
    if info.st_uid != os.geteuid() or stat.S_IMODE(info.st_mode) & 0o077:
        return None
    folder = root / f"{fingerprint()[:32]}-{_signature(secret, 'the store', '')[:8]}"
    if not folder.is_dir():
        for older in root.iterdir():
            if older.is_dir() and not older.name.startswith(fingerprint()[:32]):
                shutil.rmtree(older, ignore_errors=True)
        folder.mkdir(mode=0o700, exist_ok=True)
    return folder


def _signature(secret: bytes, name: str, payload: str) -> str:
    message = "\0".join((fingerprint(), name, payload)).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def _read(path: Path, secret: bytes, name: str) -> Any | None:
    """The data stored at `path` for `name`, if its signature verifies; None otherwise."""
    try:
        entry = json.loads(path.read_text())
        payload, signature = entry["payload"], entry["signature"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if entry.get("name") != name or not isinstance(payload, str) or not isinstance(signature, str):
        return None
    if not hmac.compare_digest(signature, _signature(secret, name, payload)):
        return None
    return json.loads(payload)


def _write(path: Path, secret: bytes, name: str, data: Any) -> None:
    """Store `data` for `name` at `path`, whole or not at all (written aside, then renamed)."""
    payload = json.dumps(data)
    entry = json.dumps({"name": name, "payload": payload, "signature": _signature(secret, name, payload)})
    try:
        handle, aside = tempfile.mkstemp(dir=path.parent, prefix=".writing-")
    except OSError:  # the folder is gone (another course version's grading removed it): not kept this time
        return
    try:
        with os.fdopen(handle, "w") as out:
            out.write(entry)
        os.replace(aside, path)
    except OSError:
        Path(aside).unlink(missing_ok=True)


def kept(kind: str, key: Hashable, make: Callable[[], T], encode: Callable[[T], Any], decode: Callable[[Any], T]) -> T:
    """The reference (`kind`, `key`): read from the store where a verified copy is there, else `make()` and
    stored (as `encode` writes it). What is returned is always the decoded data, made here or read, so every
    process judges with the same values. A failure of `make` propagates and stores nothing."""
    secret = _secret()
    folder = _folder(secret) if secret is not None else None
    if secret is None or folder is None:
        return make()
    name = f"{kind}:{key!r}"
    path = folder / f"{hashlib.sha256(name.encode()).hexdigest()}.json"
    data = _read(path, secret, name)
    if data is not None:
        return decode(data)
    data = encode(make())
    _write(path, secret, name, data)
    return decode(json.loads(json.dumps(data)))
