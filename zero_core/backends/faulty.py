"""A backend that fails on purpose: one rank dies or hangs at a chosen step, to see the others cope.

`python -m zero_core.launch --fail-rank R --fail-at-step K [--fail-mode exit|hang]` wraps rank R's
backend in a `FaultyBackend`. At its first collective of step K the rank exits at once (`exit`, as a
crashed GPU host would) or stops responding (`hang`, as a stuck kernel would) while the other ranks wait
for it in that collective. The tests use it to check that the others then exit within the timeout,
saying which collective they were waiting in, instead of hanging.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from zero_core.backends.base import CollectiveCall, Finish, ReduceOp
from zero_core.backends.torch_distributed import TorchBackend
from zero_core.context import current

EXIT_CODE = 3
HANG_S = 3600.0


class FaultyBackend:
    """`inner`, until this rank's first collective of step `fail_at_step`, where it exits or hangs (`mode`).

    It stands in for `inner` everywhere, so it has each attribute a rank reads from its backend (`device`
    too: a rank without it died at setup, before the step it was told to fail at)."""

    def __init__(self, inner: TorchBackend, fail_at_step: int, mode: str) -> None:
        if mode not in ("exit", "hang"):
            raise ValueError(f"mode must be 'exit' or 'hang', got {mode!r}")
        self.inner, self.fail_at_step, self.mode = inner, fail_at_step, mode
        self.name, self.rank, self.world_size, self.device = inner.name, inner.rank, inner.world_size, inner.device

    def _maybe_fail(self) -> None:
        step = current().step
        if step < self.fail_at_step:
            return
        what = "exiting" if self.mode == "exit" else "hanging"
        sys.stderr.write(
            f"python -m zero_core.launch: rank {self.rank}: {what} at step {step} on purpose (--fail-rank)\n"
        )
        sys.stderr.flush()
        if self.mode == "exit":
            os._exit(EXIT_CODE)
        time.sleep(HANG_S)

    def new_group(self, ranks: tuple[int, ...]) -> None:
        self.inner.new_group(ranks)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp, call: CollectiveCall) -> Finish:
        self._maybe_fail()
        return self.inner.all_reduce(tensor, op, call)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp, call: CollectiveCall) -> Finish:
        self._maybe_fail()
        return self.inner.reduce_scatter(output, input, op, call)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, call: CollectiveCall) -> Finish:
        self._maybe_fail()
        return self.inner.all_gather(output, input, call)

    def broadcast(self, tensor: torch.Tensor, src: int, call: CollectiveCall) -> Finish:
        self._maybe_fail()
        return self.inner.broadcast(tensor, src, call)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, call: CollectiveCall) -> Finish:
        self._maybe_fail()
        return self.inner.all_to_all(output, input, call)

    def barrier(self, call: CollectiveCall) -> Finish:
        self._maybe_fail()
        return self.inner.barrier(call)
