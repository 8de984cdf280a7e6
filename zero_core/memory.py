"""A byte-accurate memory ledger for one rank: what this GPU holds, by category, now and at its peak.

ZeRO is an accounting argument (ZeRO §3, §5): the 16Ψ bytes of mixed-precision Adam are fp16 parameters
(2Ψ), fp16 gradients (2Ψ) and fp32 master weights, momentum and variance (4Ψ + 4Ψ + 4Ψ = KΨ, K = 12).
Each stage changes which of these a rank keeps. The tracker makes that visible: every buffer a rank
allocates is registered under one category of a fixed vocabulary, its size read from the tensor's
storage (views of one storage count once), and released explicitly or when the tensor is collected.
Activations are counted through `torch.autograd.graph.saved_tensors_hooks`, once per storage.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from zero_core.context import maybe_current

PARAM = "param.fp16"
GRAD = "grad.fp16"
MASTER = "master.fp32"
ADAM_M = "adam.m"
ADAM_V = "adam.v"
GATHER = "gather.fp16"
GRAD_BUCKET = "grad.bucket"
ACTIVATIONS = "activations"
PADDING = "padding"

MODEL_STATES = (PARAM, GRAD, MASTER, ADAM_M, ADAM_V)
"""The paper's model states (ZeRO §3.1). "fp16" names the low-precision training copy (bf16 or fp32 too)."""

TRANSIENTS = (GATHER, GRAD_BUCKET)
"""Buffers that live for one layer: ZeRO-3's gathered parameters, ZeRO-2/3's per-layer gradient bucket
before its reduce-scatter."""

CATEGORIES = MODEL_STATES + TRANSIENTS + (ACTIVATIONS, PADDING)


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


@dataclass(slots=True)
class _Registration:
    """One counted storage, and weak references to the tensors registered on it: it stays counted until
    it is released, or until the last of those tensors is collected."""

    category: str
    nbytes: int
    padding_bytes: int
    label: str
    watches: list[weakref.ref] = field(default_factory=list)


_KNOWN_CATEGORIES = frozenset(CATEGORIES)


class MemoryTracker:
    """What one rank holds. Thread-safe, because the garbage collector may release from any thread."""

    def __init__(self, rank: int = 0, *, record_timeline: bool = True) -> None:
        self.rank = rank
        self.record_timeline = record_timeline
        self._lock = threading.RLock()
        self._live: dict[int, _Registration] = {}
        self._current = dict.fromkeys(CATEGORIES, 0)
        self._peak = dict.fromkeys(CATEGORIES, 0)
        self._total = 0
        self._peak_total = 0
        self._start = time.perf_counter()
        self.timeline: list[MemoryEvent] = []
        self.step = 0
        self.phase = ""

    @staticmethod
    def _key(tensor: torch.Tensor) -> int:
        return tensor.untyped_storage().data_ptr()

    def register(
        self, tensor: torch.Tensor, category: str, *, padding_elements: int = 0, label: str = ""
    ) -> torch.Tensor:
        """Count `tensor`'s storage under `category` until it is released or collected; returns `tensor`.

        `padding_elements` of the storage are counted as `padding` instead, so that padding added to make
        a buffer divisible by N is reported, never hidden inside a model-state category. Registering a
        second view of an already registered storage counts nothing more.
        """
        if category not in _KNOWN_CATEGORIES:
            raise ValueError(f"unknown memory category {category!r}; use one of {CATEGORIES}")
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        nbytes = storage.nbytes()
        padding_bytes = padding_elements * tensor.element_size() if padding_elements else 0
        if padding_bytes > nbytes:
            raise ValueError(
                f"padding of {padding_bytes} bytes exceeds the buffer's {nbytes} bytes ({label or category})"
            )
        with self._lock:
            reg = self._live.get(key)
            if reg is None:
                if nbytes == 0:
                    return tensor
                reg = self._live[key] = _Registration(category, nbytes, padding_bytes, label)
                self._count(reg, 1)
            reg.watches.append(weakref.ref(tensor, functools.partial(self._collected, key)))
        return tensor

    def release(self, tensor: torch.Tensor) -> None:
        """Stop counting `tensor`'s storage now (the buffer is being freed or handed back)."""
        with self._lock:
            reg = self._live.pop(self._key(tensor), None)
            if reg is not None:
                self._count(reg, -1)

    def is_tracked(self, tensor: torch.Tensor) -> bool:
        with self._lock:
            return self._key(tensor) in self._live

    def _collected(self, key: int, watch: weakref.ref) -> None:
        """A registered tensor was collected; the storage stops counting when no registered tensor is left.

        A watch that is not among the registration's belongs to an earlier, released registration of a
        buffer at the same address, and changes nothing.
        """
        with self._lock:
            reg = self._live.get(key)
            if reg is None:
                return
            for index, other in enumerate(reg.watches):
                if other is watch:
                    del reg.watches[index]
                    break
            else:
                return
            if not reg.watches:
                del self._live[key]
                self._count(reg, -1)

    def _count(self, reg: _Registration, sign: int) -> None:
        """Add (sign 1) or take away (sign -1) a buffer: its bytes under its category, its padding as padding."""
        where = self._labels() if self.record_timeline else None
        self._change(reg.category, sign * (reg.nbytes - reg.padding_bytes), reg.label, where)
        if reg.padding_bytes:
            self._change(PADDING, sign * reg.padding_bytes, reg.label, where)

    def _labels(self) -> tuple[str, int]:
        """(phase, step) of the event: the rank context's when this is the calling rank's tracker."""
        ctx = maybe_current()
        if ctx is not None and ctx.tracker is self:
            return ctx.phase, ctx.step
        return self.phase, self.step

    def _change(self, category: str, delta: int, label: str, where: tuple[str, int] | None) -> None:
        """Apply one change; `where` (phase, step) labels its timeline event, `None` records none."""
        now = self._current[category] = self._current[category] + delta
        if now > self._peak[category]:
            self._peak[category] = now
        self._total += delta
        if self._total > self._peak_total:
            self._peak_total = self._total
        if where is not None:
            phase, step = where
            self.timeline.append(
                MemoryEvent(
                    len(self.timeline),
                    time.perf_counter() - self._start,
                    category,
                    delta,
                    self._total,
                    label,
                    phase,
                    step,
                )
            )

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

    @contextmanager
    def count_activations(self) -> Iterator[None]:
        """Count every tensor autograd saves for backward as `activations`, once per storage.

        Tensors already on the ledger (parameters, gathered weights) are not counted again. The count
        drops when autograd frees the saved tensor after backward.
        """

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            if not self.is_tracked(tensor):
                self.register(tensor, ACTIVATIONS, label="saved for backward")
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
