"""Run one child process of the grader: capped reads of what it writes, and its memory as the kernel counts it.

A grading child (`autograder.sandbox`) writes its observations to a pipe and its errors to stderr; the parent
reads at most `MAX_RESULTS_BYTES` and the last `MAX_STDERR_BYTES`, so no child can make it hold more. While
the child runs, a thread of the parent samples the resident memory of the child's whole process tree from
the kernel's `/proc` (`RssSampler`): a measure nothing in the child can rewrite, which the grader reads for a
crash message and for the memory the kernel saw during a graded run (`autograder.kernel_memory`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import BinaryIO

import psutil

MiB = 2**20

MAX_RESULTS_BYTES = 16 * MiB
"""What the parent reads of the child's observations at most; the rest is drained unread."""
MAX_STDERR_BYTES = 64 * 1024
"""The end of the child's stderr kept for a message; the rest is drained unread."""


@dataclass
class ChildRun:
    """What the parent saw of one child: its observations (capped), exit, stderr's end, peak memory."""

    results: bytes
    returncode: int | None
    timed_out: bool
    stderr_tail: str
    peak_rss_bytes: int
    """The largest resident memory of the child's whole process tree, read by this process from the
    kernel's `/proc` every `RSS_SAMPLE_S` (not `wait4`'s peak, which counts the grader's own memory at
    the fork)."""
    memory_samples: list[tuple[float, int]] = field(default_factory=list)
    """Every sample: (`time.perf_counter()`, bytes), in order."""

    def peak_since(self, moment_s: float) -> int:
        """The largest sample taken at or after `moment_s` (the parent's `perf_counter` clock), else 0."""
        return max((held for at, held in self.memory_samples if at >= moment_s), default=0)


def _drain(stream: BinaryIO, keep: int, tail: bool, into: list[bytes]) -> None:
    """Read `stream` to its end, keeping its first (or last) `keep` bytes in `into`."""
    kept = b""
    while chunk := stream.read(65536):
        kept = (kept + chunk)[-keep:] if tail else (kept + chunk[: max(0, keep - len(kept))])
    into.append(kept)


def run_child(
    command: list[str],
    env: dict[str, str] | None,
    time_s: float,
    results_pipe: tuple[int, int],
    passed: tuple[int, ...] = (),
) -> ChildRun:
    """Run the grading child for at most `time_s`, reading what it writes to `results_pipe` (its observations,
    one JSON line each: nothing goes through its disk) and its stderr with caps, and kill its whole process
    group at the limit. The child inherits the pipe's write end and the descriptors `passed` (the witness's
    link, the seccomp program); all of them, and the pipe, are closed here."""
    results_read, results_write = results_pipe
    inherited = (results_write, *passed)
    try:
        child = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
            cwd="/",
            start_new_session=True,
            pass_fds=inherited,
        )
    except BaseException:
        os.close(results_read)
        raise
    finally:
        for fd in inherited:
            os.close(fd)
    results: list[bytes] = []
    stderr: list[bytes] = []
    with os.fdopen(results_read, "rb") as results_stream:
        readers = [
            threading.Thread(target=_drain, args=(results_stream, MAX_RESULTS_BYTES, False, results), daemon=True),
            threading.Thread(target=_drain, args=(child.stderr, MAX_STDERR_BYTES, True, stderr), daemon=True),
        ]
        for reader in readers:
            reader.start()
        sampler = RssSampler(child.pid)
        sampler.start()
        returncode, timed_out = _wait(child, time_s)
        sampler.stop()
        for reader in readers:
            reader.join(timeout=10)
    return ChildRun(
        results=results[0] if results else b"",
        returncode=returncode,
        timed_out=timed_out,
        stderr_tail="\n".join((stderr[0] if stderr else b"").decode(errors="replace").strip().splitlines()[-8:]),
        peak_rss_bytes=sampler.peak_bytes,
        memory_samples=sampler.samples,
    )


RSS_SAMPLE_S = 0.02
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it, walked down each thread's `/proc/<pid>/task/<tid>/children` (the
    processes that thread started, as the kernel lists them): the cost follows the child's own tree. psutil's
    `children(recursive=True)` reads the parent of every process on the machine instead, which took a grading
    parent about 10% of a core at one sample per `RSS_SAMPLE_S` with 70 processes running, and more on a busy
    grading machine, beside the child it waits for. A list that cannot be read while its thread still exists
    (a kernel built without CONFIG_PROC_CHILDREN, a process this user may not inspect) is never skipped: the
    whole walk is then psutil's."""
    found, waiting = [], [pid]
    while waiting:
        process = waiting.pop()
        if process in found:  # listed twice: its parent thread ended between two reads, and it moved to another
            continue
        found.append(process)
        try:
            threads = os.listdir(f"/proc/{process}/task")
        except OSError:
            continue  # the process ended
        for thread in threads:
            try:
                with open(f"/proc/{process}/task/{thread}/children") as listed:
                    waiting += [int(child) for child in listed.read().split()]
            except OSError:
                if os.path.exists(f"/proc/{process}/task/{thread}"):
                    return _descendants_by_scan(pid)
    return found


def _descendants_by_scan(pid: int) -> list[int]:
    try:
        return [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:
        return [pid]


def resident_bytes(pid: int) -> int:
    """The process's resident memory, the kernel's count (`/proc/<pid>/statm`'s second field); 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):
        return 0


class RssSampler(threading.Thread):
    """The peak, over samples every `RSS_SAMPLE_S`, of the summed resident memory of a process and all its
    descendants: what the kernel says the child holds, which nothing in the child can rewrite."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak_bytes = 0
        self.samples: list[tuple[float, int]] = []
        self._done = threading.Event()

    def sample(self) -> None:
        if not os.path.exists(f"/proc/{self.pid}"):
            return
        held = sum(resident_bytes(process) for process in descendants(self.pid))
        self.peak_bytes = max(self.peak_bytes, held)
        self.samples.append((time.perf_counter(), held))

    def run(self) -> None:
        while not self._done.wait(RSS_SAMPLE_S):
            self.sample()

    def stop(self) -> None:
        self._done.set()
        self.join()


def _wait(child: subprocess.Popen, time_s: float) -> tuple[int, bool]:
    """(exit status as Popen gives it, whether the time limit killed it) of `child`."""
    try:
        return child.wait(timeout=time_s), False
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        return child.wait(), True
