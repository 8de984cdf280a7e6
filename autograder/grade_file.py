"""The grades file: a CSV of one signed row per student, written atomically, and the key that signs it.

Every row `grade` writes carries an HMAC-SHA256 signature over its cells with a key only the instructor's
grading holds: by default a file beside the CSV (`.<name>.key`, mode 0600, out of every submission's
reach), or one the instructor makes once with `python -m autograder new-key FILE` and hands to every
grading job (`grade --key FILE`), so that the rows of many jobs verify with one key and `merge` can join
them (`autograder.shards`). A row whose signature does not verify (edited, forged, from another key) is
never trusted: a rerun grades its student again, and `merge` refuses it.
"""

from __future__ import annotations

import csv
import hashlib
import hmac
import io
import json
import os
import secrets
import stat
import tempfile
from pathlib import Path

from autograder.submission import EXERCISES

SIGNATURE = "signature"
KEY_BYTES = 32


def write_csv_atomically(path: Path, fieldnames: list[str], rows: list[dict]) -> None:
    """The whole CSV, made in memory, then written as one file (`write_text_atomically`)."""
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=fieldnames)
    writer.writeheader()
    writer.writerows(rows)
    write_text_atomically(path, text.getvalue())


def read_rows(path: Path, fieldnames: list[str]) -> list[dict]:
    """The rows of an earlier run of the same assignments; none (every student is graded again, and the file
    rewritten) when the file has other columns: another set of assignments, or an older grader's."""
    if not path.exists():
        return []
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        if reader.fieldnames != fieldnames:
            graded = [name for name in reader.fieldnames or [] if name in EXERCISES]
            now = [name for name in fieldnames if name in EXERCISES]
            print(f"{path} graded {', '.join(graded) or 'other columns'}; now {', '.join(now)}: "
                  "every student is graded again")
            return []
        return list(reader)


def key_path(out: Path) -> Path:
    return out.parent / f".{out.name}.key"


def grading_key(out: Path) -> bytes:
    """The key that signs the rows of `out`, made (mode 0600) on the first run."""
    path = key_path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_bytes()
    key = secrets.token_bytes(32)
    with os.fdopen(fd, "wb") as handle:
        handle.write(key)
    return key


def sign(key: bytes, row: dict, fieldnames: list[str]) -> str:
    message = json.dumps([row.get(name, "") for name in fieldnames if name != SIGNATURE]).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def signed_rows(rows: list[dict], key: bytes, fieldnames: list[str]) -> tuple[list[dict], int]:
    """The rows whose signature this grader made, and how many others there were."""
    kept = [row for row in rows if hmac.compare_digest(row.get(SIGNATURE) or "", sign(key, row, fieldnames))]
    return kept, len(rows) - len(kept)


def write_text_atomically(path: Path, text: str) -> None:
    """Write `text` to a temporary file beside `path`, then rename it over `path`: a reader sees the old
    file or the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", newline="") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def new_key(path: Path) -> None:
    """Make a signing key at `path` (32 random bytes, mode 0600); an existing file is never overwritten."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ValueError(f"{path} exists: a key is made once, and every job of a course signs with that one") from None
    with os.fdopen(fd, "wb") as handle:
        handle.write(secrets.token_bytes(KEY_BYTES))


def read_key(path: Path) -> bytes:
    """The instructor's signing key at `path`: it must exist, and no one but its owner may read it."""
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
        key = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"no key at {path}; make one with `python -m autograder new-key {path}`") from None
    if mode & 0o077:
        raise ValueError(f"{path} may be read by other users (mode {mode:o}), who could sign rows: chmod 600 {path}")
    if len(key) < KEY_BYTES:
        raise ValueError(f"{path} holds {len(key)} bytes, not a key of {KEY_BYTES}; make one with new-key")
    return key
