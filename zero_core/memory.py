"""A byte-accurate memory ledger for one rank: what this GPU holds, by category, now and at its peak.

ZeRO is an accounting argument (ZeRO §3, §5): the 16Ψ bytes of mixed-precision Adam are fp16 parameters
(2Ψ), fp16 gradients (2Ψ) and fp32 master weights, momentum and variance (4Ψ + 4Ψ + 4Ψ = KΨ, K = 12).
Each stage changes which of these a rank keeps. The tracker makes that visible, and it does not take a
stage's word for it:

- **What is counted is what is alive.** The unit is a storage (views of one storage count once). A storage
  counts from the moment the tracker first sees it until it is freed, which the tracker learns from a
  weak reference to the storage itself, whoever held it: a stage's attribute, an autograd `ctx`, a
  closure, a list. `release` says a buffer is done and re-reads its size (0 after `resize_(0)`); it
  cannot make a live buffer disappear from the count.
- **The audit sees every allocation.** Inside `audit()` a dispatch mode looks at the output of every
  tensor operation the rank runs, so every storage it allocates is on the ledger, registered or not.
- **Categories are labels.** `register` names a storage (`param.fp16`, `grad.bucket`, ...); the tensors
  autograd saves for backward are named `activations`. A storage nobody names is `temporary` (the
  paper's temporary buffers, ZeRO §3.2) while the phase that made it runs; if it outlives that phase, it
  is `untracked`: memory a rank holds that no part of the code accounts for. For the reference stages
  that is 0 bytes, and a test keeps it so.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from zero_core.context import maybe_current

PARAM = "param.fp16"
GRAD = "grad.fp16"
MASTER = "master.fp32"
ADAM_M = "adam.m"
ADAM_V = "adam.v"
GATHER = "gather.fp16"
GRAD_BUCKET = "grad.bucket"
ACTIVATIONS = "activations"
TEMPORARY = "temporary"
UNTRACKED = "untracked"
PADDING = "padding"
HOST_GRAD = "host.grad.fp16"
HOST_MASTER = "host.master.fp32"
HOST_ADAM_M = "host.adam.m"
HOST_ADAM_V = "host.adam.v"

MODEL_STATES = (PARAM, GRAD, MASTER, ADAM_M, ADAM_V)
"""The paper's model states (ZeRO §3.1). "fp16" names the low-precision training copy (bf16 or fp32 too)."""

TRANSIENTS = (GATHER, GRAD_BUCKET)
"""Buffers that live for one layer: ZeRO-3's gathered parameters, ZeRO-2/3's per-layer gradient bucket
before its reduce-scatter."""

UNLABELLED = (TEMPORARY, UNTRACKED)
"""What the audit alone saw: op outputs alive inside their phase (`temporary`) and those that outlived it
(`untracked`)."""

HOST_STATES = (HOST_GRAD, HOST_MASTER, HOST_ADAM_M, HOST_ADAM_V)
"""Model states kept in the host's memory, not the GPU's (ZeRO-Offload §4): counted apart, never in
`MODEL_STATES`, so a GPU's model-state total stays what the GPU holds."""

CATEGORIES = MODEL_STATES + TRANSIENTS + (ACTIVATIONS,) + UNLABELLED + (PADDING,) + HOST_STATES

_LABELS = frozenset(MODEL_STATES + TRANSIENTS + (ACTIVATIONS, PADDING) + HOST_STATES)


class MemoryEvent(NamedTuple):
    """One change of the ledger: `delta_bytes` in `category`, and the rank's total right after.

    A named tuple of plain values: a rank records hundreds per step, and the garbage collector does not
    track such tuples, while it would scan every dataclass instance in a growing timeline.
    """

    index: int
    seconds: float
    category: str
    delta_bytes: int
    total_bytes: int
    label: str
    phase: str
    step: int


_new_event = functools.partial(tuple.__new__, MemoryEvent)
"""`MemoryEvent` from a tuple of its fields, without the named tuple's Python-level `__new__`: the same
object, made once per change of the ledger."""


class Leftover(NamedTuple):
    """A storage still alive when a phase ended, in a category that should be empty between phases:
    gathered parameters, gradient buckets, or memory nobody named (`untracked`)."""

    step: int
    phase: str
    category: str
    label: str
    nbytes: int


LEFTOVER_CATEGORIES = (*TRANSIENTS, UNTRACKED)


@dataclass(slots=True)
class HeldStorage:
    """One live storage on the ledger: its category, size, padding and who named it (or what made it)."""

    category: str
    nbytes: int
    padding_bytes: int
    label: str
    ref: weakref.ref
    released: bool = False
    """`release` was called: the owner said it is done with it, so it should be freed (or empty) by now."""


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of `tensor`'s storage: the same for every view, stable across `resize_`."""
    return tensor.untyped_storage()._cdata


class MemoryTracker:
    """What one rank holds. Thread-safe, because a storage may be freed from any thread."""

    def __init__(self, rank: int = 0, *, record_timeline: bool = True) -> None:
        self.rank = rank
        self.record_timeline = record_timeline
        self._lock = threading.RLock()
        self._live: dict[int, HeldStorage] = {}
        self._current = dict.fromkeys(CATEGORIES, 0)
        self._peak = dict.fromkeys(CATEGORIES, 0)
        self._total = 0
        self._peak_total = 0
        self._start = time.perf_counter()
        self.timeline: list[MemoryEvent] = []
        self.leftovers: list[Leftover] = []
        """What each phase left alive in `LEFTOVER_CATEGORIES`, one entry per storage (`end_phase`)."""
        self.step = 0
        self.phase = ""

    # -- naming storages -----------------------------------------------------------------------------

    def register(
        self, tensor: torch.Tensor, category: str, *, padding_elements: int = 0, label: str = ""
    ) -> torch.Tensor:
        """Name `tensor`'s storage `category` for as long as it lives; returns `tensor`.

        `padding_elements` of the storage are counted as `padding` instead, so that padding added to make
        a buffer divisible by N is reported, never hidden inside a model-state category. A storage the
        audit already counts as temporary gets the name; a second view of a named storage changes nothing
        (unless the storage was released and is now reused: then it takes the new name).
        """
        if category not in _LABELS:
            raise ValueError(f"unknown memory category {category!r}; use one of {sorted(_LABELS)}")
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        padding_bytes = padding_elements * tensor.element_size() if padding_elements else 0
        if padding_bytes > nbytes:
            raise ValueError(
                f"padding of {padding_bytes} bytes exceeds the buffer's {nbytes} bytes ({label or category})"
            )
        with self._lock:
            held = self._live.get(storage._cdata)
            if held is None:
                if nbytes:
                    self._add(storage, category, nbytes, padding_bytes, label)
            elif held.category in UNLABELLED or held.released:
                self._count(held, -1)
                held.category, held.nbytes, held.padding_bytes, held.label = category, nbytes, padding_bytes, label
                held.released = False
                self._count(held, 1)
            elif held.nbytes != nbytes:
                self._resize(held, nbytes)
        return tensor

    def release(self, tensor: torch.Tensor) -> None:
        """The owner is done with this buffer: it keeps counting until it is freed (or shrunk to nothing
        with `untyped_storage().resize_(0)`, which this re-reads). Freeing is seen, not taken on trust."""
        storage = tensor.untyped_storage()
        with self._lock:
            held = self._live.get(storage._cdata)
            if held is not None:
                held.released = True
                if held.nbytes != storage.nbytes():
                    self._resize(held, storage.nbytes())

    def move(self, tensor: torch.Tensor, category: str) -> None:
        """Count `tensor`'s named storage under `category` from now on (offload moves the optimizer states
        to the host category after the shared setup has registered them on the GPU)."""
        if category not in _LABELS:
            raise ValueError(f"unknown memory category {category!r}; use one of {sorted(_LABELS)}")
        with self._lock:
            held = self._live.get(storage_key(tensor))
            if held is None:
                raise ValueError(f"move to {category!r}: the tracker does not hold this storage; register it")
            self._count(held, -1)
            held.category = category
            self._count(held, 1)

    def category_of(self, tensor: torch.Tensor) -> str | None:
        """The category `tensor`'s storage counts under, or None if the tracker has not seen it."""
        held = self._live.get(storage_key(tensor))
        return None if held is None else held.category

    def is_tracked(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s storage is named (registered or saved for backward), not just seen."""
        return self.category_of(tensor) not in (None, *UNLABELLED)

    def held_storages(self) -> dict[int, HeldStorage]:
        """Every storage counted now, by `storage_key` (a snapshot)."""
        with self._lock:
            return dict(self._live)

    # -- what the audit sees -------------------------------------------------------------------------

    def observe(self, tensor: torch.Tensor, made_by: str) -> None:
        """A tensor operation allocated `tensor`'s storage: count it as temporary until someone names it."""
        storage = tensor.untyped_storage()
        if storage._cdata not in self._live:
            with self._lock:
                if storage._cdata not in self._live:
                    self._add(storage, TEMPORARY, storage.nbytes(), 0, made_by)

    def observe_alias(self, tensor: torch.Tensor) -> None:
        """A tensor operation wrote into or resized an existing storage: if the tracker counts it, re-read
        its size (`resize_` grows a storage without allocating a new one)."""
        storage = tensor.untyped_storage()
        held = self._live.get(storage._cdata)
        if held is not None and held.nbytes != storage.nbytes():
            with self._lock:
                self._resize(held, storage.nbytes())

    def end_phase(self) -> None:
        """A phase ended: re-read every storage's size; what the phase left alive that nobody named is
        untracked; and every storage left in `LEFTOVER_CATEGORIES` is recorded in `leftovers`."""
        with self._lock:
            phase, step = self._labels()
            for held in list(self._live.values()):
                storage = held.ref()
                if storage is not None and storage.nbytes() != held.nbytes:
                    self._resize(held, storage.nbytes())
                if held.category == TEMPORARY:
                    self._count(held, -1)
                    held.category = UNTRACKED
                    self._count(held, 1)
                if held.category in LEFTOVER_CATEGORIES and held.nbytes:
                    self.leftovers.append(Leftover(step, phase, held.category, held.label, held.nbytes))

    @contextmanager
    def audit(self) -> Iterator[None]:
        """See every storage the calling thread's tensor operations allocate, until the block ends."""
        with StorageAudit(self):
            yield

    @contextmanager
    def count_activations(self) -> Iterator[None]:
        """Name every tensor autograd saves for backward `activations`, once per storage.

        Storages that already have a name (parameters, gathered weights) keep it. A saved tensor counts
        until autograd frees it after backward (and its storage with it).
        """

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if not self.is_tracked(tensor):
                self.register(tensor, ACTIVATIONS, label="saved for backward")
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield

    # -- reading the ledger --------------------------------------------------------------------------

    def current_bytes(self, category: str | None = None) -> int:
        with self._lock:
            return self._total if category is None else self._current[category]

    def peak_bytes(self, category: str | None = None) -> int:
        """Peak of one category, or (no category) the peak of the rank's total, not a sum of peaks."""
        with self._lock:
            return self._peak_total if category is None else self._peak[category]

    def current_by_category(self) -> dict[str, int]:
        with self._lock:
            return dict(self._current)

    def peak_by_category(self) -> dict[str, int]:
        with self._lock:
            return dict(self._peak)

    def model_state_bytes(self) -> int:
        """Bytes of the paper's model states held now (padding excluded)."""
        with self._lock:
            return sum(self._current[c] for c in MODEL_STATES)

    def reset_peaks(self) -> None:
        """Start a new peak window (e.g. one training step) from what is held now."""
        with self._lock:
            self._peak = dict(self._current)
            self._peak_total = self._total

    # -- bookkeeping ---------------------------------------------------------------------------------

    def _add(self, storage: torch.UntypedStorage, category: str, nbytes: int, padding_bytes: int, label: str) -> None:
        key = storage._cdata
        held = HeldStorage(category, nbytes, padding_bytes, label, weakref.ref(storage, self._freed_callback(key)))
        self._live[key] = held
        self._count(held, 1)

    def _freed_callback(self, key: int):
        def freed(ref: weakref.ref) -> None:
            with self._lock:
                held = self._live.get(key)
                if held is not None and held.ref is ref:
                    del self._live[key]
                    self._count(held, -1)

        return freed

    def _resize(self, held: HeldStorage, nbytes: int) -> None:
        self._count(held, -1)
        held.nbytes, held.padding_bytes = nbytes, min(held.padding_bytes, nbytes)
        self._count(held, 1)

    def _count(self, held: HeldStorage, sign: int) -> None:
        """Add (sign 1) or take away (sign -1) a storage: its bytes under its category, its padding as padding.

        An empty storage (a gathered buffer after `resize_(0)`) changes nothing and records no event, so it
        returns before looking up the rank's labels: a stage frees such buffers dozens of times per step.
        """
        padding = held.padding_bytes
        delta = sign * (held.nbytes - padding)
        if not delta and not padding:
            return
        where = self._labels() if self.record_timeline else None
        if delta:
            self._change(held.category, delta, held.label, where)
        if padding:
            self._change(PADDING, sign * padding, held.label, where)

    def _labels(self) -> tuple[str, int]:
        """(phase, step) of the event: the rank context's when this is the calling rank's tracker."""
        ctx = maybe_current()
        if ctx is not None and ctx.tracker is self:
            return ctx.phase, ctx.step
        return self.phase, self.step

    def _change(self, category: str, delta: int, label: str, where: tuple[str, int] | None) -> None:
        """Apply one nonzero change; `where` (phase, step) labels its timeline event, `None` records none."""
        now = self._current[category] = self._current[category] + delta
        if now > self._peak[category]:
            self._peak[category] = now
        if category in HOST_STATES:
            return  # the host's bytes are not the GPU's: out of its total (the timeline records no event)
        total = self._total = self._total + delta
        if total > self._peak_total:
            self._peak_total = total
        if where is not None:
            timeline = self.timeline
            phase, step = where
            timeline.append(
                _new_event(
                    (len(timeline), time.perf_counter() - self._start, category, delta, total, label, phase, step)
                )
            )


@dataclass
class TrackerSnapshot:
    """The read side of a rank's `MemoryTracker` as plain data, so that it can travel pickled: to rank 0 under
    torchrun (`zero_core.launch`), or from a worker process to `compare` (`zero_core.stage_pool`)."""

    rank: int
    peak_total: int
    peaks: dict[str, int]
    current: dict[str, int]
    timeline: list[MemoryEvent]
    leftovers: list[Leftover]

    @classmethod
    def of(cls, tracker: MemoryTracker) -> TrackerSnapshot:
        return cls(
            tracker.rank,
            tracker.peak_bytes(),
            tracker.peak_by_category(),
            tracker.current_by_category(),
            list(tracker.timeline),
            list(tracker.leftovers),
        )

    def peak_bytes(self, category: str | None = None) -> int:
        return self.peak_total if category is None else self.peaks[category]

    def current_bytes(self, category: str | None = None) -> int:
        return sum(self.current.values()) if category is None else self.current[category]


@contextmanager
def unaudited() -> Iterator[None]:
    """Run the block outside the calling thread's audit (and its other dispatch modes): for an observer's
    own copies, such as a grader's record of the gradients a rank gave Adam, which are not the rank's."""
    with _disable_current_modes():
        yield


class StorageAudit(TorchDispatchMode):
    """Counts every storage the thread's tensor operations allocate on `tracker`: nothing made escapes.

    An operation's output is a new allocation unless its schema says it aliases an input (views,
    in-place and `out=` operations): those only write into a storage that exists, whose size is re-read
    (`resize_`). Dispatch modes are thread-local, so each rank thread of the virtual cluster audits only
    its own work; the interconnect's arithmetic runs outside the ranks' modes (`zero_core.cluster`), as
    NCCL's buffers are outside PyTorch's allocator on a real GPU.

    A FLOP meter can ride along (`counting`): one mode that audits and counts sees each operation once,
    where a second mode stacked on it would take every operation through Python twice.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """The audit never runs under torch.compile, so it needs no wrapper that keeps the compiler out of its
        frames: that wrapper costs microseconds per operation, and importing the compiler for it, seconds."""
        return False

    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()
        self.tracker = tracker
        self.meter: Any = None
        """What also counts each operation (`counting`): anything with `count(func, args, kwargs, out)`."""

    @contextmanager
    def counting(self, meter: Any) -> Iterator[Any]:
        """Hand every operation of the block to `meter.count` too (a `zero_core.flops.FlopMeter`); yields it."""
        previous, self.meter = self.meter, meter
        try:
            yield meter
        finally:
            self.meter = previous

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        aliases = _ALIASING.get(func)
        if aliases is None:
            aliases = _aliasing_returns(func)
        if isinstance(out, torch.Tensor):
            if aliases:
                if aliases[0]:
                    self.tracker.observe_alias(out)
                else:
                    self.tracker.observe(out, func.__name__)
        else:
            _observe_outputs(self.tracker, func, out, aliases)
        if self.meter is not None:
            self.meter.count(func, args, kwargs, out)
        return out


def _observe_outputs(tracker: MemoryTracker, func, out, aliases: tuple[bool, ...]) -> None:
    """`StorageAudit`'s look at the outputs of an operation that returns several, or a list, or none."""
    outputs = out if isinstance(out, tuple | list) else (out,)
    if len(aliases) == 1:  # one return, perhaps a list: `split` returns a list of views of its input
        aliases *= len(outputs)
    for item, alias in zip(outputs, aliases, strict=False):
        if isinstance(item, torch.Tensor):
            if alias:
                tracker.observe_alias(item)
            else:
                tracker.observe(item, func.__name__)


_ALIASING: dict[object, tuple[bool, ...]] = {}


def _aliasing_returns(func) -> tuple[bool, ...]:
    """For each return of the operator, whether it aliases an input (from the operator's schema)."""
    aliases = _ALIASING.get(func)
    if aliases is None:
        aliases = _ALIASING[func] = tuple(r.alias_info is not None for r in func._schema.returns)
    return aliases
