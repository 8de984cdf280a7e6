"""A virtual GPU cluster: N ranks as N threads running the same function (SPMD), as torchrun would.

Each rank has its own tensors, its own `torch.Generator` (threads share torch's global RNG, so seeding
it per rank would race), its own memory tracker and its own ledger of collectives. Collectives meet in
a rendezvous: the last rank to arrive combines everyone's input once, in rank order, and every rank
takes its part of the result.

The cluster never hangs on a mistake:
- a rank that raises releases every other rank at once, and `run` raises `RankFailed` naming the rank,
  chained to the original traceback;
- ranks that call different collectives at the same point raise `CollectiveMismatch` at once;
- a rank that returns while others wait for it in a collective raises `CollectiveDeadlock` at once;
- a collective that does not complete within `timeout_s` raises `CollectiveTimeout`, which says what
  every rank was doing;
- each of these is detected per process group: a collective with `group=` (`dist.new_group`) meets only
  the group's ranks, numbered in their own sequence, and the errors name the group;
- each of these messages names the line of code every waiting rank called its collective from (and, for a
  timeout, where a rank that never arrived is running), read off the ranks' stacks only when a failure is
  diagnosed (`zero_core.call_sites`);
- after any failure, ranks still running are stopped (a Python-level loop is interrupted), and the
  cluster is ready for the next `run`.

Ranks take turns on the CPU: at most `max_running` of them run their own code at a time, and a rank
gives up its turn while it waits in a collective (`zero_core.cpu_turns`, the simulator's speed, not
ZeRO's). What each rank computes, and the order of every reduction, is the same either way.
"""

from __future__ import annotations

import ctypes
import gc
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from zero_core import call_sites
from zero_core.backends.base import Backend, CollectiveCall
from zero_core.backends.virtual import VirtualBackend
from zero_core.comm import CommLedger
from zero_core.context import RankContext, activate
from zero_core.cpu_turns import CpuTurns, machine_cores
from zero_core.memory import MemoryTracker

MAX_WORLD_SIZE = 4096
_STOP_GRACE_S = 1.0
_INTERRUPT_S = 2.0
RUN_WALL_FACTOR = 4
"""A run's deadline (`VirtualCluster.run(deadline_s=)`) counts the CPU time the process spends, so that a loaded
machine, which slows the run without making it work more, does not end a correct run (a correct notebook's
4-rank run in a grading child passed its 30 s deadline in a test run with two workers and their grading
children on two cores). Ranks that only wait (a sleep, a lock) are stopped at this many times the deadline
in wall-clock time."""
_INTERRUPT_RANK = ctypes.pythonapi.PyThreadState_SetAsyncExc
"""CPython's call that raises an exception in another thread, looked up once, when the cluster is imported: a
grading child imports it before its audit hook (`autograder.child_guard`) refuses looking native code up, so
stopping a rank that loops stays possible there and the rank's own error is the one reported."""


class ClusterError(RuntimeError):
    """A run on the virtual cluster failed; the message says which rank and why."""


class RankFailed(ClusterError):
    """A rank's own code raised. `rank` names it; the original exception is the `__cause__`."""

    def __init__(self, rank: int, error: BaseException) -> None:
        super().__init__(f"rank {rank} raised {type(error).__name__}: {error}")
        self.rank = rank
        self.error = error


class CollectiveMismatch(ClusterError):
    """Two ranks called different collectives at the same position in their sequences."""


class CollectiveDeadlock(ClusterError):
    """A rank finished while other ranks were still waiting for it in a collective."""


class CollectiveTimeout(ClusterError):
    """A collective did not complete in time; the message describes every rank."""


class RunTimeout(ClusterError):
    """The whole run exceeded its deadline."""


class RankAborted(BaseException):
    """Raised inside a rank to unwind it after another rank failed (not an error of this rank)."""


def _combine_outside_dispatch_modes(combine: Callable[[list[Any]], Any], payloads: list[Any]) -> Any:
    """Run the interconnect's arithmetic outside the rank's dispatch modes (a FLOP counter counts the
    rank's own work, not the network's). Leaving the modes costs microseconds, so only when one is on."""
    if not torch._C._len_torch_dispatch_stack():
        return combine(payloads)
    with _disable_current_modes():
        return combine(payloads)


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run torch's ops on one thread each while the block runs (the rank threads are the parallelism).

    Two reasons: N rank threads each starting an intra-op pool oversubscribe the cores, and some kernels
    (LayerNorm's reductions among them) split their sums by the thread count, so the same run rounds
    differently on machines with different cores. Every run whose bits are compared, the grading child's
    (`OMP_NUM_THREADS=1`) and the references it is compared with, runs inside this.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextmanager
def _older_objects_frozen() -> Iterator[None]:
    """Keep the garbage collector's full collections to what the run itself allocates.

    The process holds some 285,000 objects before a run starts (most of them torch's), and a full
    collection traverses them all: ~150 ms during which no rank runs, at a moment that depends on how
    many objects the ranks happened to allocate. Freezing them for the run (`gc.freeze`) leaves
    collection on for everything the ranks create; afterwards they are collectable again.
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class _Rendezvous:
    """The meeting point of one collective: who arrived with what, and the combined result.

    `members` are the global ranks that take part, in group order; `calls` and `payloads` follow that order.
    """

    def __init__(self, members: range | tuple[int, ...]) -> None:
        self.members = members
        self.calls: list[CollectiveCall | None] = [None] * len(members)
        self.payloads: list[Any] = [None] * len(members)
        self.arrived = 0
        self.first_rank = -1
        self.signature: tuple = ()
        self.done = False
        self.done_at = 0.0
        self.result: Any = None
        self.waiters: list[int] = []
        """The ranks asleep until it completes (a rank that arrived without waiting is not among them)."""


class VirtualCluster:
    """N virtual GPUs in one process. `run(fn, *args)` runs `fn` on every rank and returns the results.

    Ranks meet in collectives through `arrive`, `exchange` and `result`: the last rank to arrive combines
    every rank's input once. A rank runs its own code only while it holds one of `max_running` turns on
    the CPU (`zero_core.cpu_turns`), and gives its turn up while it waits in a collective.
    """

    def __init__(
        self,
        world_size: int,
        timeout_s: float = 30.0,
        *,
        seed: int = 0,
        record_timeline: bool = True,
        max_running: int | None = None,
        backend: Callable[[VirtualCluster, int], Backend] = VirtualBackend,
    ) -> None:
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        if world_size > MAX_WORLD_SIZE:
            raise ValueError(
                f"world_size {world_size} is more threads than this simulator supports (max {MAX_WORLD_SIZE})"
            )
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if max_running is not None and max_running < 1:
            raise ValueError(f"max_running must be at least 1, got {max_running}")
        self.world_size = world_size
        self.max_running = max_running or len(machine_cores()) + 1
        self.timeout_s = timeout_s
        self.seed = seed
        self.record_timeline = record_timeline
        self.backend = backend
        """Makes each rank's backend: the rendezvous itself, or a graded run's witnessed one
        (`zero_core.backends.witnessed`)."""
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        n = self.world_size
        self.ledger = CommLedger(n)
        self.trackers = [MemoryTracker(r, record_timeline=self.record_timeline) for r in range(n)]
        self._pending: dict[tuple[tuple[int, ...], int], _Rendezvous] = {}
        self._next_seq: list[dict[tuple[int, ...], int]] = [{} for _ in range(n)]
        """Per rank, per group (`()`: every rank), the position of its next collective in that group."""
        self._calls_made = [0] * n
        self._waiting: list[CollectiveCall | None] = [None] * n
        self._finished = [False] * n
        self._finished_count = 0
        self._status = ["starting"] * n
        self._idents = [0] * n
        """Each rank's thread, by `threading.get_ident`: where a failure's message finds its call site."""
        self._results: list[Any] = [None] * n
        self._failure: tuple[int, BaseException] | None = None
        self._running = n
        self._all_done = threading.Event()
        self._turns = CpuTurns(n, self.max_running)
        """Each run starts afresh with `max_running` turns (`limit_running` lowers them for the run)."""

    def run(self, fn: Callable[..., Any], *args: Any, deadline_s: float | None = None, **kwargs: Any) -> list[Any]:
        """Run `fn(*args, **kwargs)` once on every rank, each in its own thread; results in rank order.

        `deadline_s` bounds the whole run in CPU time (for code that might loop forever without communicating;
        `RUN_WALL_FACTOR`); collectives are bounded by the cluster's `timeout_s` in any case.
        """
        self._reset()
        with _older_objects_frozen():
            return self._run_ranks(fn, args, kwargs, deadline_s)

    def _run_ranks(self, fn: Callable[..., Any], args: tuple, kwargs: dict, deadline_s: float | None) -> list[Any]:
        threads = [
            threading.Thread(target=self._rank_main, args=(r, fn, args, kwargs), name=f"rank-{r}", daemon=True)
            for r in range(self.world_size)
        ]
        for thread in threads:
            thread.start()
        try:
            if not self._done_before(deadline_s):
                wall_s = RUN_WALL_FACTOR * deadline_s
                with self._lock:
                    self._fail(-1, RunTimeout(
                        f"the run exceeded its deadline of {deadline_s} s of CPU time ({wall_s:g} s of wall-clock time "
                        f"for ranks that only wait).\n{self.describe_ranks()}"
                    ))
        except BaseException as interrupt:
            with self._lock:
                self._fail(-1, interrupt)
        if self._failure is not None:
            self._stop(threads)
            rank, error = self._failure
            if isinstance(error, ClusterError):
                raise error
            if rank < 0:
                raise error
            raise RankFailed(rank, error) from error
        for thread in threads:
            thread.join()
        return list(self._results)

    def _done_before(self, deadline_s: float | None) -> bool:
        """Wait for every rank to finish, up to `deadline_s` of this process's CPU time (all its threads), or
        `RUN_WALL_FACTOR` times that of wall-clock time; whether they finished."""
        if deadline_s is None:
            return self._all_done.wait()
        cpu_end = time.process_time() + deadline_s
        wall_end = time.monotonic() + RUN_WALL_FACTOR * deadline_s
        while True:  # `left` wall-clock seconds may hold more CPU seconds (several busy threads): look again
            left = min(cpu_end - time.process_time(), wall_end - time.monotonic())
            if left <= 0:
                return False
            if self._all_done.wait(left):
                return True

    def _rank_main(self, rank: int, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        ctx = RankContext(
            rank=rank,
            world_size=self.world_size,
            generator=torch.Generator().manual_seed(self.seed * 1_000_003 + rank),
            backend=self.backend(self, rank),
            ledger=self.ledger.ranks[rank],
            tracker=self.trackers[rank],
        )
        self._idents[rank] = threading.get_ident()
        try:
            self._take_turn(rank)
            with activate(ctx):
                self._results[rank] = fn(*args, **kwargs)
            self._status[rank] = "finished"
        except RankAborted:
            self._status[rank] = "stopped because another rank failed"
        except BaseException as error:
            with self._lock:
                self._status[rank] = f"raised {type(error).__name__}"
                self._fail(rank, error)
        finally:
            with self._lock:
                self._pass_turn(rank)
                self._finished[rank] = True
                self._finished_count += 1
                self._waiting[rank] = None
                self._running -= 1
                if self._failure is None:
                    self._fail_if_deadlocked_by(rank)
                if self._running == 0:
                    self._all_done.set()

    def _fail(self, rank: int, error: BaseException) -> None:
        """Record the first failure and wake every parked rank, which then unwinds (caller holds the lock)."""
        if self._failure is None:
            self._failure = (rank, error)
        for parked_rank, parked in enumerate(self._turns.parked):
            if parked:
                self._turns.unpark(parked_rank)
        self._all_done.set()

    def _stop(self, threads: list[threading.Thread]) -> None:
        """Let released ranks unwind; interrupt ranks busy in their own code; leave none running.

        Each rank is interrupted once: a second `RankAborted` could land in its `finally` blocks (cutting
        the rank's cleanup short) or inside the cluster's own bookkeeping.
        """
        deadline = time.monotonic() + _STOP_GRACE_S
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t for t in threads if t.is_alive()]
        for thread in alive:
            _INTERRUPT_RANK(ctypes.c_ulong(thread.ident), ctypes.py_object(RankAborted))
        deadline = time.monotonic() + _INTERRUPT_S
        for thread in alive:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t for t in alive if t.is_alive()]
        if alive:
            names = ", ".join(t.name for t in alive)
            raise ClusterError(
                f"{names} could not be stopped (stuck inside native code) after: {self._failure[1]}; "
                "restart the Python process"
            ) from self._failure[1]

    def describe_ranks(self) -> str:
        """One line per rank: the collective it waits in and the line that called it, or what it is doing and
        where (caller holds the lock)."""
        lines = []
        for rank in range(self.world_size):
            call = self._waiting[rank]
            done = self._calls_made[rank]
            if call is not None:
                lines.append(f"  rank {rank}: waiting in {call.describe()}, called at {self._site(rank)}")
            elif rank in self._turns.queue:
                lines.append(f"  rank {rank}: waiting for a turn on the CPU after {done} collective(s)")
            elif self._finished[rank]:
                lines.append(f"  rank {rank}: {self._status[rank]} after {done} collective(s)")
            else:
                lines.append(
                    f"  rank {rank}: {self._status[rank]} its own code after {done} collective(s), now at "
                    f"{self._site(rank)}"
                )
        return "\n".join(lines)

    def _site(self, rank: int) -> str:
        """Where `rank`'s thread is, outside the collectives' code: the call site of the collective it waits
        in, or the line it is running. Read from its stack now (`zero_core.call_sites`), only on a failure."""
        if self._idents[rank] == threading.get_ident():
            return call_sites.describe(sys._getframe(1)) or "?"
        return call_sites.of_thread(self._idents[rank]) or "?"

    def _sites(self, ranks: list[int]) -> str:
        """The call sites of `ranks`' collective, one line per site, the ranks at each together (caller holds
        the lock). A rank that arrived with `async_op=True` and ran on has left its call site behind."""
        by_site: dict[str, list[int]] = {}
        for rank in ranks:
            waiting = self._waiting[rank] is not None or self._idents[rank] == threading.get_ident()
            site = self._site(rank) if waiting else "? (it arrived with async_op=True and ran on)"
            by_site.setdefault(site, []).append(rank)
        return "\n".join(f"  {_ranks_text(at)} called it at {site}" for site, at in by_site.items())

    # -- collectives -------------------------------------------------------------------------------

    def arrive(self, rank: int, call: CollectiveCall, payload: Any, combine: Callable[[list[Any]], Any]) -> _Rendezvous:
        """Hand `payload` to the collective `call`; the last rank to arrive runs `combine` once.

        The collective meets the ranks of `call.group` (every rank when it is empty). `combine` gets the
        payloads in rank order (group order in a group), and its return value is the collective's result,
        which `result` hands out. Arriving never waits: an `async_op=True` collective calls `result` when
        its `Work` is waited on (a blocking one calls `exchange` instead). Until then the rank runs its own
        code, and must leave its payload as it is.
        """
        with self._lock:
            return self._meet(rank, call, payload, combine)

    def exchange(self, rank: int, call: CollectiveCall, payload: Any, combine: Callable[[list[Any]], Any]) -> Any:
        """A blocking collective: `arrive`, then `result`, in one turn of the cluster's lock.

        Every rank but the last to arrive sleeps until the collective completes; taking the lock once
        rather than twice for it matters, since every rank of the cluster pays it in every collective.
        """
        with self._lock:
            meeting = self._meet(rank, call, payload, combine)
            if meeting.done:
                return meeting.result
            self._wait_in(rank, meeting, call)
        self._wait_for_turn(rank, meeting)
        return meeting.result

    def _meet(self, rank: int, call: CollectiveCall, payload: Any, combine: Callable[[list[Any]], Any]) -> _Rendezvous:
        """`arrive`'s work (caller holds the lock)."""
        self._raise_if_failed()
        group = call.group
        seqs = self._next_seq[rank]
        seq = seqs.get(group, 0)
        seqs[group] = seq + 1
        self._calls_made[rank] += 1
        call.seq = seq
        meeting = self._pending.get((group, seq))
        if meeting is None:
            meeting = self._pending[group, seq] = _Rendezvous(group or range(self.world_size))
        if meeting.first_rank >= 0:
            if meeting.signature != call.signature():
                first = meeting.calls[meeting.members.index(meeting.first_rank)]
                where = f" in group {list(group)}" if group else ""
                raise CollectiveMismatch(
                    f"collective mismatch at position #{seq}{where}: rank {rank} called {call.describe()}, "
                    f"but rank {meeting.first_rank} called {first.describe()}. Every rank must call the "
                    "same collectives, in the same order, with the same shapes and dtypes.\n"
                    f"  rank {rank} called it at {self._site(rank)}\n{self._sites([meeting.first_rank])}"
                )
        else:
            meeting.first_rank = rank
            meeting.signature = call.signature()
        index = group.index(rank) if group else rank
        meeting.calls[index] = call
        meeting.payloads[index] = payload
        meeting.arrived += 1
        self._raise_if_deadlocked(meeting, call)
        if meeting.arrived == len(meeting.members):
            meeting.result = _combine_outside_dispatch_modes(combine, meeting.payloads)
            meeting.payloads = []
            meeting.done = True
            meeting.done_at = time.monotonic()
            del self._pending[group, seq]
            for waiter in meeting.waiters:
                self._waiting[waiter] = None
                self._grant_turn(waiter)
            meeting.waiters = []
        return meeting

    def result(self, rank: int, meeting: _Rendezvous) -> Any:
        """`meeting`'s result, once every rank has arrived. Every rank gets the same object: read-only.

        A rank whose collective is not complete yet gives up its turn on the CPU while it waits, and
        gets one back before it goes on.
        """
        if meeting.done:  # set under the lock after `result`: a complete meeting needs no lock to read
            self._raise_if_failed()
            return meeting.result
        with self._lock:
            self._raise_if_failed()
            if meeting.done:
                return meeting.result
            self._wait_in(rank, meeting, meeting.calls[meeting.members.index(rank)])
        self._wait_for_turn(rank, meeting)
        return meeting.result

    def _wait_in(self, rank: int, meeting: _Rendezvous, call: CollectiveCall) -> None:
        """Put `rank` to sleep until `meeting` completes, giving up its turn (caller holds the lock, then
        waits in `_wait_for_turn`)."""
        meeting.waiters.append(rank)
        self._waiting[rank] = call
        self._turns.park(rank)
        self._pass_turn(rank)

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise RankAborted()

    def _fail_if_deadlocked_by(self, rank: int) -> None:
        """`rank` just finished: any collective that other ranks wait in without it can never complete."""
        for meeting in self._pending.values():
            if rank in meeting.members and meeting.calls[meeting.members.index(rank)] is None and meeting.arrived:
                call = meeting.calls[meeting.members.index(meeting.first_rank)]
                self._fail(-1, self._deadlock(rank, meeting, call))
                return

    def _raise_if_deadlocked(self, meeting: _Rendezvous, call: CollectiveCall) -> None:
        if not self._finished_count:
            return
        missing = [r for i, r in enumerate(meeting.members) if self._finished[r] and meeting.calls[i] is None]
        if missing:
            raise self._deadlock(missing[0], meeting, call)

    def _deadlock(self, missing: int, meeting: _Rendezvous, call: CollectiveCall) -> CollectiveDeadlock:
        waiting = [r for i, r in enumerate(meeting.members) if meeting.calls[i] is not None]
        return CollectiveDeadlock(
            f"rank {missing} returned without calling {call.describe()}, which rank(s) {waiting} are "
            "waiting in. Every rank must call the same collectives; look for a collective inside an "
            "`if rank == ...` branch, a return or break that only some ranks take, or a loop whose length "
            f"depends on the rank.\n{self._sites(waiting)}"
        )


    # -- turns on the CPU --------------------------------------------------------------------------

    def _grant_turn(self, rank: int) -> None:
        """Make a waiting rank runnable now or when a turn frees up (caller holds the lock)."""
        if self._turns.grant(rank):
            self._status[rank] = "running"

    def _pass_turn(self, rank: int) -> None:
        """Give up `rank`'s turn to the rank that has waited longest for one (caller holds the lock)."""
        waiter = self._turns.pass_on(rank)
        if waiter is not None:
            self._status[waiter] = "running"

    def limit_running(self, max_running: int) -> None:
        """From now until this run ends, at most `max_running` ranks run their own code at once; any rank
        may call it, and again with the same limit changes nothing. Ranks holding a turn keep it until they
        next wait, so the limit holds from each one's next collective on (the turns taken away are simply not
        handed on). Raising it wakes queued ranks at once."""
        if max_running < 1:
            raise ValueError(f"max_running must be at least 1, got {max_running}")
        with self._lock:
            for waiter in self._turns.set_limit(max_running):
                self._status[waiter] = "running"

    def _take_turn(self, rank: int) -> None:
        """Wait for a first turn on the CPU, bounded by the timeout like a collective."""
        with self._lock:
            self._raise_if_failed()
            self._turns.park(rank)
            self._grant_turn(rank)
        self._wait_for_turn(rank, None)

    def _wait_for_turn(self, rank: int, meeting: _Rendezvous | None) -> None:
        """Sleep until the rank holds a turn again (and `meeting`, if any, is done).

        A wait that times out says why: the collective never completed, or it did but the ranks holding
        the turns never reached a collective to hand one over. Decided under the cluster's lock, so a
        wakeup that lands just as the wait times out is not lost.
        """
        deadline = time.monotonic() + self.timeout_s
        while not self._turns.sleep(rank, max(0.0, deadline - time.monotonic())):
            with self._lock:
                if not self._turns.parked[rank]:  # woken just as the wait timed out
                    self._turns.take_late_wakeup(rank)
                    break
                if meeting is not None and not meeting.done:
                    self._turns.stop_waiting(rank)
                    raise CollectiveTimeout(
                        f"{self._waiting[rank].describe()} did not complete within {self.timeout_s} s "
                        f"(rank {rank} timed out). What each rank was doing:\n{self.describe_ranks()}\n"
                        "A rank that never reaches this collective is stuck or on another code path."
                    )
                if meeting is not None and time.monotonic() < meeting.done_at + self.timeout_s:
                    deadline = meeting.done_at + self.timeout_s  # it completed late: a full wait for a turn
                    continue
                error = CollectiveTimeout(
                    f"rank {rank} waited {self.timeout_s} s for a turn on the CPU: the ranks running their "
                    f"own code ({self._turns.limit} at a time) never reached a collective. What each rank "
                    f"was doing:\n{self.describe_ranks()}"
                )
                self._turns.stop_waiting(rank)
                raise error
        self._raise_if_failed()

def _ranks_text(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> "ranks 0-2, 5"; [3] -> "rank 3"."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    text = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


INTERCONNECT = (VirtualCluster, _Rendezvous)
"""The interconnect's objects, not any rank's: a walk over what a rank holds (`zero_core.reachable`) stops
at them. A collective's combined result lives in its rendezvous, as NCCL's buffers live outside a GPU's
allocator."""
