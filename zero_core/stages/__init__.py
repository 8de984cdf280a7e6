"""The reference ZeRO stages: one module per stage, one interface (`ZeroStage`).

The stage modules are imported when first named (`zero_core.stages.Zero2`, `STAGES`), not with the
package: the grader imports `zero_core.stages.base` and one stage's scaffolding without loading the
modules that hold an exercise's answer.

`STAGES` are the paper's four, by number. `NODE_STAGES` are the stages that need to know the nodes
(`gpus_per_node`), by name: "hsdp" (ZeRO-3 inside a node, replicated across nodes), "hpz" (ZeRO++'s
hierarchical partitioning), "qgz" (ZeRO++'s int4 all-to-all for gradients) and "zeropp" (ZeRO++: hpZ, qwZ
and qgZ). `NAMED_STAGES` are every stage named by a string: the node stages, "offload" (ZeRO-Offload:
ZeRO-2 with the optimizer on the host) and "qwz" (ZeRO++'s int8 weight all-gathers).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from zero_core.stages.base import TrainConfig, ZeroStage

if TYPE_CHECKING:
    from zero_core.stages.hpz import HpzZero3
    from zero_core.stages.hsdp import HybridZero3
    from zero_core.stages.offload import OffloadZero2
    from zero_core.stages.qgz import QgzZero3
    from zero_core.stages.qwz import QwzZero3
    from zero_core.stages.zero0 import Zero0
    from zero_core.stages.zero1 import Zero1
    from zero_core.stages.zero2 import Zero2
    from zero_core.stages.zero3 import Zero3
    from zero_core.stages.zeropp import ZeroppZero3

_STAGE_MODULES = {
    "Zero0": "zero0",
    "Zero1": "zero1",
    "Zero2": "zero2",
    "Zero3": "zero3",
    "HybridZero3": "hsdp",
    "HpzZero3": "hpz",
    "OffloadZero2": "offload",
    "QwzZero3": "qwz",
    "QgzZero3": "qgz",
    "ZeroppZero3": "zeropp",
}
_NODE_STAGES = {"hsdp": "HybridZero3", "hpz": "HpzZero3", "qgz": "QgzZero3", "zeropp": "ZeroppZero3"}
_NAMED_STAGES = {
    "offload": "OffloadZero2",
    "hsdp": "HybridZero3",
    "hpz": "HpzZero3",
    "qwz": "QwzZero3",
    "qgz": "QgzZero3",
    "zeropp": "ZeroppZero3",
}
NAMED_STAGE_NAMES = tuple(_NAMED_STAGES)
"""The named stages in the order tables list them, known without importing their modules."""


def stage_class(stage: int | str) -> type[ZeroStage]:
    """The class of a stage number (0-3) or name ("offload", "hsdp", "hpz", "qwz", ...), its module imported now."""
    if stage in (0, 1, 2, 3):
        return __getattr__(f"Zero{stage}")
    if stage in _NAMED_STAGES:
        return __getattr__(_NAMED_STAGES[stage])
    raise ValueError(f"unknown stage {stage!r}; choose from 0, 1, 2, 3, {', '.join(map(repr, _NAMED_STAGES))}")


def __getattr__(name: str) -> Any:
    if name in _STAGE_MODULES:
        return getattr(importlib.import_module(f"{__name__}.{_STAGE_MODULES[name]}"), name)
    if name == "STAGES":
        stages: dict[int, type[ZeroStage]] = {i: __getattr__(f"Zero{i}") for i in range(4)}
        return stages
    if name == "NODE_STAGES":
        return {key: __getattr__(cls) for key, cls in _NODE_STAGES.items()}
    if name == "NAMED_STAGES":
        return {key: __getattr__(cls) for key, cls in _NAMED_STAGES.items()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "NAMED_STAGES",
    "NAMED_STAGE_NAMES",
    "NODE_STAGES",
    "STAGES",
    "HpzZero3",
    "HybridZero3",
    "OffloadZero2",
    "QgzZero3",
    "QwzZero3",
    "TrainConfig",
    "ZeroStage",
    "stage_class",
    "Zero0",
    "Zero1",
    "Zero2",
    "Zero3",
    "ZeroppZero3",
]
