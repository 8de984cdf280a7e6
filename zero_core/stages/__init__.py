"""The paper's ZeRO stages: one module per stage, one interface (`ZeroStage`), read in this order:

- `base.py`: the training step every stage runs, and what a stage decides (where the bytes live);
- `zero0.py`: plain data parallelism, 16Ψ per rank (ZeRO §3.1);
- `zero1.py`: optimizer states partitioned, 4Ψ + 12Ψ/N (ZeRO §5.1);
- `sharding.py`: a layer's gradient reduce-scattered and its parameters gathered, what ZeRO-2 and 3 share;
- `zero2.py`: gradients partitioned too, 2Ψ + 14Ψ/N (ZeRO §5.2);
- `zero3.py`: parameters partitioned too, 16Ψ/N (ZeRO §5.3).

The systems beyond the paper (ZeRO-Offload, ZeRO++, HSDP, the exercises' stages) are in `zero_core.variants`;
the pieces the exercises ask for, in `zero_core.answers`; every stage by number or name in
`zero_core.registry`, which `STAGES`, `NAMED_STAGES`, `NODE_STAGES`, `NAMED_STAGE_NAMES` and `stage_class`
here read. The stage modules are imported when first named (`zero_core.stages.Zero2`, `STAGES`), not with
the package: the grader imports `zero_core.stages.base` and one stage's scaffolding without loading the
modules that hold an exercise's answer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from zero_core import registry
from zero_core.registry import NAMED_STAGE_NAMES, stage_class
from zero_core.stages.base import TrainConfig, ZeroStage

if TYPE_CHECKING:
    from zero_core.stages.zero0 import Zero0
    from zero_core.stages.zero1 import Zero1
    from zero_core.stages.zero2 import Zero2
    from zero_core.stages.zero3 import Zero3

_STAGE_MODULES = {"Zero0": "zero0", "Zero1": "zero1", "Zero2": "zero2", "Zero3": "zero3"}


def __getattr__(name: str) -> Any:
    if name in _STAGE_MODULES:
        return getattr(importlib.import_module(f"{__name__}.{_STAGE_MODULES[name]}"), name)
    if name in ("STAGES", "NAMED_STAGES", "NODE_STAGES"):
        return getattr(registry, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "NAMED_STAGES",
    "NAMED_STAGE_NAMES",
    "NODE_STAGES",
    "STAGES",
    "TrainConfig",
    "ZeroStage",
    "stage_class",
    "Zero0",
    "Zero1",
    "Zero2",
    "Zero3",
]
