"""Turns on the CPU for the virtual cluster's rank threads: the simulator's speed, not ZeRO's.

The rank threads of one process share Python's interpreter lock. Thirty-two threads all runnable at once
would mostly trade that lock back and forth between tiny tensor operations, so a rank runs its own code
only while it holds one of `limit` turns (by default one more than there are cores: a rank with a turn
often waits a moment for the interpreter lock), and gives its turn up while it waits in a collective.

A rank that must wait (for a turn, or for the other ranks in a collective) parks on a lock of its own and
is woken by exactly the rank that hands it a turn; ranks that become runnable queue for turns first come,
first served. So no more than `limit` + 1 threads ever compete for the interpreter, however many ranks
wait, and a collective's completion wakes ranks one turn at a time rather than all at once. What each
rank computes, and the order of every reduction, is the same whatever the limit.

`zero_core.cluster.VirtualCluster` calls every method but `sleep` with its own lock held.
"""

from __future__ import annotations

import os
import threading
from collections import deque


def machine_cores() -> list[int]:
    """The cores this process may run on: its affinity where the OS has one (Linux), else all of them (macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


class CpuTurns:
    """Which of `world_size` ranks may run now: at most `limit`, the others parked or queued for a turn."""

    def __init__(self, world_size: int, limit: int) -> None:
        self.limit = limit
        """This run's limit: the cluster's `max_running` until a rank lowers it (`set_limit`)."""
        self.free = limit
        self.queue: deque[int] = deque()
        """The ranks waiting for a turn, longest first."""
        self.has_turn = [False] * world_size
        self.parked = [False] * world_size
        """The ranks asleep on their wakeup lock (for a turn, or in a collective)."""
        self._wakeups = [threading.Lock() for _ in range(world_size)]
        for wakeup in self._wakeups:
            wakeup.acquire()

    def park(self, rank: int) -> None:
        """Mark `rank` as asleep; it then waits in `sleep`, outside the cluster's lock."""
        self.parked[rank] = True

    def unpark(self, rank: int) -> None:
        """Wake `rank` if it is parked."""
        if self.parked[rank]:
            self.parked[rank] = False
            self._wakeups[rank].release()

    def grant(self, rank: int) -> bool:
        """Make a waiting rank runnable: give it a free turn and wake it (True), or queue it (False)."""
        if self.free > 0:
            self.free -= 1
            self.has_turn[rank] = True
            self.unpark(rank)
            return True
        self.queue.append(rank)
        return False

    def pass_on(self, rank: int) -> int | None:
        """Give up `rank`'s turn to the rank that has waited longest for one; which rank got it, if any."""
        if not self.has_turn[rank]:
            return None
        self.has_turn[rank] = False
        self.free += 1
        if self.queue and self.free > 0:
            waiter = self.queue.popleft()
            self.grant(waiter)
            return waiter
        return None

    def set_limit(self, limit: int) -> list[int]:
        """At most `limit` ranks from now on; the queued ranks a raised limit lets run at once."""
        self.free += limit - self.limit
        self.limit = limit
        granted = []
        while self.queue and self.free > 0:
            granted.append(self.queue.popleft())
            self.grant(granted[-1])
        return granted

    def sleep(self, rank: int, timeout_s: float) -> bool:
        """Sleep until woken (True) or `timeout_s` passes (False); called without the cluster's lock."""
        return self._wakeups[rank].acquire(timeout=timeout_s)

    def stop_waiting(self, rank: int) -> None:
        """`rank` gives up waiting (its wait timed out): neither parked nor queued any more."""
        self.parked[rank] = False
        if rank in self.queue:
            self.queue.remove(rank)

    def take_late_wakeup(self, rank: int) -> None:
        """`rank` was woken just as its wait timed out: take the wakeup, so that its next sleep sleeps."""
        self._wakeups[rank].acquire()
