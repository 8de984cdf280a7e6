"""Counting the floating-point work one rank does, per phase of a step.

ZeRO's claim about compute is that it does not change (ZeRO §5: same computational granularity as data
parallelism), except the optimizer, which ZeRO-1 and later run on 1/N of the parameters. `FlopMeter` is
a dispatch mode that counts matmul FLOPs with `torch.utils.flop_counter`'s own formulas and, so that the
optimizer's share shows too, one FLOP per output element of elementwise arithmetic. Dispatch modes are
thread-local, so each rank thread counts only its own work.
"""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten
ELEMENTWISE = {
    aten.add,
    aten.add_,
    aten.sub,
    aten.sub_,
    aten.mul,
    aten.mul_,
    aten.div,
    aten.div_,
    aten.sqrt,
    aten.sqrt_,
}


class FlopMeter(TorchDispatchMode):
    """`with FlopMeter() as meter: ...` then `meter.flops`: matmul FLOPs (2·m·n·k) plus elementwise ops."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in flop_registry:
            self.flops += flop_registry[packet](*args, **kwargs, out_val=out)
        elif packet in ELEMENTWISE and isinstance(out, torch.Tensor) and out.is_floating_point():
            self.flops += math.prod(out.shape)
        return out
