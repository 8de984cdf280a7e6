"""Grade a class too large for one machine: one job per shard of the students, then one merge.

`grade --shard K/M --key FILE` grades the K-th of M shards of a class (students K-1, K-1+M, K-1+2M, ... of
the folders in name order, so that the shards are as even as the class allows) and signs its rows with the
instructor's key (`autograder.grade_file`), which the instructor makes once (`new-key`) and hands to the
grading jobs and nothing else. Each job writes its own CSV and feedback folder, as `grade` always does.
`merge` then joins the shards' CSVs into the class's, with every row's signature checked against that key:
a row that does not verify (edited, forged, signed with another key) is refused and named, and so is a
student two shards both graded. The merged file's rows keep their signatures, so it is itself a grades
file a later `grade --key FILE` resumes. docs/grading.md shows a Slurm job array that does this.
"""

from __future__ import annotations

import csv
import hmac
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from autograder.grade_file import SIGNATURE, sign, write_csv_atomically

T = TypeVar("T")
GRADES = "grades.csv"
FEEDBACK = "feedback"
"""What a shard's folder holds: `grade --out SHARD/grades.csv --feedback SHARD/feedback` writes them."""


def parse_shard(text: str) -> tuple[int, int]:
    """`--shard K/M`: the K-th of M shards, 1 <= K <= M."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if match is None or not 1 <= int(match.group(1)) <= int(match.group(2)):
        raise ValueError(f"--shard takes K/M with 1 <= K <= M, like 2/8 (the second of eight); got {text!r}")
    return int(match.group(1)), int(match.group(2))


def shard_of(students: list[T], shard: tuple[int, int]) -> list[T]:
    """The students of shard K of M: every M-th of them, from the K-th on (the list in name order)."""
    k, m = shard
    return students[k - 1 :: m]


@dataclass
class Merged:
    """What `merge` made of the shards: the rows it kept, and why it refused the others."""

    fieldnames: list[str]
    rows: list[dict] = field(default_factory=list)
    sources: dict[str, Path] = field(default_factory=dict)
    """The shard each kept row came from: where its student's feedback is taken from."""
    unsigned: list[tuple[Path, str]] = field(default_factory=list)
    """(shard, student) of each row whose signature does not verify."""
    twice: dict[str, list[Path]] = field(default_factory=dict)
    """Students more than one shard graded, and those shards: refused, every row of them."""

    @property
    def refused(self) -> set[str]:
        """Every student with a row refused (and none kept, unless another shard's row of them verified)."""
        return {student for _, student in self.unsigned} | set(self.twice)


def read_shard(folder: Path) -> tuple[list[str], list[dict]]:
    """(columns, rows) of a shard's grades file."""
    path = folder / GRADES
    if not path.is_file():
        raise ValueError(f"no {GRADES} in {folder}: a shard's folder holds what `grade --out {path}` wrote")
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        return list(reader.fieldnames or []), list(reader)


def merge_rows(shards: list[Path], key: bytes) -> Merged:
    """Every shard's rows checked against `key`; one set of columns across the shards, or a ValueError."""
    merged: Merged | None = None
    by_student: dict[str, list[tuple[Path, dict]]] = {}
    for folder in shards:
        fieldnames, rows = read_shard(folder)
        if merged is None:
            merged = Merged(fieldnames)
        elif fieldnames != merged.fieldnames:
            raise ValueError(
                f"{folder / GRADES} has the columns {fieldnames}, {shards[0] / GRADES} {merged.fieldnames}: every "
                "shard must grade the same assignments (one --assignments for every job)"
            )
        for row in rows:
            if hmac.compare_digest(row.get(SIGNATURE) or "", sign(key, row, fieldnames)):
                by_student.setdefault(row["student"], []).append((folder, row))
            else:
                merged.unsigned.append((folder, row.get("student", "?")))
    if merged is None:
        raise ValueError("merge needs at least one shard's folder")
    for student, graded in sorted(by_student.items()):
        if len(graded) == 1:
            merged.sources[student] = graded[0][0]
            merged.rows.append(graded[0][1])
        else:
            merged.twice[student] = [folder for folder, _ in graded]
    return merged


def merge(shards: list[Path], key: bytes, out: Path, feedback: Path) -> Merged:
    """Write the class's CSV (`out`) from the shards' verified rows, and copy those students' feedback files
    into `feedback`, removing the feedback there of any student refused (an earlier merge's); returns what
    was kept and refused."""
    merged = merge_rows(shards, key)
    feedback.mkdir(parents=True, exist_ok=True)
    for student in merged.refused - set(merged.sources):
        (feedback / f"{student}.txt").unlink(missing_ok=True)
    for student, folder in merged.sources.items():
        text = folder / FEEDBACK / f"{student}.txt"
        if text.is_file():
            shutil.copyfile(text, feedback / text.name)
    write_csv_atomically(out, merged.fieldnames, merged.rows)
    return merged
