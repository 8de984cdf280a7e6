"""Counting the floating-point work one rank does, per phase of a step.

ZeRO's claim about compute is that it does not change (ZeRO §5: same computational granularity as data
parallelism), except the optimizer, which ZeRO-1 and later run on 1/N of the parameters. `FlopMeter`
counts matmul FLOPs with `torch.utils.flop_counter`'s own formulas and, so that the optimizer's share
shows too, one FLOP per output element of elementwise arithmetic. It is a dispatch mode of its own, or
rides on the memory audit's (`StorageAudit.counting`), so that a step both audited and counted passes
each tensor operation through Python once. Dispatch modes are thread-local, so each rank thread counts
only its own work.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, shape_wrapper

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

_ELEMENTWISE = "elementwise"
_UNSEEN = object()
_SHAPE_WRAPPED = shape_wrapper(math.prod).__code__
_RULES: dict[object, Callable[[tuple, dict, object], int] | str | None] = {}


def _shapes(value: object) -> object:
    """`value` with every tensor replaced by its shape, walking tuples, lists and dicts: what
    `flop_counter.shape_wrapper` hands a formula, without its general tree walk (a dozen calls a leaf)."""
    if isinstance(value, torch.Tensor):
        return value.shape
    kind = type(value)
    if kind is tuple or kind is list:
        return kind(_shapes(item) for item in value)
    if kind is dict:
        return {key: _shapes(item) for key, item in value.items()}
    return value


def _rule(func) -> Callable[[tuple, dict, object], int] | str | None:
    """How `func` counts, looked up once per operator: `(args, kwargs, out) -> FLOPs` from torch's formula,
    `_ELEMENTWISE`, or None (free)."""
    packet = func._overloadpacket
    formula = flop_registry.get(packet)
    if formula is None:
        rule = _ELEMENTWISE if packet in ELEMENTWISE else None
    elif getattr(formula, "__code__", None) is _SHAPE_WRAPPED:
        shaped = formula.__wrapped__

        def rule(args: tuple, kwargs: dict, out: object) -> int:
            return shaped(*_shapes(args), out_shape=_shapes(out), **_shapes(kwargs))

    else:

        def rule(args: tuple, kwargs: dict, out: object) -> int:
            return formula(*args, **kwargs, out_val=out)

    _RULES[func] = rule
    return rule


class FlopMeter(TorchDispatchMode):
    """`with FlopMeter() as meter: ...` then `meter.flops`: matmul FLOPs (2·m·n·k) plus elementwise ops."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Never under torch.compile: no compiler-disabling wrapper around each operation (nor its import)."""
        return False

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def count(self, func, args: tuple, kwargs: dict | None, out: object) -> None:
        """Add what one operation `func(*args, **kwargs) -> out` computed."""
        rule = _RULES.get(func, _UNSEEN)
        if rule is _UNSEEN:
            rule = _rule(func)
        if rule is None:
            return
        if rule is _ELEMENTWISE:
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                self.flops += math.prod(out.shape)
        else:
            self.flops += rule(args, kwargs or {}, out)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.count(func, args, kwargs, out)
        return out
