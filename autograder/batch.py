"""Grade a class's students `jobs` at a time: `python -m autograder grade --jobs J` (`autograder.cli`).

`Batch` hands the students to `J` threads of the grading parent. Each thread grades one student at a time
exactly as a sequential batch does (`cli.grade_student`): every notebook in its own walled child with the same
time and memory limits, its observations judged in the parent (`autograder.sandbox`, whose judges take
turns). No student's code runs in these threads: they start children, wait for them and judge what came back.
The parent's main thread takes each student as they finish (`Batch.finished`) and writes the feedback and the
CSV itself, rows in the students' order whatever order they finish in, so `--jobs` changes the wall time only.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from autograder.checks import CheckResult

Graded = dict[str, list[CheckResult]]
"""One student's results: {assignment: every check's result}."""


@dataclass(frozen=True)
class Finished:
    """A student graded: their folder's name, their results, and how long grading them took (wall seconds)."""

    student: str
    graded: Graded
    seconds: float


class Batch:
    """`grade(student)` for every student, `jobs` at a time, each on a thread of this process.

    The threads are daemons: a batch stopped early (Ctrl-C, an error of the grader's own) ends without waiting
    for the notebooks still running, as a sequential batch does; what was written before stays written.
    """

    def __init__(self, students: list[Path], jobs: int, grade: Callable[[Path], Graded]) -> None:
        self._grade = grade
        self._count = len(students)
        self._todo: queue.SimpleQueue[Path] = queue.SimpleQueue()
        for student in students:
            self._todo.put(student)
        self._done: queue.SimpleQueue[Finished | BaseException] = queue.SimpleQueue()
        self._running: dict[str, float] = {}
        self._lock = threading.Lock()
        for index in range(min(jobs, len(students))):
            threading.Thread(target=self._work, name=f"grade-{index}", daemon=True).start()

    def _work(self) -> None:
        while True:
            try:
                student = self._todo.get_nowait()
            except queue.Empty:
                return
            started = time.perf_counter()
            with self._lock:
                self._running[student.name] = started
            try:
                graded = self._grade(student)
            except BaseException as error:  # a fault of the grader's, not of a notebook: the main thread raises it
                self._done.put(error)
                return
            with self._lock:
                del self._running[student.name]
            self._done.put(Finished(student.name, graded, time.perf_counter() - started))

    def finished(self) -> Iterator[Finished]:
        """Each student as they finish, in the order they finish; an error of the grader's raises here."""
        for _ in range(self._count):
            done = self._done.get()
            if isinstance(done, BaseException):
                raise done
            yield done

    def slowest_running(self) -> tuple[str, float] | None:
        """(student, seconds so far) of the student being graded for longest, or None when none is."""
        with self._lock:
            if not self._running:
                return None
            student = min(self._running, key=self._running.__getitem__)
            return student, time.perf_counter() - self._running[student]


def progress_line(finished: int, total: int, slowest: tuple[str, float] | None) -> str:
    """`graded 3/40 students (slowest still running: bob, 41 s)`: after each student, on stderr."""
    line = f"graded {finished}/{total} students"
    if slowest is not None:
        line += f" (slowest still running: {slowest[0]}, {slowest[1]:.0f} s)"
    return line
