"""Grade a class's notebooks `jobs` at a time: `python -m autograder grade --jobs J` (`autograder.cli`).

`Batch` hands the class's notebooks, student by student and each student's in the assignments' order, to `J`
threads of the grading parent. Each thread grades one notebook at a time exactly as a sequential batch does
(`cli.grade_assignment`): in its own walled child with the same time and memory limits, its observations judged
in the parent (`autograder.sandbox`, whose judges take turns). No student's code runs in these threads: they
start children, wait for them and judge what came back. A student is finished when their last notebook is; the
parent's main thread takes each student as they finish (`Batch.finished`) and writes the feedback and the CSV
itself, rows in the students' order whatever order they finish in, so `--jobs` changes the wall time only.

The unit is a notebook, not a student, so that the cores stay busy to the end of a batch: with a student a
unit, a term's batch could end with one thread grading the last student's ten notebooks alone.
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
    """A student graded: their folder's name, their results, and how long grading their notebooks took (the
    sum of each notebook's wall seconds)."""

    student: str
    graded: Graded
    seconds: float


class Batch:
    """`grade(student, assignment)` for every assignment of every student, `jobs` notebooks at a time, each on a
    thread of this process; `finished` yields each student once all of their notebooks are graded.

    The threads are daemons: a batch stopped early (Ctrl-C, an error of the grader's own) ends without waiting
    for the notebooks still running, as a sequential batch does; what was written before stays written.
    """

    def __init__(
        self, students: list[Path], assignments: list[str], jobs: int, grade: Callable[[Path, str], list[CheckResult]]
    ) -> None:
        self._grade = grade
        self._count = len(students)
        self._assignments = list(assignments)
        self._todo: queue.SimpleQueue[tuple[Path, str]] = queue.SimpleQueue()
        for student in students:
            for assignment in assignments:
                self._todo.put((student, assignment))
        self._done: queue.SimpleQueue[Finished | BaseException] = queue.SimpleQueue()
        self._graded: dict[str, Graded] = {student.name: {} for student in students}
        self._seconds: dict[str, float] = dict.fromkeys(self._graded, 0.0)
        self._running: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()
        for index in range(min(jobs, len(students) * len(assignments))):
            threading.Thread(target=self._work, name=f"grade-{index}", daemon=True).start()

    def _work(self) -> None:
        while True:
            try:
                student, assignment = self._todo.get_nowait()
            except queue.Empty:
                return
            started = time.perf_counter()
            with self._lock:
                self._running[student.name, assignment] = started
            try:
                results = self._grade(student, assignment)
            except BaseException as error:  # a fault of the grader's, not of a notebook: the main thread raises it
                self._done.put(error)
                return
            with self._lock:
                del self._running[student.name, assignment]
                graded = self._graded[student.name]
                graded[assignment] = results
                self._seconds[student.name] += time.perf_counter() - started
                if len(graded) == len(self._assignments):
                    in_order = {a: graded[a] for a in self._assignments}
                    self._done.put(Finished(student.name, in_order, self._seconds[student.name]))

    def finished(self) -> Iterator[Finished]:
        """Each student as they finish, in the order they finish; an error of the grader's raises here."""
        for _ in range(self._count):
            done = self._done.get()
            if isinstance(done, BaseException):
                raise done
            yield done

    def slowest_running(self) -> tuple[str, float] | None:
        """(student, seconds so far) of the notebook being graded for longest, or None when none is."""
        with self._lock:
            if not self._running:
                return None
            student, assignment = min(self._running, key=self._running.__getitem__)
            return student, time.perf_counter() - self._running[student, assignment]


def progress_line(finished: int, total: int, slowest: tuple[str, float] | None) -> str:
    """`graded 3/40 students (slowest still running: bob, 41 s)`: after each student, on stderr."""
    line = f"graded {finished}/{total} students"
    if slowest is not None:
        line += f" (slowest still running: {slowest[0]}, {slowest[1]:.0f} s)"
    return line
